// Which tensors the torchring backend moves into its shared-memory arena (backend.h).
//
// DDP allreduces the same bucket tensors every step, and a tensor outside the arena costs a
// copy into shared memory and one back per allreduce (the zero-copy path needs every local
// rank's tensor in the arena: transport/shm/allreduce.cpp). So a CPU tensor of at least
// kSettleBytes whose storage is all_reduced a second time is a buffer that lives across steps:
// its storage moves into the arena (Communicator::moveIntoArena: in place, views follow; only
// torch's own CPU memory, only while the engine is idle, else tried again at the next
// all_reduce). `seen_` counts all_reduces per storage (kMoved once moved or refused for good);
// it is cleared when it grows past kSeenLimit, so a stream of fresh tensors cannot make it grow
// without bound (a reused address only moves a tensor one call early).
#include "c10d/backend.h"

namespace torchring {

namespace {
constexpr size_t kSettleBytes = 64 << 10;
constexpr size_t kSeenLimit = 4096;
constexpr int kMoved = -1;
}  // namespace

void C10dBackend::settle(const at::Tensor& t) {
  if (!t.device().is_cpu() || !t.has_storage() || t.nbytes() < kSettleBytes) return;
  const void* key = t.storage().unsafeGetStorageImpl();
  std::lock_guard<std::mutex> lock(seenMutex_);
  if (seen_.size() > kSeenLimit) seen_.clear();
  int& calls = seen_[key];
  if (calls == kMoved || ++calls < 2) return;
  if (comm_->moveIntoArena(t)) calls = kMoved;
}

}  // namespace torchring
