#include "grad_pool.h"

#include <pthread.h>
#include <sys/mman.h>

#include <map>
#include <mutex>
#include <new>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

namespace torchring {
namespace gradpool {
namespace {

constexpr size_t kPage = 4096;
constexpr size_t kMinBytes = 256 << 10;  // smaller blocks come from malloc's heap without faults

// Why: torch's CPU allocator returns a large tensor's memory to the kernel when the tensor
// dies (glibc maps anything above 32 MiB, and often smaller, fresh each time), so every
// backward faults in its weight gradients page by page again: 16 k faults and ~20 ms per
// step for a 64 MiB gradient in a VM. Gradients are the memory torchring owns in a step, so
// allocations of at least kMinBytes made by a thread inside a wrapped model's backward
// (tlActive) come from here instead.
//
// How: `free_` maps block bytes (page multiples) to blocks not in use; allocate(n) takes the
// smallest free block of at least n bytes and at most n + n/8 (so a 16 MiB gradient never
// pins a 64 MiB block), else maps a new one. `live_` remembers each handed-out block's bytes
// for the deleter, which puts the block back in `free_` while `cached_` stays within
// `limit_` and unmaps it otherwise. A steady training loop allocates the same sizes every
// step, so after the first step every gradient reuses a block whose pages are resident.
// Every other allocation, and every allocation of a thread outside backward, goes to the
// allocator this one replaced (`fallback_`), untouched.
class Pool final : public c10::Allocator {
 public:
  explicit Pool(c10::Allocator* fallback) : fallback_(fallback) {}

  c10::DataPtr allocate(size_t n) override {
    if (!tlActive || n < kMinBytes) return fallback_->allocate(n);
    void* block = take(n);
    if (block == nullptr) return fallback_->allocate(n);
    return {block, block, &Pool::release, c10::Device(c10::DeviceType::CPU)};
  }

  // raw_allocate/raw_deallocate pairs: blocks handed out above, or the fallback's.
  c10::DeleterFnPtr raw_deleter() const override { return &Pool::rawDelete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void raiseLimit(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (bytes > limit_) limit_ = bytes;
  }

  Stats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    Stats s = stats_;
    s.cachedBytes = cached_;
    s.limitBytes = limit_;
    s.minBytes = kMinBytes;
    return s;
  }

  // After fork() only the forking thread exists: a mutex another thread held is reset.
  void resetAfterFork() { new (&mutex_) std::mutex(); }

  static Pool* instance;
  static thread_local bool tlActive;

 private:
  void* take(size_t n) {
    const size_t want = (n + kPage - 1) / kPage * kPage;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.lower_bound(want);
      if (it != free_.end() && it->first <= want + want / 8) {
        void* block = it->second;
        live_[block] = it->first;
        stats_.liveBytes += it->first;
        cached_ -= it->first;
        free_.erase(it);
        ++stats_.hits;
        return block;
      }
    }
    void* block = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (block == MAP_FAILED) return nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    live_[block] = want;
    stats_.liveBytes += want;
    ++stats_.misses;
    return block;
  }

  // Returns false when `block` was not handed out by the pool.
  bool give(void* block) {
    size_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(block);
      if (it == live_.end()) return false;
      bytes = it->second;
      live_.erase(it);
      stats_.liveBytes -= bytes;
      if (cached_ + bytes <= limit_) {
        free_.emplace(bytes, block);
        cached_ += bytes;
        return true;
      }
      ++stats_.released;
    }
    munmap(block, bytes);
    return true;
  }

  static void release(void* block) { instance->give(block); }

  static void rawDelete(void* ptr) {
    if (!instance->give(ptr)) instance->fallback_->raw_deleter()(ptr);
  }

  c10::Allocator* fallback_;
  std::mutex mutex_;
  std::multimap<size_t, void*> free_;  // bytes -> block not in use
  std::unordered_map<void*, size_t> live_;
  size_t cached_ = 0, limit_ = 0;
  Stats stats_;
};

Pool* Pool::instance = nullptr;
thread_local bool Pool::tlActive = false;
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
    pthread_atfork(nullptr, nullptr, [] { Pool::instance->resetAfterFork(); });
  }
  Pool::instance->raiseLimit(limitBytes);
  return true;
}

bool installed() { return Pool::instance != nullptr; }

void setActive(bool on) { Pool::tlActive = on && Pool::instance != nullptr; }

bool active() { return Pool::tlActive; }

Stats stats() { return Pool::instance != nullptr ? Pool::instance->stats() : Stats{}; }

}  // namespace gradpool
}  // namespace torchring
