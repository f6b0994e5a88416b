// C10dBackend: torch.distributed's collectives on one engine Communicator (backend.h).
//
// Each c10d call below checks its tensors, submits one or more engine operations (in the
// order torch calls them, so every rank's engine sees the same sequence) and returns a
// C10dWork whose `post` moves results into the caller's outputs. A tensor the engine cannot
// take in place (not contiguous, or a CUDA tensor: the staged path) goes to the engine as a
// contiguous host copy and `post` copies the result back. Mapping to engine operations:
//   allreduce        ALLREDUCE (PREMUL_SUM(f): SUM with prescale f; a tensor reduced again
//                    moves into the shared-memory arena: backend_arena.cpp); of a sparse COO tensor,
//                    three ALLGATHERs (shape, indices, values: backend_sparse.cpp)
//   allreduce_coal.  ALLREDUCE_MANY
//   broadcast        BROADCAST            reduce    REDUCE
//   allgather (list) ALLGATHER, then the gathered rows are copied into each output (and the
//                    deprecated allgather_coalesced: one ALLGATHER per input)
//   _allgather_base  ALLGATHER of the input straight into the output
//   gather           GATHER, rows copied into the root's outputs
//   scatter          SCATTER (the root's chunks concatenated)
//   reduce_scatter   REDUCE_SCATTER of the inputs stacked along a new dim 0, into the output
//   alltoall_base    ALLTOALL with the split sizes (equal blocks when empty)
//   alltoall (list)  ALLTOALL of the concatenated inputs, split into the outputs
//   send / recv      the engine's point-to-point (recv from any source: its kAnySource, the
//                    sender read back by the Work's sourceRank())
//   barrier          BARRIER
#include "c10d/backend.h"

#include <ATen/core/ivalue.h>

#include <algorithm>
#include <type_traits>

#include <sstream>

namespace torchring {

namespace {

// Names that differ between the torch releases the engine builds against: the PREMUL_SUM factor's
// type is NCCLPreMulSumSupplement up to torch 2.11 and an alias of PreMulSumSupplement after, and
// OpType::REDUCE_SCATTER_TENSOR_COALESCED came after 2.11 (before, the work is labelled
// _REDUCE_SCATTER_BASE, the op it is made of).
template <typename T, typename = void>
struct HasReduceScatterCoalesced : std::false_type {};
template <typename T>
struct HasReduceScatterCoalesced<T, std::void_t<decltype(T::REDUCE_SCATTER_TENSOR_COALESCED)>> : std::true_type {};

template <typename T = c10d::OpType>
constexpr T reduceScatterCoalescedOp() {
  if constexpr (HasReduceScatterCoalesced<T>::value) {
    return T::REDUCE_SCATTER_TENSOR_COALESCED;
  } else {
    return T::_REDUCE_SCATTER_BASE;
  }
}

}  // namespace

C10dBackend::C10dBackend(std::shared_ptr<Communicator> comm, int rank, int size, std::string label)
    : c10d::Backend(rank, size), comm_(std::move(comm)), completer_(std::make_shared<Completer>()),
      label_(std::move(label)) {}

C10dBackend::~C10dBackend() { shutdown(); }

void C10dBackend::shutdown() {
  if (comm_) comm_->shutdown();  // fails what is queued: those works complete with the error
  if (completer_) completer_->stop();
}

void C10dBackend::abort() {
  if (comm_) comm_->abort(label_ + "rank " + std::to_string(rank_) + " aborted its torchring process group");
  if (completer_) completer_->stop();
}

std::string C10dBackend::where(const char* op) const {
  std::ostringstream out;
  out << label_ << "rank " << rank_ << ": torch.distributed " << op << " on the torchring backend";
  return out.str();
}

at::Tensor C10dBackend::checked(const at::Tensor& t, const char* op, const char* name) const {
  TORCH_CHECK_VALUE(t.defined(), where(op), ": ", name, " is undefined");
  TORCH_CHECK_VALUE(t.device().is_cpu() || t.device().is_cuda(), where(op), ": ", name, " is on ",
                    t.device(), "; this backend takes CPU and CUDA tensors");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, where(op), ": ", name, " is a ", t.layout(),
                    " tensor; torchring takes dense tensors, and sparse COO ones in all_reduce (SUM)");
  return t;
}

const at::Tensor& C10dBackend::one(const std::vector<at::Tensor>& tensors, const char* op) const {
  TORCH_CHECK_VALUE(tensors.size() == 1, where(op), ": expected one tensor per call, got ", tensors.size(),
                    " (several tensors per process, one per device, are not supported)");
  return tensors[0];
}

std::pair<ReduceOp, double> C10dBackend::reduceOp(const c10d::ReduceOp& op, const at::Tensor& like,
                                                  const char* what) const {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return {ReduceOp::SUM, 1.0};
    case c10d::ReduceOp::AVG:
      return {ReduceOp::AVG, 1.0};
    case c10d::ReduceOp::MIN:
      return {ReduceOp::MIN, 1.0};
    case c10d::ReduceOp::MAX:
      return {ReduceOp::MAX, 1.0};
    case c10d::ReduceOp::PRODUCT:
      return {ReduceOp::PRODUCT, 1.0};
    case c10d::ReduceOp::BAND:
      return {ReduceOp::BAND, 1.0};
    case c10d::ReduceOp::BOR:
      return {ReduceOp::BOR, 1.0};
    case c10d::ReduceOp::BXOR:
      return {ReduceOp::BXOR, 1.0};
    case c10d::ReduceOp::PREMUL_SUM: {
      auto* factor = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK_VALUE(factor != nullptr, where(what), ": PREMUL_SUM without its factor");
      DType dtype;  // the dtype x op rule of common.h: factors need a floating dtype
      TORCH_CHECK_VALUE(engineDType(like.scalar_type(), &dtype) &&
                            reductionRefusal(OpKind::ALLREDUCE, dtype, ReduceOp::SUM, true) == Refusal::NONE,
                        where(what), ": PREMUL_SUM needs a floating-point tensor, got ", like.scalar_type());
      double f = factor->tensor_factor.defined() ? factor->tensor_factor.item<double>() : factor->double_factor;
      return {ReduceOp::SUM, f};
    }
    default:
      TORCH_CHECK_VALUE(false, where(what), ": reduce op ", static_cast<int>(op.op_),
                        " is not supported by torchring; it reduces with SUM, AVG, MIN, MAX, PRODUCT, "
                        "BAND, BOR, BXOR and PREMUL_SUM");
  }
}

c10::intrusive_ptr<C10dWork> C10dBackend::make(c10d::OpType type, std::vector<at::Tensor> outputs) {
  return c10::make_intrusive<C10dWork>(rank_, type, std::move(outputs), false,
                                       std::vector<std::vector<at::Tensor>>{});
}

std::shared_ptr<CpuWork> C10dBackend::submit(C10dWork& work, OpKind kind, const at::Tensor& tensor, ReduceOp op,
                                             int root, bool runInline, OpArgs args) {
  auto engine = comm_->submit(kind, tensor, op, root, runInline, std::move(args));
  if (tensor.defined()) work.keep.push_back(tensor);
  work.engine.push_back(engine);
  return engine;
}

c10::intrusive_ptr<c10d::Work> C10dBackend::launch(c10::intrusive_ptr<C10dWork> work) {
  const auto type = work->retrieveOpType();
  if (type != c10d::OpType::SEND && type != c10d::OpType::RECV && type != c10d::OpType::RECVANYSOURCE) {
    ++collectives_;
  }
  bool done = true;
  for (auto& e : work->engine) done = done && e->isCompleted();
  if (done) {  // ran inline (asyncOp=False) or finished already: complete on the caller's
    work->complete();  // thread, without a hand-off to the completer (a thread wake-up)
    return work;
  }
  work->pending = static_cast<int>(work->engine.size());
  auto completer = completer_;
  auto engine = work->engine;  // onDone may run at once and complete (and clear) the work
  for (auto& e : engine) {
    e->onDone([work, completer] {
      if (--work->pending == 0) completer->push(work);
    });
  }
  return work;
}

namespace {

// The CPU engine's copy of `t` to read: itself, or a contiguous host copy (a CUDA tensor is
// copied after the work queued on the current stream, the staged path).
at::Tensor hostIn(const at::Tensor& t) { return t.to(at::kCPU).contiguous(); }

// A contiguous CPU tensor for the engine to write: `t` itself, or a copy (of a non-contiguous or
// CUDA tensor) whose result `post` copies back into `t`.
at::Tensor staged(const at::Tensor& t, C10dWork& work) {
  if (t.is_contiguous() && t.device().is_cpu()) return t;
  at::Tensor copy = hostIn(t);
  auto previous = work.post;
  work.post = [previous, t, copy]() mutable {
    if (previous) previous();
    t.copy_(copy);
  };
  return copy;
}

// Row r of the gathered `all` into outs[r] (list-form allgather and gather).
void copyRows(const at::Tensor& all, const std::vector<at::Tensor>& outs) {
  for (size_t r = 0; r < outs.size(); ++r) outs[r].copy_(all[r].view(outs[r].sizes()));
}

}  // namespace

c10::intrusive_ptr<c10d::Work> C10dBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) {
  if (one(tensors, "all_reduce").layout() != at::kStrided) return sparseAllreduce(tensors[0], opts);
  at::Tensor t = checked(one(tensors, "all_reduce"), "all_reduce", "tensor");
  auto [op, prescale] = reduceOp(opts.reduceOp, t, "all_reduce");
  if (t.is_contiguous()) settle(t);
  auto work = make(c10d::OpType::ALLREDUCE, {t});
  OpArgs args;
  args.prescale = prescale;
  submit(*work, OpKind::ALLREDUCE, staged(t, *work), op, -1, !opts.asyncOp, args);
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK_VALUE(!tensors.empty(), where("all_reduce_coalesced"), ": no tensors");
  auto work = make(c10d::OpType::ALLREDUCE_COALESCED, tensors);
  OpArgs args;
  ReduceOp op = ReduceOp::SUM;
  for (auto& t : tensors) {
    checked(t, "all_reduce_coalesced", "tensor");
    std::tie(op, args.prescale) = reduceOp(opts.reduceOp, t, "all_reduce_coalesced");
    if (t.is_contiguous()) settle(t);
    args.tensors.push_back(staged(t, *work));
  }
  submit(*work, OpKind::ALLREDUCE_MANY, at::Tensor(), op, -1, !opts.asyncOp, args);
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                      const c10d::BroadcastOptions& opts) {
  at::Tensor t = checked(one(tensors, "broadcast"), "broadcast", "tensor");
  auto work = make(c10d::OpType::BROADCAST, {t});
  submit(*work, OpKind::BROADCAST, staged(t, *work), ReduceOp::SUM, static_cast<int>(opts.rootRank), !opts.asyncOp);
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::reduce(std::vector<at::Tensor>& tensors,
                                                   const c10d::ReduceOptions& opts) {
  at::Tensor t = checked(one(tensors, "reduce"), "reduce", "tensor");
  auto [op, prescale] = reduceOp(opts.reduceOp, t, "reduce");
  TORCH_CHECK_VALUE(prescale == 1.0, where("reduce"), ": PREMUL_SUM is not supported for reduce");
  auto work = make(c10d::OpType::REDUCE, {t});
  submit(*work, OpKind::REDUCE, staged(t, *work), op, static_cast<int>(opts.rootRank), !opts.asyncOp);
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions& opts) {
  at::Tensor in = checked(one(inputs, "all_gather"), "all_gather", "input");
  TORCH_CHECK_VALUE(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_, where("all_gather"),
                    ": expected one list of ", size_, " output tensors");
  for (auto& o : outputs[0]) {
    checked(o, "all_gather", "an output");
    TORCH_CHECK_VALUE(o.numel() == in.numel() && o.scalar_type() == in.scalar_type(), where("all_gather"),
                      ": every output must have the input's size and dtype (", in.sizes(), ", ",
                      in.scalar_type(), "), got ", o.sizes(), ", ", o.scalar_type());
  }
  auto work = c10::make_intrusive<C10dWork>(rank_, c10d::OpType::ALLGATHER, outputs[0], true, outputs);
  at::Tensor flat = hostIn(in).reshape({1, -1});
  auto gathered = submit(*work, OpKind::ALLGATHER, flat, ReduceOp::SUM, -1, !opts.asyncOp);
  std::vector<at::Tensor> outs = outputs[0];
  work->post = [gathered, outs]() { copyRows(gathered->wait(0), outs); };
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                            const c10d::AllgatherOptions& opts) {
  checked(input, "all_gather_into_tensor", "input");
  checked(output, "all_gather_into_tensor", "output");
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size_ && output.scalar_type() == input.scalar_type(),
                    where("all_gather_into_tensor"), ": the output must hold ", size_, " times the input (",
                    input.numel(), " elements of ", input.scalar_type(), " each), got ", output.numel(),
                    " elements of ", output.scalar_type());
  auto work = make(c10d::OpType::_ALLGATHER_BASE, {output});
  at::Tensor flat = hostIn(input).reshape({1, -1});
  OpArgs args;
  args.out = staged(output, *work);  // the engine gathers straight into it
  auto gathered = submit(*work, OpKind::ALLGATHER, flat, ReduceOp::SUM, -1, !opts.asyncOp, args);
  at::Tensor out = args.out;
  auto previous = work->post;
  work->post = [gathered, out, previous]() mutable {
    at::Tensor all = gathered->wait(0);
    if (!all.is_same(out)) out.copy_(all.view(out.sizes()));
    if (previous) previous();  // a staged output: copy back
  };
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                                std::vector<at::Tensor>& inputs,
                                                                const c10d::AllgatherOptions& opts) {
  // torch's layout: outputLists[r][i] receives rank r's inputs[i].
  TORCH_CHECK_VALUE(static_cast<int>(outputLists.size()) == size_, where("all_gather_coalesced"), ": expected ",
                    size_, " output lists (one per rank), got ", outputLists.size());
  std::vector<at::Tensor> flatOuts, keep;
  std::vector<std::pair<std::shared_ptr<CpuWork>, std::vector<at::Tensor>>> parts;
  std::vector<std::shared_ptr<CpuWork>> engine;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checked(inputs[i], "all_gather_coalesced", "an input");
    std::vector<at::Tensor> outs;  // input i of every rank
    for (int r = 0; r < size_; ++r) {
      TORCH_CHECK_VALUE(outputLists[r].size() == inputs.size(), where("all_gather_coalesced"), ": output list ",
                        r, " must hold ", inputs.size(), " tensors (one per input), got ", outputLists[r].size());
      const at::Tensor& o = checked(outputLists[r][i], "all_gather_coalesced", "an output");
      TORCH_CHECK_VALUE(o.numel() == inputs[i].numel() && o.scalar_type() == inputs[i].scalar_type(),
                        where("all_gather_coalesced"), ": output ", i, " of rank ", r, " must have input ", i,
                        "'s size and dtype");
      outs.push_back(o);
      flatOuts.push_back(o);
    }
    at::Tensor flat = hostIn(inputs[i]).reshape({1, -1});
    engine.push_back(comm_->submit(OpKind::ALLGATHER, flat, ReduceOp::SUM, -1, false));
    keep.push_back(flat);
    parts.emplace_back(engine.back(), std::move(outs));
  }
  auto work = c10::make_intrusive<C10dWork>(rank_, c10d::OpType::ALLGATHER_COALESCED, flatOuts, true,
                                            outputLists);
  work->engine = std::move(engine);
  work->keep = std::move(keep);
  work->post = [parts]() {
    for (auto& [gathered, outs] : parts) copyRows(gathered->wait(0), outs);
  };
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), where("all_gather_into_tensor_coalesced"),
                    ": ", outputs.size(), " outputs for ", inputs.size(), " inputs");
  auto work = make(c10d::OpType::COALESCED, outputs);
  std::vector<std::pair<std::shared_ptr<CpuWork>, at::Tensor>> parts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checked(inputs[i], "all_gather_into_tensor_coalesced", "an input");
    checked(outputs[i], "all_gather_into_tensor_coalesced", "an output");
    TORCH_CHECK_VALUE(outputs[i].numel() == inputs[i].numel() * size_, where("all_gather_into_tensor_coalesced"),
                      ": output ", i, " must hold ", size_, " times input ", i);
    at::Tensor flat = hostIn(inputs[i]).reshape({1, -1});
    auto gathered = submit(*work, OpKind::ALLGATHER, flat, ReduceOp::SUM, -1, false);
    parts.emplace_back(gathered, outputs[i]);
  }
  work->post = [parts]() mutable {
    for (auto& [gathered, out] : parts) out.copy_(gathered->wait(0).view(out.sizes()));
  };
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                   std::vector<at::Tensor>& inputs,
                                                   const c10d::GatherOptions& opts) {
  at::Tensor in = checked(one(inputs, "gather"), "gather", "input");
  const int root = static_cast<int>(opts.rootRank);
  if (rank_ == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_, where("gather"),
                      ": the root needs one list of ", size_, " output tensors");
    for (auto& o : outputs[0]) {
      checked(o, "gather", "an output");
      TORCH_CHECK_VALUE(o.numel() == in.numel() && o.scalar_type() == in.scalar_type(), where("gather"),
                        ": every output must have the input's size and dtype");
    }
  } else {
    TORCH_CHECK_VALUE(outputs.empty() || outputs[0].empty(), where("gather"),
                      ": only the root (rank ", root, ") passes output tensors");
  }
  std::vector<at::Tensor> outs = rank_ == root ? outputs[0] : std::vector<at::Tensor>{};
  auto work = c10::make_intrusive<C10dWork>(rank_, c10d::OpType::GATHER, outs, true,
                                            rank_ == root ? outputs : std::vector<std::vector<at::Tensor>>{});
  at::Tensor flat = hostIn(in).reshape({1, -1});
  auto gathered = submit(*work, OpKind::GATHER, flat, ReduceOp::SUM, root, false);
  work->post = [gathered, outs]() { copyRows(gathered->wait(0), outs); };
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::scatter(std::vector<at::Tensor>& outputs,
                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                    const c10d::ScatterOptions& opts) {
  at::Tensor out = checked(one(outputs, "scatter"), "scatter", "output");
  const int root = static_cast<int>(opts.rootRank);
  auto work = make(c10d::OpType::SCATTER, {out});
  OpArgs args;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_, where("scatter"),
                      ": the root needs one list of ", size_, " input tensors");
    std::vector<at::Tensor> rows;
    for (auto& t : inputs[0]) {
      checked(t, "scatter", "an input");
      TORCH_CHECK_VALUE(t.numel() == out.numel() && t.scalar_type() == out.scalar_type(), where("scatter"),
                        ": every input must have the output's size and dtype");
      rows.push_back(hostIn(t).reshape({1, -1}));
    }
    args.tensors = {at::cat(rows)};
  }
  at::Tensor flat = staged(out, *work).reshape({1, -1});
  submit(*work, OpKind::SCATTER, flat, ReduceOp::SUM, root, false, args);
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                           std::vector<std::vector<at::Tensor>>& inputs,
                                                           const c10d::ReduceScatterOptions& opts) {
  at::Tensor out = checked(one(outputs, "reduce_scatter"), "reduce_scatter", "output");
  TORCH_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_, where("reduce_scatter"),
                    ": expected one list of ", size_, " input tensors");
  std::vector<at::Tensor> rows;
  for (auto& t : inputs[0]) {
    checked(t, "reduce_scatter", "an input");
    TORCH_CHECK_VALUE(t.numel() == out.numel() && t.scalar_type() == out.scalar_type(), where("reduce_scatter"),
                      ": every input must have the output's size and dtype");
    rows.push_back(hostIn(t).reshape({1, -1}));
  }
  at::Tensor stacked = at::cat(rows);
  auto [op, prescale] = reduceOp(opts.reduceOp, out, "reduce_scatter");
  auto work = make(c10d::OpType::REDUCE_SCATTER, {out});
  at::Tensor target = staged(out, *work).reshape({1, -1});
  OpArgs args;
  args.out = target;
  args.prescale = prescale;
  submit(*work, OpKind::REDUCE_SCATTER, stacked, op, -1, !opts.asyncOp, args);
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::ReduceScatterOptions& opts) {
  checked(input, "reduce_scatter_tensor", "input");
  checked(output, "reduce_scatter_tensor", "output");
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size_ && input.scalar_type() == output.scalar_type(),
                    where("reduce_scatter_tensor"), ": the input must hold ", size_, " times the output (",
                    output.numel(), " elements of ", output.scalar_type(), "), got ", input.numel(),
                    " elements of ", input.scalar_type());
  auto [op, prescale] = reduceOp(opts.reduceOp, output, "reduce_scatter_tensor");
  auto work = make(c10d::OpType::_REDUCE_SCATTER_BASE, {output});
  at::Tensor stacked = hostIn(input).reshape({size_, input.numel() / size_});
  OpArgs args;
  args.out = staged(output, *work).reshape({1, -1});
  args.prescale = prescale;
  submit(*work, OpKind::REDUCE_SCATTER, stacked, op, -1, !opts.asyncOp, args);
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), where("reduce_scatter_tensor_coalesced"),
                    ": ", outputs.size(), " outputs for ", inputs.size(), " inputs");
  auto work = make(reduceScatterCoalescedOp(), outputs);
  for (size_t i = 0; i < inputs.size(); ++i) {
    checked(inputs[i], "reduce_scatter_tensor_coalesced", "an input");
    checked(outputs[i], "reduce_scatter_tensor_coalesced", "an output");
    TORCH_CHECK_VALUE(inputs[i].numel() == outputs[i].numel() * size_, where("reduce_scatter_tensor_coalesced"),
                      ": input ", i, " must hold ", size_, " times output ", i);
    auto [op, prescale] = reduceOp(opts.reduceOp, outputs[i], "reduce_scatter_tensor_coalesced");
    at::Tensor stacked = hostIn(inputs[i]).reshape({size_, inputs[i].numel() / size_});
    OpArgs args;
    args.out = staged(outputs[i], *work).reshape({1, -1});
    args.prescale = prescale;
    submit(*work, OpKind::REDUCE_SCATTER, stacked, op, -1, false, args);
  }
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                          std::vector<int64_t>& outputSplits,
                                                          std::vector<int64_t>& inputSplits,
                                                          const c10d::AllToAllOptions& opts) {
  checked(input, "all_to_all_single", "input");
  checked(output, "all_to_all_single", "output");
  auto splits = [&](std::vector<int64_t> given, const at::Tensor& t, const char* name) {
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    if (given.empty()) {
      TORCH_CHECK_VALUE(rows % size_ == 0, where("all_to_all_single"), ": without ", name, " dim 0 of the ",
                        name[0] == 'i' ? "input" : "output", " (", rows, ") must divide by ", size_);
      given.assign(size_, rows / size_);
    }
    TORCH_CHECK_VALUE(static_cast<int>(given.size()) == size_, where("all_to_all_single"), ": ", name,
                      " must have one entry per rank (", size_, "), got ", given.size());
    return at::tensor(given, at::kLong);
  };
  auto work = make(c10d::OpType::ALLTOALL_BASE, {output});
  OpArgs args;
  args.sendSplits = splits(inputSplits, input, "input_split_sizes");
  args.recvSplits = splits(outputSplits, output, "output_split_sizes");
  args.recvSplitsKnown = true;
  args.out = staged(output, *work);
  at::Tensor in = hostIn(input);
  submit(*work, OpKind::ALLTOALL, in, ReduceOp::SUM, -1, false, args);
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllToAllOptions& opts) {
  TORCH_CHECK_VALUE(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_,
                    where("all_to_all"), ": expected ", size_, " input and ", size_, " output tensors");
  std::vector<at::Tensor> ins, rowsOut;
  std::vector<int64_t> send, recv;
  for (int r = 0; r < size_; ++r) {
    checked(inputs[r], "all_to_all", "an input");
    checked(outputs[r], "all_to_all", "an output");
    ins.push_back(hostIn(inputs[r]).view({-1}));
    send.push_back(inputs[r].numel());
    recv.push_back(outputs[r].numel());
  }
  at::Tensor in = at::cat(ins).view({-1, 1});
  int64_t total = 0;
  for (auto n : recv) total += n;
  at::Tensor out = at::empty({total, 1}, in.options());  // on the host, like `in`
  auto work = make(c10d::OpType::ALLTOALL, outputs);
  OpArgs args;
  args.sendSplits = at::tensor(send, at::kLong);
  args.recvSplits = at::tensor(recv, at::kLong);
  args.recvSplitsKnown = true;
  args.out = out;
  std::vector<at::Tensor> outs = outputs;
  work->post = [out, outs, recv]() {
    int64_t offset = 0;
    for (size_t r = 0; r < outs.size(); ++r) {
      outs[r].copy_(out.narrow(0, offset, recv[r]).view(outs[r].sizes()));
      offset += recv[r];
    }
  };
  work->keep.push_back(out);
  submit(*work, OpKind::ALLTOALL, in, ReduceOp::SUM, -1, false, args);
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  at::Tensor t = hostIn(checked(one(tensors, "send"), "send", "tensor"));
  auto work = make(c10d::OpType::SEND, {tensors[0]});
  work->keep.push_back(t);
  work->engine.push_back(comm_->send(t, dstRank, tag));
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  at::Tensor t = checked(one(tensors, "recv"), "recv", "tensor");
  auto work = make(c10d::OpType::RECV, {t});
  work->engine.push_back(comm_->recv(staged(t, *work), srcRank, tag));
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  at::Tensor t = checked(one(tensors, "recv"), "recv", "tensor");
  auto work = make(c10d::OpType::RECVANYSOURCE, {t});
  work->engine.push_back(comm_->recv(staged(t, *work), P2P::kAnySource, tag));
  return launch(work);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::barrier(const c10d::BarrierOptions& opts) {
  auto work = make(c10d::OpType::BARRIER, {});
  submit(*work, OpKind::BARRIER, at::Tensor(), ReduceOp::SUM, -1, !opts.asyncOp);
  return launch(work);
}

}  // namespace torchring
