#include "cuda/nccl.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>

namespace torchring {
namespace {

ncclDataType_t ncclType(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kChar: return ncclInt8;
    case at::kByte:
    case at::kBool: return ncclUint8;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    default:  // int16: collectives/basic.py keeps it off the NCCL path
      TORCH_INTERNAL_ASSERT(false, "NCCL path: unsupported dtype ", c10::toString(type));
  }
}

// Over one rank the average is the sum: ncclAvg would still run a kernel that divides every
// element by 1 (a read and a write of the whole tensor), ncclSum in place runs nothing.
ncclRedOp_t ncclOp(ReduceOp op, int ranks) {
  if (ranks == 1 && op == ReduceOp::AVG) op = ReduceOp::SUM;
  switch (op) {
    case ReduceOp::SUM: return ncclSum;
    case ReduceOp::PRODUCT: return ncclProd;
    case ReduceOp::MIN: return ncclMin;
    case ReduceOp::MAX: return ncclMax;
    case ReduceOp::AVG: return ncclAvg;
    default:  // NCCL has no bitwise ops: collectives/basic.py's nccl_runs stages BAND, BOR and BXOR
      TORCH_INTERNAL_ASSERT(false, "NCCL path: no NCCL reduction for ", opName(op));
  }
  return ncclSum;
}

// "allreduce #17 float32[10, 100] SUM on cuda:0": the label and spelling of the engine's
// header (the sequence number is the header check's), so both paths name an operation alike.
std::string describe(const std::shared_ptr<CpuWork>& check, const at::Tensor& t, ReduceOp op, int root) {
  TORCH_INTERNAL_ASSERT(check, "an NCCL collective was launched without its header check");
  OpHeader header;
  header.kind = static_cast<uint8_t>(check->kind());
  header.seq = check->seq();
  header.dtype = static_cast<uint8_t>(toDType(t.scalar_type()));
  header.op = static_cast<uint8_t>(op);
  header.root = root;
  header.setShape(t.sizes().data(), static_cast<int>(t.dim()));
  std::ostringstream out;
  out << header.what() << " on " << t.device();
  return out.str();
}

// Ends every message that aborts the communicator.
const std::string kAborted = std::string("; the NCCL communicator is aborted: ") + kRecoveryHint.torchring;

void cudaCheck(cudaError_t result, const char* call) {
  if (result != cudaSuccess) {
    throw CommFailedError(std::string(call) + " failed: " + cudaGetErrorString(result));
  }
}

}  // namespace

Event::Event() { cudaCheck(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate"); }

Event::~Event() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

void Event::record(cudaStream_t stream) { cudaCheck(cudaEventRecord(event_, stream), "cudaEventRecord"); }

void Event::block(cudaStream_t stream) {
  cudaCheck(cudaStreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent");
}

bool Event::query() const {
  cudaError_t result = cudaEventQuery(event_);
  if (result == cudaErrorNotReady) return false;
  cudaCheck(result, "cudaEventQuery");
  return true;
}

std::string NcclComm::uniqueId() {
  ncclUniqueId id;
  ncclResult_t result = ncclGetUniqueId(&id);
  if (result != ncclSuccess) {
    throw CommFailedError(std::string("ncclGetUniqueId failed: ") + ncclGetErrorString(result));
  }
  return std::string(id.internal, sizeof(id.internal));
}

std::string NcclComm::version() {
  int v = 0;
  ncclGetVersion(&v);
  return std::to_string(v / 10000) + "." + std::to_string((v / 100) % 100) + "." + std::to_string(v % 100);
}

NcclComm::NcclComm(int rank, int size, int device, const std::string& uniqueId, double timeoutSec)
    : rank_(rank), size_(size), device_(device), timeoutSec_(timeoutSec),
      stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)) {
  c10::cuda::CUDAGuard guard(device);
  ncclUniqueId id;
  std::memcpy(id.internal, uniqueId.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // lets setup be timed out and aborted
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    ncclResult_t result = ncclCommInitRankConfig(&comm_, size, id, rank, &config);
    if (result != ncclSuccess && result != ncclInProgress) check(result, "ncclCommInitRankConfig", "setup");
    waitEnqueued("ncclCommInitRankConfig", "setup (waiting for every rank to join)");
  } catch (...) {
    if (abortDue_ && comm_ != nullptr) ncclCommAbort(comm_);  // no other thread uses it yet
    throw;
  }
  watchdog_ = std::thread([this] { watch(); });
}

bool NcclComm::shrinkSupported() {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
  return true;
#else
  return false;
#endif
}

NcclComm::NcclComm(NcclComm& parent, const std::vector<int>& exclude, bool parentFailed, double timeoutSec)
    : rank_(parent.rank_), size_(parent.size_ - static_cast<int>(exclude.size())), device_(parent.device_),
      timeoutSec_(timeoutSec), stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, parent.device_)) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
  c10::cuda::CUDAGuard guard(device_);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // as at setup: a rank that never comes is timed out, not waited for
  std::vector<int> excluded(exclude);
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    {
      std::lock_guard<std::mutex> parentLock(parent.mutex_);
      if (parent.aborted_ || parent.comm_ == nullptr) {
        throw CommFailedError("ncclCommShrink: the parent communicator was aborted (" + parent.failure_ +
                              "); make a new one instead");
      }
      ncclResult_t result = ncclCommShrink(parent.comm_, excluded.data(), static_cast<int>(excluded.size()), &comm_,
                                           &config, parentFailed ? NCCL_SHRINK_ABORT : NCCL_SHRINK_DEFAULT);
      if (result != ncclSuccess && result != ncclInProgress) check(result, "ncclCommShrink", "re-forming");
    }
    waitEnqueued("ncclCommShrink", "re-forming (waiting for every remaining rank to shrink)");
    check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank", "re-forming");
  } catch (...) {
    if (abortDue_ && comm_ != nullptr) ncclCommAbort(comm_);  // no other thread uses it yet
    throw;
  }
  watchdog_ = std::thread([this] { watch(); });
#else
  (void)exclude;
  (void)parentFailed;
  throw CommFailedError("ncclCommShrink needs NCCL 2.27 or newer; this build has " + version());
#endif
}

bool NcclComm::failed() {
  std::lock_guard<std::mutex> lock(mutex_);
  return aborted_ || !failure_.empty();
}

NcclComm::~NcclComm() { close(); }

// Stops the watchdog, then lets NCCL finish the communicator's work and frees it. With work
// still queued, or finishing slower than the timeout (a peer is gone), ncclCommDestroy would
// hang the process: abort instead.
void NcclComm::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    closed_ = stopping_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  if (comm_ == nullptr) return;
  if (aborted_) {
    if (abortDue_) ncclCommAbort(comm_);  // marked, but the watchdog stopped before doing it
    abortDue_ = false;
    return;
  }
  c10::cuda::CUDAGuard guard(device_);
  bool busy = false;
  for (auto& p : pending_) {
    try {
      busy = busy || !p.done->query();
    } catch (const std::exception&) {
      busy = true;
    }
  }
  if (!busy) {
    ncclResult_t state = ncclCommFinalize(comm_);
    auto start = Clock::now();
    while (state == ncclSuccess || state == ncclInProgress) {
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclInProgress) break;
      if (secondsSince(start) > std::min(timeoutSec_, 10.0)) break;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (state == ncclSuccess) {
      ncclCommDestroy(comm_);
      return;
    }
  }
  ncclCommAbort(comm_);
}

void NcclComm::abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  abortLocked(why);
}

void NcclComm::abortLocked(const std::string& why) {
  if (aborted_ || comm_ == nullptr) return;
  aborted_ = abortDue_ = true;
  failure_ = why;
  pending_.clear();
  cv_.notify_all();  // the watchdog runs the abort
}

// A failure found off the caller's thread (watchdog, drain): abort, and return the warning to
// show at once, since no caller may look for a while. The caller warns only after releasing
// mutex_: the warning sink takes the GIL, which a thread waiting for mutex_ may hold.
// (check() aborted already when it is the source.)
std::string NcclComm::failLocked(const std::string& why) {
  abortLocked(why.find(kAborted) == std::string::npos ? why + kAborted : why);
  return "watchdog: " + failure_;
}

// ncclCommAbort waits for work NCCL queued on its own streams, which can take long when the
// GPU is stuck: it runs with the lock released, so other threads see `aborted_` and raise.
void NcclComm::runAbort(std::unique_lock<std::mutex>& lock) {
  if (!abortDue_ || comm_ == nullptr) return;
  abortDue_ = false;
  ncclComm_t comm = comm_;
  lock.unlock();
  ncclCommAbort(comm);
  lock.lock();
}

void NcclComm::check(ncclResult_t result, const std::string& call, const std::string& what) {
  if (result == ncclSuccess || result == ncclInProgress) return;
  std::ostringstream msg;
  msg << "rank " << rank_ << " (this process, cuda:" << device_ << "): " << call << " for " << what
      << " failed: " << ncclGetErrorString(result);
  const char* last = comm_ ? ncclGetLastError(comm_) : nullptr;
  if (last != nullptr && *last) msg << " (" << last << ")";
  msg << kAborted;
  abortLocked(msg.str());
  throw CommFailedError(msg.str());
}

void NcclComm::waitEnqueued(const std::string& call, const std::string& what) {
  auto start = Clock::now();
  for (;;) {
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(comm_, &state);
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) check(state, call, what);
    if (secondsSince(start) > timeoutSec_) {
      std::ostringstream msg;
      msg << "rank " << rank_ << ": " << call << " for " << what << " timed out after " << timeoutSec_
          << " s (a rank did not take part; TORCHRING_TIMEOUT)";
      abortLocked(msg.str());
      throw CommFailedError(msg.str());
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void NcclComm::checkAsyncError(const std::string& what) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) {
    throw CommFailedError("rank " + std::to_string(rank_) + ": " + what +
                         ": the NCCL communicator failed earlier: " + failure_);
  }
  ncclResult_t state = ncclSuccess;
  ncclCommGetAsyncError(comm_, &state);
  if (state != ncclSuccess && state != ncclInProgress) check(state, "NCCL (asynchronous error)", what);
}

std::string NcclComm::settleLocked() {
  for (const auto& p : pending_) {
    std::string error = p.check ? p.check->error() : "";
    if (!error.empty()) {
      return "rank " + std::to_string(rank_) + " (cuda:" + std::to_string(device_) + "): " + p.what +
             " cannot run on NCCL: " + error;
    }
  }
  while (!pending_.empty()) {
    Pending& front = pending_.front();
    if (!front.hasAgreed) {  // then it has a check
      // Still comparing (the engine times out a missing peer and fails the check), or it
      // failed since the scan above: reported next time.
      if (!front.check->isCompleted() || !front.check->error().empty()) break;
      front.hasAgreed = true;
      front.agreed = Clock::now();
    }
    if (front.done->query()) {
      pending_.pop_front();
      continue;
    }
    if (secondsSince(front.agreed) > timeoutSec_) {
      std::ostringstream msg;
      msg << "rank " << rank_ << " (cuda:" << device_ << "): " << front.what << " did not complete within "
          << timeoutSec_ << " s after every rank issued it (a GPU or a peer is stuck; "
          << kRaiseTimeout.torchring << " if the GPU work queued before it takes that long)";
      return msg.str();
    }
    break;
  }
  return "";
}

// The watchdog: every 100 ms (or at once when asked) it runs a due abort, drops collectives
// that completed (kernel done, headers agreed) and aborts the communicator when a header check
// failed (ranks disagreed, or the engine saw a peer die), NCCL reported an asynchronous error,
// or the oldest agreed collective has not completed within the timeout of its agreement.
// Aborting ends the in-flight kernels, so a host blocked on the stream wakes up; the reason is
// printed at once and the next wait() or collective raises it.
void NcclComm::watch() {
  std::unique_lock<std::mutex> lock(mutex_);
  try {
    c10::cuda::CUDAGuard guard(device_);  // queries must not create a context on device 0
    for (;;) {
      runAbort(lock);
      if (stopping_) return;
      cv_.wait_for(lock, std::chrono::milliseconds(100));
      if (stopping_ || aborted_ || pending_.empty()) continue;
      std::string why;
      try {
        why = settleLocked();
        if (why.empty()) {
          ncclResult_t state = ncclSuccess;
          ncclCommGetAsyncError(comm_, &state);
          if (state != ncclSuccess && state != ncclInProgress) {
            check(state, "NCCL (asynchronous error)", pending_.empty() ? "idle" : pending_.front().what);
          }
        }
      } catch (const std::exception& e) {
        why = e.what();  // check() marked the abort already
      }
      if (!why.empty()) {
        std::string warning = failLocked(why);
        lock.unlock();
        warn(warning);
        lock.lock();
      }
    }
  } catch (const std::exception& e) {  // never let an exception end the process from here
    if (lock.owns_lock()) lock.unlock();
    warn("watchdog (rank " + std::to_string(rank_) + ") stopped: " + e.what());
  }
}

void NcclComm::drain(double timeoutSec) {
  auto start = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  while (!aborted_ && !pending_.empty()) {
    std::string why;
    try {
      why = settleLocked();
    } catch (const std::exception& e) {
      why = e.what();
    }
    if (why.empty() && !pending_.empty() && secondsSince(start) > timeoutSec) {
      why = "rank " + std::to_string(rank_) + ": " + kShutdownCall.torchring + ": " + pending_.front().what +
            " still running after " + std::to_string(timeoutSec) + " s";
    }
    if (!why.empty()) {
      std::string warning = failLocked(why);
      lock.unlock();
      warn(warning);
      return;
    }
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    lock.lock();
  }
}

template <typename F>
std::shared_ptr<NcclWork> NcclComm::launch(const std::string& call, const std::string& what,
                                           const std::vector<at::Tensor>& tensors, at::Tensor result,
                                           std::shared_ptr<CpuWork> headerCheck, F enqueue) {
  c10::cuda::CUDAGuard guard(device_);
  auto current = c10::cuda::getCurrentCUDAStream(device_);
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) {
    throw CommFailedError("rank " + std::to_string(rank_) + ": " + what +
                         ": the NCCL communicator failed earlier: " + failure_);
  }
  Event ready;
  ready.record(current.stream());
  ready.block(stream_.stream());  // the NCCL stream starts after the caller's queued work
  check(enqueue(stream_.stream()), call, what);
  waitEnqueued(call, what);
  for (const auto& t : tensors) {
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
  }
  auto done = std::make_shared<Event>();
  done->record(stream_.stream());
  pending_.push_back({done, headerCheck, what, Clock::now(), headerCheck == nullptr});
  return std::make_shared<NcclWork>(shared_from_this(), done, std::move(headerCheck), std::move(result), what);
}

std::shared_ptr<NcclWork> NcclComm::allreduce(at::Tensor t, ReduceOp op, std::shared_ptr<CpuWork> headerCheck) {
  std::string what = describe(headerCheck, t, op, -1);
  return launch("ncclAllReduce", what, {t}, t, std::move(headerCheck), [&](cudaStream_t s) {
    return ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), ncclType(t.scalar_type()), ncclOp(op, size_), comm_, s);
  });
}

std::shared_ptr<NcclWork> NcclComm::broadcast(at::Tensor t, int root, std::shared_ptr<CpuWork> headerCheck) {
  std::string what = describe(headerCheck, t, ReduceOp::SUM, root);
  return launch("ncclBroadcast", what, {t}, t, std::move(headerCheck), [&](cudaStream_t s) {
    return ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), ncclType(t.scalar_type()), root, comm_, s);
  });
}

// Allgather with a different dim-0 size per rank: one broadcast per rank, grouped so NCCL
// runs them as a single operation, each writing its piece straight to its place in `out`.
std::shared_ptr<NcclWork> NcclComm::allgather(at::Tensor t, const std::vector<int64_t>& rows,
                                              std::shared_ptr<CpuWork> headerCheck) {
  std::vector<int64_t> sizes = t.sizes().vec();
  int64_t total = 0;
  for (auto r : rows) total += r;
  sizes[0] = total;
  at::Tensor out = at::empty(sizes, t.options());
  int64_t rowElems = 1;  // from the trailing dims: right even when this rank has 0 rows
  for (int64_t d = 1; d < t.dim(); ++d) rowElems *= t.size(d);
  std::string what = describe(headerCheck, t, ReduceOp::SUM, -1);
  const ncclDataType_t type = ncclType(t.scalar_type());  // may throw: not inside the group
  return launch("ncclBroadcast (grouped allgather)", what, {t, out}, out, std::move(headerCheck),
                [&](cudaStream_t s) {
    ncclGroupStart();
    int64_t offset = 0;
    for (int r = 0; r < size_; ++r) {
      const int64_t elems = rows[r] * rowElems;
      char* dst = static_cast<char*>(out.data_ptr()) + offset * t.element_size();
      const void* src = r == rank_ ? t.data_ptr() : dst;
      if (elems > 0) ncclBroadcast(src, dst, elems, type, r, comm_, s);
      offset += elems;
    }
    return ncclGroupEnd();
  });
}

std::shared_ptr<NcclWork> NcclComm::reduceScatter(at::Tensor t, ReduceOp op, std::shared_ptr<CpuWork> headerCheck) {
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes[0] /= size_;
  at::Tensor out = at::empty(sizes, t.options());
  std::string what = describe(headerCheck, t, op, -1);
  return launch("ncclReduceScatter", what, {t, out}, out, std::move(headerCheck), [&](cudaStream_t s) {
    return ncclReduceScatter(t.data_ptr(), out.data_ptr(), out.numel(), ncclType(t.scalar_type()),
                             ncclOp(op, size_), comm_, s);
  });
}

NcclWork::NcclWork(std::shared_ptr<NcclComm> comm, std::shared_ptr<Event> done,
                   std::shared_ptr<CpuWork> check, at::Tensor result, std::string what)
    : Work(check->kind(), check->seq(), comm->rank()), comm_(std::move(comm)),
      done_(std::move(done)), check_(std::move(check)), result_(std::move(result)),
      what_(std::move(what)) {}

bool NcclWork::isCompleted() { return done_->query() && (!check_ || check_->isCompleted()); }

// A failed header check (ranks disagreed, a peer died) aborts the communicator, so that the
// collective, which may never complete, stops occupying the GPU.
void NcclWork::failIfCheckFailed() {
  if (!check_) return;
  std::string error = check_->error();
  if (error.empty()) return;
  std::string why = "rank " + std::to_string(comm_->rank()) + ": " + what_ + " cannot run on NCCL: " + error;
  comm_->abort(why);
  throw CommFailedError(why + kAborted);
}

at::Tensor NcclWork::wait(double timeoutSec) {
  // A timed wait polls: on expiry the collective is still running and nothing is aborted
  // (WaitTimeoutError); a collective that never completes is the watchdog's to abort.
  const auto start = Clock::now();
  while (timeoutSec > 0 && !isCompleted()) {
    failIfCheckFailed();
    comm_->checkAsyncError(what_);
    if (secondsSince(start) > timeoutSec) {
      std::ostringstream msg;
      msg << "rank " << comm_->rank() << ": " << what_ << ": Handle.wait(timeout=" << timeoutSec
          << ") expired; the operation is still running and the communicator is fine (wait again, "
          << "or raise the timeout)";
      throw WaitTimeoutError(msg.str());
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  failIfCheckFailed();
  comm_->checkAsyncError(what_);
  done_->block(c10::cuda::getCurrentCUDAStream(comm_->device()).stream());
  return result_;
}

at::Tensor NcclWork::synchronize(double timeoutSec) {
  if (timeoutSec <= 0) timeoutSec = comm_->timeout();
  auto start = Clock::now();
  while (!isCompleted()) {
    failIfCheckFailed();
    comm_->checkAsyncError(what_);
    if (secondsSince(start) > timeoutSec) {
      std::ostringstream msg;
      msg << "rank " << comm_->rank() << ": " << what_ << " did not complete within " << timeoutSec
          << " s (a rank is missing or stuck); the NCCL communicator is aborted";
      comm_->abort(msg.str());
      throw CommFailedError(msg.str() + ": " + kRecoveryHint.torchring);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  failIfCheckFailed();
  comm_->checkAsyncError(what_);
  return result_;
}

}  // namespace torchring
