// The leaders' collectives (links.h): each runs the schedule its algorithm names
// (schedule/schedule.h), step by step over the links, except the ring allreduce (ring.cpp).
//
// stepAllreduce: fold steps send units of the work buffer (float32 partial sums for 16-bit
// floats, else the data itself) and receive into `scratch_`, folding received units into the
// work buffer as whole segments arrive; a step whose send and receive ranges overlap
// (doubling swaps the whole buffer) folds only after its send is done, so it never changes
// bytes still to be sent. When the fold steps are over, the `owned` units are complete: they
// are scaled (or rounded to 16 bits) once, into `data`, and the copy steps move `data`.
#include <algorithm>
#include <cstring>

#include "core/reduce.h"
#include "transport/tcp/links.h"

namespace torchring {

std::vector<Span> TcpLinks::spansOf(const std::vector<Range>& ranges, char* base, size_t unit) {
  std::vector<Span> out;
  for (const Range& r : ranges) out.push_back({base + r.first * unit, r.count * unit});
  return out;
}

void TcpLinks::foldRanges(char* work, const std::vector<Range>& ranges, const char* received, DType type, ReduceOp op,
                          size_t lo, size_t hi) {
  const size_t esize = elementSize(type);
  size_t at = 0;
  for (const Range& r : ranges) {
    const size_t len = r.count * esize, from = std::max(lo, at), to = std::min(hi, at + len);
    if (to > from) {
      char* target = work + r.first * esize + (from - at);
      const void* srcs[2] = {target, received + from};
      reduceInto(target, nullptr, srcs, 2, (to - from) / esize, type, op);
    }
    at += len;
  }
}

void TcpLinks::finishOwned(const std::vector<Range>& owned, char* data, const char* work, DType dtype,
                           double scale) {
  const size_t outSize = elementSize(dtype);
  for (const Range& r : owned) {
    char* out = data + r.first * outSize;
    if (isHalfFloat(dtype)) {
      narrowFromFloat(out, reinterpret_cast<const float*>(work) + r.first, r.count, dtype, scale);
      continue;
    }
    if (work != data && r.count > 0) std::memcpy(out, work + r.first * outSize, r.count * outSize);
    if (scale != 1.0) scaleInPlace(out, r.count, dtype, scale);
  }
}

float* TcpLinks::partialSums(char* data, size_t count, DType dtype, float* hostSum) {
  if (!isHalfFloat(dtype) || hostSum != nullptr) return hostSum;
  hostSum_.resize(count);
  widenToFloat(hostSum_.data(), data, count, dtype);
  return hostSum_.data();
}

void TcpLinks::allreduce(AllreduceChoice algo, char* data, size_t count, DType dtype, ReduceOp op, double scale,
                         float* hostSum) {
  if (members() == 1 || count == 0) return;
  hostSum = partialSums(data, count, dtype, hostSum);
  if (algo.algo == Algo::Ring) return ringAllreduce(data, count, dtype, op, scale, hostSum);
  stepAllreduce(allreduceSchedule(algo.algo, members(), opt_.member, count, algo.levels), data, count, dtype, op,
                scale, hostSum);
}

void TcpLinks::reduceScatter(char* data, size_t count, DType dtype, ReduceOp op, double scale,
                             const std::vector<std::vector<Range>>& blocks, float* hostSum) {
  if (count == 0) return;
  hostSum = partialSums(data, count, dtype, hostSum);
  stepAllreduce(reduceScatterSchedule(members(), opt_.member, blocks), data, count, dtype, op, scale, hostSum);
}

void TcpLinks::stepAllreduce(const Schedule& schedule, char* data, size_t count, DType dtype, ReduceOp op,
                             double scale, float* hostSum) {
  const bool half = isHalfFloat(dtype);
  char* work = half ? reinterpret_cast<char*>(hostSum) : data;
  const DType workType = half ? DType::F32 : dtype;
  const size_t esize = elementSize(workType), outSize = elementSize(dtype);
  const size_t segBytes = std::max(esize, opt_.segmentBytes / esize * esize);
  bool finished = false;
  auto finish = [&] {  // the owned units are complete: scale or round them once
    finishOwned(schedule.owned, data, work, dtype, scale);
    finished = true;
  };
  for (const Step& step : schedule.steps) {
    if (!step.fold) {
      if (!finished) finish();
      exchange(step.sendTo, spansOf(step.send, data, outSize), step.recvFrom, spansOf(step.recv, data, outSize));
      continue;
    }
    size_t bytes = 0;
    for (const Range& r : step.recv) bytes += r.count * esize;
    if (scratch_.size() < bytes) scratch_.resize(bytes);
    // Folds received bytes [folded, upTo) of the scratch into the ranges they belong to.
    size_t folded = 0;
    auto foldUpTo = [&](size_t upTo) {
      foldRanges(work, step.recv, scratch_.data(), workType, op, folded, upTo);
      folded = std::max(folded, upTo);
    };
    const bool foldLate = rangesOverlap(step.send, step.recv);
    auto onRecv = [&](size_t received) {
      if (foldLate) return;
      const size_t upTo = received == bytes ? bytes : received / segBytes * segBytes;
      if (upTo > folded) foldUpTo(upTo);
    };
    std::vector<Span> into;
    if (step.recvFrom >= 0) into.push_back({scratch_.data(), bytes});
    exchange(step.sendTo, spansOf(step.send, work, esize), step.recvFrom, into, onRecv);
    foldUpTo(bytes);
  }
  if (!finished) finish();
}

void TcpLinks::broadcast(Algo algo, char* data, size_t bytes, int rootMember) {
  if (members() == 1 || bytes == 0) return;
  const Schedule schedule = broadcastSchedule(algo, members(), opt_.member, rootMember, bytes, opt_.segmentBytes);
  for (const Step& step : schedule.steps) {
    exchange(step.sendTo, spansOf(step.send, data, 1), step.recvFrom, spansOf(step.recv, data, 1));
  }
}

void TcpLinks::allgather(Algo algo, const std::vector<std::vector<Span>>& blocks) {
  if (members() == 1) return;
  auto spans = [&](const std::vector<Range>& ranges) {
    std::vector<Span> out;
    for (const Range& r : ranges) {
      for (size_t b = r.first; b < r.first + r.count; ++b) out.insert(out.end(), blocks[b].begin(), blocks[b].end());
    }
    return out;
  };
  for (const Step& step : allgatherSchedule(algo, members(), opt_.member).steps) {
    exchange(step.sendTo, spans(step.send), step.recvFrom, spans(step.recv));
  }
}

}  // namespace torchring
