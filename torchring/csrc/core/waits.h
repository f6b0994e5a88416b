// Who this rank waited for, and how long: a WaitLedger per transport (shared memory: by local
// rank; TCP: by host) adds up the time each wait for a peer took past its first check, and
// remembers the longest wait of the operation in flight, so the communicator can tell which
// peer made this rank wait (torchring.stats(), the dumps, the straggler warning). A wait
// during which this rank's own link held its sent bytes back is no peer's: it adds to own().
//
// Times are CPU time-stamp ticks (cpuTicks(), a third of a steady-clock read): a wait that
// ends at its first check costs nothing, one that spins or sleeps pays two reads.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

namespace torchring {

// The time-stamp counter on x86-64, else the steady clock in nanoseconds.
int64_t cpuTicks();
// Nanoseconds per tick, from the steady clock since the engine loaded (1 where ticks are ns).
// It reads the steady clock; `settled` (when given) is set once a second has passed since the
// engine loaded, from when on the ratio moves by less than a part in ten thousand.
double nsPerTick(bool* settled = nullptr);

class WaitLedger {
 public:
  explicit WaitLedger(int peers = 0) { resize(peers); }
  void resize(int peers) {
    peers_ = peers;
    totals_.reset(peers > 0 ? new std::atomic<int64_t>[peers] : nullptr);
    for (int i = 0; i < peers; ++i) totals_[i].store(0, std::memory_order_relaxed);
  }
  int peers() const { return peers_; }
  // A wait of `ticks` for peer `peer` (called by the thread running the operation).
  void add(int peer, int64_t ticks) {
    if (peer < 0 || peer >= peers_) return;
    totals_[peer].fetch_add(ticks, std::memory_order_relaxed);
    if (ticks > opLongest_) {
      opLongest_ = ticks;
      opPeer_ = peer;
    }
  }
  // A wait of `ticks` on this rank's own link (its bytes held back on their way out).
  void addOwn(int64_t ticks) { own_.fetch_add(ticks, std::memory_order_relaxed); }
  int64_t own() const { return own_.load(std::memory_order_relaxed); }
  // Every total back to 0 (the thread that adds; a reader may see some totals cleared and not
  // yet others).
  void clear() {
    for (int i = 0; i < peers_; ++i) totals_[i].store(0, std::memory_order_relaxed);
    own_.store(0, std::memory_order_relaxed);
    startOp();
  }
  // Ticks waited for `peer` so far (any thread).
  int64_t total(int peer) const {
    return peer >= 0 && peer < peers_ ? totals_[peer].load(std::memory_order_relaxed) : 0;
  }
  // The operation in flight: its longest wait starts over; (peer, ticks) of it so far.
  void startOp() {
    opLongest_ = 0;
    opPeer_ = -1;
  }
  std::pair<int, int64_t> opLongest() const { return {opPeer_, opLongest_}; }

 private:
  int peers_ = 0;
  std::unique_ptr<std::atomic<int64_t>[]> totals_;
  std::atomic<int64_t> own_{0};
  int64_t opLongest_ = 0;
  int opPeer_ = -1;
};

// Adds the time from its creation to its end to `ledger` for `peer` (every way out of a wait),
// or to its own() once onOwnLink() says this rank's own link held the wait up.
class TimedWait {
 public:
  TimedWait(WaitLedger& ledger, int peer) : ledger_(ledger), peer_(peer), start_(cpuTicks()) {}
  ~TimedWait() {
    const int64_t ticks = cpuTicks() - start_;
    if (ownLink_) {
      ledger_.addOwn(ticks);
    } else {
      ledger_.add(peer_, ticks);
    }
  }
  void onOwnLink() { ownLink_ = true; }
  TimedWait(const TimedWait&) = delete;
  TimedWait& operator=(const TimedWait&) = delete;

 private:
  WaitLedger& ledger_;
  int peer_;
  int64_t start_;
  bool ownLink_ = false;
};

}  // namespace torchring
