#include "shm.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <sstream>

#include "reduce.h"

namespace torchring {
namespace {

constexpr uint32_t kMagic = 0x74727367;     // "trsg"
constexpr size_t kPage = 4096;
constexpr size_t kOneShotBytes = 128 << 10;  // below this every rank reduces everything
constexpr double kCheckInterval = 0.05;      // seconds between liveness/timeout checks

size_t roundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

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

std::string errnoText() { return std::strerror(errno); }

// Identifies this process's PID namespace (0 when unknown). Peers in another namespace (ranks
// in separate containers that share /dev/shm) see pids that mean nothing to us, so their
// liveness is judged by the timeout alone, never by their pid.
uint64_t pidNamespace() {
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino) ^ (static_cast<uint64_t>(st.st_dev) << 32);
}

// Elements [lo, hi) of `count` that local index `index` of `n` reduces. Slices are whole
// multiples of 64 bytes so two ranks never write the same cache line.
std::pair<size_t, size_t> sliceOf(int index, int n, size_t count, size_t esize) {
  size_t align = std::max<size_t>(1, 64 / esize);
  size_t per = roundUp((count + n - 1) / n, align);
  size_t lo = std::min(count, per * index);
  return {lo, std::min(count, lo + per)};
}

}  // namespace

struct ShmGroup::Control {
  uint32_t magic;
  int32_t pid;
  int32_t rank;
  uint64_t pidNamespace;                        // pidNamespace() of the owner
  alignas(64) std::atomic<uint32_t> stamp;      // phases this rank completed
  alignas(64) std::atomic<uint32_t> sleepers;   // peers sleeping on `stamp`
  alignas(64) std::atomic<uint64_t> progress;   // (seq << 1) | done, for timeout messages
  std::atomic<uint64_t> heartbeat;              // bumped by progress outside shared memory
  uint64_t segmentBytes, stagingOffset, arenaOffset, worldSize;  // layout, checked by peers
  std::atomic<uint32_t> abortState;             // group-wide, in local index 0: 0, 1 writing, 2 set
  char abortMessage[4096];
};

Mapping::~Mapping() {
  if (base != nullptr) munmap(base, bytes);
  if (fd >= 0) ::close(fd);
}

Arena::Arena(std::shared_ptr<Mapping> mapping, size_t offset, size_t bytes)
    : mapping_(std::move(mapping)), offset_(offset), bytes_(bytes), forkGeneration_(forkGeneration()) {
  if (bytes_ > 0) free_[0] = bytes_;
}

int64_t Arena::alloc(size_t bytes) {
  if (forkGeneration() != forkGeneration_) return -1;  // a forked child: a stale free list
  size_t want = roundUp(std::max<size_t>(bytes, 1), kPage);
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < want) continue;
    size_t off = it->first, have = it->second;
    if (posix_fallocate(mapping_->fd, static_cast<off_t>(offset_ + off), want) != 0) return -1;
    free_.erase(it);
    if (have > want) free_[off + want] = have - want;
    used_[off] = want;
    return static_cast<int64_t>(off);
  }
  return -1;
}

void Arena::free(int64_t offset) {
  if (forkGeneration() != forkGeneration_) return;  // a forked child: still the parent's
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = used_.find(static_cast<size_t>(offset));
  if (it == used_.end()) return;
  size_t off = it->first, len = it->second;
  used_.erase(it);
  fallocate(mapping_->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
            static_cast<off_t>(offset_ + off), static_cast<off_t>(len));
  auto next = free_.lower_bound(off);
  if (next != free_.end() && off + len == next->first) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += len;
      return;
    }
  }
  free_[off] = len;
}

ShmGroup::ShmGroup(ShmOptions options) : opt_(std::move(options)) {
  controlBytes_ = roundUp(sizeof(Control), kPage);
  tableBytes_ = roundUp(2 * opt_.worldSize * sizeof(OpHeader), kPage);
  stagingOffset_ = controlBytes_ + tableBytes_;
  opt_.segmentBytes = roundUp(std::max<size_t>(opt_.segmentBytes, kPage), 64);
  arenaOffset_ = roundUp(stagingOffset_ + 2 * opt_.segmentBytes, kPage);
  mappings_.resize(opt_.localRanks.size());
}

ShmGroup::~ShmGroup() { unlinkOwn(); }

std::string ShmGroup::create(const std::string& nameTag) {
  std::ostringstream name;
  name << "/torchring-" << nameTag << "-" << opt_.localRanks[opt_.localIndex] << "-" << getpid();
  ownName_ = name.str();
  int fd = shm_open(ownName_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    throw CommFailedError("rank " + std::to_string(opt_.localRanks[opt_.localIndex]) +
                         ": shm_open(" + ownName_ + ") failed: " + errnoText() +
                         "; check that /dev/shm is mounted and writable, or set "
                         "TORCHRING_TRANSPORT=tcp");
  }
  unlinked_ = false;
  size_t total = arenaOffset_ + opt_.arenaBytes;
  auto mapping = std::make_shared<Mapping>();
  mapping->fd = fd;
  int reserveError = ftruncate(fd, static_cast<off_t>(total)) != 0 ? errno : 0;
  if (reserveError == 0) reserveError = posix_fallocate(fd, 0, static_cast<off_t>(arenaOffset_));
  if (reserveError != 0) {
    throw CommFailedError("rank " + std::to_string(opt_.localRanks[opt_.localIndex]) +
                         ": cannot reserve (" + std::strerror(reserveError) + ") " +
                         std::to_string(arenaOffset_ >> 10) +
                         " KiB in /dev/shm for segment " + ownName_ +
                         "; free space there (docker: --shm-size), lower "
                         "TORCHRING_SHM_CHUNK_KB, or set TORCHRING_TRANSPORT=tcp");
  }
  void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    throw CommFailedError("rank " + std::to_string(opt_.localRanks[opt_.localIndex]) +
                         ": mmap of " + ownName_ + " failed: " + errnoText());
  }
  mapping->base = static_cast<char*>(base);
  mapping->bytes = total;
  mappings_[opt_.localIndex] = mapping;
  arena_ = std::make_shared<Arena>(mapping, arenaOffset_, opt_.arenaBytes);
  Control* own = control(opt_.localIndex);
  own->segmentBytes = opt_.segmentBytes;
  own->stagingOffset = stagingOffset_;
  own->arenaOffset = arenaOffset_;
  own->worldSize = static_cast<uint64_t>(opt_.worldSize);
  own->pid = getpid();
  own->pidNamespace = pidNamespace();
  own->rank = opt_.localRanks[opt_.localIndex];
  own->magic = kMagic;
  return ownName_;
}

void ShmGroup::attach(const std::vector<std::string>& names) {
  const int me = opt_.localIndex;
  for (int i = 0; i < localSize(); ++i) {
    if (i == me) continue;
    std::string who = "rank " + std::to_string(opt_.localRanks[me]) + ": cannot map segment " +
                      names[i] + " of rank " + std::to_string(opt_.localRanks[i]);
    int fd = shm_open(names[i].c_str(), O_RDWR, 0600);
    if (fd < 0) {
      throw CommFailedError(who + ": " + errnoText() +
                           "; ranks that share TORCHRING_HOSTNAME must share /dev/shm");
    }
    struct stat st;
    fstat(fd, &st);
    auto mapping = std::make_shared<Mapping>();
    mapping->fd = fd;
    void* base = mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) throw CommFailedError(who + ": mmap: " + errnoText());
    mapping->base = static_cast<char*>(base);
    mapping->bytes = st.st_size;
    mappings_[i] = mapping;
    Control* peer = control(i);
    if (peer->magic != kMagic || peer->rank != opt_.localRanks[i]) {
      throw CommFailedError(who + ": it does not hold a torchring segment of that rank");
    }
    if (peer->segmentBytes != opt_.segmentBytes || peer->arenaOffset != arenaOffset_ ||
        peer->stagingOffset != stagingOffset_ || peer->worldSize != static_cast<uint64_t>(opt_.worldSize)) {
      throw CommFailedError(
          who + ": its shared-memory layout differs from this rank's (staging chunk " +
          std::to_string(peer->segmentBytes >> 10) + " KiB vs " + std::to_string(opt_.segmentBytes >> 10) +
          " KiB, world " + std::to_string(peer->worldSize) + " vs " + std::to_string(opt_.worldSize) +
          "); give every rank the same TORCHRING_SHM_CHUNK_KB");
    }
  }
}

void ShmGroup::unlinkOwn() {
  if (!unlinked_) shm_unlink(ownName_.c_str());
  unlinked_ = true;
}

ShmGroup::Control* ShmGroup::control(int index) const {
  return reinterpret_cast<Control*>(mappings_[index]->base);
}

OpHeader* ShmGroup::table(int index, uint64_t seq) const {
  return reinterpret_cast<OpHeader*>(mappings_[index]->base + controlBytes_) +
         (seq & 1) * opt_.worldSize;
}

char* ShmGroup::staging(int index, int buffer) const {
  return mappings_[index]->base + stagingOffset_ + buffer * opt_.segmentBytes;
}

int64_t ShmGroup::arenaOffsetOf(const void* ptr, size_t bytes) const {
  if (!arena_ || opt_.arenaBytes == 0) return -1;
  auto p = static_cast<const char*>(ptr);
  char* base = arena_->base();
  if (p < base || p + bytes > base + opt_.arenaBytes) return -1;
  return p - base;
}

void ShmGroup::setCurrent(const OpHeader& header) {
  currentSeq_ = header.seq;
  currentWhat_ = header.label() + " " + header.describe();
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
  for (int i = 0; i < opt_.spinIters; ++i) {
    cpuRelax();
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
                       currentWhat_ + " aborted because another rank failed: " +
                       std::string(leader->abortMessage));
}

void ShmGroup::failWaiting(int index, const char* why) const {
  Control* peer = control(index);
  uint64_t progress = peer->progress.load();
  std::ostringstream msg;
  msg << "rank " << opt_.localRanks[opt_.localIndex] << " (this process): " << currentWhat_;
  if (std::strcmp(why, "died") == 0) {
    msg << " failed: rank " << peer->rank << " (pid " << peer->pid
        << ", same host) died; the job cannot continue, restart it (torchrun --max-restarts)";
  } else {
    msg << " timed out after " << opt_.timeoutSec << " s waiting for rank " << peer->rank
        << " (pid " << peer->pid << ", same host), which is " << ((progress & 1) ? "done with" : "in")
        << " operation #" << (progress >> 1)
        << "; a rank is stuck or stopped, or ranks issued different numbers of collectives "
           "(raise TORCHRING_TIMEOUT if the work between collectives is that slow)";
  }
  throw CommFailedError(msg.str());
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

void ShmGroup::exchangeHeaders(const OpHeader& header, std::vector<OpHeader>& headers) {
  const int me = opt_.localIndex;
  table(me, header.seq)[opt_.localRanks[me]] = header;
  arrive();
  waitAll();
  for (int i = 0; i < localSize(); ++i) {
    headers[opt_.localRanks[i]] = table(i, header.seq)[opt_.localRanks[i]];
  }
}

void ShmGroup::publishAllHeaders(const std::vector<OpHeader>& headers) {
  std::copy(headers.begin(), headers.end(), table(opt_.localIndex, headers[0].seq));
  arrive();
}

void ShmGroup::receiveAllHeaders(uint64_t seq, std::vector<OpHeader>& headers) {
  arrive();
  waitFor(0, stamp_);
  const OpHeader* leaderTable = table(0, seq);
  std::copy(leaderTable, leaderTable + opt_.worldSize, headers.begin());
}

// Allreduce through the staging buffers, one chunk of at most segmentBytes at a time.
// Small messages (one-shot): copy the chunk in, arrive, wait, and every rank reduces all
// n staged chunks into its own tensor: one synchronization per chunk. Larger messages
// (reduce-scatter + allgather through memory): copy in, wait; each rank reduces its own
// slice of the chunk from all n staging buffers into both its staging buffer and its
// tensor; wait; each rank copies the other slices out of their owners' staging buffers.
// Chunks alternate between two staging buffers, so writing chunk k+1 never races with
// peers still reading chunk k, and the wait at chunk k+1 proves every peer is done with
// chunk k before chunk k+2 reuses its buffer: no trailing barrier.
void ShmGroup::allreduce(char* data, size_t count, DType dtype, ReduceOp op, double scale,
                         const std::vector<OpHeader>& headers) {
  const int n = localSize(), me = opt_.localIndex;
  bool zeroCopy = opt_.arenaBytes > 0 && count > 0;
  for (int i = 0; i < n; ++i) zeroCopy = zeroCopy && headers[opt_.localRanks[i]].arenaOffset >= 0;
  if (zeroCopy) return allreduceZeroCopy(data, count, dtype, op, scale, headers);
  const size_t esize = elementSize(dtype);
  const size_t chunkElems = opt_.segmentBytes / esize;
  const bool oneShot = count * esize <= kOneShotBytes;
  std::vector<const void*> srcs(n);
  for (size_t start = 0; start < count; start += chunkElems) {
    const size_t len = std::min(chunkElems, count - start);
    const int buf = nextBuffer();
    char* chunk = data + start * esize;
    std::memcpy(staging(me, buf), chunk, len * esize);
    arrive();
    waitAll();
    if (oneShot) {
      for (int p = 0; p < n; ++p) srcs[p] = staging(p, buf);
      reduceInto(chunk, nullptr, srcs.data(), n, len, dtype, op, scale);
      continue;
    }
    auto [lo, hi] = sliceOf(me, n, len, esize);
    for (int p = 0; p < n; ++p) srcs[p] = staging(p, buf) + lo * esize;
    reduceInto(staging(me, buf) + lo * esize, chunk + lo * esize, srcs.data(), n, hi - lo,
               dtype, op, scale);
    arrive();
    waitAll();
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      auto [plo, phi] = sliceOf(p, n, len, esize);
      std::memcpy(chunk + plo * esize, staging(p, buf) + plo * esize, (phi - plo) * esize);
    }
  }
}

// Zero-copy allreduce, used when every local rank's tensor lives in its arena. The header
// exchange that precedes it proves every tensor is complete. Each rank reduces its own
// slice [lo, hi) straight out of all n tensors and writes the result into its own tensor
// and into every peer's, a block of kPushBytes at a time (the block stays in cache for the
// extra copies); slices are disjoint, so no two ranks touch the same bytes. Then it arrives
// and waits: once every peer has arrived, every slice of this rank's tensor is final and no
// peer reads it any more. One synchronization; per rank it reads S and writes S.
void ShmGroup::allreduceZeroCopy(char* data, size_t count, DType dtype, ReduceOp op,
                                 double scale, const std::vector<OpHeader>& headers) {
  constexpr size_t kPushBytes = 256 << 10;
  const int n = localSize(), me = opt_.localIndex;
  const size_t esize = elementSize(dtype);
  std::vector<char*> tensors(n);
  for (int p = 0; p < n; ++p) {
    tensors[p] = p == me ? data
                         : mappings_[p]->base + arenaOffset_ + headers[opt_.localRanks[p]].arenaOffset;
  }
  auto [lo, hi] = sliceOf(me, n, count, esize);
  const int peer = n > 1 ? (me + 1) % n : me;
  std::vector<const void*> srcs(n);
  const size_t step = std::max<size_t>(1, kPushBytes / esize);
  for (size_t start = lo; start < hi; start += step) {
    // A peer that gave up (another rank failed) may already reuse its tensor: stop writing.
    checkAbort();
    const size_t len = std::min(step, hi - start), off = start * esize;
    for (int p = 0; p < n; ++p) srcs[p] = tensors[p] + off;
    reduceInto(data + off, peer != me ? tensors[peer] + off : nullptr, srcs.data(), n, len,
               dtype, op, scale);
    for (int p = 0; p < n; ++p) {
      if (p != me && p != peer) std::memcpy(tensors[p] + off, data + off, len * esize);
    }
  }
  arrive();
  waitAll();
}

// Reduce to the leader in float32: every rank stages a chunk, everyone waits, the leader
// folds the staged chunks into `hostSum`. One synchronization per chunk, as broadcast.
void ShmGroup::reduceToLeader(const char* data, size_t count, DType dtype, ReduceOp op,
                              float* hostSum) {
  const int n = localSize(), me = opt_.localIndex;
  const size_t esize = elementSize(dtype), chunkElems = opt_.segmentBytes / esize;
  std::vector<const void*> srcs(n);
  for (size_t start = 0; start < count; start += chunkElems) {
    const size_t len = std::min(chunkElems, count - start);
    const int buf = nextBuffer();
    std::memcpy(staging(me, buf), data + start * esize, len * esize);
    arrive();
    waitAll();
    if (me != 0) continue;
    for (int p = 0; p < n; ++p) srcs[p] = staging(p, buf);
    reduceToFloat(hostSum + start, srcs.data(), n, len, dtype, op);
  }
}

// Reduce-scatter through the staging buffers: with n ranks and blocks of B = count/n
// elements, round k handles elements [o, o + len) of every block (len = what fits n times
// in a chunk). Each rank stages piece p of its input (block p, offset o) at p*len, arrives,
// waits, and reduces piece `me` of every rank's staging buffer into `out`. One
// synchronization per round; double buffering as in broadcast. Each rank reads its input
// once and writes only its block.
void ShmGroup::reduceScatter(const char* input, char* out, size_t count, DType dtype,
                             ReduceOp op, double scale) {
  const int n = localSize(), me = opt_.localIndex;
  const size_t esize = elementSize(dtype), block = count / n;
  const size_t pieceElems = std::max<size_t>(1, opt_.segmentBytes / esize / n);
  std::vector<const void*> srcs(n);
  for (size_t o = 0; o < block; o += pieceElems) {
    const size_t len = std::min(pieceElems, block - o);
    const int buf = nextBuffer();
    char* own = staging(me, buf);
    for (int p = 0; p < n; ++p) {
      std::memcpy(own + p * len * esize, input + (p * block + o) * esize, len * esize);
    }
    arrive();
    waitAll();
    for (int q = 0; q < n; ++q) srcs[q] = staging(q, buf) + me * len * esize;
    reduceInto(out + o * esize, nullptr, srcs.data(), n, len, dtype, op, scale);
  }
}

// Broadcast: the root copies a chunk into its staging buffer, everyone waits, the others
// copy it out. Double buffering gives the same no-trailing-barrier argument as allreduce.
void ShmGroup::broadcast(char* data, size_t bytes, int rootIndex) {
  const int me = opt_.localIndex;
  for (size_t start = 0; start < bytes; start += opt_.segmentBytes) {
    const size_t len = std::min(opt_.segmentBytes, bytes - start);
    const int buf = nextBuffer();
    if (me == rootIndex) std::memcpy(staging(me, buf), data + start, len);
    arrive();
    waitAll();
    if (me != rootIndex) std::memcpy(data + start, staging(rootIndex, buf), len);
  }
}

// Allgather: in round r every rank stages bytes [r*segmentBytes, (r+1)*segmentBytes) of its
// contribution, everyone waits, and each rank copies every staged piece to its place.
void ShmGroup::allgather(const char* src, char* out,
                         const std::vector<std::pair<size_t, size_t>>& pieces) {
  const int n = localSize(), me = opt_.localIndex;
  size_t most = 0;
  for (auto& piece : pieces) most = std::max(most, piece.second);
  std::memcpy(out + pieces[me].first, src, pieces[me].second);
  for (size_t start = 0; start < most; start += opt_.segmentBytes) {
    const int buf = nextBuffer();
    if (start < pieces[me].second) {
      std::memcpy(staging(me, buf), src + start, std::min(opt_.segmentBytes, pieces[me].second - start));
    }
    arrive();
    waitAll();
    for (int p = 0; p < n; ++p) {
      if (p == me || start >= pieces[p].second) continue;
      size_t len = std::min(opt_.segmentBytes, pieces[p].second - start);
      std::memcpy(out + pieces[p].first + start, staging(p, buf), len);
    }
  }
}

}  // namespace torchring
