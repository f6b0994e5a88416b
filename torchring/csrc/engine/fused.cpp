// The header exchange among hosts, and the allreduces that ride on it.
//
// Every operation on several hosts starts with the leaders' header exchange
// (TcpLinks::exchangeHeaders: recursive doubling whose messages summarize the headers their
// sender knows). An allreduce whose algorithm is Doubling or Rabenseifner (any halvings),
// small enough that copying its tensor costs less than the header exchange's steps
// (schedule/cost.h ridesOnHeaders), carries its data in the same messages (carriedPlan): the host's ranks first reduce a copy of their tensors to the leader, the
// leaders' schedule runs its first steps inside the header exchange and the rest once every
// header is known to agree, and every rank checks the headers as usual. Its steps are the
// header exchange's instead of coming after them: log2(hosts) steps fewer. Which schedule a
// member carries is a function of its header alone, which every receiver holds before the
// data, so ranks that issued different operations still read every message whole and all
// fail with the same CollectiveMismatchError; the work happens on a copy, so the caller's
// tensor is left as it was then, as the contract says.
#include "core/reduce.h"
#include "engine/communicator.h"

namespace torchring {

Schedule Communicator::carriedPlan(const OpHeader& header, int member) const {
  if (static_cast<OpKind>(header.kind) != OpKind::ALLREDUCE || header.onGpu) return {};
  const auto dtype = static_cast<DType>(header.dtype);
  const auto algo = static_cast<Algo>(header.algo);
  if (!ridesOnHeaders(algo, numHosts(), header.count, isHalfFloat(dtype) ? 4 : elementSize(dtype), cost_)) return {};
  return allreduceSchedule(algo, numHosts(), member, header.count, header.levels);
}

void Communicator::exchangeHostHeaders(std::vector<OpHeader>& all, const TcpLinks::Carry* carry) {
  if (isLeader()) {
    // Without a carry this operation carries nothing: others' data is read and dropped.
    TcpLinks::Carry what = carry ? *carry : TcpLinks::Carry();
    what.planOf = [this](const OpHeader& header, int member) { return carriedPlan(header, member); };
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
  const auto [rop, scale] = reductionOf(header);
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
  carry.data = data;
  carry.hostSum = half ? hostSum.data() : nullptr;
  carry.op = rop;
  carry.scale = scale;
  exchangeHostHeaders(all, &carry);
  checkHeaders(all);
  if (shm_) shm_->broadcast(data, count * elementSize(dtype), 0);
  op.tensor.copy_(copy);
  if (shm_) shm_->markDone(header.seq);
  return op.tensor;
}

}  // namespace torchring
