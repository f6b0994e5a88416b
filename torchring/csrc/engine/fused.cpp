// The header exchange among hosts, and the small allreduces that ride on it.
//
// Every operation on several hosts starts with the leaders' header exchange
// (TcpLinks::exchangeHeaders: recursive doubling, each message the headers its sender knows).
// A small allreduce whose algorithm is Doubling carries its data in the same messages
// (carriedBytes > 0): the host's ranks first reduce a copy of their tensors to the leader,
// the leaders' doubling folds the data while it gathers the headers, and once every header
// is known every rank checks them as usual. log2(hosts) steps in all instead of the header
// exchange's and then the allreduce's. The rule that says how many bytes a message carries
// is a function of its sender's header alone, which every receiver holds before the data, so
// ranks that issued different operations still read every message whole and all fail with
// the same CollectiveMismatchError; the work happens on a copy, so the caller's tensor is
// left as it was then, as the contract says.
#include "core/reduce.h"
#include "engine/communicator.h"

namespace torchring {

size_t Communicator::carriedBytes(const OpHeader& header, bool partial) {
  if (static_cast<OpKind>(header.kind) != OpKind::ALLREDUCE || header.onGpu ||
      static_cast<Algo>(header.algo) != Algo::Doubling) {
    return 0;
  }
  const auto dtype = static_cast<DType>(header.dtype);
  const size_t work = header.count * (isHalfFloat(dtype) ? 4 : elementSize(dtype));
  if (work == 0 || work > kCarriedLimitBytes) return 0;
  return partial ? work : header.count * elementSize(dtype);
}

void Communicator::exchangeHostHeaders(std::vector<OpHeader>& all, const TcpLinks::Carry* carry) {
  if (isLeader()) {
    // Without a carry this operation carries nothing: others' data is read and dropped.
    TcpLinks::Carry what = carry ? *carry : TcpLinks::Carry();
    what.bytesOf = carriedBytes;
    tcp_->exchangeHeaders(all, opt_.hosts, what);
    if (shm_) shm_->publishAllHeaders(all);
  } else {
    shm_->receiveAllHeaders(all[opt_.rank].seq, all);
  }
}

at::Tensor Communicator::runCarried(Op& op) {
  const OpHeader& header = op.header;
  std::vector<OpHeader> all(opt_.size);
  all[opt_.rank] = header;
  if (shm_) shm_->exchangeHeaders(header, all);
  const auto& local = opt_.hosts[hostIndex_];
  bool localOk = true;  // the same verdict on every rank of the host
  for (int r : local) localOk = localOk && all[r].matches(all[local[0]]);
  const auto dtype = static_cast<DType>(header.dtype);
  const auto reduction = reductionOf(header);  // named: the lambdas below capture them
  const ReduceOp rop = reduction.first;
  const double scale = reduction.second;
  const size_t count = header.count;
  at::Tensor copy = op.tensor.clone();
  char* data = static_cast<char*>(copy.data_ptr());
  if (header.prescale != 1.0) scaleInPlace(data, count, dtype, header.prescale);
  const bool half = isHalfFloat(dtype);
  std::vector<float> hostSum(isLeader() && half ? count : 0);
  if (localOk && shm_) {
    if (half) {
      shm_->reduceToLeader(data, count, dtype, rop, hostSum.data());
    } else {  // staged from the copies: the arena offsets are the callers' tensors'
      std::vector<OpHeader> staged = all;
      for (int r : local) staged[r].arenaOffset = -1;
      shm_->allreduce(data, count, dtype, rop, 1.0, staged);
    }
  } else if (half && isLeader()) {
    widenToFloat(hostSum.data(), data, count, dtype);
  }
  TcpLinks::Carry carry;
  carry.work = half ? reinterpret_cast<char*>(hostSum.data()) : data;
  carry.out = data;
  const DType workType = half ? DType::F32 : dtype;
  carry.fold = [&](char* work, const char* received) {
    const void* srcs[2] = {work, received};
    reduceInto(work, nullptr, srcs, 2, count, workType, rop);
  };
  carry.finish = [&] {
    if (half) {
      narrowFromFloat(data, hostSum.data(), count, dtype, scale);
    } else if (scale != 1.0) {
      scaleInPlace(data, count, dtype, scale);
    }
  };
  exchangeHostHeaders(all, &carry);
  checkHeaders(all);
  if (shm_) shm_->broadcast(data, count * elementSize(dtype), 0);
  op.tensor.copy_(copy);
  if (shm_) shm_->markDone(header.seq);
  return op.tensor;
}

}  // namespace torchring
