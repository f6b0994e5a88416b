// The header exchange among hosts, and the allreduces that ride on it.
//
// Every operation on several hosts starts with the leaders' header exchange
// (TcpLinks::exchangeHeaders: an allreduce schedule whose messages summarize the headers
// their sender knows; Doubling's, or Multiplying's where groups of transfers pay,
// schedule/cost.h headerAlgo). An allreduce whose schedule begins with the header's (Doubling
// or Rabenseifner on Doubling's, Multiplying or Radix4 on Multiplying's), small enough that
// copying it once costs less than the header exchange's steps (cost.h ridesOnHeaders; no
// copy when every host has several ranks, staged()), carries its data in the same messages
// (carriedPlan): the host's ranks reduce their tensors into a buffer of the leader's own
// (its `work`), the leaders' schedule runs its first steps inside the header exchange and
// the rest once every header is known to agree, and every rank checks the headers as usual.
// Its steps are the header exchange's instead of coming after them. Which schedule a
// member carries is a function of its header alone, which every receiver holds before the
// data, so ranks that issued different operations still read every message whole and all
// fail with the same CollectiveMismatchError; the folds change only `work`, and the caller's
// tensor is written only once every header is known to agree, so a failed one is left as it
// was, as the contract says.
#include "core/reduce.h"
#include "engine/communicator.h"

namespace torchring {

bool Communicator::ridesOnHeaders(const OpHeader& header) const {
  if (static_cast<OpKind>(header.kind) != OpKind::ALLREDUCE || header.onGpu) return false;
  const auto dtype = static_cast<DType>(header.dtype);
  return torchring::ridesOnHeaders(static_cast<Algo>(header.algo), numHosts(), header.count,
                                   isHalfFloat(dtype) ? 4 : elementSize(dtype), cost_, staged());
}

bool Communicator::staged() const {
  for (const auto& host : opt_.hosts) {
    if (host.size() < 2) return false;
  }
  return true;
}

Schedule Communicator::carriedPlan(const OpHeader& header, int member) const {
  if (!ridesOnHeaders(header)) return {};
  return allreduceSchedule(static_cast<Algo>(header.algo), numHosts(), member, header.count, header.levels);
}

void Communicator::exchangeHostHeaders(std::vector<OpHeader>& all, const TcpLinks::Carry* carry) {
  if (isLeader()) {
    // Without a carry this operation carries nothing: others' data is read and dropped.
    TcpLinks::Carry what = carry ? *carry : TcpLinks::Carry();
    what.planOf = [this](const OpHeader& header, int member) { return carriedPlan(header, member); };
    what.shape = headerAlgo(numHosts(), cost_);
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
  const bool half = isHalfFloat(dtype);
  // What this rank contributes, read only: the caller's tensor, or a copy when prescaled.
  at::Tensor source = op.tensor;
  if (header.prescale != 1.0) {
    source = op.tensor.clone();
    scaleInPlace(source.data_ptr(), count, dtype, header.prescale);
  }
  const char* in = static_cast<const char*>(source.data_ptr());
  // The leader's work: the host's sum (float32 for 16-bit floats), which the folds change.
  if (isLeader() && carryWork_.size() < count * (half ? 4 : elementSize(dtype))) {
    carryWork_.resize(count * (half ? 4 : elementSize(dtype)));
  }
  char* work = isLeader() ? carryWork_.data() : nullptr;
  if (localOk && shm_) {
    shm_->reduceToLeader(in, count, dtype, rop, work);
  } else if (isLeader() && half) {
    widenToFloat(reinterpret_cast<float*>(work), in, count, dtype);
  } else if (isLeader() && count > 0) {
    std::memcpy(work, in, count * elementSize(dtype));
  }
  char* data = static_cast<char*>(op.tensor.data_ptr());
  TcpLinks::Carry carry;
  carry.data = data;
  carry.work = work;
  carry.op = rop;
  carry.scale = scale;
  exchangeHostHeaders(all, &carry);
  checkHeaders(all);
  if (shm_) shm_->broadcast(data, count * elementSize(dtype), 0);
  if (shm_) shm_->markDone(header.seq);
  return op.tensor;
}

}  // namespace torchring
