// The zero-copy arena: the part of a rank's shared-memory region that torchring.empty
// hands out, so peers can reduce straight out of (and into) each other's tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace torchring {

// One mapped shared-memory region; unmapped when the last owner (the group, or a tensor
// allocated from its arena) lets go.
struct Mapping {
  char* base = nullptr;
  size_t bytes = 0;
  int fd = -1;
  ~Mapping();
};

// A first-fit allocator over the arena part of this rank's region. Pages are committed
// with posix_fallocate when a range is handed out (so a full /dev/shm is a clean failure,
// not a SIGBUS) and released with a hole punch when it comes back. Only the process that
// created the arena hands ranges out and takes them back: a forked child (a DataLoader
// worker) shares the mapping, so its hole punch would zero the parent's live tensors and
// its stale copy of the free list would hand out ranges the parent uses.
class Arena {
 public:
  Arena(std::shared_ptr<Mapping> mapping, size_t offset, size_t bytes);
  // Byte offset (from the arena start) of a new range, or -1 when none can be committed.
  int64_t alloc(size_t bytes);
  void free(int64_t offset);
  char* base() const { return mapping_->base + offset_; }
  size_t bytes() const { return bytes_; }

 private:
  std::shared_ptr<Mapping> mapping_;
  size_t offset_, bytes_;
  uint64_t forkGeneration_;  // at creation (see forkGeneration())
  std::mutex mutex_;
  std::map<size_t, size_t> free_;  // offset -> bytes
  std::map<size_t, size_t> used_;  // offset -> bytes
};

}  // namespace torchring
