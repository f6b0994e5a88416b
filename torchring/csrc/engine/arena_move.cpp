// Communicator::moveIntoArena: a tensor's storage moved into this rank's shared-memory arena,
// so later collectives of it go zero-copy (peers reduce straight out of it and into it).
//
// The storage keeps its identity: every tensor and view of it (a DDP bucket and the gradient
// views into it) follows, because the StorageImpl's data pointer is swapped, not the tensor's
// storage. The bytes are copied into a range of the arena of the storage's size, the range's
// deleter gives it back to the arena when the storage dies (the arena's mapping lives as long
// as any such range), and the old memory is freed by its own deleter at the swap. Only storages
// that torch's CPU allocator made are moved: memory someone else owns (a numpy array's, a
// tensor.share_memory_() mapping, pinned memory, an mmap'd file) must keep its address. And only
// while the communicator is idle (nothing queued, nothing running): an operation already queued
// on the storage would otherwise touch the freed memory. The caller makes no other use of the
// storage meanwhile (the c10d backend calls it from the collective's own call).
#include <c10/core/CPUAllocator.h>

#include <cstring>
#include <mutex>

#include "engine/communicator.h"
#include "transport/shm/arena.h"
#include "transport/shm/group.h"

namespace torchring {

bool Communicator::moveIntoArena(const at::Tensor& tensor) {
  if (!shm_ || !shm_->arena() || !tensor.defined() || !tensor.device().is_cpu() || !tensor.has_storage()) {
    return false;
  }
  c10::StorageImpl* impl = tensor.storage().unsafeGetStorageImpl();
  const size_t bytes = impl->nbytes();
  if (bytes == 0 || shm_->arenaOffsetOf(impl->data(), bytes) >= 0) return false;  // empty, or there already
  const c10::DeleterFnPtr deleter = impl->data_ptr().get_deleter();
  if (deleter == nullptr || deleter != c10::GetDefaultCPUAllocator()->raw_deleter() || !impl->resizable()) {
    return false;  // not torch's own CPU memory
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (busy_ || !queue_.empty()) return false;
  auto arena = shm_->arena();
  const int64_t offset = arena->alloc(bytes);
  if (offset < 0) return false;  // the arena is full: the tensor stays where it is
  char* range = arena->base() + offset;
  std::memcpy(range, impl->data(), bytes);
  impl->set_data_ptr_noswap(c10::InefficientStdFunctionContext::makeDataPtr(
      range, [arena, offset](void*) { arena->free(offset); }, c10::Device(c10::kCPU)));
  return true;
}

}  // namespace torchring
