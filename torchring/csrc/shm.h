// Shared-memory transport between the ranks of one host ("the local group").
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"

namespace torchring {

// One mapped shared-memory segment; unmapped when the last owner (the group, or a tensor
// allocated from its arena) lets go.
struct Mapping {
  char* base = nullptr;
  size_t bytes = 0;
  int fd = -1;
  ~Mapping();
};

// A first-fit allocator over the arena part of this rank's segment. Pages are committed
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

struct ShmOptions {
  int worldSize = 1;
  std::vector<int> localRanks;  // global ranks of this host, ascending; index = local index
  int localIndex = 0;           // this process's index in localRanks
  size_t segmentBytes = 1 << 20;  // staging buffer per rank (two of them: double buffering)
  size_t arenaBytes = 0;        // virtual size of the zero-copy arena (committed on use)
  double timeoutSec = 300;      // a wait that sees no progress this long fails
  int spinIters = 20000;        // busy-wait iterations before sleeping on a futex
};

// Each rank owns one segment: [control | header tables | 2 staging buffers | arena].
// Peers map every segment of the group, so a rank reads its peers' staging buffers and
// arena tensors directly. Progress is tracked by one monotonically increasing `stamp` per
// rank: a rank bumps its stamp when it finishes a phase (arrive) and waits until every
// peer's stamp has reached its own (waitAll). Waiting spins, then sleeps on a futex, and
// checks every ~50 ms for an abort, a dead peer (same PID namespace only) and the timeout.
class ShmGroup {
 public:
  explicit ShmGroup(ShmOptions options);
  ~ShmGroup();

  // Creates this rank's segment and returns its name (for the store).
  std::string create(const std::string& nameTag);
  // Maps every peer's segment; names are indexed by local index.
  void attach(const std::vector<std::string>& names);
  // Removes this rank's segment name once every peer has mapped it; nothing is left in
  // /dev/shm even if the job crashes later.
  void unlinkOwn();

  int localSize() const { return static_cast<int>(opt_.localRanks.size()); }
  int localIndex() const { return opt_.localIndex; }

  // Operation bookkeeping, shown in timeout messages of peers.
  void setCurrent(const OpHeader& header);
  void markDone(uint64_t seq);
  // Progress outside shared memory (the leader's TCP transfers): peers waiting on this rank
  // see it and keep waiting instead of timing out.
  void heartbeat();
  // Publishes `header` into this rank's table for its parity and returns after every
  // local peer published theirs; headers[rank] is filled for every local rank.
  void exchangeHeaders(const OpHeader& header, std::vector<OpHeader>& headers);
  // Leader side of a multi-host header exchange: publishes the full table to the group.
  void publishAllHeaders(const std::vector<OpHeader>& headers);
  // Non-leader side: waits for the leader's table and copies it.
  void receiveAllHeaders(uint64_t seq, std::vector<OpHeader>& headers);

  // The collectives on raw memory; `headers` are the whole job's headers of this operation.
  void allreduce(char* data, size_t count, DType dtype, ReduceOp op, double scale,
                 const std::vector<OpHeader>& headers);
  // Local index i gets block i (elements [i*count/n, (i+1)*count/n)) of the reduction of
  // every rank's `input` (count elements, left as it was) in `out` (count/n elements).
  void reduceScatter(const char* input, char* out, size_t count, DType dtype, ReduceOp op,
                     double scale);
  void broadcast(char* data, size_t bytes, int rootIndex);
  // 16-bit floats across hosts: the leader (local index 0) gets the float32 sum of every
  // local rank's `data` in `hostSum`; the others only contribute.
  void reduceToLeader(const char* data, size_t count, DType dtype, ReduceOp op, float* hostSum);
  // pieces[i] = (offset into out, bytes) of local rank i; src is this rank's contribution.
  void allgather(const char* src, char* out, const std::vector<std::pair<size_t, size_t>>& pieces);

  // The zero-copy arena of this rank (tensors allocated there keep it mapped).
  std::shared_ptr<Arena> arena() const { return arena_; }
  // Offset of [ptr, ptr+bytes) in this rank's arena, or -1 if it lies outside.
  int64_t arenaOffsetOf(const void* ptr, size_t bytes) const;

  // Marks the group failed with `message` and wakes every waiter (first caller wins).
  void abort(const std::string& message);

 private:
  struct Control;
  Control* control(int index) const;
  OpHeader* table(int index, uint64_t seq) const;
  char* staging(int index, int buffer) const;
  void arrive();
  void waitFor(int index, uint32_t target);
  void waitAll();
  void checkAbort() const;
  [[noreturn]] void failWaiting(int index, const char* why) const;
  int nextBuffer() { return static_cast<int>(bufferCounter_++ & 1); }
  void allreduceZeroCopy(char* data, size_t count, DType dtype, ReduceOp op, double scale,
                         const std::vector<OpHeader>& headers);

  ShmOptions opt_;
  size_t controlBytes_ = 0, tableBytes_ = 0, stagingOffset_ = 0, arenaOffset_ = 0;
  std::vector<std::shared_ptr<Mapping>> mappings_;
  std::string ownName_;
  bool unlinked_ = true;
  uint32_t stamp_ = 0;           // phases this rank completed (mirrors its control stamp)
  uint64_t bufferCounter_ = 0;   // staging buffers used so far; parity picks the buffer
  uint64_t currentSeq_ = 0;
  std::string currentWhat_;
  std::shared_ptr<Arena> arena_;
};

}  // namespace torchring
