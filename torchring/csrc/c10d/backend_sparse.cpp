// all_reduce of a sparse COO tensor on the torchring backend (backend.h), as gloo's sparse
// allreduce computes it and DDP sends it for nn.Embedding(sparse=True) / EmbeddingBag.
//
// Every rank coalesces its tensor `in` (one entry per index), then queues three ALLGATHERs,
// back to back and without waiting (so DDP's other buckets keep flowing):
//   shape   int64[1, 2 + ndim]: sparse_dim, dense_dim and the sizes, one row per rank; a rank
//           whose row differs fails every rank, named (a differing ndim already fails the
//           allgather's header check);
//   rows    in.indices() transposed, int64[nnz, sparse_dim]: one row per non-zero, so each
//           rank's own count of non-zeros travels with it (the engine's ragged allgather);
//   values  in.values(), [nnz, dense...] of the tensor's dtype, along dim 0 likewise.
// `post` makes the gathered rows and values one COO tensor and coalesces it: entries of the same
// index from several ranks are summed, in rank order; the result is copied into the caller's
// tensor (in place, as gloo does) and completes the Future.
#include "c10d/backend.h"

#include <sstream>

namespace torchring {

namespace {

std::string sizesText(const at::Tensor& row) {
  std::ostringstream out;
  auto r = row.accessor<int64_t, 1>();
  out << "[";
  for (int64_t d = 2; d < row.size(0); ++d) out << (d > 2 ? ", " : "") << r[d];
  out << "] (sparse_dim " << r[0] << ", dense_dim " << r[1] << ")";
  return out.str();
}

}  // namespace

c10::intrusive_ptr<c10d::Work> C10dBackend::sparseAllreduce(at::Tensor& t, const c10d::AllreduceOptions& opts) {
  TORCH_CHECK_VALUE(t.layout() == at::kSparse, where("all_reduce"), ": a ", t.layout(),
                    " tensor; torchring reduces dense tensors and sparse COO ones (torch.sparse_coo)");
  TORCH_CHECK_VALUE(opts.reduceOp.op_ == c10d::ReduceOp::SUM, where("all_reduce"), ": a sparse tensor (",
                    t.scalar_type(), t.sizes(), ") is reduced with SUM only, as on gloo; got reduce op ",
                    static_cast<int>(opts.reduceOp.op_), " (divide the values afterwards for an average)");
  TORCH_CHECK_VALUE(t.device().is_cpu() || t.device().is_cuda(), where("all_reduce"), ": tensor is on ",
                    t.device(), "; this backend takes CPU and CUDA tensors");
  at::Tensor in = t.coalesce().cpu();
  std::vector<int64_t> shape{in.sparse_dim(), in.dense_dim()};
  for (int64_t s : in.sizes()) shape.push_back(s);
  at::Tensor mine = at::tensor(shape, at::kLong).reshape({1, -1});
  at::Tensor rows = in.indices().t().contiguous();
  at::Tensor values = in.values().contiguous();
  auto work = make(c10d::OpType::ALLREDUCE, {t});
  const bool runInline = false;  // three operations: each queued, none waited for here
  auto shapes = submit(*work, OpKind::ALLGATHER, mine, ReduceOp::SUM, -1, runInline);
  auto gatheredRows = submit(*work, OpKind::ALLGATHER, rows, ReduceOp::SUM, -1, runInline);
  auto gatheredValues = submit(*work, OpKind::ALLGATHER, values, ReduceOp::SUM, -1, runInline);
  const std::string where = this->where("all_reduce");
  const int rank = rank_;
  at::Tensor target = t;
  work->post = [shapes, gatheredRows, gatheredValues, mine, target, where, rank]() mutable {
    at::Tensor all = shapes->wait(0);
    for (int64_t r = 0; r < all.size(0); ++r) {
      TORCH_CHECK_VALUE(all[r].equal(mine[0]), where, ": rank ", r, "'s sparse tensor is ", sizesText(all[r]),
                        " but this rank's is ", sizesText(mine[0]),
                        "; every rank must reduce a sparse tensor of the same sizes");
    }
    at::Tensor indices = gatheredRows->wait(0).t();
    at::Tensor vals = gatheredValues->wait(0);
    at::Tensor sum = at::sparse_coo_tensor(indices, vals, target.sizes(), vals.options().layout(at::kSparse)).coalesce();
    target.copy_(sum.to(target.device()));
  };
  return launch(work);
}

}  // namespace torchring
