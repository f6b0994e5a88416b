// Allreduce within a host: through the staging buffers (one-shot for small messages,
// reduce-scatter + allgather through memory for larger ones), or zero-copy when every
// rank's tensor lives in its arena.
#include <algorithm>
#include <cstring>
#include <utility>

#include "core/reduce.h"
#include "core/stores.h"
#include "transport/shm/group.h"
#include "transport/shm/region.h"

namespace torchring {
namespace {

// Elements [lo, hi) of `count` that make up the chunk of local index `index` of `n`: the part
// it reduces. Chunks are whole multiples of 64 bytes so two ranks never write the same
// cache line.
std::pair<size_t, size_t> chunkOf(int index, int n, size_t count, size_t esize) {
  size_t align = std::max<size_t>(1, 64 / esize);
  size_t per = shm::roundUp((count + n - 1) / n, align);
  size_t lo = std::min(count, per * index);
  return {lo, std::min(count, lo + per)};
}

}  // namespace

// Allreduce through the staging buffers, one segment of at most segmentBytes at a time.
// Small messages (one-shot): copy the segment in, arrive, wait, and every rank reduces all
// n staged segments into its own tensor: one synchronization per segment. Larger messages
// (reduce-scatter + allgather through memory): each rank copies in every chunk but its own
// chunk [lo, hi) (only peers read the staged chunks, and a rank reads its own chunk from its
// tensor), waits, reduces its chunk from its tensor and the n-1 peers' staging buffers into
// both its staging buffer and its tensor; waits; copies the other chunks out of their owners'
// staging buffers. Per element a rank reads and writes 2 bytes for every byte of the tensor
// (not 2.5 at n = 2, as when it also staged its own chunk). Its writes into its staging buffer
// use the stores that stores_ picks (cached or streaming, core/stores.h); the copy out into its own
// tensor stays cached.
// Segments alternate between two staging buffers, so writing segment k+1 never races with
// peers still reading segment k, and the wait at segment k+1 proves every peer is done with
// segment k before segment k+2 reuses its buffer: no trailing barrier. staged(p, buf) is where
// rank p's copy is this time: the regions holding the buffer rotate among the ranks from one
// use to the next, so a rank writes into lines it has just read (ShmGroup::nextBuffer).
void ShmGroup::allreduce(char* data, size_t count, DType dtype, ReduceOp op, double scale,
                         const std::vector<OpHeader>& headers) {
  if (prestaged_ >= 0) return reduceStaged(data, count, dtype, op, scale, headers);
  const int n = localSize(), me = opt_.localIndex;
  bool zeroCopy = opt_.arenaBytes > 0 && count > 0;
  for (int i = 0; i < n; ++i) zeroCopy = zeroCopy && headers[opt_.localRanks[i]].arenaOffset >= 0;
  if (zeroCopy) {
    // The header exchange proved every tensor complete, but a prescale is applied after it
    // (so that a mismatch leaves the input alone): wait until every rank scaled its own
    // tensor before reading any. The factor is in the header, so every rank waits here.
    if (headers[opt_.localRanks[me]].prescale != 1.0) {
      arrive();
      waitAll();
    }
    return allreduceZeroCopy(data, count, dtype, op, scale, headers);
  }
  const size_t esize = elementSize(dtype);
  const size_t segmentElems = opt_.segmentBytes / esize;
  placeKnown(headers);
  const bool oneShot = count * esize <= opt_.oneShotBytes;
  auto& srcs = srcs_;
  for (size_t start = 0; start < count; start += segmentElems) {
    const size_t len = std::min(segmentElems, count - start);
    const int buf = nextBuffer();
    char* segment = data + start * esize;
    auto [lo, hi] = chunkOf(me, n, len, esize);
    if (oneShot) {
      std::memcpy(staged(me, buf), segment, len * esize);
      arrive();
      waitAll();
      for (int p = 0; p < n; ++p) srcs[p] = staged(p, buf);
      reduceInto(segment, nullptr, srcs.data(), n, len, dtype, op, scale);
      continue;
    }
    // The staging writes (the copy-in, the reduced chunk) stream when stores_ says so
    // (core/stores.h); the segment is timed for it.
    const size_t inBytes = (len - (hi - lo)) * esize;
    const bool stream = stores_.streaming(inBytes);
    const auto segmentStart = Clock::now();
    copyWith(stream, staged(me, buf), segment, lo * esize);
    copyWith(stream, staged(me, buf) + hi * esize, segment + hi * esize, (len - hi) * esize);
    if (stream) streamFence();
    arrive();
    waitAll();
    for (int p = 0; p < n; ++p) srcs[p] = (p == me ? segment : staged(p, buf)) + lo * esize;
    reduceInto(segment + lo * esize, staged(me, buf) + lo * esize, srcs.data(), n, hi - lo,
               dtype, op, scale, stream);
    arrive();
    waitAll();
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      auto [plo, phi] = chunkOf(p, n, len, esize);
      std::memcpy(segment + plo * esize, staged(p, buf) + plo * esize, (phi - plo) * esize);
    }
    stores_.record(stream, inBytes, secondsSince(segmentStart));
  }
}

// The one-sync allreduce: exchangeHeadersWithData staged every rank's whole message in
// staging buffer prestaged_ with the header exchange's synchronization; every rank reduces the
// n staged copies into its tensor. One synchronization in all, where a separate header
// exchange and one-shot segment take two. The copy-in streams when oneSyncStores_ says so
// (from 64 KiB, StoreChooser::kMinBytes): the call, copy-in to the end of the reduce, is timed
// for it. With the host's two vCPUs far apart, benchmarks/probes/oneshot_probe.c's 64 KiB one-sync
// allreduce takes 46 us with cached copy-in stores and 11.6 us with streaming ones; close
// together, 13.2 and 13.1.
void ShmGroup::reduceStaged(char* data, size_t count, DType dtype, ReduceOp op, double scale,
                            const std::vector<OpHeader>& headers) {
  const int n = localSize(), buf = prestaged_;
  prestaged_ = -1;
  placeOwn(headers);
  auto& srcs = srcs_;
  // This rank's own values are still in its tensor (nothing wrote it since they were staged):
  // read them there, one stream less. The order of the sources, and so the result, is the
  // same on every rank.
  for (int p = 0; p < n; ++p) srcs[p] = p == opt_.localIndex ? data : staged(p, buf);
  reduceInto(data, nullptr, srcs.data(), n, count, dtype, op, scale);
  const size_t bytes = count * elementSize(dtype);
  if (bytes >= StoreChooser::kMinBytes) oneSyncStores_.record(prestagedStreamed_, bytes, secondsSince(prestagedStart_));
}

// Zero-copy allreduce, used when every local rank's tensor lives in its arena. The header
// exchange that precedes it proves every tensor is complete (with a prescale, the extra
// arrive-and-wait in allreduce() does, since each rank scales its tensor after the exchange). No segments: each rank reduces
// its own chunk [lo, hi) straight out of all n tensors and writes the result into its own
// tensor and into every peer's, a block of kPushBytes at a time (the block stays in cache for
// the extra copies); chunks are disjoint, so no two ranks touch the same bytes. Then it
// arrives and waits: once every peer has arrived, every chunk of this rank's tensor is final
// and no peer reads it any more. One synchronization; per rank it reads S and writes S.
void ShmGroup::allreduceZeroCopy(char* data, size_t count, DType dtype, ReduceOp op,
                                 double scale, const std::vector<OpHeader>& headers) {
  constexpr size_t kPushBytes = 256 << 10;
  const int n = localSize(), me = opt_.localIndex;
  const size_t esize = elementSize(dtype);
  std::vector<char*> tensors(n);
  for (int p = 0; p < n; ++p) {
    tensors[p] = p == me ? data
                         : mappings_[p]->base + arenaOffset_ + headers[opt_.localRanks[p]].arenaOffset;
  }
  auto [lo, hi] = chunkOf(me, n, count, esize);
  const int peer = n > 1 ? (me + 1) % n : me;
  auto& srcs = srcs_;
  const size_t step = std::max<size_t>(1, kPushBytes / esize);
  for (size_t start = lo; start < hi; start += step) {
    // A peer that gave up (another rank failed) may already reuse its tensor: stop writing.
    checkAbort();
    const size_t len = std::min(step, hi - start), off = start * esize;
    for (int p = 0; p < n; ++p) srcs[p] = tensors[p] + off;
    reduceInto(data + off, peer != me ? tensors[peer] + off : nullptr, srcs.data(), n, len,
               dtype, op, scale);
    for (int p = 0; p < n; ++p) {
      if (p != me && p != peer) std::memcpy(tensors[p] + off, data + off, len * esize);
    }
  }
  arrive();
  waitAll();
}

}  // namespace torchring
