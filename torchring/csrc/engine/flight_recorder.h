// The flight recorder: every communicator keeps its last `capacity` operations (collectives
// and point-to-point), each with its header, the frame of the Python line that issued it and
// the times it was enqueued, started and finished on this rank, so that a hang or a failure
// can be explained after the fact (torchring/trace reads snapshot() and writes the dumps).
//
// Recording must cost next to nothing on a 4 KiB allreduce, so a slot is written without a
// lock: record() (whose callers hold the communicator's mutex, so ids need no atomic add) takes
// the next id (reserve), owns slot id % capacity, marks its version odd while it copies the
// header's fields in, then even (2 * id + 2) once it is whole (fill). An operation run at once
// on one host has its slot filled later than its id was taken: once its header is out, while
// the rank waits for its peers (Communicator::writeDeferredTrace), away from the communicator's
// lock. A reader (snapshot, any thread) copies a slot between two loads of its version and
// keeps the copy only when both are the same even number (a seqlock). started() and
// finished() touch only atomics, and only while the slot still holds their id. Times are read
// from the CPU's time-stamp counter (a third of the steady clock's cost) and turned into
// steady-clock nanoseconds only by snapshot(), counting back from now at core/waits.h's
// nsPerTick(); an operation that starts as it is recorded (run inline on an idle
// communicator) reads the clock once for both: when it is filled, for one filled later.
//
// Process-wide, next to the recorders: the table of Python frames (bindings.cpp interns them
// and hands the engine an id), the calling thread's frame for the next operation, and the
// notification fd that tells torchring/trace a communicator failed (one byte, async-safe).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/common.h"

namespace torchring {

// A state of a recorded operation.
enum class TraceState : uint8_t { SCHEDULED = 0, STARTED = 1, COMPLETED = 2, FAILED = 3 };

// One recorded operation, as snapshot() copies it out.
struct TraceEntry {
  uint64_t id = 0;          // record id in this recorder, counted from 0
  OpHeader header;          // kind, seq, dtype, shape, op, root, rows (send/recv: seq counts them);
                            // scale factors are not kept, nor dims past the sixth
  bool truncatedDims = false;  // the shape had more dims than the record keeps
  bool p2p = false;         // a send or recv
  int peer = -1;            // send/recv: the other rank (-1: any source)
  int64_t tag = 0;          // send/recv: the tag
  uint32_t frame = 0;       // FlightRecorder::frame(frame); 0: no Python frame
  TraceState state = TraceState::SCHEDULED;
  int64_t enqueuedNs = 0, startedNs = 0, finishedNs = 0;  // steady clock; 0: not yet
};

// What a communicator's rank waited: seconds for each of its ranks (by index), and on its own
// link (a leader's bytes held back on their way out: core/waits.h own()).
struct WaitTotals {
  std::vector<double> byRank;
  double ownLink = 0;
};

// A Python frame: "train.py", 12, "step".
struct TraceFrame {
  std::string file;
  int line = 0;
  std::string function;
};

class FlightRecorder {
 public:
  // capacity 0: records nothing (TORCHRING_TRACE=0).
  explicit FlightRecorder(size_t capacity);

  // Records an operation about to be queued (startsNow: it runs at once, on this thread);
  // returns its id for started()/finished(). Callers serialize (the communicator's mutex).
  uint64_t record(const OpHeader& header, uint32_t frame, bool startsNow, bool p2p = false, int peer = -1,
                  int64_t tag = 0);
  // record() in two steps, for an operation that runs at once: reserve() takes its id (callers
  // serialize, as for record()); fill() writes its slot later, on any one thread, before
  // started()/finished() of that id (until then snapshot() leaves the id out).
  uint64_t reserve();
  void fill(uint64_t id, const OpHeader& header, uint32_t frame, bool startsNow, bool p2p = false, int peer = -1,
            int64_t tag = 0);
  void started(uint64_t id);
  void finished(uint64_t id, bool ok);
  // The recorded operations, oldest first (a slot being rewritten right now is left out).
  std::vector<TraceEntry> snapshot() const;
  size_t capacity() const { return capacity_; }
  bool enabled() const { return capacity_ > 0; }

  // What the dump calls this communicator's group: name, description, its world ranks.
  void setIdentity(std::string name, std::string desc, std::vector<int> ranks);
  std::string name() const;
  std::string desc() const;
  std::vector<int> ranks() const;
  // Seconds this rank waited for each of its ranks, and on its own link (the communicator's,
  // set by it at start).
  void setWaits(std::function<WaitTotals()> waits);
  WaitTotals waits() const;
  // The communicator's first failure, for the dump ("" while none).
  void setFailure(const std::string& message);
  std::string failure() const;

  // Every live recorder of the process (the world's, its groups', the c10d backends').
  static std::vector<std::shared_ptr<FlightRecorder>> all();
  static std::shared_ptr<FlightRecorder> create(size_t capacity);  // registered in all()

  // Frames: bindings.cpp interns each (file, line, function) once and passes its id.
  static uint32_t addFrame(TraceFrame frame);
  static TraceFrame frame(uint32_t id);
  // The frame the calling thread set for its next operation (then cleared), else what the
  // provider finds (bindings.cpp: the caller's Python frame), else 0.
  static void setCallerFrame(uint32_t id);
  static void clearCallerFrame();
  static uint32_t callerFrame();
  static void setFrameProvider(uint32_t (*provider)());

  // SIGUSR1 and SIGTERM, where their action is still the default: a C handler writes the
  // signal's number to the notify fd, so the dump starts at once whatever the main thread is
  // doing. After SIGTERM a watchdog thread waits until signalDumped() or graceSec, then puts
  // the default action back and raises SIGTERM again: the process ends as it would have. In
  // a forked child (which shares the fd) both signals take their default action at once.
  // Returns the signals taken.
  static std::vector<int> takeSignals(double graceSec);
  static void releaseSignals();
  static void signalDumped();
  // Where a failure is announced (-1: nowhere): notifyFailure() writes one byte to it.
  static void setNotifyFd(int fd);
  static void notifyFailure();
  // How many failures notifyFailure() announced so far (the at-exit dump compares it with
  // those already dumped: the pipe's byte may not have been read when the process ends).
  static uint64_t failures();
  // The steady clock in nanoseconds, what snapshot() gives the entries' times in.
  static int64_t nowNs();
  // The cheap clock records read: the time-stamp counter on x86-64, else nowNs().
  static int64_t ticks();

 private:
  // Two cache lines per operation, so that a loop of small operations streams through as
  // little memory as it can: the header's fields that describe() reads, up to kDims dims.
  static constexpr int kDims = 6;
  struct alignas(64) Slot {
    std::atomic<uint64_t> version{0};
    int64_t enqueued = 0;
    std::atomic<int64_t> startedAt{0}, finishedAt{0};
    uint64_t seq = 0, count = 0;
    int64_t tagOrRows = 0;  // send/recv: the tag; else the header's rows
    uint32_t frame = 0;
    int32_t peer = -1, root = -1;
    uint8_t kind = 0, dtype = 0, op = 0, ndim = 0, onGpu = 0, p2p = 0;
    std::atomic<uint8_t> state{0};
    int64_t dims[kDims] = {};
  };
  static_assert(sizeof(Slot) == 128, "a slot is two cache lines");
  Slot* slotOf(uint64_t id);

  size_t capacity_;
  std::unique_ptr<Slot[]> slots_;
  std::atomic<uint64_t> next_{0};
  mutable std::mutex identityMutex_;
  std::string name_, desc_, failure_;
  std::function<WaitTotals()> waits_;
  std::vector<int> ranks_;
};

}  // namespace torchring
