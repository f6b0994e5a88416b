// What one rank's shared-memory region holds, and the constants its layout uses. Private to
// the transport/shm/*.cpp files: nothing outside the shared-memory transport reads a region directly.
//
// A region is [control | header tables | staging buffers | p2p rings | arena], each part
// starting on a page boundary: the control block below; two header tables of worldSize
// OpHeaders (one per parity of the operation's seq); two staging buffers of segmentBytes
// each, back to back (segments alternate between them, see allreduce.cpp; which rank's data
// a region's buffer holds rotates from one use to the next, ShmGroup::nextBuffer); one
// point-to-point ring per local rank that writes to this one (p2p.h); the arena (arena.h),
// committed page by page on use.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "transport/shm/group.h"

namespace torchring {
namespace shm {

constexpr uint32_t kMagic = 0x74727367;  // "trsg"
constexpr size_t kPage = 4096;

inline size_t roundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }

}  // namespace shm

// The first page of a region: who owns it, its layout (checked by every peer at attach),
// and the words the group synchronizes on (sync.cpp).
struct ShmGroup::Control {
  uint32_t magic;
  int32_t pid;
  int32_t rank;
  uint64_t pidNamespace;                        // pidNamespace() of the owner
  alignas(64) std::atomic<uint32_t> stamp;      // phases this rank completed
  alignas(64) std::atomic<uint32_t> sleepers;   // peers sleeping on `stamp`
  alignas(64) std::atomic<uint64_t> progress;   // (seq << 1) | done, for timeout messages
  std::atomic<uint64_t> heartbeat;              // bumped by progress outside shared memory
  std::atomic<uint32_t> departed;               // 1 once the owner shut its communicator down
  uint64_t segmentBytes, stagingOffset, arenaOffset, worldSize;  // layout, checked by peers
  uint64_t oneShotBytes;                        // checked too: it sets how many waits a step has
  uint64_t cpus[16];                            // the owner's CPU affinity mask (CPUs 0-1023)
  std::atomic<uint32_t> abortState;             // group-wide, in local index 0: 0, 1 writing, 2 set
  char abortMessage[4096];
};

}  // namespace torchring
