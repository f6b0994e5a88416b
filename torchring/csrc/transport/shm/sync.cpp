// How the ranks of a host synchronize through their regions: arrive (bump this rank's stamp)
// and wait (spin, yield the CPU a few times, then sleep on a futex until a peer's stamp
// reaches ours), with a check every kCheckInterval for a group-wide abort, a dead peer and
// the timeout; the messages those failures raise; and the progress words peers show in theirs.
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "transport/shm/group.h"
#include "transport/shm/region.h"

namespace torchring {
namespace {

constexpr double kCheckInterval = 0.05;  // seconds between liveness/timeout checks
constexpr int kYields = 50;              // sched_yield()s between spinning and sleeping

void futexWait(std::atomic<uint32_t>* word, uint32_t expected, long nanos) {
  timespec ts{0, nanos};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// A process that exited but was not reaped yet still answers kill(pid, 0): look at its state.
bool processAlive(int pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content;
  if (!std::getline(stat, content)) return true;  // no procfs: trust kill()
  auto close = content.rfind(')');
  if (close == std::string::npos || close + 2 >= content.size()) return true;
  char state = content[close + 2];
  return state != 'Z' && state != 'X';
}

}  // namespace

void ShmGroup::setCurrent(const OpHeader& header) {
  current_ = header;  // its words are made only if it fails
  hasCurrent_ = true;
  control(opt_.localIndex)->progress.store(header.seq << 1, std::memory_order_relaxed);
}

void ShmGroup::markDone(uint64_t seq) {
  control(opt_.localIndex)->progress.store((seq << 1) | 1, std::memory_order_relaxed);
}

void ShmGroup::heartbeat() {
  control(opt_.localIndex)->heartbeat.fetch_add(1, std::memory_order_relaxed);
}

void ShmGroup::arrive() {
  Control* own = control(opt_.localIndex);
  own->stamp.store(++stamp_, std::memory_order_seq_cst);
  if (own->sleepers.load(std::memory_order_seq_cst) != 0) futexWakeAll(&own->stamp);
}

void ShmGroup::waitFor(int index, uint32_t target) {
  Control* peer = control(index);
  auto reached = [&] {
    return static_cast<int32_t>(peer->stamp.load(std::memory_order_acquire) - target) >= 0;
  };
  if (reached()) return;
  const TimedWait timed(waits_, index);  // from here on, this rank waits for that one
  // On the progress thread of a one-CPU rank, a spin would take that CPU from the caller.
  const int spins = onProgressThread_ && ownCpus_ <= 1 ? ShmOptions::kNoSpin : opt_.spinIters;
  for (int i = 0; i < spins; ++i) {
    cpuRelax();
    if (reached()) return;
  }
  // Then hand the CPU over a few times before sleeping: when ranks outnumber CPUs the awaited
  // rank may be waiting for this very CPU, and a yield runs it without a futex round trip.
  for (int i = 0; i < kYields; ++i) {
    sched_yield();
    if (reached()) return;
  }
  auto start = Clock::now(), lastCheck = start;
  uint64_t beat = peer->heartbeat.load(std::memory_order_relaxed);
  for (;;) {
    checkAbort();
    peer->sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint32_t seen = peer->stamp.load(std::memory_order_seq_cst);
    if (static_cast<int32_t>(seen - target) < 0) futexWait(&peer->stamp, seen, 2000000);
    peer->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (reached()) return;
    // A departed peer arrived at every phase it ever will before it set the flag, so the
    // flag, read after the stamp still falls short, means this wait can never end. A peer
    // that failed aborted the group before it departed (the acquire makes that visible):
    // its reason, which names the rank really lost, comes first.
    if (peer->departed.load(std::memory_order_acquire) != 0 && !reached()) {
      checkAbort();
      failWaiting(index, "left");
    }
    if (secondsSince(lastCheck) > kCheckInterval) {
      lastCheck = Clock::now();
      const uint64_t ns = control(opt_.localIndex)->pidNamespace;
      if (ns != 0 && peer->pidNamespace == ns && !processAlive(peer->pid)) failWaiting(index, "died");
      uint64_t now = peer->heartbeat.load(std::memory_order_relaxed);
      if (now != beat) {  // the peer is busy elsewhere (its TCP stage): no progress is due here
        beat = now;
        start = Clock::now();
      }
      if (secondsSince(start) > opt_.timeoutSec) failWaiting(index, "timeout");
    }
  }
}

void ShmGroup::waitAll() {
  for (int i = 0; i < localSize(); ++i) {
    if (i != opt_.localIndex) waitFor(i, stamp_);
  }
}

void ShmGroup::checkAbort() const {
  Control* leader = control(0);
  if (leader->abortState.load(std::memory_order_acquire) == 0) return;
  for (int i = 0; i < 1000000 && leader->abortState.load(std::memory_order_acquire) != 2; ++i) {
    cpuRelax();
  }
  throw CommFailedError("rank " + std::to_string(opt_.localRanks[opt_.localIndex]) + ": " +
                       currentWhat() + " aborted because another rank failed: " +
                       std::string(leader->abortMessage));
}

void ShmGroup::failWaiting(int index, const char* why) const {
  Control* peer = control(index);
  uint64_t progress = peer->progress.load();
  std::ostringstream msg;
  msg << "rank " << opt_.localRanks[opt_.localIndex] << " (this process): " << currentWhat();
  if (std::strcmp(why, "left") == 0) {
    msg << " failed: Connection closed by peer: rank " << peer->rank << " (pid " << peer->pid
        << ", same host) shut its communicator down while this rank waited for it; re-form the "
           "group without it (torchring.elastic) or have every rank issue the same collectives";
  } else if (std::strcmp(why, "died") == 0) {
    msg << " failed: rank " << peer->rank << " (pid " << peer->pid
        << ", same host) died; the job cannot continue, restart it (torchrun --max-restarts)";
  } else {
    msg << " hit the " << opt_.timeoutSec << " s timeout waiting for rank " << peer->rank
        << " (pid " << peer->pid << ", same host), which is " << ((progress & 1) ? "done with" : "in")
        << " operation #" << (progress >> 1)
        << "; a rank is stuck or stopped, or ranks issued different numbers of collectives "
           "(" << kRaiseTimeout.torchring << " if the work between collectives is that slow)";
  }
  throw CommFailedError(msg.str());
}

std::string ShmGroup::peerTrouble(int index) const {
  Control* leader = control(0);
  if (leader->abortState.load(std::memory_order_acquire) == 2) {
    return std::string("another rank failed: ") + leader->abortMessage;
  }
  Control* peer = control(index);
  const uint64_t ns = control(opt_.localIndex)->pidNamespace;
  if (ns != 0 && peer->pidNamespace == ns && !processAlive(peer->pid)) {
    return "rank " + std::to_string(peer->rank) + " (pid " + std::to_string(peer->pid) + ", same host) died";
  }
  return "";
}

std::string ShmGroup::abortMessage() const {
  if (mappings_.empty() || !mappings_[0]) return "";
  Control* leader = control(0);
  if (leader->abortState.load(std::memory_order_acquire) != 2) return "";
  return std::string(leader->abortMessage);
}

bool ShmGroup::departed(int index) const {
  return control(index)->departed.load(std::memory_order_acquire) != 0;
}

void ShmGroup::depart() {
  if (mappings_.empty() || !mappings_[opt_.localIndex]) return;
  Control* own = control(opt_.localIndex);
  own->departed.store(1, std::memory_order_release);
  futexWakeAll(&own->stamp);
}

void ShmGroup::abort(const std::string& message) {
  if (mappings_.empty() || !mappings_[0]) return;
  for (auto& m : mappings_) {
    if (!m) return;  // not attached yet: peers fail on their own
  }
  Control* leader = control(0);
  uint32_t expected = 0;
  if (!leader->abortState.compare_exchange_strong(expected, 1)) return;
  std::snprintf(leader->abortMessage, sizeof(leader->abortMessage), "%s", message.c_str());
  leader->abortState.store(2, std::memory_order_release);
  for (int i = 0; i < localSize(); ++i) futexWakeAll(&control(i)->stamp);
}

}  // namespace torchring
