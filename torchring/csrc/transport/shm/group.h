// Shared-memory transport between the ranks of one host ("the local group"): the ShmGroup
// and its options. Its members are defined by concern in this folder: group.cpp (region
// layout, create/attach/unlink, header tables), sync.cpp (arrive/wait, abort, dead-peer and
// timeout detection), allreduce.cpp and collectives.cpp (the algorithms).
//
// Vocabulary (gloo's): a *chunk* is one rank's share of a message (the part it reduces, or
// contributes to an allgather); a *segment* is the pipelining unit, what one staging buffer
// holds at once (segmentBytes). The shared memory a rank owns is its *region*.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/common.h"
#include "core/waits.h"
#include "core/stores.h"
#include "transport/shm/arena.h"

namespace torchring {

struct ShmOptions {
  int worldSize = 1;
  std::vector<int> localRanks;  // global ranks of this host, ascending; index = local index
  int localIndex = 0;           // this process's index in localRanks
  size_t segmentBytes = 1 << 20;  // one segment: a staging buffer (two per rank: double buffering)
  size_t arenaBytes = 0;        // virtual size of the zero-copy arena (committed on use)
  double timeoutSec = kDefaultTimeoutSec;  // a wait that sees no progress this long fails
  int spinIters = 20000;        // busy-wait iterations before sleeping on a futex
  // Replace spinIters at attach by the CPU-set rule (group.cpp, chooseSpin).
  bool spinAuto = false;
  // Ranks that outnumber their CPUs do not spin: a wait yields at once (spinning 200 pauses
  // first doubled a 4-byte allreduce at world 3 on 2 CPUs; benchmarks/RESULTS.md).
  static constexpr int kLongSpin = 20000, kNoSpin = 0;
  // A staged allreduce of at most this many bytes is one-shot: every rank reduces the whole
  // message (one synchronization per segment); above it, each rank reduces its chunk.
  // kOneShotBySize (the default) takes oneShotFor(local ranks).
  size_t oneShotBytes = kOneShotBySize;
  static constexpr size_t kOneShotBySize = ~size_t{0};
  // One-shot makes every rank read all n staged copies (n * S per rank, each cache line pulled
  // by n - 1 other cores), the chunked path about 3 * S and one more synchronization: the
  // one-shot limit falls as n grows, 128 KiB for 2 ranks (measured on 2 vCPUs), 64 KiB for 4,
  // 32 KiB for 8, 16 KiB for 16. On 16 cores of a Xeon, 64 KiB one-shot took 85 us at 8
  // ranks and 180 us at 16, where Open MPI's chunked allreduce took 60 and 87
  // (benchmarks/RESULTS.md, "GPU machine, second visit").
  static constexpr size_t kOneShotTotalBytes = 256 << 10;
  static size_t oneShotFor(int localRanks) {
    return kOneShotTotalBytes / static_cast<size_t>(localRanks < 2 ? 2 : localRanks);
  }
  // Cached or streaming stores for staging writes, or AUTO: measured while running (core/stores.h).
  StorePolicy stagingStores = StorePolicy::AUTO;
};

// Each rank owns one region: [control | header tables | 2 staging buffers | p2p rings | arena]
// (region.h). Peers map every region of the group, so a rank reads its peers' staging
// buffers and arena tensors directly. Progress is tracked by one monotonically increasing
// `stamp` per rank: a rank bumps its stamp when it finishes a phase (arrive) and waits until
// every peer's stamp has reached its own (waitAll). Waiting spins, yields, then sleeps on a
// futex, and checks every ~50 ms for an abort, a dead peer (same PID namespace only) and the
// timeout.
class ShmGroup {
 public:
  explicit ShmGroup(ShmOptions options);
  ~ShmGroup();

  // Creates this rank's region and returns its name (for the store).
  std::string create(const std::string& nameTag);
  // Maps every peer's region; names are indexed by local index.
  void attach(const std::vector<std::string>& names);
  // Removes this rank's region name once every peer has mapped it; nothing is left in
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
  // True when `header` is an allreduce that exchangeHeadersWithData can run: one segment that
  // fits the one-shot limit, no prescale. Reads only fields that every rank's header must
  // share, so ranks whose headers match all take the same path.
  bool fitsOneSync(const OpHeader& header) const;
  // exchangeHeaders that also stages `data` (header.count elements) for the allreduce that
  // follows: one synchronization for both. The data stays staged for allreduce(), which then
  // only reduces; a mismatch found in `headers` leaves `data` untouched.
  void exchangeHeadersWithData(const OpHeader& header, const char* data, std::vector<OpHeader>& headers);
  // Called by every header exchange right after this rank's header is out and before it
  // waits for its peers' (the communicator writes its flight recorder entry there, where that
  // work can overlap the wait).
  void setOnArrived(std::function<void()> hook) { onArrived_ = std::move(hook); }
  // Leader side of a multi-host header exchange: publishes the full table to the group.
  void publishAllHeaders(const std::vector<OpHeader>& headers);
  // Non-leader side: waits for the leader's table and copies it.
  void receiveAllHeaders(uint64_t seq, std::vector<OpHeader>& headers);

  // The collectives on raw memory; `headers` are the whole job's headers of this operation.
  void allreduce(char* data, size_t count, DType dtype, ReduceOp op, double scale,
                 const std::vector<OpHeader>& headers);
  // Local index i gets chunk i (elements [i*count/n, (i+1)*count/n)) of the reduction of
  // every rank's `input` (count elements, left as it was) in `out` (count/n elements).
  void reduceScatter(const char* input, char* out, size_t count, DType dtype, ReduceOp op,
                     double scale);
  void broadcast(char* data, size_t bytes, int rootIndex);
  // The leader (local index 0) gets the sum of every local rank's `data` in `out`: float32
  // partial sums for 16-bit floats, else `dtype`; the others only contribute. `data` is read.
  void reduceToLeader(const char* data, size_t count, DType dtype, ReduceOp op, void* out);
  // chunks[i] = (offset into out, bytes) of local rank i's chunk; src is this rank's chunk.
  void allgather(const char* src, char* out, const std::vector<std::pair<size_t, size_t>>& chunks);

  // Point-to-point mailboxes (p2p.h): the ring of kP2PRingBytes in local rank `owner`'s
  // region that local rank `writer` writes into and `owner` reads from.
  char* p2pRing(int owner, int writer) const;
  static constexpr size_t kP2PRingBytes = 256 << 10;

  // The rules of group.cpp as pure functions (tests call them through the bindings):
  // placeKnown's staging shifts for the local ranks' tensor page offsets, and chooseSpin's
  // test of whether the local ranks' CPU sets let them spin (masks of CPUs 0-1023).
  static std::vector<uint16_t> stagingShifts(const std::vector<int>& pageOffsets);
  static bool cpusSuffice(const std::vector<std::array<uint64_t, 16>>& masks);

  // The zero-copy arena of this rank (tensors allocated there keep it mapped).
  std::shared_ptr<Arena> arena() const { return arena_; }
  // Offset of [ptr, ptr+bytes) in this rank's arena, or -1 if it lies outside.
  int64_t arenaOffsetOf(const void* ptr, size_t bytes) const;

  // "" while local rank `index` lives and the group was not aborted; else what went wrong
  // (for waits outside these collectives: point-to-point transfers).
  std::string peerTrouble(int index) const;

  // True while operations run on the progress thread, false while they run inline on the
  // caller's: a rank with one CPU then spins briefly, since its caller may be computing.
  void setOnProgressThread(bool on) { onProgressThread_ = on; }

  // Marks the group failed with `message` and wakes every waiter (first caller wins).
  void abort(const std::string& message);
  // Marks this rank as gone for good (its communicator shut down, every operation it
  // started done) and wakes its waiters: a peer still waiting for it fails at once with
  // "Connection closed by peer" instead of after the timeout.
  void depart();
  // The message of the group's abort ("" while none): a rank about to start an operation
  // fails it at once instead of running it with the peers that are still there.
  std::string abortMessage() const;
  // Whether local rank `index` has departed (point-to-point: its last messages may still be
  // in flight, so the caller decides when that means a transfer can no longer complete).
  bool departed(int index) const;
  // How long this rank waited for each local rank (by local index; core/waits.h).
  WaitLedger& waits() { return waits_; }
  const WaitLedger& waits() const { return waits_; }

 private:
  struct Control;  // region.h
  Control* control(int index) const;
  OpHeader* table(int index, uint64_t seq) const;
  char* staging(int index, int buffer) const;
  // Where local rank `index` stages an allreduce's data: staging() + shift_[index], which
  // placeKnown or placeOwn set for the operation (group.cpp).
  char* staged(int index, int buffer) const;
  void placeKnown(const std::vector<OpHeader>& headers);
  void placeOwn(const std::vector<OpHeader>& headers);
  // A staging buffer holds a segment at any shift below a page.
  size_t stagingStride() const { return opt_.segmentBytes + 4096; }
  void arrive();
  void waitFor(int index, uint32_t target);
  void waitAll();
  void checkAbort() const;
  [[noreturn]] void failWaiting(int index, const char* why) const;
  // The staging buffer this segment uses (the parity of bufferCounter_), and which region
  // holds each rank's copy of it this time (holder_, staging() in group.cpp).
  int nextBuffer();
  void reduceStaged(char* data, size_t count, DType dtype, ReduceOp op, double scale,
                    const std::vector<OpHeader>& headers);
  void chooseSpin();
  void allreduceZeroCopy(char* data, size_t count, DType dtype, ReduceOp op, double scale,
                         const std::vector<OpHeader>& headers);

  ShmOptions opt_;
  size_t controlBytes_ = 0, tableBytes_ = 0, stagingOffset_ = 0, p2pOffset_ = 0, arenaOffset_ = 0;
  std::vector<std::shared_ptr<Mapping>> mappings_;
  std::string ownName_;
  bool unlinked_ = true;
  uint32_t stamp_ = 0;           // phases this rank completed (mirrors its control stamp)
  uint64_t bufferCounter_ = 0;   // segments staged so far; parity picks the staging buffer
  int holder_[2] = {0, 0};       // per staging buffer: local index i's copy is in region
                                 // (i + holder_) mod n (nextBuffer)
  int prestaged_ = -1;           // staging buffer holding this operation's data, or -1
  StoreChooser stores_;          // cached or streaming staging writes (core/stores.h)
  // The same choice for the one-sync path's copy-in (its own history: its time per byte is
  // mostly the synchronization and the peers' reads, unlike a staged segment's).
  StoreChooser oneSyncStores_;
  WaitLedger waits_;             // by local index (waits())
  bool prestagedStreamed_ = false;        // how the prestaged copy-in was written
  Clock::time_point prestagedStart_{};    // when it began, from StoreChooser::kMinBytes (the call is timed)
  std::vector<uint16_t> shift_;  // per local index: where this allreduce is staged (staged())
  std::vector<const void*> srcs_;  // per local index: what a reduce reads (one operation at a time)
  int ownCpus_ = 0;              // CPUs in this process's affinity mask
  bool onProgressThread_ = false;
  OpHeader current_;             // the operation in progress, named by failure messages
  bool hasCurrent_ = false;
  std::string currentWhat() const { return hasCurrent_ ? current_.what() : std::string(); }
  std::shared_ptr<Arena> arena_;
  std::function<void()> onArrived_;  // setOnArrived
};

}  // namespace torchring
