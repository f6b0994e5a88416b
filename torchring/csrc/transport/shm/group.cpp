// The ShmGroup's regions: their layout, creating this rank's, mapping the peers' (checking
// that every rank computed the same layout), unlinking; and the header tables through which
// the ranks of a host compare the operation they are about to run.
#include "transport/shm/group.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>

#include "transport/shm/region.h"

namespace torchring {
namespace {

std::string errnoText() { return std::strerror(errno); }

// Identifies this process's PID namespace (0 when unknown). Peers in another namespace (ranks
// in separate containers that share /dev/shm) see pids that mean nothing to us, so their
// liveness is judged by the timeout alone, never by their pid.
uint64_t pidNamespace() {
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino) ^ (static_cast<uint64_t>(st.st_dev) << 32);
}

// This process's CPU affinity mask as 16 words of 64 CPUs; every CPU when it cannot be read.
void affinityMask(uint64_t (&words)[16]) {
  cpu_set_t set;
  CPU_ZERO(&set);
  const bool known = sched_getaffinity(0, sizeof(set), &set) == 0;
  for (int cpu = 0; cpu < 1024; ++cpu) {
    if (!known || (cpu < CPU_SETSIZE && CPU_ISSET(cpu, &set))) words[cpu / 64] |= uint64_t{1} << (cpu % 64);
  }
}

int countCpus(const uint64_t (&words)[16]) {
  int n = 0;
  for (uint64_t w : words) n += __builtin_popcountll(w);
  return n;
}

}  // namespace

using shm::kPage;
using shm::roundUp;

ShmGroup::ShmGroup(ShmOptions options) : opt_(std::move(options)), stores_(opt_.stagingStores),
      oneSyncStores_(opt_.stagingStores), waits_(static_cast<int>(opt_.localRanks.size())) {
  controlBytes_ = roundUp(sizeof(Control), kPage);
  tableBytes_ = roundUp(2 * opt_.worldSize * sizeof(OpHeader), kPage);
  stagingOffset_ = controlBytes_ + tableBytes_;
  opt_.segmentBytes = roundUp(std::max<size_t>(opt_.segmentBytes, kPage), 64);
  if (opt_.oneShotBytes == ShmOptions::kOneShotBySize) opt_.oneShotBytes = ShmOptions::oneShotFor(localSize());
  p2pOffset_ = roundUp(stagingOffset_ + 2 * stagingStride(), kPage);
  arenaOffset_ = p2pOffset_ + opt_.localRanks.size() * kP2PRingBytes;
  mappings_.resize(opt_.localRanks.size());
  shift_.resize(opt_.localRanks.size());
  srcs_.resize(opt_.localRanks.size());
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
  // Reserved now: control, tables, staging. The point-to-point rings (localSize^2 of them on
  // a host) are committed on first use, like the arena: only pairs that talk cost memory.
  if (reserveError == 0) reserveError = posix_fallocate(fd, 0, static_cast<off_t>(p2pOffset_));
  if (reserveError != 0) {
    throw CommFailedError("rank " + std::to_string(opt_.localRanks[opt_.localIndex]) +
                         ": cannot reserve (" + std::strerror(reserveError) + ") " +
                         std::to_string(p2pOffset_ >> 10) +
                         " KiB in /dev/shm for the shared-memory region " + ownName_ +
                         "; free space there (docker: --shm-size), lower "
                         "TORCHRING_SHM_SEGMENT_KB, or set TORCHRING_TRANSPORT=tcp");
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
  own->oneShotBytes = opt_.oneShotBytes;
  own->stagingOffset = stagingOffset_;
  own->arenaOffset = arenaOffset_;
  own->worldSize = static_cast<uint64_t>(opt_.worldSize);
  own->pid = getpid();
  own->pidNamespace = pidNamespace();
  own->rank = opt_.localRanks[opt_.localIndex];
  own->departed.store(0, std::memory_order_relaxed);
  std::fill(std::begin(own->cpus), std::end(own->cpus), 0);
  affinityMask(own->cpus);
  ownCpus_ = countCpus(own->cpus);
  own->magic = shm::kMagic;
  return ownName_;
}

void ShmGroup::attach(const std::vector<std::string>& names) {
  const int me = opt_.localIndex;
  for (int i = 0; i < localSize(); ++i) {
    if (i == me) continue;
    std::string who = "rank " + std::to_string(opt_.localRanks[me]) +
                      ": cannot map the shared-memory region " + names[i] + " of rank " +
                      std::to_string(opt_.localRanks[i]);
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
    if (peer->magic != shm::kMagic || peer->rank != opt_.localRanks[i]) {
      throw CommFailedError(who + ": it does not hold a torchring region of that rank");
    }
    if (peer->segmentBytes != opt_.segmentBytes || peer->arenaOffset != arenaOffset_ ||
        peer->stagingOffset != stagingOffset_ || peer->worldSize != static_cast<uint64_t>(opt_.worldSize) ||
        peer->oneShotBytes != opt_.oneShotBytes) {
      throw CommFailedError(
          who + ": its shared-memory layout differs from this rank's (staging segment " +
          std::to_string(peer->segmentBytes >> 10) + " KiB vs " + std::to_string(opt_.segmentBytes >> 10) +
          " KiB, world " + std::to_string(peer->worldSize) + " vs " + std::to_string(opt_.worldSize) +
          ", one-shot limit " + std::to_string(peer->oneShotBytes) + " vs " +
          std::to_string(opt_.oneShotBytes) + " bytes); give every rank the same TORCHRING_SHM_SEGMENT_KB");
    }
  }
  chooseSpin();
}

// How long a wait spins before it sleeps, from the CPU sets of this host's ranks: spinning
// only hurts when the rank being waited for needs the CPU the spinner holds. That cannot
// happen when the ranks' sets are pairwise disjoint (mpirun --bind-to core, srun --cpu-bind,
// taskset per rank: every rank has cores of its own), nor when together they hold at least
// one CPU per rank (the scheduler spreads them). Otherwise (ranks outnumber the CPUs they
// may use) a wait does not spin: it yields, then sleeps.
void ShmGroup::chooseSpin() {
  if (!opt_.spinAuto) return;
  std::vector<std::array<uint64_t, 16>> masks(localSize());
  for (int i = 0; i < localSize(); ++i) {
    std::copy(std::begin(control(i)->cpus), std::end(control(i)->cpus), masks[i].begin());
  }
  opt_.spinIters = cpusSuffice(masks) ? ShmOptions::kLongSpin : ShmOptions::kNoSpin;
}

bool ShmGroup::cpusSuffice(const std::vector<std::array<uint64_t, 16>>& masks) {
  uint64_t all[16] = {};
  bool disjoint = true;
  for (const auto& mask : masks) {
    for (int w = 0; w < 16; ++w) {
      disjoint = disjoint && (all[w] & mask[w]) == 0;
      all[w] |= mask[w];
    }
  }
  return disjoint || countCpus(all) >= static_cast<int>(masks.size());
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

// Which region holds a rank's staged copy rotates. Staging buffer `buffer` (the parity of
// bufferCounter_) is used every second segment; on its u-th use local index i writes into the
// buffer of region (i + u) mod n, holder_[buffer] = u mod n. So a rank writes into the lines
// it read on the buffer's previous use (its next peer's copy then), which are still in its
// cache. A rank that rewrote its own region's buffer instead would store into lines a peer
// read last, and that costs far more: at world 2, 64 KiB exchanged each way through buffers
// that swap took 2.9 us, through fixed ones 9.3 us, on the EPYC VM
// (benchmarks/probes/rotation_probe.c). Every use is still safe: the buffer a rank writes on
// use u+1 was last read on use u, two segments back, and the wait at the segment in between
// proves every rank finished that one.
int ShmGroup::nextBuffer() {
  const int buffer = static_cast<int>(bufferCounter_ & 1);
  holder_[buffer] = static_cast<int>((bufferCounter_ >> 1) % static_cast<uint64_t>(localSize()));
  ++bufferCounter_;
  return buffer;
}

char* ShmGroup::staging(int index, int buffer) const {
  // (index + holder_) mod n without a division: both are below n. Called per rank per segment.
  int region = index + holder_[buffer];
  if (region >= localSize()) region -= localSize();
  return mappings_[region]->base + stagingOffset_ + buffer * stagingStride();
}

char* ShmGroup::staged(int index, int buffer) const { return staging(index, buffer) + shift_[index]; }

// Where each rank stages an allreduce in its staging buffers (shift_, below a page). Copying
// between a stream that stores and one that loads at addresses with the same low 12 bits makes
// the CPU mistake the store for one to the loaded address (4K aliasing): measured here, a
// tensor at offset 0 or 64 of a page (where torch puts large tensors) staged at a page
// boundary made the allreduce 5-8x slower at 1-64 MiB. A rank stores to its staging and its
// tensor and loads from its tensor and every peer's staging, so every staging shift should be
// far from every rank's tensor offset and from the other shifts.
// - placeKnown: every rank's pageOffset is known (a separate header exchange came first):
//   shifts are given in local index order, each at the multiple of 64 farthest (circular
//   distance) from every tensor offset and the shifts given so far; every rank computes the same.
// - placeOwn: the one-sync path stages before it sees the peers' headers, so each rank puts
//   its data half a page from its own tensor's offset (peers apply the same rule to its header).
std::vector<uint16_t> ShmGroup::stagingShifts(const std::vector<int>& pageOffsets) {
  std::vector<int> taken(pageOffsets);
  std::vector<uint16_t> shifts;
  for (size_t i = 0; i < pageOffsets.size(); ++i) {
    const int best = farthestPageShift(0, 64, taken.data(), static_cast<int>(taken.size()));
    shifts.push_back(static_cast<uint16_t>(best));
    taken.push_back(best);
  }
  return shifts;
}

void ShmGroup::placeKnown(const std::vector<OpHeader>& headers) {
  std::vector<int> offsets;
  for (int i = 0; i < localSize(); ++i) offsets.push_back(headers[opt_.localRanks[i]].pageOffset);
  shift_ = stagingShifts(offsets);
}

void ShmGroup::placeOwn(const std::vector<OpHeader>& headers) {
  for (int i = 0; i < localSize(); ++i) {
    shift_[i] = static_cast<uint16_t>((headers[opt_.localRanks[i]].pageOffset + kPage / 2) % kPage);
  }
}

char* ShmGroup::p2pRing(int owner, int writer) const {
  return mappings_[owner]->base + p2pOffset_ + static_cast<size_t>(writer) * kP2PRingBytes;
}

int64_t ShmGroup::arenaOffsetOf(const void* ptr, size_t bytes) const {
  if (!arena_ || opt_.arenaBytes == 0) return -1;
  auto p = static_cast<const char*>(ptr);
  char* base = arena_->base();
  if (p < base || p + bytes > base + opt_.arenaBytes) return -1;
  return p - base;
}

// Header tables: each rank writes its header for operation `seq` into its own table of
// parity seq & 1 and arrives; once every peer arrived, their tables hold this operation's
// headers. Consecutive operations use different tables, so writing the next operation's
// header never races with a peer still reading this one's.
// Every exchange also takes the next staging buffer, whether it stages data into it
// (exchangeHeadersWithData) or not: ranks whose headers differ (one staged, one did not) still
// agree on which buffer comes next, and the double-buffering rule of allreduce.cpp holds,
// since every buffer turn has at least one synchronization.
void ShmGroup::exchangeHeaders(const OpHeader& header, std::vector<OpHeader>& headers) {
  exchangeHeadersWithData(header, nullptr, headers);
}

bool ShmGroup::fitsOneSync(const OpHeader& header) const {
  const size_t bytes = header.count * elementSize(static_cast<DType>(header.dtype));
  return static_cast<OpKind>(header.kind) == OpKind::ALLREDUCE && !header.onGpu && header.prescale == 1.0 &&
         bytes > 0 && bytes <= opt_.oneShotBytes && bytes <= opt_.segmentBytes;
}

void ShmGroup::exchangeHeadersWithData(const OpHeader& header, const char* data, std::vector<OpHeader>& headers) {
  const int me = opt_.localIndex;
  const int buf = nextBuffer();
  prestaged_ = -1;
  if (data != nullptr) {
    shift_[me] = static_cast<uint16_t>((header.pageOffset + kPage / 2) % kPage);  // placeOwn's rule
    const size_t bytes = header.count * elementSize(static_cast<DType>(header.dtype));
    prestagedStreamed_ = oneSyncStores_.streaming(bytes);
    if (bytes >= StoreChooser::kMinBytes) prestagedStart_ = Clock::now();  // below, no time is used
    copyWith(prestagedStreamed_, staged(me, buf), data, bytes);
    if (prestagedStreamed_) streamFence();
    prestaged_ = buf;
  }
  table(me, header.seq)[opt_.localRanks[me]] = header;
  arrive();
  if (onArrived_) onArrived_();
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

}  // namespace torchring
