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
  uint64_t released = 0;     // blocks unmapped because the cache was full
  size_t cachedBytes = 0;    // bytes held between uses
  size_t liveBytes = 0;      // bytes handed out and not yet freed
  size_t limitBytes = 0;     // most bytes the cache keeps
  size_t minBytes = 0;       // smaller allocations go to torch's allocator
};

// Makes the pool torch's CPU allocator (once; later calls only raise the cache limit to at
// least `limitBytes`). Allocations pass straight through to the allocator it replaces
// unless the calling thread is inside setActive(true). Returns false when torch keeps
// another allocator (one registered with a higher priority).
bool install(size_t limitBytes);
bool installed();
// Whether the calling thread's large allocations come from the pool.
void setActive(bool active);
bool active();
Stats stats();

}  // namespace gradpool
}  // namespace torchring
