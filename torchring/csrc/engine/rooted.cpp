// The collectives built on the engine's others and on point-to-point transfers (p2p.h):
// reduce, gather, scatter, alltoall and the fused allreduce of many tensors, plus the
// checks every collective's arguments get before they are queued.
//
// gather: every rank but the root sends its tensor to the root, which receives the
//   size - 1 messages at once into their rows of the result (the root's own rows are
//   copied). The root receives (size - 1) * bytes; every other rank sends bytes once.
// scatter: the mirror image: the root sends chunk r to rank r, in parallel.
// alltoall: first every rank learns every rank's send splits (and, when the caller gave
//   them, the receive splits it expects) with one allgather of 2 * size int64s, so every
//   rank checks the same table and fails the same way on an inconsistency; then each rank
//   posts a recv from and a send to every other rank at once (rows of `sendSplits[r]` to
//   rank r), starting with its right neighbour so that no peer is everyone's first target.
// reduce: an allreduce of the root's tensor in place and of a copy elsewhere (the same
//   bytes as an allreduce; non-roots keep their input).
// allreduce_many: the tensors are packed into one buffer, allreduced as one operation (one
//   header, one transfer) and unpacked.
// Transfers of a collective use the tag -1 - seq, never a user's tag (>= 0).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "engine/communicator.h"
#include "core/reduce.h"

namespace torchring {
namespace {

int64_t internalTag(uint64_t seq) { return -1 - static_cast<int64_t>(seq & 0x3fffffffffffffffull); }

}  // namespace

void Communicator::waitAll(const std::vector<std::shared_ptr<CpuWork>>& works) {
  for (const auto& work : works) work->wait(0);
}

// The Python API checks these for its callers with its own words; the engine is bound
// directly too (tests), so it checks again. TORCH_CHECK_VALUE raises ValueError.
void Communicator::checkArgs(OpKind kind, const at::Tensor& tensor, ReduceOp op, int root,
                             const OpArgs& args) const {
  // The words of a failure, made only when a check fails (every call passes through here).
  auto what = [&] { return rankText() + ": " + kindName(kind); };
  if (kind == OpKind::ALLREDUCE_MANY) {
    TORCH_CHECK_VALUE(!args.tensors.empty(), what(), " needs at least one tensor");
    for (const auto& t : args.tensors) {
      TORCH_CHECK_VALUE(t.defined() && t.device().is_cpu() && t.is_contiguous(), what(),
                        " needs contiguous CPU tensors");
      TORCH_CHECK_VALUE(t.scalar_type() == args.tensors[0].scalar_type(), what(), ": every tensor must have the dtype ",
                        tensorText(args.tensors[0]), " has, got ", tensorText(t));
    }
  } else {
    TORCH_CHECK_VALUE(kind == OpKind::BARRIER || tensor.defined(), what(), " needs a tensor");
    TORCH_CHECK_VALUE(!tensor.defined() || (tensor.device().is_cpu() && tensor.is_contiguous()), what(),
                      " needs a contiguous CPU tensor, got ", tensorText(tensor), " on ", tensor.device());
  }
  const OpSpec& spec = opSpec(kind);
  TORCH_CHECK_VALUE(!spec.rooted || (root >= 0 && root < opt_.size), what(), ": the root must be a rank in [0, ",
                    opt_.size, "), got ", root);
  TORCH_CHECK_VALUE(std::isfinite(args.prescale) && std::isfinite(args.postscale), what(),
                    ": prescale and postscale must be finite, got ", args.prescale, " and ", args.postscale);
  const bool scaled = args.prescale != 1.0 || args.postscale != 1.0;
  TORCH_CHECK_VALUE(!scaled || spec.scalable, what(), " takes no prescale or postscale factor");
  if (spec.reduces) {  // the dtype x op rule (common.h)
    const at::Tensor& t = kind == OpKind::ALLREDUCE_MANY ? args.tensors[0] : tensor;
    const Refusal refusal = reductionRefusal(kind, toDType(t.scalar_type()), op, scaled);
    TORCH_CHECK_VALUE(refusal == Refusal::NONE, what(), " of ", tensorText(t), ": ", refusalText(refusal));
  }
  if (kind == OpKind::REDUCE_SCATTER) {
    TORCH_CHECK_VALUE(tensor.dim() > 0, what(), " of ", tensorText(tensor), ": the tensor needs a dim 0 to split");
    if (args.out.defined()) {
      std::vector<int64_t> sizes = tensor.sizes().vec();
      sizes[0] = rowsOf(tensor.size(0), opt_.size, opt_.rank);
      TORCH_CHECK_VALUE(args.out.sizes().vec() == sizes && args.out.scalar_type() == tensor.scalar_type() &&
                            args.out.is_contiguous() && args.out.device().is_cpu(),
                        what(), " of ", tensorText(tensor), ": the output must be a contiguous CPU ",
                        dtypeName(toDType(tensor.scalar_type())), at::IntArrayRef(sizes), " (this rank's rows), got ",
                        tensorText(args.out));
    }
  }
  if (kind == OpKind::ALLGATHER && args.out.defined()) {
    TORCH_CHECK_VALUE(args.out.scalar_type() == tensor.scalar_type() && args.out.is_contiguous() &&
                          args.out.device().is_cpu(),
                      what(), " of ", tensorText(tensor), ": the output must be a contiguous CPU tensor of its dtype, got ",
                      tensorText(args.out));
  }
  if (kind == OpKind::SCATTER && opt_.rank == root) {
    TORCH_CHECK_VALUE(args.tensors.size() == 1, what(), ": the root passes its chunks as one tensor");
    const at::Tensor& all = args.tensors[0];
    TORCH_CHECK_VALUE(all.scalar_type() == tensor.scalar_type() && all.device().is_cpu() && all.is_contiguous() &&
                          all.numel() == tensor.numel() * opt_.size,
                      what(), ": the root's chunks ", tensorText(all), " must be ", opt_.size, " tensors like ",
                      tensorText(tensor), ", concatenated");
  }
  if (kind == OpKind::ALLTOALL) {
    TORCH_CHECK_VALUE(tensor.dim() > 0, what(), " of ", tensorText(tensor), ": the tensor needs a dim 0 to split");
    for (const at::Tensor* splits : {&args.sendSplits, &args.recvSplits}) {
      TORCH_CHECK_VALUE(splits->defined() && splits->scalar_type() == at::kLong && splits->device().is_cpu() &&
                            splits->is_contiguous() && splits->numel() == opt_.size,
                        what(), ": send and receive splits must be int64 CPU tensors of ", opt_.size, " elements");
    }
    if (args.out.defined()) {
      TORCH_CHECK_VALUE(args.recvSplitsKnown, what(), ": an output tensor needs the receive splits");
      TORCH_CHECK_VALUE(args.out.dim() == tensor.dim() && args.out.sizes().slice(1) == tensor.sizes().slice(1) &&
                            args.out.scalar_type() == tensor.scalar_type() && args.out.is_contiguous() &&
                            args.out.device().is_cpu(),
                        what(), " of ", tensorText(tensor), ": the output must be a contiguous CPU tensor of its dtype ",
                        "and row shape, got ", tensorText(args.out));
    }
    // Whether the splits sum to the rows is checked with every rank's splits (alltoall()), so
    // that every rank fails alike instead of the others waiting for this one.
  }
}

at::Tensor Communicator::reduce(Op& op, const std::vector<OpHeader>& headers) {
  at::Tensor buffer = opt_.rank == op.header.root ? op.tensor : op.tensor.clone();
  allreduce(static_cast<char*>(buffer.data_ptr()), op.header, headers);
  return op.tensor;
}

at::Tensor Communicator::gather(Op& op) {
  const at::Tensor& t = op.tensor;
  const int root = op.header.root;
  const std::string what = op.header.label() + " " + tensorText(t);
  const int64_t tag = internalTag(op.header.seq);
  if (opt_.rank != root) {
    waitAll({p2p_->send(root, tag, static_cast<const char*>(t.data_ptr()), t.nbytes(), what, t)});
    return at::Tensor();
  }
  std::vector<int64_t> sizes = t.dim() == 0 ? std::vector<int64_t>{1} : t.sizes().vec();
  sizes[0] *= opt_.size;
  at::Tensor out = at::empty(sizes, t.options());
  char* base = static_cast<char*>(out.data_ptr());
  const size_t bytes = t.nbytes();
  if (bytes > 0) std::memcpy(base + root * bytes, t.data_ptr(), bytes);
  std::vector<std::shared_ptr<CpuWork>> works;
  for (int k = 1; k < opt_.size; ++k) {
    const int r = (root + k) % opt_.size;
    works.push_back(p2p_->recv(r, tag, base + r * bytes, bytes, what, out));
  }
  waitAll(works);
  return out;
}

at::Tensor Communicator::scatter(Op& op) {
  const at::Tensor& t = op.tensor;
  const int root = op.header.root;
  const std::string what = op.header.label() + " " + tensorText(t);
  const int64_t tag = internalTag(op.header.seq);
  const size_t bytes = t.nbytes();
  if (opt_.rank != root) {
    waitAll({p2p_->recv(root, tag, static_cast<char*>(t.data_ptr()), bytes, what, t)});
    return t;
  }
  const at::Tensor& all = op.args.tensors[0];
  const char* base = static_cast<const char*>(all.data_ptr());
  std::vector<std::shared_ptr<CpuWork>> works;
  for (int k = 1; k < opt_.size; ++k) {
    const int r = (root + k) % opt_.size;
    works.push_back(p2p_->send(r, tag, base + r * bytes, bytes, what, all));
  }
  if (bytes > 0) std::memcpy(t.data_ptr(), base + root * bytes, bytes);
  waitAll(works);
  return t;
}

namespace {

std::string listText(const int64_t* values, int n) {
  std::string text = "[";
  for (int i = 0; i < n; ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  return text + "]";
}

}  // namespace

at::Tensor Communicator::alltoall(Op& op) {
  const at::Tensor& t = op.tensor;
  const int n = opt_.size, me = opt_.rank;
  // Row r of `table` (w = 2n + 3 int64s): rank r's send splits, its expected receive splits,
  // its input's rows, its output's rows (-1: no output given), 1 if it gave receive splits.
  const int w = 2 * n + 3;
  at::Tensor mine = at::empty({w}, at::kLong);
  int64_t* m = mine.data_ptr<int64_t>();
  const int64_t* recvGiven = op.args.recvSplits.data_ptr<int64_t>();
  for (int r = 0; r < n; ++r) {
    m[r] = op.args.sendSplits.data_ptr<int64_t>()[r];
    m[n + r] = op.args.recvSplitsKnown ? recvGiven[r] : 0;
  }
  m[2 * n] = t.size(0);
  m[2 * n + 1] = op.args.out.defined() ? op.args.out.size(0) : -1;
  m[2 * n + 2] = op.args.recvSplitsKnown ? 1 : 0;
  std::vector<OpHeader> splitHeaders(n);
  for (auto& h : splitHeaders) {
    h.count = w;
    h.rows = w;
  }
  at::Tensor table = allgather(mine, splitHeaders);
  const int64_t* all = table.data_ptr<int64_t>();
  auto sends = [&](int from, int to) { return all[from * w + to]; };
  // The same checks, on the same table, on every rank: every rank fails alike.
  const std::string where = rankText() + ": " + op.header.label() + " " + tensorText(t) + ": ";
  const std::string after =
      ". Nothing was sent: this operation failed on every rank and the next collective runs normally";
  for (int r = 0; r < n; ++r) {
    const int64_t* row = all + r * w;
    int64_t sent = 0, expected = 0;
    // Each count is within [0, rows] before any sum, so no sum can overflow.
    const int64_t outRows = row[2 * n + 1] >= 0 ? row[2 * n + 1] : INT64_MAX / n;
    bool negative = false, negativeRecv = false;
    for (int k = 0; k < n; ++k) {
      negative |= row[k] < 0 || row[k] > row[2 * n];
      negativeRecv |= row[n + k] < 0 || row[n + k] > outRows;
      if (!negative) sent += row[k];
      if (!negativeRecv) expected += row[n + k];
    }
    if (negative || sent != row[2 * n]) {
      throw MismatchError(where + "rank " + std::to_string(r) + "'s send splits " + listText(row, n) +
                          (negative ? " hold a count below 0 or above its rows" : " sum to " + std::to_string(sent)) +
                          " and its tensor has " +
                          std::to_string(row[2 * n]) +
                          " rows (dim 0); splits must be >= 0 and sum to dim 0 (without splits, dim 0 must "
                          "divide by the group size)" + after);
    }
    if (row[2 * n + 2] && (negativeRecv || (row[2 * n + 1] >= 0 && expected != row[2 * n + 1]))) {
      throw MismatchError(where + "rank " + std::to_string(r) + "'s receive splits " + listText(row + n, n) +
                          (negativeRecv ? " hold a count below 0 or above its output's rows"
                                        : " sum to " + std::to_string(expected)) +
                          " and its output has " + std::to_string(row[2 * n + 1]) +
                          " rows; they must be >= 0 and sum to the output's dim 0" + after);
    }
  }
  for (int to = 0; to < n; ++to) {
    for (int from = 0; from < n; ++from) {
      const int64_t expected = all[to * w + n + from];
      if (!all[to * w + 2 * n + 2] || expected == sends(from, to)) continue;
      throw MismatchError(where + "rank " + std::to_string(to) + " expects " + std::to_string(expected) +
                          " rows from rank " + std::to_string(from) + ", but rank " + std::to_string(from) +
                          " sends it " + std::to_string(sends(from, to)) +
                          " (its send splits); every rank's receive splits must equal what the others send it" +
                          after);
    }
  }
  std::vector<int64_t> recv(n), sendOffset(n + 1, 0), recvOffset(n + 1, 0);
  for (int r = 0; r < n; ++r) {
    recv[r] = sends(r, me);
    sendOffset[r + 1] = sendOffset[r] + sends(me, r);
    recvOffset[r + 1] = recvOffset[r] + recv[r];
  }
  if (!op.args.recvSplitsKnown) std::memcpy(op.args.recvSplits.data_ptr<int64_t>(), recv.data(), n * sizeof(int64_t));
  at::Tensor out = op.args.out;
  if (!out.defined()) {
    std::vector<int64_t> sizes = t.sizes().vec();
    sizes[0] = recvOffset[n];
    out = at::empty(sizes, t.options());
  }
  const size_t row = op.header.rowElems * elementSize(static_cast<DType>(op.header.dtype));  // 0 rows too
  const char* src = static_cast<const char*>(t.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const std::string what = op.header.label() + " " + tensorText(t);
  const int64_t tag = internalTag(op.header.seq);
  std::vector<std::shared_ptr<CpuWork>> works;
  for (int k = 1; k < n; ++k) {
    const int from = (me + n - k) % n, to = (me + k) % n;
    works.push_back(p2p_->recv(from, tag, dst + recvOffset[from] * row, recv[from] * row, what, out));
    works.push_back(p2p_->send(to, tag, src + sendOffset[to] * row, sends(me, to) * row, what, t));
  }
  const size_t own = sends(me, me) * row;
  if (own > 0) std::memcpy(dst + recvOffset[me] * row, src + sendOffset[me] * row, own);
  waitAll(works);
  return out;
}

void Communicator::allreduceMany(Op& op, const std::vector<OpHeader>& headers) {
  const auto& tensors = op.args.tensors;
  const auto dtype = static_cast<DType>(op.header.dtype);
  at::Tensor flat = at::empty({static_cast<int64_t>(op.header.count)}, tensors[0].options());
  char* base = static_cast<char*>(flat.data_ptr());
  size_t offset = 0;
  for (const auto& t : tensors) {
    if (t.nbytes() > 0) std::memcpy(base + offset, t.data_ptr(), t.nbytes());
    offset += t.nbytes();
  }
  if (op.header.prescale != 1.0) scaleInPlace(base, op.header.count, dtype, op.header.prescale);
  allreduce(base, op.header, headers);
  offset = 0;
  for (const auto& t : tensors) {
    if (t.nbytes() > 0) std::memcpy(t.data_ptr(), base + offset, t.nbytes());
    offset += t.nbytes();
  }
}

}  // namespace torchring
