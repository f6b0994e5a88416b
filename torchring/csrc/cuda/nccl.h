// NCCL collectives on CUDA tensors: one communicator per process and device, a stream of
// torchring's own, and event-completed handles. Built only against a CUDA build of torch.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>
#include <string>

#include "../common.h"

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

// A collective in flight on the NCCL stream.
class NcclWork {
 public:
  NcclWork(std::shared_ptr<NcclComm> comm, std::shared_ptr<Event> done,
           at::Tensor result, std::string what)
      : comm_(std::move(comm)), done_(std::move(done)), result_(std::move(result)), what_(std::move(what)) {}
  bool isCompleted();
  // Makes the caller's current stream wait for the collective; the host does not block.
  at::Tensor wait();
  // Blocks the host until done; an NCCL error or `timeoutSec` without completion aborts the
  // communicator and raises TorchringError.
  at::Tensor synchronize(double timeoutSec);

 private:
  std::shared_ptr<NcclComm> comm_;
  std::shared_ptr<Event> done_;
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
  ~NcclComm();

  std::shared_ptr<NcclWork> allreduce(at::Tensor tensor, ReduceOp op);
  std::shared_ptr<NcclWork> broadcast(at::Tensor tensor, int root);
  // rows[r] = dim-0 size of rank r's tensor (the caller agreed them on the CPU engine).
  std::shared_ptr<NcclWork> allgather(at::Tensor tensor, const std::vector<int64_t>& rows);
  // Input rows split evenly over the ranks; returns this rank's reduced block.
  std::shared_ptr<NcclWork> reduceScatter(at::Tensor tensor, ReduceOp op);

  // Raises TorchringError if NCCL reported an asynchronous error (then the comm is aborted).
  void checkAsyncError(const std::string& what);
  void abort(const std::string& why);
  int rank() const { return rank_; }
  int device() const { return device_; }
  double timeout() const { return timeoutSec_; }

 private:
  void check(ncclResult_t result, const std::string& call, const std::string& what);
  void waitEnqueued(const std::string& call, const std::string& what);
  // Orders `stream_` after the caller's current stream, launches `enqueue`, and returns a
  // handle whose event completes with it. `tensors` stay valid across both streams.
  template <typename F>
  std::shared_ptr<NcclWork> launch(const std::string& call, const std::string& what,
                                   const std::vector<at::Tensor>& tensors, at::Tensor result, F enqueue);

  int rank_, size_, device_;
  double timeoutSec_;
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;
  std::string failure_;
  c10::cuda::CUDAStream stream_;
  uint64_t seq_ = 0;
};

}  // namespace torchring
