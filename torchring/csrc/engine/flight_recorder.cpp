// FlightRecorder (flight_recorder.h): the lock-free slots, the process-wide registry of
// recorders, the frame table and the failure notification.
#include "engine/flight_recorder.h"

#include <fcntl.h>
#include <semaphore.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <thread>

#include "core/waits.h"

namespace torchring {

namespace {

struct Registry {
  std::mutex mutex;
  std::vector<std::weak_ptr<FlightRecorder>> recorders;
  std::vector<TraceFrame> frames{TraceFrame{}};  // id 0: no frame
};

Registry& registry() {
  static auto* r = new Registry();  // never destroyed: engine threads may record at exit
  return *r;
}

std::atomic<int> gNotifyFd{-1};
std::atomic<uint32_t (*)()> gProvider{nullptr};
// The calling thread's frame for its next operation: kSet | id, or 0 when none was set. The
// initial-exec model makes each access one load relative to the thread pointer, not a call
// into the dynamic linker (this library is loaded at run time, but its 8 bytes fit the static
// TLS space glibc keeps for that).
constexpr uint64_t kSet = uint64_t{1} << 32;
thread_local uint64_t tCaller __attribute__((tls_model("initial-exec"))) = 0;

}  // namespace

FlightRecorder::FlightRecorder(size_t capacity) : capacity_(capacity) {
  if (capacity_ > 0) slots_.reset(new Slot[capacity_]);
}

std::shared_ptr<FlightRecorder> FlightRecorder::create(size_t capacity) {
  auto recorder = std::make_shared<FlightRecorder>(capacity);
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.recorders.erase(std::remove_if(r.recorders.begin(), r.recorders.end(),
                                   [](const std::weak_ptr<FlightRecorder>& weak) { return weak.expired(); }),
                    r.recorders.end());
  r.recorders.push_back(recorder);
  return recorder;
}

std::vector<std::shared_ptr<FlightRecorder>> FlightRecorder::all() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::shared_ptr<FlightRecorder>> out;
  for (const auto& weak : r.recorders) {
    if (auto recorder = weak.lock()) out.push_back(std::move(recorder));
  }
  return out;
}

int64_t FlightRecorder::nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t FlightRecorder::ticks() { return cpuTicks(); }

FlightRecorder::Slot* FlightRecorder::slotOf(uint64_t id) {
  if (capacity_ == 0) return nullptr;
  Slot* slot = &slots_[id % capacity_];
  // Still this id's slot (not yet reused by an operation `capacity_` later)?
  return slot->version.load(std::memory_order_relaxed) == 2 * id + 2 ? slot : nullptr;
}

uint64_t FlightRecorder::record(const OpHeader& header, uint32_t frame, bool startsNow, bool p2p, int peer,
                                int64_t tag) {
  const uint64_t id = reserve();
  fill(id, header, frame, startsNow, p2p, peer, tag);
  return id;
}

uint64_t FlightRecorder::reserve() {
  if (capacity_ == 0) return 0;
  const uint64_t id = next_.load(std::memory_order_relaxed);
  next_.store(id + 1, std::memory_order_release);  // snapshot() skips the slot until fill() ends
  return id;
}

void FlightRecorder::fill(uint64_t id, const OpHeader& header, uint32_t frame, bool startsNow, bool p2p, int peer,
                          int64_t tag) {
  if (capacity_ == 0) return;
  Slot& slot = slots_[id % capacity_];
  slot.version.store(2 * id + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  slot.enqueued = ticks();
  slot.seq = header.seq;
  slot.count = header.count;
  slot.tagOrRows = p2p ? tag : static_cast<int64_t>(header.rows);
  slot.frame = frame;
  slot.peer = peer;
  slot.root = header.root;
  slot.kind = header.kind;
  slot.dtype = header.dtype;
  slot.op = header.op;
  slot.ndim = header.ndim;
  slot.onGpu = header.onGpu;
  slot.p2p = p2p ? 1 : 0;
  for (int d = 0; d < kDims; ++d) slot.dims[d] = header.dims[d];
  slot.state.store(static_cast<uint8_t>(startsNow ? TraceState::STARTED : TraceState::SCHEDULED),
                   std::memory_order_relaxed);
  slot.startedAt.store(startsNow ? slot.enqueued : 0, std::memory_order_relaxed);
  slot.finishedAt.store(0, std::memory_order_relaxed);
  slot.version.store(2 * id + 2, std::memory_order_release);
  // The next slot, written at the next operation, into the cache now: a store that misses is
  // cheap until the next locked instruction (for record(), the communicator's mutex, right
  // after), which waits for it to reach memory; a prefetch is not waited for.
  const Slot* ahead = &slots_[(id + 1) % capacity_];
  __builtin_prefetch(ahead, 1, 3);
  __builtin_prefetch(reinterpret_cast<const char*>(ahead) + 64, 1, 3);
}

void FlightRecorder::started(uint64_t id) {
  Slot* slot = slotOf(id);
  if (slot != nullptr && slot->startedAt.load(std::memory_order_relaxed) == 0) {
    slot->startedAt.store(ticks(), std::memory_order_relaxed);
    slot->state.store(static_cast<uint8_t>(TraceState::STARTED), std::memory_order_release);
  }
}

void FlightRecorder::finished(uint64_t id, bool ok) {
  if (Slot* slot = slotOf(id)) {
    const int64_t now = ticks();
    if (slot->startedAt.load(std::memory_order_relaxed) == 0) slot->startedAt.store(now, std::memory_order_relaxed);
    slot->finishedAt.store(now, std::memory_order_relaxed);
    slot->state.store(static_cast<uint8_t>(ok ? TraceState::COMPLETED : TraceState::FAILED),
                      std::memory_order_release);
  }
}

std::vector<TraceEntry> FlightRecorder::snapshot() const {
  std::vector<TraceEntry> out;
  if (capacity_ == 0) return out;
  // ticks -> steady ns: back from now at the engine's one calibration (core/waits.h nsPerTick).
  const int64_t ticksNow = ticks(), steadyNow = nowNs();
  const double perTick = nsPerTick();
  auto toNs = [&](int64_t t) { return t == 0 ? int64_t{0} : steadyNow - int64_t(double(ticksNow - t) * perTick); };
  const uint64_t end = next_.load(std::memory_order_acquire);
  const uint64_t begin = end > capacity_ ? end - capacity_ : 0;
  out.reserve(end - begin);
  for (uint64_t id = begin; id < end; ++id) {
    const Slot& slot = slots_[id % capacity_];
    const uint64_t before = slot.version.load(std::memory_order_acquire);
    if (before != 2 * id + 2) continue;  // being written, or already reused
    TraceEntry e;
    e.id = id;
    OpHeader& h = e.header;
    h.seq = slot.seq;
    h.count = slot.count;
    h.root = slot.root;
    h.kind = slot.kind;
    h.dtype = slot.dtype;
    h.op = slot.op;
    h.onGpu = slot.onGpu;
    h.ndim = slot.ndim;
    for (int d = 0; d < kDims; ++d) h.dims[d] = slot.dims[d];
    e.p2p = slot.p2p != 0;
    e.peer = slot.peer;
    e.tag = e.p2p ? slot.tagOrRows : 0;
    if (!e.p2p) h.rows = static_cast<uint64_t>(slot.tagOrRows);
    e.frame = slot.frame;
    e.enqueuedNs = slot.enqueued;
    e.state = static_cast<TraceState>(slot.state.load(std::memory_order_acquire));
    e.startedNs = slot.startedAt.load(std::memory_order_relaxed);
    e.finishedNs = slot.finishedAt.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (slot.version.load(std::memory_order_relaxed) != before) continue;
    e.truncatedDims = h.ndim > kDims;
    e.enqueuedNs = toNs(e.enqueuedNs);
    e.startedNs = toNs(e.startedNs);
    e.finishedNs = toNs(e.finishedNs);
    out.push_back(std::move(e));
  }
  return out;
}

void FlightRecorder::setIdentity(std::string name, std::string desc, std::vector<int> ranks) {
  std::lock_guard<std::mutex> lock(identityMutex_);
  name_ = std::move(name);
  desc_ = std::move(desc);
  ranks_ = std::move(ranks);
}

std::string FlightRecorder::name() const {
  std::lock_guard<std::mutex> lock(identityMutex_);
  return name_;
}

std::string FlightRecorder::desc() const {
  std::lock_guard<std::mutex> lock(identityMutex_);
  return desc_;
}

std::vector<int> FlightRecorder::ranks() const {
  std::lock_guard<std::mutex> lock(identityMutex_);
  return ranks_;
}

void FlightRecorder::setWaits(std::function<WaitTotals()> waits) {
  std::lock_guard<std::mutex> lock(identityMutex_);
  waits_ = std::move(waits);
}

WaitTotals FlightRecorder::waits() const {
  std::function<WaitTotals()> waits;
  {
    std::lock_guard<std::mutex> lock(identityMutex_);
    waits = waits_;
  }
  return waits ? waits() : WaitTotals();
}

void FlightRecorder::setFailure(const std::string& message) {
  std::lock_guard<std::mutex> lock(identityMutex_);
  if (failure_.empty()) failure_ = message;
}

std::string FlightRecorder::failure() const {
  std::lock_guard<std::mutex> lock(identityMutex_);
  return failure_;
}

uint32_t FlightRecorder::addFrame(TraceFrame frame) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.frames.push_back(std::move(frame));
  return static_cast<uint32_t>(r.frames.size() - 1);
}

TraceFrame FlightRecorder::frame(uint32_t id) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return id < r.frames.size() ? r.frames[id] : TraceFrame{};
}

void FlightRecorder::setCallerFrame(uint32_t id) { tCaller = kSet | id; }

void FlightRecorder::clearCallerFrame() { tCaller = 0; }

uint32_t FlightRecorder::callerFrame() {
  if (const uint64_t caller = tCaller) {
    tCaller = 0;
    return static_cast<uint32_t>(caller);
  }
  auto* provider = gProvider.load(std::memory_order_relaxed);
  return provider != nullptr ? provider() : 0;
}

void FlightRecorder::setFrameProvider(uint32_t (*provider)()) { gProvider.store(provider); }

void FlightRecorder::setNotifyFd(int fd) { gNotifyFd.store(fd); }

namespace {

constexpr int kSignals[] = {SIGUSR1, SIGTERM};
struct sigaction gOldActions[2];
bool gTaken[2] = {false, false};
std::atomic<pid_t> gArmedPid{0};
std::atomic<bool> gDumped{false};
sem_t gTermSem;
double gGraceSec = 3;

void onSignal(int sig) {
  const int saved = errno;
  if (getpid() != gArmedPid.load()) {  // a forked child: what the default action would do
    signal(sig, SIG_DFL);
    raise(sig);
  } else {
    const int fd = gNotifyFd.load();
    const char byte = static_cast<char>(sig);
    if (fd >= 0) (void)!write(fd, &byte, 1);
    if (sig == SIGTERM) sem_post(&gTermSem);
  }
  errno = saved;
}

// After SIGTERM: the dump's grace, then the default action.
void termWatchdog() {
  for (;;) {
    while (sem_wait(&gTermSem) != 0) {
    }
    if (gArmedPid.load() != getpid()) continue;  // released: nothing to end
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(gGraceSec);
    while (!gDumped.load() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    signal(SIGTERM, SIG_DFL);
    kill(getpid(), SIGTERM);
  }
}

}  // namespace

std::vector<int> FlightRecorder::takeSignals(double graceSec) {
  static std::once_flag once;
  std::call_once(once, [] {
    sem_init(&gTermSem, 0, 0);
    std::thread(termWatchdog).detach();
  });
  gGraceSec = graceSec;
  gDumped = false;
  gArmedPid = getpid();
  std::vector<int> taken;
  for (int i = 0; i < 2; ++i) {
    struct sigaction current {};
    if (gTaken[i] || sigaction(kSignals[i], nullptr, &current) != 0) continue;
    if (current.sa_handler != SIG_DFL || (current.sa_flags & SA_SIGINFO)) continue;  // the program's own
    struct sigaction ours {};
    ours.sa_handler = onSignal;
    sigemptyset(&ours.sa_mask);
    ours.sa_flags = SA_RESTART;
    if (sigaction(kSignals[i], &ours, &gOldActions[i]) == 0) {
      gTaken[i] = true;
      taken.push_back(kSignals[i]);
    }
  }
  return taken;
}

void FlightRecorder::releaseSignals() {
  gArmedPid = 0;
  for (int i = 0; i < 2; ++i) {
    if (gTaken[i]) sigaction(kSignals[i], &gOldActions[i], nullptr);
    gTaken[i] = false;
  }
}

void FlightRecorder::signalDumped() { gDumped = true; }

std::atomic<uint64_t> gFailures{0};

uint64_t FlightRecorder::failures() { return gFailures.load(); }

void FlightRecorder::notifyFailure() {
  gFailures.fetch_add(1);
  const int fd = gNotifyFd.load();
  if (fd < 0) return;
  const char byte = 'F';
  (void)!write(fd, &byte, 1);  // non-blocking: a full pipe already has a dump coming
}

}  // namespace torchring
