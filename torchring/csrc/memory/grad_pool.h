// Gradient memory pool: large CPU allocations made inside a wrapped model's backward are
// served from memory kept between steps, so a fresh gradient costs no page faults.
#pragma once

#include <cstddef>
#include <cstdint>

namespace torchring {
namespace gradpool {

struct Stats {
  uint64_t hits = 0;         // allocations served from cached blocks
  uint64_t misses = 0;       // allocations that had to map new memory
  uint64_t evicted = 0;      // cached blocks unmapped to stay within the limit
  size_t cachedBytes = 0;    // bytes held between uses
  size_t liveBytes = 0;      // bytes handed out and not yet freed
  size_t limitBytes = 0;     // most bytes the cache keeps
  size_t minBytes = 0;       // smaller allocations go to torch's allocator
  int activeTasks = 0;       // autograd graph tasks whose allocations are pooled now
};

// Makes the pool torch's CPU allocator (once) and sets how many bytes it may keep between
// uses (lowering it unmaps cached blocks). Allocations pass straight through to the
// allocator it replaced unless they are made by a thread working on an autograd graph task
// registered with begin(). Returns false when torch keeps another allocator (one
// registered with a higher priority).
bool install(size_t limitBytes);
bool installed();
// Registers the autograd graph task the calling thread is running (a backward through a
// wrapped model) and returns its id, or -1 outside backward or without the pool.
int begin();
// Stops pooling for graph task `task` (a finished or failed backward).
void end(int task);
Stats stats();

}  // namespace gradpool
}  // namespace torchring
