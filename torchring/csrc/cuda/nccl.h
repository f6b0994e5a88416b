// NCCL collectives on CUDA tensors: one communicator per process and device, a stream of
// torchring's own, and event-completed handles. Built only against a CUDA build of torch.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "core/common.h"
#include "core/tensor.h"
#include "core/work.h"

namespace torchring {

class NcclComm;

// A CUDA event without timing: marks a point on a stream that other streams, or the host,
// can wait for. (Plain CUDA runtime calls: ATen's CUDA headers need all of the toolkit.)
class Event {
 public:
  Event();
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(cudaStream_t stream);
  void block(cudaStream_t stream);  // `stream` waits for this event
  bool query() const;               // true once everything before the record ran

 private:
  cudaEvent_t event_ = nullptr;
};

// A collective in flight on the NCCL stream, with the engine's header check of it. It is a
// Work (same sequence number as its check) so Python holds one kind of handle.
class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<NcclComm> comm, std::shared_ptr<Event> done,
           std::shared_ptr<CpuWork> check, at::Tensor result, std::string what);
  bool isCompleted() override;
  // Makes the caller's current stream wait for the collective; the host does not block
  // (with timeoutSec > 0 it first polls until the collective completed, and throws
  // WaitTimeoutError, aborting nothing, if that takes longer). Raises CommFailedError if
  // the communicator failed (an NCCL error, the watchdog's timeout, or ranks that disagreed
  // on this or an earlier collective: NCCL had launched it, so NCCL is aborted).
  at::Tensor wait(double timeoutSec) override;
  // Blocks the host until done, and until the ranks' headers were compared; an NCCL error,
  // a mismatch or `timeoutSec` without completion aborts the communicator and raises.
  at::Tensor synchronize(double timeoutSec) override;

 private:
  void failIfCheckFailed();

  std::shared_ptr<NcclComm> comm_;
  std::shared_ptr<Event> done_;
  std::shared_ptr<CpuWork> check_;
  at::Tensor result_;
  std::string what_;
};

class NcclComm : public std::enable_shared_from_this<NcclComm> {
 public:
  // The bytes of a fresh ncclUniqueId (rank 0 makes it; the store carries it).
  static std::string uniqueId();
  static std::string version();
  // Joins the communicator on `device`; setup that makes no progress for `timeoutSec`
  // (a rank that never joins) is aborted with an error instead of hanging.
  NcclComm(int rank, int size, int device, const std::string& uniqueId, double timeoutSec);
  // The communicator of `parent`'s ranks less `exclude` (parent ranks), made by ncclCommShrink
  // (NCCL >= 2.27) without a new bootstrap: the survivors of a re-formed world, in their old
  // order, as torchring.elastic ranks them. Every remaining rank must call it together.
  // `parentFailed`: the parent saw an error, so NCCL first ends its operations (NCCL_SHRINK_ABORT).
  // The parent is unusable afterwards: close() it.
  NcclComm(NcclComm& parent, const std::vector<int>& exclude, bool parentFailed, double timeoutSec);
  // Whether this build's NCCL has ncclCommShrink.
  static bool shrinkSupported();
  ~NcclComm();

  // Each collective takes `check`, the engine's header check of it (submitCheck), which the
  // watchdog watches alongside the collective.
  std::shared_ptr<NcclWork> allreduce(at::Tensor tensor, ReduceOp op, std::shared_ptr<CpuWork> check);
  std::shared_ptr<NcclWork> broadcast(at::Tensor tensor, int root, std::shared_ptr<CpuWork> check);
  // rows[r] = dim-0 size of rank r's tensor (the caller agreed them on the CPU engine).
  std::shared_ptr<NcclWork> allgather(at::Tensor tensor, const std::vector<int64_t>& rows,
                                      std::shared_ptr<CpuWork> check);
  // Input rows split evenly over the ranks; returns this rank's reduced block.
  std::shared_ptr<NcclWork> reduceScatter(at::Tensor tensor, ReduceOp op, std::shared_ptr<CpuWork> check);

  // Raises CommFailedError if the communicator failed or NCCL reported an asynchronous error
  // (then the communicator is aborted).
  void checkAsyncError(const std::string& what);
  // Marks the communicator failed with `why` (later calls raise it) and has the watchdog
  // abort NCCL, which ends the in-flight kernels.
  void abort(const std::string& why);
  // Waits (host) until every launched collective completed and its headers were compared,
  // up to `timeoutSec`; aborts on timeout. shutdown() calls it before close().
  void drain(double timeoutSec);
  // Stops the watchdog and frees the communicator: finalize + destroy when nothing is in
  // flight, abort otherwise. Idempotent; the destructor calls it too.
  void close();
  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  // Whether the communicator failed (an NCCL error, an abort): it cannot be shrunk then.
  bool failed();
  double timeout() const { return timeoutSec_; }

 private:
  // A launched collective the watchdog has not seen complete yet.
  struct Pending {
    std::shared_ptr<Event> done;
    std::shared_ptr<CpuWork> check;
    std::string what;
    Clock::time_point agreed;  // when its header check was first seen passed (or launch)
    bool hasAgreed = false;
  };
  // The five below run with mutex_ held. abortLocked() only marks the failure: the NCCL
  // abort itself runs without the lock (runAbort), since it can wait on the GPU.
  void check(ncclResult_t result, const std::string& call, const std::string& what);
  void waitEnqueued(const std::string& call, const std::string& what);
  void abortLocked(const std::string& why);
  // abortLocked + how to recover; returns the warning the caller shows once mutex_ is released
  std::string failLocked(const std::string& why);
  // Drops completed, agreed collectives from the front; returns why the communicator must
  // be aborted ("" if not): a failed check, or the oldest agreed collective is overdue.
  std::string settleLocked();
  void runAbort(std::unique_lock<std::mutex>& lock);
  // Orders `stream_` after the caller's current stream, launches `enqueue`, and returns a
  // handle whose event completes with it. `tensors` stay valid across both streams.
  template <typename F>
  std::shared_ptr<NcclWork> launch(const std::string& call, const std::string& what,
                                   const std::vector<at::Tensor>& tensors, at::Tensor result,
                                   std::shared_ptr<CpuWork> check, F enqueue);
  void watch();

  int rank_, size_, device_;
  double timeoutSec_;
  ncclComm_t comm_ = nullptr;
  c10::cuda::CUDAStream stream_;

  std::mutex mutex_;  // NCCL calls on comm_, and everything below
  std::condition_variable cv_;
  bool aborted_ = false, abortDue_ = false, stopping_ = false, closed_ = false;
  std::string failure_;
  std::deque<Pending> pending_;
  std::thread watchdog_;
};

}  // namespace torchring
