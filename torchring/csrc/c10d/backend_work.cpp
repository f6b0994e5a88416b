// C10dWork and its Completer (backend_work.h).
#include "c10d/backend_work.h"

#include <ATen/core/ivalue.h>

#include <algorithm>

#include "core/common.h"

namespace torchring {

namespace {

c10::TypePtr futureType(bool nested) {
  auto list = c10::ListType::create(c10::TensorType::get());
  return nested ? c10::ListType::create(list) : list;
}

// The CUDA devices of `outputs`: a Future holding CUDA tensors must name them (it records an
// event on each when it completes, so that users of the value wait for the copies back).
std::vector<c10::Device> devicesOf(const std::vector<at::Tensor>& outputs,
                                   const std::vector<std::vector<at::Tensor>>& nested) {
  std::vector<c10::Device> devices;
  auto add = [&](const at::Tensor& t) {
    if (t.defined() && t.is_cuda() && std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
      devices.push_back(t.device());
    }
  };
  for (const auto& t : outputs) add(t);
  for (const auto& list : nested) {
    for (const auto& t : list) add(t);
  }
  return devices;
}

// `error`'s message in torch.distributed's words: the advice it carries as a field (the
// recovery hint) in the backend's words, and the Advice its text names (core/common.h: the
// timeout is init_process_group's, the restart is destroy/init_process_group; a message
// quoting another rank's failure names them too) replaced by name.
std::string torchWords(const TorchringError& error) {
  std::string message = error.message();
  for (const Advice* advice : kAllAdvice) {
    const std::string from(advice->torchring);
    for (size_t at = message.find(from); at != std::string::npos; at = message.find(from, at + 1)) {
      message.replace(at, from.size(), advice->torch);
    }
  }
  return error.advice() ? message + "; " + error.advice()->torch : message;
}

// The same exception class as `error`, its message in torch.distributed's words.
std::exception_ptr forTorch(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const MismatchError& e) {
    return std::make_exception_ptr(MismatchError(torchWords(e)));
  } catch (const CommFailedError& e) {
    return std::make_exception_ptr(CommFailedError(torchWords(e)));
  } catch (const WaitTimeoutError& e) {
    return std::make_exception_ptr(WaitTimeoutError(torchWords(e)));
  } catch (const TorchringError& e) {
    return std::make_exception_ptr(TorchringError(torchWords(e)));
  } catch (...) {
    return error;
  }
}

}  // namespace

C10dWork::C10dWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, bool nested,
                   std::vector<std::vector<at::Tensor>> nestedOutputs)
    : c10d::Work(rank, type),
      outputs_(std::move(outputs)),
      nested_(std::move(nestedOutputs)),
      isNested_(nested),
      future_(c10::make_intrusive<c10::ivalue::Future>(futureType(nested), devicesOf(outputs_, nested_))) {}

bool C10dWork::wait(std::chrono::milliseconds timeout) {
  try {
    return c10d::Work::wait(timeout);
  } catch (const c10::Error&) {
    if (timeout == kNoTimeout || isCompleted()) throw;  // the operation's own failure
  }
  TORCH_CHECK(false, "rank ", rank_, ": torch.distributed ", c10d::opTypeToString(opType_),
              " on the torchring backend timed out after ", timeout.count(),
              " ms in Work.wait(timeout): it is still waiting for its peers (a send or recv for the "
              "matching recv or send). It keeps running and the process group stays usable: wait "
              "again, or abort the group");
}

int C10dWork::sourceRank() const {
  TORCH_CHECK_VALUE(opType_ == c10d::OpType::RECV || opType_ == c10d::OpType::RECVANYSOURCE, "rank ", rank_,
                    ": sourceRank() of a torch.distributed ", c10d::opTypeToString(opType_),
                    " on the torchring backend: only a recv has a source rank");
  const int source = source_.load();
  TORCH_CHECK_VALUE(source >= 0, "rank ", rank_, ": sourceRank() of a recv on the torchring backend that has "
                    "not received a message yet: wait() for it first");
  return source;
}

void C10dWork::complete() {
  std::exception_ptr error;
  try {
    for (auto& w : engine) w->wait(0);  // all finished: rethrows the first failure
    if (post) post();
  } catch (...) {
    error = forTorch(std::current_exception());
  }
  if (!engine.empty()) source_.store(engine[0]->source());
  engine.clear();  // drops the engine operations (and their callbacks, which hold this work)
  keep.clear();
  post = nullptr;
  if (error) {
    future_->setError(error);
    finish(error);
    return;
  }
  if (isNested_) {
    future_->markCompleted(c10::IValue(nested_));
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
  finish();
}

// Completer: the threads that complete works. One, until a work completes while every thread is
// busy completing another: a Future callback that starts a collective and waits for its Future
// (torch's PowerSGD hook, fut.then(lambda f: dist.all_reduce(..., async_op=True).wait())) would
// wait for ever on the only thread that could complete it. A push that finds no idle thread then
// starts one more (kMaxThreads in all), so completions keep flowing around a blocked callback.
Completer::Completer() { threads_.emplace_back([this] { loop(); }); }

Completer::~Completer() { stop(); }

void Completer::push(c10::intrusive_ptr<C10dWork> work) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ready_.push_back(std::move(work));
    if (idle_ == 0 && !stopping_ && threads_.size() < kMaxThreads) {
      threads_.emplace_back([this] { loop(); });
      return;
    }
  }
  cv_.notify_one();
}

void Completer::stop() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    threads.swap(threads_);
  }
  cv_.notify_all();
  for (auto& t : threads) {
    if (t.get_id() == std::this_thread::get_id()) {
      t.detach();  // stopped from a callback this thread runs: it returns to loop() and ends
    } else if (t.joinable()) {
      t.join();
    }
  }
}

void Completer::loop() {
  while (true) {
    c10::intrusive_ptr<C10dWork> work;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ++idle_;
      cv_.wait(lock, [&] { return stopping_ || !ready_.empty(); });
      --idle_;
      if (ready_.empty()) return;  // stopping, and every handed-over work was completed
      work = std::move(ready_.front());
      ready_.pop_front();
    }
    work->complete();
  }
}

}  // namespace torchring
