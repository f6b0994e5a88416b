#include "core/work.h"

#include <sstream>

namespace torchring {

bool CpuWork::isCompleted() {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

at::Tensor CpuWork::wait(double timeoutSec) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (timeoutSec > 0) {
    auto limit = std::chrono::duration<double>(timeoutSec);
    if (!cv_.wait_for(lock, limit, [&] { return done_; })) {
      std::ostringstream msg;
      msg << context_ << "rank " << rank() << ": " << kindName(kind()) << " #" << seq() << ": Handle.wait(timeout="
          << timeoutSec << ") expired; the operation is still running and the communicator is "
          << "fine (wait again, or raise the timeout)";
      throw WaitTimeoutError(msg.str());
    }
  } else {
    cv_.wait(lock, [&] { return done_; });
  }
  if (error_) std::rethrow_exception(error_);
  return result_;
}

std::string CpuWork::error() {
  std::lock_guard<std::mutex> lock(mutex_);
  return message_;
}

std::exception_ptr withContext(std::exception_ptr error, const std::string& context) {
  if (!error || context.empty()) return error;
  try {
    std::rethrow_exception(error);
  } catch (const MismatchError& e) {
    return std::make_exception_ptr(MismatchError(context + e.what()));
  } catch (const CommFailedError& e) {
    return std::make_exception_ptr(CommFailedError(context + e.what()));
  } catch (const WaitTimeoutError& e) {
    return std::make_exception_ptr(WaitTimeoutError(context + e.what()));
  } catch (const TorchringError& e) {
    return std::make_exception_ptr(TorchringError(context + e.what()));
  } catch (...) {
  }
  return error;
}

void CpuWork::finish(at::Tensor result, std::exception_ptr error) {
  std::string message;
  if (error) {
    error = withContext(std::move(error), context_);
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      message = e.what();
    } catch (...) {
      message = "unknown error";
    }
  }
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    result_ = std::move(result);
    error_ = std::move(error);
    message_ = std::move(message);
    done_ = true;
    callbacks.swap(onDone_);
  }
  cv_.notify_all();
  for (auto& fn : callbacks) fn();
}

void CpuWork::onDone(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_) {
      onDone_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

}  // namespace torchring
