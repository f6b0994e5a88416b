// The other collectives within a host, all through the staging buffers one segment at a
// time: reduceToLeader (the float32 host sum for 16-bit floats across hosts), reduceScatter,
// broadcast and allgather. Segments alternate between the two staging buffers as in
// allreduce.cpp, so none of them needs a trailing barrier.
#include <algorithm>
#include <cstring>
#include <utility>

#include "core/reduce.h"
#include "transport/shm/group.h"

namespace torchring {

// Reduce to the leader: every rank stages a segment, everyone waits, the leader folds the
// staged segments into `out` (float32 partial sums for 16-bit floats, else `dtype`). One
// synchronization per segment, as broadcast. `data` is only read.
void ShmGroup::reduceToLeader(const char* data, size_t count, DType dtype, ReduceOp op, void* out) {
  const int n = localSize(), me = opt_.localIndex;
  const size_t esize = elementSize(dtype), segmentElems = opt_.segmentBytes / esize;
  auto& srcs = srcs_;
  for (size_t start = 0; start < count; start += segmentElems) {
    const size_t len = std::min(segmentElems, count - start);
    const int buf = nextBuffer();
    std::memcpy(staging(me, buf), data + start * esize, len * esize);
    arrive();
    waitAll();
    if (me != 0) continue;
    for (int p = 0; p < n; ++p) srcs[p] = staging(p, buf);
    if (isHalfFloat(dtype)) {
      reduceToFloat(static_cast<float*>(out) + start, srcs.data(), n, len, dtype, op);
    } else {
      reduceInto(static_cast<char*>(out) + start * esize, nullptr, srcs.data(), n, len, dtype, op);
    }
  }
}

// Reduce-scatter through the staging buffers: with n ranks, chunk p is elements
// [p*C, (p+1)*C) of the input (C = chunkElems = count/n), and local index p receives the
// reduction of every rank's chunk p. Each segment carries elements [o, o + len) of every
// chunk (len = what fits n times in a segment): each rank stages piece p of its input
// (chunk p, offset o) at p*len, arrives, waits, and reduces piece `me` of every rank's
// staging buffer into `out`. One synchronization per segment. Each rank reads its input
// once and writes only its chunk.
void ShmGroup::reduceScatter(const char* input, char* out, size_t count, DType dtype,
                             ReduceOp op, double scale) {
  const int n = localSize(), me = opt_.localIndex;
  const size_t esize = elementSize(dtype), chunkElems = count / n;
  const size_t pieceElems = std::max<size_t>(1, opt_.segmentBytes / esize / n);
  auto& srcs = srcs_;
  for (size_t o = 0; o < chunkElems; o += pieceElems) {
    const size_t len = std::min(pieceElems, chunkElems - o);
    const int buf = nextBuffer();
    char* own = staging(me, buf);
    for (int p = 0; p < n; ++p) {
      std::memcpy(own + p * len * esize, input + (p * chunkElems + o) * esize, len * esize);
    }
    arrive();
    waitAll();
    for (int q = 0; q < n; ++q) srcs[q] = staging(q, buf) + me * len * esize;
    reduceInto(out + o * esize, nullptr, srcs.data(), n, len, dtype, op, scale);
  }
}

// Broadcast: the root copies a segment into its staging buffer, everyone waits, the others
// copy it out. One synchronization per segment.
void ShmGroup::broadcast(char* data, size_t bytes, int rootIndex) {
  const int me = opt_.localIndex;
  for (size_t start = 0; start < bytes; start += opt_.segmentBytes) {
    const size_t len = std::min(opt_.segmentBytes, bytes - start);
    const int buf = nextBuffer();
    if (me == rootIndex) std::memcpy(staging(me, buf), data + start, len);
    arrive();
    waitAll();
    if (me != rootIndex) std::memcpy(data + start, staging(rootIndex, buf), len);
  }
}

// Allgather: every rank contributes one chunk (chunks may differ in size). Each rank copies
// its own chunk to its place; then segment r carries bytes [r*segmentBytes, (r+1)*segmentBytes)
// of every chunk that long: every rank stages its part, everyone waits, and each rank copies
// every peer's staged part to its place.
void ShmGroup::allgather(const char* src, char* out,
                         const std::vector<std::pair<size_t, size_t>>& chunks) {
  const int n = localSize(), me = opt_.localIndex;
  size_t most = 0;
  for (auto& chunk : chunks) most = std::max(most, chunk.second);
  if (chunks[me].second > 0) std::memcpy(out + chunks[me].first, src, chunks[me].second);  // src may be null then
  for (size_t start = 0; start < most; start += opt_.segmentBytes) {
    const int buf = nextBuffer();
    if (start < chunks[me].second) {
      std::memcpy(staging(me, buf), src + start, std::min(opt_.segmentBytes, chunks[me].second - start));
    }
    arrive();
    waitAll();
    for (int p = 0; p < n; ++p) {
      if (p == me || start >= chunks[p].second) continue;
      size_t len = std::min(opt_.segmentBytes, chunks[p].second - start);
      std::memcpy(out + chunks[p].first + start, staging(p, buf), len);
    }
  }
}

}  // namespace torchring
