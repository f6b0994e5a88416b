#include "memory/grad_pool.h"

#include <pthread.h>
#include <sys/mman.h>

#include <atomic>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/graph_task.h>

namespace torchring {
namespace gradpool {
namespace {

constexpr size_t kPage = 4096;
constexpr size_t kMinBytes = 256 << 10;  // smaller blocks come from malloc's heap without faults
constexpr int kSlots = 8;                // graph tasks pooled at once (one per concurrent backward)

// Why: torch's CPU allocator returns a large tensor's memory to the kernel when the tensor
// dies (glibc maps anything above 32 MiB, and often smaller, fresh each time), so every
// backward faults in its weight gradients page by page again: 16 k faults and ~20 ms per
// step for a 64 MiB gradient in a VM. Gradients are the memory torchring owns in a step, so
// allocations of at least kMinBytes made while running a registered autograd graph task
// (a backward through a wrapped model: `tasks_`, on whichever autograd thread runs it) come
// from here instead. Graph task ids are never reused, so a backward that failed before
// end() leaves nothing pooled behind it.
//
// How: free blocks are kept twice: `byAge_` (age -> block, oldest first) and `bySize_`
// (bytes -> age). allocate(n) takes the smallest free block of at least n bytes and at most
// n + n/8 (so a 16 MiB gradient never pins a 64 MiB block), else maps a new one. `live_`
// remembers each handed-out block's bytes for the deleter, which files the block as the
// youngest free block, first unmapping the oldest free blocks until `cached_` fits within
// `limit_`: sizes that stop recurring (a changed batch shape) age out instead of crowding
// out the gradients that come back every step. After the first step of a steady loop every
// gradient reuses a block whose pages are resident. Every other allocation goes to the
// allocator this one replaced (`fallback_`), untouched.
class Pool final : public c10::Allocator {
 public:
  explicit Pool(c10::Allocator* fallback) : fallback_(fallback) {
    for (auto& slot : tasks_) slot.store(-1);
  }

  c10::DataPtr allocate(size_t n) override {
    if (n < kMinBytes || !inRegisteredTask()) return fallback_->allocate(n);
    void* block = take(n);
    if (block == nullptr) return fallback_->allocate(n);
    return {block, block, &Pool::rawDelete, c10::Device(c10::DeviceType::CPU)};
  }

  // raw_allocate/raw_deallocate pairs: blocks handed out above, or the fallback's.
  c10::DeleterFnPtr raw_deleter() const override {
    return fallback_->raw_deleter() != nullptr ? &Pool::rawDelete : nullptr;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void setLimit(size_t bytes) {
    std::vector<std::pair<void*, size_t>> unmap;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      limit_ = bytes;
      evictLocked(0, unmap);
    }
    for (auto& [block, size] : unmap) munmap(block, size);
  }

  int begin() {
    const int task = torch::autograd::get_current_graph_task_id();
    if (task < 0) return -1;
    for (auto& slot : tasks_) {
      if (slot.load() == task) return task;
    }
    for (auto& slot : tasks_) {
      int expected = -1;
      if (slot.compare_exchange_strong(expected, task)) return task;
    }
    tasks_[task % kSlots].store(task);  // more concurrent backwards than slots: evict one
    return task;
  }

  void end(int task) {
    for (auto& slot : tasks_) {
      int expected = task;
      slot.compare_exchange_strong(expected, -1);
    }
  }

  Stats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    Stats s = stats_;
    s.cachedBytes = cached_;
    s.limitBytes = limit_;
    s.minBytes = kMinBytes;
    for (auto& slot : tasks_) s.activeTasks += slot.load() >= 0;
    return s;
  }

  // fork() while another thread is inside take()/give() would hand the child half-updated
  // maps: hold the lock across fork, and the child runs no backward of the parent's.
  void prepareFork() { mutex_.lock(); }
  void parentAfterFork() { mutex_.unlock(); }
  void childAfterFork() {
    mutex_.unlock();
    for (auto& slot : tasks_) slot.store(-1);
  }

  static Pool* instance;

 private:
  bool inRegisteredTask() const {
    const int task = torch::autograd::get_current_graph_task_id();
    if (task < 0) return false;
    for (auto& slot : tasks_) {
      if (slot.load(std::memory_order_relaxed) == task) return true;
    }
    return false;
  }

  void* take(size_t n) {
    const size_t want = (n + kPage - 1) / kPage * kPage;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = bySize_.lower_bound(want);
      if (it != bySize_.end() && it->first <= want + want / 8) {
        auto aged = byAge_.find(it->second);
        void* block = aged->second.first;
        const size_t bytes = it->first;
        byAge_.erase(aged);
        bySize_.erase(it);
        cached_ -= bytes;
        live_[block] = bytes;
        stats_.liveBytes += bytes;
        liveCount_.fetch_add(1);
        ++stats_.hits;
        return block;
      }
    }
    void* block = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (block == MAP_FAILED) return nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    live_[block] = want;
    stats_.liveBytes += want;
    liveCount_.fetch_add(1);
    ++stats_.misses;
    return block;
  }

  // Unmaps the oldest free blocks until `incoming` more bytes fit within the limit.
  void evictLocked(size_t incoming, std::vector<std::pair<void*, size_t>>& unmap) {
    while (!byAge_.empty() && cached_ + incoming > limit_) {
      auto oldest = byAge_.begin();
      auto [block, bytes] = oldest->second;
      auto range = bySize_.equal_range(bytes);
      for (auto it = range.first; it != range.second; ++it) {
        if (it->second == oldest->first) {
          bySize_.erase(it);
          break;
        }
      }
      byAge_.erase(oldest);
      cached_ -= bytes;
      ++stats_.evicted;
      unmap.emplace_back(block, bytes);
    }
  }

  // Returns false when `block` was not handed out by the pool.
  bool give(void* block) {
    if (liveCount_.load() == 0) return false;
    std::vector<std::pair<void*, size_t>> unmap;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(block);
      if (it == live_.end()) return false;
      const size_t bytes = it->second;
      live_.erase(it);
      liveCount_.fetch_sub(1);
      stats_.liveBytes -= bytes;
      if (bytes > limit_) {
        unmap.emplace_back(block, bytes);
      } else {
        evictLocked(bytes, unmap);
        const uint64_t age = nextAge_++;
        byAge_.emplace(age, std::make_pair(block, bytes));
        bySize_.emplace(bytes, age);
        cached_ += bytes;
      }
    }
    for (auto& [b, size] : unmap) munmap(b, size);
    return true;
  }

  static void rawDelete(void* ptr) {
    if (!instance->give(ptr)) instance->fallback_->raw_deleter()(ptr);
  }

  c10::Allocator* fallback_;
  std::atomic<int> tasks_[kSlots];
  std::atomic<int64_t> liveCount_{0};
  std::mutex mutex_;
  std::map<uint64_t, std::pair<void*, size_t>> byAge_;  // age -> (free block, bytes)
  std::multimap<size_t, uint64_t> bySize_;              // bytes -> age of a free block
  std::unordered_map<void*, size_t> live_;
  uint64_t nextAge_ = 0;
  size_t cached_ = 0, limit_ = 0;
  Stats stats_;
};

Pool* Pool::instance = nullptr;
std::mutex installMutex;

}  // namespace

bool install(size_t limitBytes) {
  std::lock_guard<std::mutex> lock(installMutex);
  if (Pool::instance == nullptr) {
    c10::Allocator* previous = c10::GetCPUAllocator();
    // Never deleted: tensors made from its blocks may outlive every torchring object.
    auto* pool = new Pool(previous);
    c10::SetCPUAllocator(pool, /*priority=*/0);
    if (c10::GetCPUAllocator() != pool) {
      delete pool;
      return false;
    }
    Pool::instance = pool;
    pthread_atfork([] { Pool::instance->prepareFork(); }, [] { Pool::instance->parentAfterFork(); },
                   [] { Pool::instance->childAfterFork(); });
  }
  Pool::instance->setLimit(limitBytes);
  return true;
}

bool installed() { return Pool::instance != nullptr; }

int begin() { return Pool::instance != nullptr ? Pool::instance->begin() : -1; }

void end(int task) {
  if (Pool::instance != nullptr && task >= 0) Pool::instance->end(task);
}

Stats stats() { return Pool::instance != nullptr ? Pool::instance->stats() : Stats{}; }

}  // namespace gradpool
}  // namespace torchring
