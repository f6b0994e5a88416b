// The ring allreduce over the leaders' links (links.h), run as one stream each way.
//
// The steps are the ring schedule's (schedule/allreduce_steps.cpp: reduce-scatter, then
// allgather, one chunk per member): in step s member `me` sends one chunk to the right and
// receives one from the left, folding it into its own copy of that chunk segment by segment
// as the bytes arrive (so reduction overlaps the transfer); received allgather chunks land
// straight in place. The 2(n-1) steps are one stream each way, not one exchange per step:
// span j of the send stream is the chunk that span j-1 of the receive stream brings (folded
// in reduce-scatter, final in allgather), so its bytes may go as soon as they are folded or
// arrived (sendable); the link to the right then never waits for a step to end (at the step
// between the phases it would idle until the last segment of the left's chunk had arrived).
// 16-bit floats travel as float32 partial sums in reduce-scatter (exact accumulation, 1.5x
// the bytes of a 16-bit ring) and are rounded once, segment by segment, before the 16-bit
// allgather; a scale is applied to the complete (owned) chunk the same way.
#include "core/reduce.h"
#include "transport/tcp/links.h"

namespace torchring {

void TcpLinks::ringAllreduce(char* data, size_t count, DType dtype, ReduceOp op, double scale, float* hostSum) {
  const int n = members(), me = opt_.member;
  const bool half = isHalfFloat(dtype);
  char* work = half ? reinterpret_cast<char*>(hostSum) : data;  // what reduce-scatter runs on
  const DType workType = half ? DType::F32 : dtype;
  const size_t esize = elementSize(workType), outSize = elementSize(dtype);
  const Schedule schedule = allreduceSchedule(Algo::Ring, n, me, count);
  scratch_.resize((count / n + 1) * esize);
  const size_t segBytes = std::max(esize, opt_.segmentBytes / esize * esize);
  const int steps = static_cast<int>(schedule.steps.size()), lastFold = n - 2;  // spans 0..lastFold fold
  std::vector<Span> send, recv;
  std::vector<size_t> foldStart(n - 1);  // first element of reduce-scatter's receive span j
  for (int s = 0; s < steps; ++s) {
    const Step& step = schedule.steps[s];
    const Range out = step.send[0], in = step.recv[0];
    if (step.fold) {
      send.push_back({work + out.first * esize, out.count * esize});
      foldStart[s] = in.first;
      recv.push_back({scratch_.data(), in.count * esize});
    } else {
      send.push_back({data + out.first * outSize, out.count * outSize});
      recv.push_back({data + in.first * outSize, in.count * outSize});
    }
  }
  // Receive span `cur` is ready (folded, and for the last fold also scaled or rounded; or
  // arrived, in allgather) up to byte `ready`; every earlier span is ready whole.
  int cur = 0;
  size_t ready = 0, recvBefore = 0, sendBefore = 0;  // bytes of the spans before cur, each stream
  auto consume = [&](size_t received) {
    while (cur < steps) {
      const size_t bytes = recv[cur].bytes;
      const size_t got = std::min(bytes, received - std::min(received, recvBefore));
      size_t now = got;
      if (cur <= lastFold) {
        now = got == bytes ? bytes : got / segBytes * segBytes;
        if (now > ready) {
          char* target = work + foldStart[cur] * esize;
          const void* srcs[2] = {target + ready, scratch_.data() + ready};
          reduceInto(target + ready, nullptr, srcs, 2, (now - ready) / esize, workType, op);
          if (cur == lastFold) {  // the owned chunk is complete here: scale it once, round it once
            const size_t first = foldStart[cur] + ready / esize;
            const size_t len = (now - ready) / esize;
            if (half) {
              narrowFromFloat(data + first * outSize, hostSum + first, len, dtype, scale);
            } else if (scale != 1.0) {
              scaleInPlace(data + first * outSize, len, dtype, scale);
            }
          }
        }
      }
      ready = now;
      if (ready < bytes) return;
      recvBefore += bytes;
      sendBefore += send[cur].bytes;
      ++cur;
      ready = 0;
    }
  };
  // Send span j+1 carries receive span j's chunk: its ready elements, in the send span's units.
  auto sendable = [&]() -> size_t {
    if (cur + 1 >= steps) return SIZE_MAX;
    const size_t unitIn = cur <= lastFold ? esize : outSize, unitOut = cur < lastFold ? esize : outSize;
    return sendBefore + send[cur].bytes + ready / unitIn * unitOut;
  };
  consume(0);  // empty chunks (count < n) are ready at once
  const int right = schedule.steps[0].sendTo, left = schedule.steps[0].recvFrom;
  exchange(right, send, left, recv, consume, sendable);
}

}  // namespace torchring
