// The arena's first-fit allocator: commit pages on alloc, punch them out on free, merge
// neighbouring free ranges; nothing at all in a forked child.
#include "transport/shm/arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <iterator>

#include "core/common.h"
#include "transport/shm/region.h"

namespace torchring {

Mapping::~Mapping() {
  if (base != nullptr) munmap(base, bytes);
  if (fd >= 0) ::close(fd);
}

Arena::Arena(std::shared_ptr<Mapping> mapping, size_t offset, size_t bytes)
    : mapping_(std::move(mapping)), offset_(offset), bytes_(bytes), forkGeneration_(forkGeneration()) {
  if (bytes_ > 0) free_[0] = bytes_;
}

int64_t Arena::alloc(size_t bytes) {
  if (forkGeneration() != forkGeneration_) return -1;  // a forked child: a stale free list
  size_t want = shm::roundUp(std::max<size_t>(bytes, 1), shm::kPage);
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < want) continue;
    size_t off = it->first, have = it->second;
    if (posix_fallocate(mapping_->fd, static_cast<off_t>(offset_ + off), want) != 0) return -1;
    free_.erase(it);
    if (have > want) free_[off + want] = have - want;
    used_[off] = want;
    return static_cast<int64_t>(off);
  }
  return -1;
}

void Arena::free(int64_t offset) {
  if (forkGeneration() != forkGeneration_) return;  // a forked child: still the parent's
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = used_.find(static_cast<size_t>(offset));
  if (it == used_.end()) return;
  size_t off = it->first, len = it->second;
  used_.erase(it);
  fallocate(mapping_->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
            static_cast<off_t>(offset_ + off), static_cast<off_t>(len));
  auto next = free_.lower_bound(off);
  if (next != free_.end() && off + len == next->first) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += len;
      return;
    }
  }
  free_[off] = len;
}

}  // namespace torchring
