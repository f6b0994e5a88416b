// The leaders' collectives (links.h): each runs the schedule its algorithm names
// (schedule/schedule.h), step by step over the links, except the ring allreduce (ring.cpp).
//
// stepAllreduce: one group of steps (schedule.h withNext) at a time. Fold steps send units of
// the work buffer (float32 partial sums for 16-bit floats, else the data itself) and receive
// into `scratch_`, folding received units into the work buffer as whole segments arrive; a
// step whose receive overlaps what its group sends (doubling swaps the whole buffer) folds
// only after the sends are done, so it never changes bytes still to be sent. When the fold
// steps are over, the `owned` units are complete: they are scaled (or rounded to 16 bits)
// once, into `data`, and the copy steps move `data`.
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

std::vector<TcpLinks::Stream> TcpLinks::streamsOf(const std::vector<Step>& steps, size_t first, size_t end,
                                                  char* base, size_t unit, std::vector<std::vector<Span>>& spans) {
  spans.assign(2 * (end - first), {});
  std::vector<Stream> streams;
  for (size_t i = first; i < end; ++i) {
    std::vector<Span>& out = spans[2 * (i - first)];
    std::vector<Span>& in = spans[2 * (i - first) + 1];
    out = spansOf(steps[i].send, base, unit);
    in = spansOf(steps[i].recv, base, unit);
    streams.push_back({steps[i].sendTo, true, &out, nullptr, nullptr});
    streams.push_back({steps[i].recvFrom, false, &in, nullptr, nullptr});
  }
  return streams;
}

// A group of fold steps (schedule.h withNext) receives each step's bytes into its own part of
// the scratch and folds whole segments as they arrive; a step that receives the same units as
// the one before it folds no further than that one has (the group's order, so the sum's order
// does not depend on which partner was faster).
void TcpLinks::stepAllreduce(const Schedule& schedule, char* data, size_t count, DType dtype, ReduceOp op,
                             double scale, float* hostSum) {
  const bool half = isHalfFloat(dtype);
  char* work = half ? reinterpret_cast<char*>(hostSum) : data;
  const DType workType = half ? DType::F32 : dtype;
  const size_t esize = elementSize(workType), outSize = elementSize(dtype);
  const size_t segBytes = std::max(esize, opt_.segmentBytes / esize * esize);
  const std::vector<Step>& steps = schedule.steps;
  bool finished = false;
  auto finish = [&] {  // the owned units are complete: scale or round them once
    finishOwned(schedule.owned, data, work, dtype, scale);
    finished = true;
  };
  std::vector<std::vector<Span>> spans;
  for (size_t first = 0; first < steps.size();) {
    const size_t end = groupEnd(steps, first), n = end - first;
    if (!steps[first].fold) {
      if (!finished) finish();
      exchangeStreams(streamsOf(steps, first, end, data, outSize, spans));
      first = end;
      continue;
    }
    std::vector<size_t> bytes(n), offset(n), received(n), folded(n);
    std::vector<Range> sent;
    size_t total = 0;
    for (size_t k = 0; k < n; ++k) {
      for (const Range& r : steps[first + k].recv) bytes[k] += r.count * esize;
      offset[k] = total;
      total += bytes[k];
      sent.insert(sent.end(), steps[first + k].send.begin(), steps[first + k].send.end());
    }
    if (scratch_.size() < total) scratch_.resize(total);
    // A step whose receive overlaps what the group sends (doubling swaps the whole buffer)
    // folds only once the group's sends are done, so it never changes bytes still to be sent.
    // A step that receives what the step before it receives folds after it (`follows`).
    std::vector<bool> late(n), follows(n);
    for (size_t k = 0; k < n; ++k) {
      late[k] = rangesOverlap(sent, steps[first + k].recv);
      follows[k] = k > 0 && sameRanges(steps[first + k].recv, steps[first + k - 1].recv);
    }
    // Folds what may be folded of every step, in the group's order.
    auto foldReady = [&](bool all) {
      for (size_t k = 0; k < n; ++k) {
        size_t upTo = all ? bytes[k]
                      : late[k] ? 0
                      : received[k] == bytes[k] ? bytes[k]
                                                : received[k] / segBytes * segBytes;
        if (follows[k]) upTo = std::min(upTo, folded[k - 1]);
        if (upTo <= folded[k]) continue;
        foldRanges(work, steps[first + k].recv, scratch_.data() + offset[k], workType, op, folded[k], upTo);
        folded[k] = upTo;
      }
    };
    // Sends from the work buffer; each receive into its own part of the scratch.
    std::vector<Stream> streams = streamsOf(steps, first, end, work, esize, spans);
    for (size_t k = 0; k < n; ++k) {
      spans[2 * k + 1].clear();
      if (steps[first + k].recvFrom >= 0 && bytes[k] > 0) {
        spans[2 * k + 1].push_back({scratch_.data() + offset[k], bytes[k]});
      }
      streams[2 * k + 1].onRecv = [&, k](size_t got) {
        received[k] = got;
        foldReady(false);
      };
    }
    exchangeStreams(streams);
    foldReady(true);
    first = end;
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
