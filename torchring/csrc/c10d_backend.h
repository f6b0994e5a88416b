// torchring as a torch.distributed backend: init_process_group("torchring") runs torch's
// collectives (and so DDP, FSDP, Lightning) on one engine Communicator per process group.
//
// C10dBackend turns each c10d call into engine operations (Communicator::submit, send, recv)
// and returns a C10dWork. The engine finishes its operations on its own threads; the last
// one to finish hands the C10dWork to the Completer, a thread of the backend that runs the
// operation's `post` step (copying results into the caller's output tensors, which may be
// views: they are written, never rebound) and then completes the c10d Work and its Future
// with the outputs, or with the error. Futures are completed there and not on an engine
// thread because a Future's callbacks (DDP communication hooks, fut.then in Python) run on
// the completing thread and may take the GIL. An operation that is complete when submit returns
// (run inline for a blocking call) is completed right there, on the caller's thread.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "communicator.h"

namespace torchring {

class C10dWork : public c10d::Work {
 public:
  // `outputs` is what the Future completes with; `nested` makes it a list of lists (list-form
  // allgather and gather, as torch's own backends do).
  C10dWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, bool nested,
           std::vector<std::vector<at::Tensor>> nestedOutputs);
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }
  // Runs post() (unless an engine operation failed), then completes the Work and its Future.
  void complete();

  std::vector<std::shared_ptr<CpuWork>> engine;  // the engine operations it waits for
  std::function<void()> post;                    // after they all succeeded
  std::vector<at::Tensor> keep;                  // inputs and staging kept alive until then
  std::atomic<int> pending{0};

 private:
  std::vector<at::Tensor> outputs_;
  std::vector<std::vector<at::Tensor>> nested_;
  bool isNested_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class Completer {
 public:
  Completer();
  ~Completer();
  void push(c10::intrusive_ptr<C10dWork> work);
  void stop();

 private:
  void loop();
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<C10dWork>> ready_;
  bool stopping_ = false;
  std::thread thread_;
};

class C10dBackend : public c10d::Backend {
 public:
  C10dBackend(std::shared_ptr<Communicator> comm, int rank, int size, std::string label);
  ~C10dBackend() override;
  const std::string getBackendName() const override { return "torchring"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void shutdown() override;

 private:
  // Starts `work` once its engine operations are set: each one's completion counts down, and
  // the last hands the work to the Completer.
  c10::intrusive_ptr<c10d::Work> launch(c10::intrusive_ptr<C10dWork> work);
  c10::intrusive_ptr<C10dWork> make(c10d::OpType type, std::vector<at::Tensor> outputs);
  at::Tensor checked(const at::Tensor& t, const char* op, const char* name) const;
  const at::Tensor& one(const std::vector<at::Tensor>& tensors, const char* op) const;
  std::string where(const char* op) const;
  // (engine op, prescale) for c10d's `op`; names what torchring cannot do.
  std::pair<ReduceOp, double> reduceOp(const c10d::ReduceOp& op, const at::Tensor& like,
                                       const char* what) const;

  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Completer> completer_;
  std::string label_;
};

}  // namespace torchring
