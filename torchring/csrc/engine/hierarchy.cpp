// How a collective composes the transports: the shared-memory group within a host and the
// TCP links among the hosts' leaders (the first rank of each host). One host: shared memory
// alone. Several hosts: reduce or gather within the host, run the cross-host algorithm among
// the leaders (the allreduce's is in its header, chosen when it was submitted; allgather's
// and broadcast's are chosen here from sizes every rank knows alike), then each leader hands
// the result to its host. A host of one rank has no shared memory, and the TCP-only
// transport is "every rank its own host".
#include <algorithm>
#include <cstring>

#include "engine/communicator.h"
#include "core/reduce.h"

namespace torchring {

void Communicator::allreduce(char* data, const OpHeader& header,
                             const std::vector<OpHeader>& headers) {
  const auto dtype = static_cast<DType>(header.dtype);
  const auto [op, scale] = reductionOf(header);
  const size_t count = header.count;
  if (numHosts() == 1) {
    if (shm_) shm_->allreduce(data, count, dtype, op, scale, headers);
    else if (scale != 1.0) scaleInPlace(data, count, dtype, scale);
    return;
  }
  // Several hosts: reduce within the host, the header's algorithm among the leaders (which
  // applies `scale` once), then each leader hands the result to its host.
  const AllreduceChoice algo{static_cast<Algo>(header.algo), header.levels};
  if (isHalfFloat(dtype) && shm_) {
    std::vector<float> hostSum(isLeader() ? count : 0);
    shm_->reduceToLeader(data, count, dtype, op, hostSum.data());
    if (tcp_) tcp_->allreduce(algo, data, count, dtype, op, scale, hostSum.data());
  } else {
    if (shm_) shm_->allreduce(data, count, dtype, op, 1.0, headers);
    if (tcp_) tcp_->allreduce(algo, data, count, dtype, op, scale);
  }
  if (shm_) shm_->broadcast(data, count * elementSize(dtype), 0);
}

// This rank's rows of the reduction as a new tensor, `input` left alone: rank r gets
// rowsOf(D, size, r) rows starting at firstRowOf(D, size, r) of dim 0 (D), so when D is not
// a multiple of the size the first D % size ranks get one row more. One host and D a
// multiple: the shared-memory reduce-scatter, which moves a block per rank instead of the
// whole tensor. Several hosts and the header's algorithm Ring: the host's sum goes to its
// leader, the leaders run the ring reduce-scatter in which each host ends with its ranks'
// rows (hostBlocks), and the leader hands that part to its host. Otherwise an allreduce of a
// copy, keeping this rank's rows. The prescale multiplies a copy of the input; AVG's 1/size
// and the postscale go to the sum.
at::Tensor Communicator::reduceScatter(const at::Tensor& input, const OpHeader& header,
                                       const std::vector<OpHeader>& headers, const at::Tensor& given) {
  const int64_t total = input.size(0);
  const int64_t rows = rowsOf(total, opt_.size, opt_.rank);
  const auto dtype = static_cast<DType>(header.dtype);
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes[0] = rows;
  if (numHosts() == 1 && shm_ && total % opt_.size == 0) {
    at::Tensor out = given.defined() ? given : at::empty(sizes, input.options());  // checkArgs checked it
    at::Tensor src = input;
    if (header.prescale != 1.0) {
      src = input.clone();
      scaleInPlace(src.data_ptr(), header.count, dtype, header.prescale);
    }
    const auto [op, scale] = reductionOf(header);
    shm_->reduceScatter(static_cast<const char*>(src.data_ptr()), static_cast<char*>(out.data_ptr()),
                        header.count, dtype, op, scale);
    return out;
  }
  at::Tensor full = input.clone();
  if (header.prescale != 1.0) scaleInPlace(full.data_ptr(), header.count, dtype, header.prescale);
  char* data = static_cast<char*>(full.data_ptr());
  if (numHosts() > 1 && static_cast<Algo>(header.algo) == Algo::Ring) {
    const auto [op, scale] = reductionOf(header);
    const auto blocks = hostBlocks(header);
    if (isHalfFloat(dtype) && shm_) {
      std::vector<float> hostSum(isLeader() ? header.count : 0);
      shm_->reduceToLeader(data, header.count, dtype, op, hostSum.data());
      if (tcp_) tcp_->reduceScatter(data, header.count, dtype, op, scale, blocks, hostSum.data());
    } else {
      if (shm_) shm_->allreduce(data, header.count, dtype, op, 1.0, headers);
      if (tcp_) tcp_->reduceScatter(data, header.count, dtype, op, scale, blocks);
    }
    if (shm_) {  // the span of this host's rows
      size_t lo = SIZE_MAX, hi = 0;
      for (const Range& r : blocks[hostIndex_]) lo = std::min(lo, r.first), hi = std::max(hi, r.first + r.count);
      const size_t esize = elementSize(dtype);
      if (hi > lo) shm_->broadcast(data + lo * esize, (hi - lo) * esize, 0);
    }
  } else {
    allreduce(data, header, headers);
  }
  return full.narrow(0, firstRowOf(total, opt_.size, opt_.rank), rows).clone();
}

// Broadcast: first within the root's host, then among leaders, then within other hosts.
void Communicator::broadcast(char* data, size_t bytes, int root) {
  const int rootHost = rankHost_[root];
  if (shm_ && hostIndex_ == rootHost) shm_->broadcast(data, bytes, rankLocal_[root]);
  if (numHosts() == 1) return;
  if (tcp_) tcp_->broadcast(broadcastAlgo(bytes), data, bytes, rootHost);
  if (shm_ && hostIndex_ != rootHost) shm_->broadcast(data, bytes, 0);
}

// Allgather with a different dim-0 size per rank: gather within the host, exchange whole
// host blocks around the leaders' ring, then the leader hands the full result to its host.
at::Tensor Communicator::allgather(const at::Tensor& input, const std::vector<OpHeader>& headers,
                                   const at::Tensor& given) {
  const size_t esize = input.element_size();
  std::vector<size_t> offset(opt_.size + 1, 0);
  int64_t rows = 0;
  for (int r = 0; r < opt_.size; ++r) {
    offset[r + 1] = offset[r] + headers[r].count * esize;
    rows += static_cast<int64_t>(headers[r].rows);
  }
  std::vector<int64_t> sizes = input.sizes().vec();
  if (sizes.empty()) sizes.push_back(1);
  sizes[0] = rows;
  // The caller's output when it has the result's size (c10d's all_gather_into_tensor): no
  // allocation, no copy. Sizes are known only now, so a wrong one falls back to a new tensor.
  const bool fits = given.defined() && static_cast<size_t>(given.nbytes()) == offset[opt_.size];
  at::Tensor out = fits ? given : at::empty(sizes, input.options());
  char* dst = static_cast<char*>(out.data_ptr());
  const char* src = static_cast<const char*>(input.data_ptr());
  const auto& local = opt_.hosts[hostIndex_];
  if (shm_) {
    std::vector<std::pair<size_t, size_t>> pieces;
    for (int r : local) pieces.emplace_back(offset[r], offset[r + 1] - offset[r]);
    shm_->allgather(src, dst, pieces);
  } else {
    const size_t mine = offset[opt_.rank + 1] - offset[opt_.rank];
    if (mine > 0) std::memcpy(dst + offset[opt_.rank], src, mine);  // src may be null then
  }
  if (numHosts() > 1) {
    if (tcp_) {
      std::vector<std::vector<Span>> blocks(numHosts());
      std::vector<size_t> hostBytes(numHosts(), 0);
      for (int h = 0; h < numHosts(); ++h) {
        for (int r : opt_.hosts[h]) {
          blocks[h].push_back({dst + offset[r], offset[r + 1] - offset[r]});
          hostBytes[h] += offset[r + 1] - offset[r];
        }
      }
      tcp_->allgather(allgatherAlgo(hostBytes), blocks);
    }
    if (shm_) shm_->broadcast(dst, offset[opt_.size], 0);
  }
  return out;
}

// The algorithm among hosts of an operation that reduces there (Algo::Auto when there is
// none): TORCHRING_ALGO's, or the cost model's for this size; for reduce_scatter, Ring means
// the ring reduce-scatter (hierarchy.cpp). 16-bit floats fold float32 partial sums, so they
// cost as 4-byte elements.
AllreduceChoice Communicator::allreduceAlgo(const OpHeader& header) const {
  const auto kind = static_cast<OpKind>(header.kind);
  const bool reducesAcrossHosts = kind == OpKind::ALLREDUCE || kind == OpKind::ALLREDUCE_MANY ||
                                  kind == OpKind::REDUCE_SCATTER || kind == OpKind::REDUCE;
  if (numHosts() == 1 || !reducesAcrossHosts || header.onGpu) return {};
  const auto dtype = static_cast<DType>(header.dtype);
  const size_t esize = isHalfFloat(dtype) ? 4 : elementSize(dtype);
  const AllreduceChoice forced{static_cast<Algo>(opt_.algo), opt_.levels};
  if (kind == OpKind::REDUCE_SCATTER) {
    std::vector<size_t> blockBytes;
    for (const auto& block : hostBlocks(header)) {
      size_t elements = 0;
      for (const Range& r : block) elements += r.count;
      blockBytes.push_back(elements * esize);
    }
    return chooseReduceScatter(forced.algo, forced.levels, header.count, esize, blockBytes, cost_);
  }
  return chooseAllreduce(forced, numHosts(), header.count, esize, cost_, staged());
}

std::string Communicator::allreduceAlgoOf(const at::Tensor& tensor) const {
  DType dtype;
  if (!engineDType(tensor.scalar_type(), &dtype)) return "";
  const AllreduceChoice choice = allreduceAlgo(makeHeader(OpKind::ALLREDUCE, tensor, ReduceOp::SUM, -1));
  return choice.algo == Algo::Auto ? "" : choiceName(choice);
}

std::pair<ReduceOp, double> Communicator::reductionOf(const OpHeader& header) const {
  const auto op = static_cast<ReduceOp>(header.op);
  const double scale = (op == ReduceOp::AVG ? 1.0 / opt_.size : 1.0) * header.postscale;
  return {op == ReduceOp::AVG ? ReduceOp::SUM : op, scale};
}

std::vector<std::vector<Range>> Communicator::hostBlocks(const OpHeader& header) const {
  const int64_t total = header.ndim > 0 ? header.dims[0] : 1;
  const size_t rowElems = total > 0 ? header.count / static_cast<size_t>(total) : 0;
  std::vector<std::vector<Range>> blocks(numHosts());
  for (int h = 0; h < numHosts(); ++h) {
    for (int r : opt_.hosts[h]) {
      const Range rows{static_cast<size_t>(firstRowOf(total, opt_.size, r)) * rowElems,
                       static_cast<size_t>(rowsOf(total, opt_.size, r)) * rowElems};
      if (!blocks[h].empty() && blocks[h].back().first + blocks[h].back().count == rows.first) {
        blocks[h].back().count += rows.count;  // ranks with adjacent rows: one range
      } else {
        blocks[h].push_back(rows);
      }
    }
  }
  return blocks;
}

Algo Communicator::allgatherAlgo(const std::vector<size_t>& hostBytes) const {
  return chooseAllgather(static_cast<Algo>(opt_.algo), hostBytes, cost_);
}

Algo Communicator::broadcastAlgo(size_t bytes) const {
  return chooseBroadcast(static_cast<Algo>(opt_.algo), numHosts(), bytes, TcpOptions().segmentBytes, cost_);
}

}  // namespace torchring
