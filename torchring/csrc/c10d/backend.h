// torchring as a torch.distributed backend: init_process_group("torchring") runs torch's
// collectives (and so DDP, FSDP, Lightning) on one engine Communicator per process group.
//
// C10dBackend turns each c10d call into engine operations (Communicator::submit, send, recv)
// and returns a C10dWork (backend_work.h), completed by the backend's Completer thread once the
// engine has finished them. An operation that is complete when submit returns (run inline for a
// blocking call) is completed right there, on the caller's thread.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "c10d/backend_work.h"
#include "engine/communicator.h"

namespace torchring {

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
  // ProcessGroup.abort(), from any thread: the operation in flight fails now, on this rank
  // and its peers (Communicator::abort), and so does every later one.
  void abort() override;
  // The number of collectives this group has issued: TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper
  // compares it across ranks before each collective. It starts at 0 on every rank (the group is
  // new on all of them), so no store round trip is needed to agree on a start.
  void setSequenceNumberForGroup() override { collectives_ = 0; }
  uint64_t getSequenceNumberForGroup() override { return collectives_.load(); }

 private:
  // Starts `work` once its engine operations are set: each one's completion counts down, and
  // the last hands the work to the Completer.
  c10::intrusive_ptr<c10d::Work> launch(c10::intrusive_ptr<C10dWork> work);
  c10::intrusive_ptr<C10dWork> make(c10d::OpType type, std::vector<at::Tensor> outputs);
  // Submits one engine operation for `work` (Communicator::submit's arguments): keeps
  // `tensor` alive until the work completes and adds the operation to those it waits for.
  std::shared_ptr<CpuWork> submit(C10dWork& work, OpKind kind, const at::Tensor& tensor, ReduceOp op, int root,
                                  bool runInline, OpArgs args = OpArgs());
  // Moves a CPU tensor all_reduced again (a DDP bucket) into the shared-memory arena, so its
  // later all_reduces are zero-copy (backend_arena.cpp).
  void settle(const at::Tensor& t);
  // all_reduce of a sparse COO tensor (backend_sparse.cpp).
  c10::intrusive_ptr<c10d::Work> sparseAllreduce(at::Tensor& t, const c10d::AllreduceOptions& opts);
  at::Tensor checked(const at::Tensor& t, const char* op, const char* name) const;
  const at::Tensor& one(const std::vector<at::Tensor>& tensors, const char* op) const;
  std::string where(const char* op) const;
  // (engine op, prescale) for c10d's `op`; names what torchring cannot do.
  std::pair<ReduceOp, double> reduceOp(const c10d::ReduceOp& op, const at::Tensor& like,
                                       const char* what) const;

  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Completer> completer_;
  std::string label_;
  std::atomic<uint64_t> collectives_{0};
  std::mutex seenMutex_;
  std::unordered_map<const void*, int> seen_;  // all_reduces per storage (settle)
};

}  // namespace torchring
