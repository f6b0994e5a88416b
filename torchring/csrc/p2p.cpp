// Point-to-point messages: matching, the send/ACK protocol and the progress thread (p2p.h
// explains the design; p2p_stream.cpp holds the streams).
//
// The progress thread owns every Link. Each turn it adopts newly posted operations, accepts
// peers' connections, writes each link's queue of frames (outq) and reads its incoming
// stream. Reading a DATA frame: the header names (tag, id, bytes); the payload goes straight
// into the first posted recv of that tag (link.target), or into a new stash entry when no
// recv waits for it; once complete the recv is finished and an ACK queued. A recv posted
// later takes the oldest unclaimed stash entry of its tag (waiting for it to complete if it
// is still arriving). A large message arrives as an RTS, matched (or stashed) the same way;
// the match queues a CTS and files the recv under the message id (link.cleared), the sender
// then queues the PAYLOAD, which goes straight into that recv. ACKs and CTSs jump ahead of
// queued messages not yet started. When nothing moves it polls a while (spinIters / 10
// rounds) if a shared-memory transfer is pending, then sleeps in ppoll() on the sockets and
// an eventfd that posting threads write: 50 us while shared memory is pending (rings have
// no file descriptor), up to 200 ms otherwise.
#include "p2p.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "shm/group.h"

namespace torchring {

namespace {
constexpr uint32_t kFrameMagic = 0x70327074;  // "tp2p"
// DATA: a small message, payload included. A message above kEagerBytes goes in three steps
// instead: RTS (its header only), the receiver's CTS once a recv for it is posted, then
// PAYLOAD; so a large message is never buffered on the receiving side and lands directly in
// the recv's tensor. ACK answers DATA and PAYLOAD (or an RTS whose recv has another size).
constexpr uint32_t kData = 1, kAck = 2, kRts = 3, kCts = 4, kPayload = 5;
constexpr size_t kEagerBytes = 64 << 10;
}  // namespace

struct P2P::Frame {
  uint32_t magic = kFrameMagic;
  uint32_t type = kData;
  int64_t tag = 0;
  uint64_t id = 0;     // DATA: the message's number on this stream; ACK: the message answered
  uint64_t bytes = 0;  // DATA, RTS, PAYLOAD: message bytes; ACK: the bytes the recv expected
  uint32_t ok = 1;     // ACK: 1 the recv took the message, 0 its size differed
  char what[28] = {};  // DATA: the sender's description; ACK: the receiver's
};
// Both ends read exactly this many bytes as a header.
constexpr size_t kFrameBytes = 64;

struct P2P::Pending {
  bool isSend = false;
  int peer = 0;
  int64_t tag = 0;
  char* data = nullptr;
  size_t bytes = 0;
  std::string what;
  at::Tensor keep;
  std::shared_ptr<CpuWork> work;
  uint64_t id = 0;  // a send's message number
  Clock::time_point last;  // last progress, for the timeout
};

struct P2P::OutItem {
  Frame frame;
  const char* payload = nullptr;
  size_t total = 0, offset = 0;  // frame + payload bytes, and how many were written
  std::shared_ptr<Pending> send;  // null for an ACK or CTS
  at::Tensor keep;                 // a refused message's payload, until written
};

struct P2P::Stashed {
  Frame frame;
  std::vector<char> payload;
  bool complete = false;
  std::shared_ptr<Pending> waiter;  // a recv that claimed it while it was still arriving
};

struct P2P::Link {
  std::unique_ptr<OutStream> out;
  std::unique_ptr<InStream> in;
  bool shm = false;
  Clock::time_point lastActive;  // a byte moved on this link, either way
  bool hungUp = false;  // the connection this rank sent on was closed by the peer
  Clock::time_point hungUpAt;
  std::deque<OutItem> outq;
  std::map<uint64_t, std::shared_ptr<Pending>> awaitingAck;
  std::map<uint64_t, std::shared_ptr<Pending>> awaitingCts;  // large sends whose RTS went out
  std::map<uint64_t, std::shared_ptr<Pending>> cleared;      // recvs that sent CTS, by message id
  uint64_t nextId = 0;
  std::deque<std::shared_ptr<Pending>> posted;   // recvs with no message yet, oldest first
  std::deque<std::unique_ptr<Stashed>> stash;    // messages (or RTSs) with no recv yet, oldest first
  // The incoming frame being read.
  Frame frame;
  size_t frameGot = 0;
  bool inPayload = false, discarding = false;
  char* dest = nullptr;
  size_t left = 0;
  std::shared_ptr<Pending> target;  // the recv being filled, or null
  Stashed* stashTarget = nullptr;   // or the stash entry
  std::vector<char> scratch;        // where a discarded payload goes
};

P2P::P2P(P2POptions options, ShmGroup* shm) : opt_(std::move(options)), shm_(shm) {
  spinRounds_ = std::max(20, opt_.spinIters / 10);  // a round polls every stream: ~10 pauses' worth
  static_assert(sizeof(Frame) == kFrameBytes, "a frame header is 64 bytes");
  links_.resize(opt_.size);
  wakeFd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
}

P2P::~P2P() { shutdown(); }

int P2P::listen(const std::string& bindAddr) {
  int port = -1;
  listenFd_ = p2pstream::tcpListen(bindAddr, opt_.rank, &port);
  return port;
}

void P2P::setPeers(std::vector<std::string> addrs, std::vector<int> ports) {
  addrs_ = std::move(addrs);
  ports_ = std::move(ports);
}

std::shared_ptr<CpuWork> P2P::send(int peer, int64_t tag, const char* data, size_t bytes,
                                   const std::string& what, at::Tensor keep) {
  return post(true, peer, tag, const_cast<char*>(data), bytes, what, std::move(keep));
}

std::shared_ptr<CpuWork> P2P::recv(int peer, int64_t tag, char* data, size_t bytes, const std::string& what,
                                   at::Tensor keep) {
  return post(false, peer, tag, data, bytes, what, std::move(keep));
}

std::shared_ptr<CpuWork> P2P::post(bool isSend, int peer, int64_t tag, char* data, size_t bytes,
                                   const std::string& what, at::Tensor keep) {
  auto op = std::make_shared<Pending>();
  op->isSend = isSend;
  op->peer = peer;
  op->tag = tag;
  op->data = data;
  op->bytes = bytes;
  op->what = what;
  op->keep = std::move(keep);
  std::unique_lock<std::mutex> lock(mutex_);
  op->work = std::make_shared<CpuWork>(isSend ? OpKind::SEND : OpKind::RECV, nextSeq_++, opt_.rank);
  op->work->setContext(opt_.label);
  auto work = op->work;
  if (!failure_.empty() || stopping_) {
    std::exception_ptr error =
        stopping_ ? std::make_exception_ptr(TorchringError(rankText() + ": " + describe(*op) +
                                                           ": torchring was shut down; call torchring.init() first"))
                  : std::make_exception_ptr(CommFailedError(rankText() + ": " + describe(*op) +
                                                            " was not run because the communicator failed earlier: " +
                                                            failure_ + "; " + kRecoveryHint));
    lock.unlock();
    work->finish({}, error);
    return work;
  }
  incoming_.push_back(std::move(op));
  if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  uint64_t one = 1;
  (void)!::write(wakeFd_, &one, sizeof(one));  // under the lock: shutdown() closes it
  return work;
}

std::string P2P::describe(const Pending& op) const {
  if (op.tag < 0) {  // a collective's transfer: `what` names the collective
    return op.what + (op.isSend ? ", its transfer to rank " : ", its transfer from rank ") + std::to_string(op.peer);
  }
  return std::string(op.isSend ? "send to rank " : "recv from rank ") + std::to_string(op.peer) + " (tag " +
         std::to_string(op.tag) + ", " + op.what + ")";
}

namespace {
inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

void finishOk(const std::shared_ptr<CpuWork>& work, const at::Tensor& result) { work->finish(result, nullptr); }
}  // namespace

void P2P::adopt(std::shared_ptr<Pending> op) {
  auto& slot = links_[op->peer];
  if (!slot) {
    slot = std::make_unique<Link>();
    if (sameHost(op->peer)) {  // rings in the receiver's region: theirs for sending, ours for receiving
      const int me = opt_.rankLocal[opt_.rank], them = opt_.rankLocal[op->peer];
      slot->shm = true;
      slot->out = p2pstream::shmOut(shm_->p2pRing(them, me));
      slot->in = p2pstream::shmIn(shm_->p2pRing(me, them), "rank " + std::to_string(op->peer));
    }
  }
  Link& link = *slot;
  ++active_;
  op->last = Clock::now();
  if (op->isSend) {
    op->id = link.nextId++;
    OutItem item;
    item.frame.tag = op->tag;
    item.frame.id = op->id;
    item.frame.bytes = op->bytes;
    std::strncpy(item.frame.what, op->what.c_str(), sizeof(item.frame.what) - 1);
    if (op->bytes > kEagerBytes) {
      item.frame.type = kRts;
      item.total = sizeof(Frame);
    } else {
      item.payload = op->data;
      item.total = sizeof(Frame) + op->bytes;
    }
    item.send = std::move(op);
    link.outq.push_back(std::move(item));
    return;
  }
  for (auto& stashed : link.stash) {  // the oldest unclaimed message of this tag
    if (stashed->waiter || stashed->frame.tag != op->tag) continue;
    stashed->waiter = op;
    if (stashed->complete) deliver(op->peer, link, *stashed, op);
    return;
  }
  link.posted.push_back(std::move(op));
}

OutStream& P2P::outStream(int peer, Link& link) {
  if (!link.out && link.hungUp) {
    throw CommFailedError(rankText() + ": the connection to rank " + std::to_string(peer) +
                          " closed: it died or shut down");
  }
  if (!link.out) {
    if (addrs_.size() != static_cast<size_t>(opt_.size) || addrs_[peer].empty()) {
      throw CommFailedError(rankText() + ": no address for rank " + std::to_string(peer) +
                            " on another host: the communicator was not wired for point-to-point messages");
    }
    int fd = p2pstream::tcpConnect(addrs_[peer], ports_[peer], opt_.rank, peer, opt_.secret, opt_.timeoutSec,
                                   [this] {
                                     std::lock_guard<std::mutex> lock(mutex_);
                                     return stopping_;
                                   });
    link.out = p2pstream::tcpOut(fd, "rank " + std::to_string(peer) + " (" + addrs_[peer] + ":" +
                                         std::to_string(ports_[peer]) + ")");
  }
  return *link.out;
}

bool P2P::pumpOut(int peer, Link& link) {
  bool moved = false;
  while (!link.outq.empty()) {
    OutItem& item = link.outq.front();
    OutStream& out = outStream(peer, link);
    size_t n;
    if (item.offset < sizeof(Frame)) {
      n = out.write(reinterpret_cast<const char*>(&item.frame) + item.offset, sizeof(Frame) - item.offset);
    } else {
      n = out.write(item.payload + (item.offset - sizeof(Frame)), item.total - item.offset);
    }
    if (n == 0) break;
    moved = true;
    link.lastActive = Clock::now();
    item.offset += n;
    if (item.send) item.send->last = Clock::now();
    if (item.offset == item.total) {
      if (item.send) (item.frame.type == kRts ? link.awaitingCts : link.awaitingAck)[item.frame.id] = item.send;
      link.outq.pop_front();
    }
  }
  return moved;
}

bool P2P::hasPending(const Link& link) const {
  if (!link.outq.empty() || !link.awaitingAck.empty() || !link.awaitingCts.empty() || !link.posted.empty() ||
      !link.cleared.empty() || link.target) {
    return true;
  }
  return std::any_of(link.stash.begin(), link.stash.end(), [](const auto& s) { return s->waiter != nullptr; });
}

// A peer's connection that closed is a failure only while something waits on that peer; a
// peer that shut down after its last message to us just leaves.
bool P2P::pumpIn(int peer, Link& link) {
  if (!link.in) return false;
  bool moved = pumpFrames(peer, link);
  std::string closed = link.in->closed();
  if (closed.empty()) return moved;
  if (hasPending(link)) throw CommFailedError(closed);
  link.in.reset();
  link.inPayload = false;
  link.frameGot = 0;
  link.stashTarget = nullptr;
  if (!link.stash.empty() && !link.stash.back()->complete) link.stash.pop_back();  // cut short
  return true;
}

bool P2P::pumpFrames(int peer, Link& link) {
  bool moved = false;
  for (;;) {
    if (!link.inPayload) {
      size_t n = link.in->read(reinterpret_cast<char*>(&link.frame) + link.frameGot, sizeof(Frame) - link.frameGot);
      if (n == 0) return moved;
      moved = true;
      link.lastActive = Clock::now();
      link.frameGot += n;
      if (link.frameGot < sizeof(Frame)) continue;
      link.frameGot = 0;
      onHeader(peer, link);
      if (!link.inPayload) continue;  // an ACK
    }
    if (link.left > 0) {
      size_t want = link.discarding ? std::min(link.left, link.scratch.size()) : link.left;
      size_t n = link.in->read(link.discarding ? link.scratch.data() : link.dest, want);
      if (n == 0) return moved;
      moved = true;
      link.lastActive = Clock::now();
      if (!link.discarding) link.dest += n;
      link.left -= n;
      if (link.target) link.target->last = Clock::now();
      if (link.left > 0) continue;
    }
    link.inPayload = false;
    onPayloadDone(peer, link);
  }
}

namespace {
std::string sizeText(const std::string& what, uint64_t bytes) {
  return what + " (" + std::to_string(bytes) + " bytes)";
}
}  // namespace

void P2P::onHeader(int peer, Link& link) {
  const Frame& f = link.frame;
  if (f.magic != kFrameMagic) {
    throw CommFailedError("the stream from rank " + std::to_string(peer) +
                          " carried bytes that are not a torchring message (a corrupted stream)");
  }
  if (f.type == kCts) {  // the peer posted the recv for a large message: send the payload
    auto it = link.awaitingCts.find(f.id);
    if (it == link.awaitingCts.end()) {
      throw CommFailedError("rank " + std::to_string(peer) + " cleared a message this rank never announced");
    }
    OutItem item;
    item.frame.type = kPayload;
    item.frame.tag = it->second->tag;
    item.frame.id = f.id;
    item.frame.bytes = it->second->bytes;
    item.payload = it->second->data;
    item.total = sizeof(Frame) + it->second->bytes;
    item.send = it->second;
    item.send->last = Clock::now();
    link.awaitingCts.erase(it);
    link.outq.push_back(std::move(item));
    return;
  }
  if (f.type == kPayload) {  // a large message this rank cleared: straight into its recv
    auto it = link.cleared.find(f.id);
    if (it == link.cleared.end()) {
      throw CommFailedError("rank " + std::to_string(peer) + " sent a payload this rank never cleared");
    }
    link.target = it->second;
    link.cleared.erase(it);
    link.inPayload = true;
    link.left = f.bytes;
    link.dest = link.target->data;
    return;
  }
  if (f.type == kAck) {
    auto& waiting = link.awaitingAck.count(f.id) ? link.awaitingAck : link.awaitingCts;  // CTS: a refused RTS
    auto it = waiting.find(f.id);
    std::shared_ptr<Pending> op;
    if (it != waiting.end()) {
      op = it->second;
      waiting.erase(it);
    } else {  // a refusal while the message is still being written: it is finished, then dropped
      for (auto& item : link.outq) {
        if (item.send && item.frame.type == kData && item.frame.id == f.id && !f.ok) {
          op = std::move(item.send);
          item.keep = op->keep;  // its payload stays alive until written
          break;
        }
      }
      if (!op) throw CommFailedError("rank " + std::to_string(peer) + " acknowledged a message this rank never sent");
    }
    --active_;
    if (f.ok) {
      finishOk(op->work, {});
    } else {
      std::string theirs(f.what, strnlen(f.what, sizeof(f.what)));
      op->work->finish({}, std::make_exception_ptr(MismatchError(
                               rankText() + ": " + describe(*op) + " is " + std::to_string(op->bytes) +
                               " bytes but rank " + std::to_string(peer) + "'s matching recv expected " +
                               sizeText(theirs, f.bytes) +
                               "; a send and its recv (same peers, same tag, in order) must have the same size. "
                               "The message was dropped on both ranks; the communicator stays usable")));
    }
    return;
  }
  std::shared_ptr<Pending> recv;
  for (auto it = link.posted.begin(); it != link.posted.end(); ++it) {
    if ((*it)->tag == f.tag) {
      recv = *it;
      link.posted.erase(it);
      break;
    }
  }
  if (f.type == kRts) {  // no payload follows: clear it now, or keep it for a later recv
    auto announced = std::make_unique<Stashed>();
    announced->frame = f;
    announced->complete = true;
    if (recv) {
      deliver(peer, link, *announced, recv);
    } else {
      link.stash.push_back(std::move(announced));
    }
    return;
  }
  link.inPayload = true;
  link.left = f.bytes;
  if (!recv) {
    auto stashed = std::make_unique<Stashed>();
    stashed->frame = f;
    stashed->payload.resize(f.bytes);
    link.dest = stashed->payload.data();
    link.stashTarget = stashed.get();
    link.stash.push_back(std::move(stashed));
    return;
  }
  if (recv->bytes == f.bytes) {
    link.target = recv;
    link.dest = recv->data;
    return;
  }
  link.discarding = true;  // a size mismatch: drop the payload, fail both sides
  link.scratch.resize(64 << 10);
  Stashed dropped;
  dropped.frame = f;
  dropped.complete = true;
  deliver(peer, link, dropped, recv);
}

void P2P::onPayloadDone(int peer, Link& link) {
  link.discarding = false;
  if (link.target) {
    auto recv = std::move(link.target);
    link.target = nullptr;
    ack(link, link.frame.id, true, recv.get());
    std::exception_ptr lost = pumpNow(peer, link);  // the ACK leaves before the caller learns
    --active_;
    finishOk(recv->work, recv->keep);  // it has its data, whatever happens to the ACK
    if (lost) std::rethrow_exception(lost);
  } else if (link.stashTarget) {
    Stashed* stashed = link.stashTarget;
    link.stashTarget = nullptr;
    stashed->complete = true;
    if (stashed->waiter) deliver(peer, link, *stashed, stashed->waiter);
  }
}

// Hands a complete message to `recv` (or fails both sides when the sizes differ) and, when
// it came from the stash, removes it there.
void P2P::deliver(int peer, Link& link, Stashed& stashed, const std::shared_ptr<Pending>& recv) {
  auto keepRecv = recv;  // `recv` may be stashed.waiter, released below
  const Frame f = stashed.frame;
  const bool ok = f.bytes == keepRecv->bytes;
  if (ok && f.type == kRts) {  // a large message: clear it, its payload comes straight in
    auto it = std::find_if(link.stash.begin(), link.stash.end(), [&](const auto& s) { return s.get() == &stashed; });
    if (it != link.stash.end()) link.stash.erase(it);
    link.cleared[f.id] = keepRecv;
    keepRecv->last = Clock::now();
    OutItem item;
    item.frame.type = kCts;
    item.frame.tag = f.tag;
    item.frame.id = f.id;
    control(link, std::move(item));
    if (std::exception_ptr lost = pumpNow(peer, link)) std::rethrow_exception(lost);  // the recv is in `cleared`
    return;
  }
  if (ok && f.bytes > 0 && !stashed.payload.empty()) std::memcpy(keepRecv->data, stashed.payload.data(), f.bytes);
  ack(link, f.id, ok, keepRecv.get());
  std::exception_ptr lost = pumpNow(peer, link);  // the ACK leaves before the caller learns
  --active_;
  const uint64_t sentBytes = f.bytes;
  const std::string sentWhat(f.what, strnlen(f.what, sizeof(f.what)));
  auto it = std::find_if(link.stash.begin(), link.stash.end(), [&](const auto& s) { return s.get() == &stashed; });
  if (it != link.stash.end()) link.stash.erase(it);
  if (ok) {
    finishOk(keepRecv->work, keepRecv->keep);
    if (lost) std::rethrow_exception(lost);
    return;
  }
  keepRecv->work->finish({}, std::make_exception_ptr(MismatchError(
                                  rankText() + ": " + describe(*keepRecv) + " is " +
                                 std::to_string(keepRecv->bytes) + " bytes but rank " + std::to_string(peer) +
                                 " sent " + sizeText(sentWhat, sentBytes) +
                                 "; a send and its recv (same peers, same tag, in order) must have the same size. "
                                 "The message was dropped on both ranks; the communicator stays usable")));
  if (lost) std::rethrow_exception(lost);
}

// Writes what `link` has queued now; a failure is returned (to be rethrown once the caller
// finished the operation it holds), not thrown.
std::exception_ptr P2P::pumpNow(int peer, Link& link) {
  try {
    pumpOut(peer, link);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

void P2P::ack(Link& link, uint64_t id, bool ok, const Pending* recv) {
  OutItem item;
  item.frame.type = kAck;
  item.frame.tag = recv->tag;
  item.frame.id = id;
  item.frame.bytes = recv->bytes;
  item.frame.ok = ok ? 1 : 0;
  std::strncpy(item.frame.what, recv->what.c_str(), sizeof(item.frame.what) - 1);
  control(link, std::move(item));
}

// Queues an ACK or CTS ahead of messages not started yet (behind the one being written and
// earlier control frames): a long message must not delay the answer a peer waits for.
void P2P::control(Link& link, OutItem item) {
  item.total = sizeof(Frame);
  auto at = link.outq.begin();
  if (at != link.outq.end() && at->offset > 0) ++at;
  while (at != link.outq.end() && !at->send) ++at;
  link.outq.insert(at, std::move(item));
}

// New connections wait in intros_ until their introduction arrived (read without blocking,
// so a silent client cannot stall the progress thread); one that says nothing for 5 s is
// dropped.
bool P2P::acceptPeers() {
  if (listenFd_ < 0) return false;
  bool any = false;
  for (int fd; (fd = p2pstream::tcpAcceptRaw(listenFd_)) >= 0;) intros_.push_back({fd, Clock::now(), {}, 0});
  for (size_t i = 0; i < intros_.size();) {
    Intro& intro = intros_[i];
    int from = -1;
    std::string refused;
    int state = p2pstream::readIntro(intro.fd, intro.bytes, &intro.got, opt_.rank, opt_.size, opt_.secret, &from,
                                     &refused);
    if (state == 0 && secondsSince(intro.start) > 5.0) {
      state = -1;
      refused = "it sent no complete introduction within 5 s";
    }
    if (state == 0) {
      ++i;
      continue;
    }
    int fd = intro.fd;
    intros_.erase(intros_.begin() + static_cast<long>(i));
    if (state < 0) {
      warn(rankText() + ": refused a point-to-point connection: " + refused);
      ::close(fd);
      continue;
    }
    auto& slot = links_[from];
    if (!slot) slot = std::make_unique<Link>();
    if (slot->in || sameHost(from)) {
      warn(rankText() + ": refused a second point-to-point connection from rank " + std::to_string(from));
      ::close(fd);
      continue;
    }
    slot->in = p2pstream::tcpIn(fd, "rank " + std::to_string(from));
    any = true;
  }
  return any;
}

// An operation that made no progress for the timeout fails the communicator, naming it.
void P2P::checkDeadlines() {
  const double limit = opt_.timeoutSec;
  // An operation is late when neither it nor its link moved a byte for the timeout: one
  // queued behind a long transfer on the same link is waiting, not stuck.
  Link* current = nullptr;
  auto late = [&](const std::shared_ptr<Pending>& op) {
    return op && secondsSince(std::max(op->last, current->lastActive)) > limit;
  };
  char seconds[32];
  std::snprintf(seconds, sizeof(seconds), "%g", limit);
  const std::string within = std::string(" within ") + seconds + " s";
  for (int peer = 0; peer < opt_.size; ++peer) {
    if (!links_[peer]) continue;
    Link& link = *links_[peer];
    current = &link;
    const std::string p = "rank " + std::to_string(peer);
    for (auto& item : link.outq) {
      if (late(item.send)) {
        failAll(rankText() + ": " + describe(*item.send) + " could not be delivered" + within + ": " + p +
                    " is not reading its messages (stuck in a long computation, or dead)",
                true, false);
        return;
      }
    }
    std::vector<std::shared_ptr<Pending>> sent;
    for (auto& [id, op] : link.awaitingAck) sent.push_back(op);
    for (auto& [id, op] : link.awaitingCts) sent.push_back(op);
    for (auto& op : sent) {
      if (late(op)) {
        failAll(rankText() + ": " + describe(*op) + " was not received" + within + ": " + p +
                    (op->tag >= 0 ? " posted no matching recv(src=" + std::to_string(opt_.rank) + ", tag=" +
                                        std::to_string(op->tag) + ")"
                                  : " did not run that collective") +
                    ", or it is stuck or dead",
                true, false);
        return;
      }
    }
    if (link.hungUp && hasPending(link) && secondsSince(link.hungUpAt) > 1.0) {
      failAll(rankText() + ": point-to-point transfers with " + p + " failed: the connection to " + p +
                  " closed (it died or shut down) before they completed",
              true, false);
      return;
    }
    if (link.shm && hasPending(link)) {  // a dead local peer or an aborted host: at once
      std::string trouble = shm_->peerTrouble(opt_.rankLocal[peer]);
      if (!trouble.empty()) {
        failAll(rankText() + ": point-to-point transfers with " + p + " failed: " + trouble, true, false);
        return;
      }
    }
    std::vector<std::shared_ptr<Pending>> recvs(link.posted.begin(), link.posted.end());
    for (auto& [id, op] : link.cleared) recvs.push_back(op);
    for (auto& s : link.stash) recvs.push_back(s->waiter);
    recvs.push_back(link.target);
    for (auto& op : recvs) {
      if (late(op)) {
        failAll(rankText() + ": " + describe(*op) + " got no message" + within + ": " + p +
                    (op->tag >= 0 ? " sent nothing with tag " + std::to_string(op->tag)
                                  : " did not run that collective") +
                    ", or it is stuck or dead",
                true, false);
        return;
      }
    }
  }
}

void P2P::failAll(const std::string& message, bool notify, bool shuttingDown) {
  std::vector<std::shared_ptr<Pending>> ops;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_.empty() && !shuttingDown) failure_ = message;
    ops.assign(incoming_.begin(), incoming_.end());
    incoming_.clear();
  }
  for (auto& slot : links_) {
    if (!slot) continue;
    for (auto& item : slot->outq) ops.push_back(item.send);
    for (auto& [id, op] : slot->awaitingAck) ops.push_back(op);
    for (auto& [id, op] : slot->awaitingCts) ops.push_back(op);
    for (auto& [id, op] : slot->cleared) ops.push_back(op);
    for (auto& op : slot->posted) ops.push_back(op);
    for (auto& s : slot->stash) ops.push_back(s->waiter);
    ops.push_back(slot->target);
    slot.reset();  // its streams are mid-frame now: nothing more goes over them
  }
  active_ = 0;
  // The communicator records the failure before any caller wakes up, so the caller's next
  // operation already sees it.
  if (notify && onFailure_ && !notified_) {
    notified_ = true;
    onFailure_(message);
  }
  for (auto& op : ops) {
    if (!op || op->work->isCompleted()) continue;
    std::exception_ptr error =
        shuttingDown ? std::make_exception_ptr(TorchringError(
                           rankText() + ": " + describe(*op) +
                           " was not completed: torchring.shutdown() (or the group's destroy()) was called first"))
                     : std::make_exception_ptr(CommFailedError(failedText(*op, message) + "; " + kRecoveryHint));
    op->work->finish({}, error);
  }
}

// The cause, prefixed with the operation unless the cause is about that very operation.
std::string P2P::failedText(const Pending& op, const std::string& cause) const {
  const std::string what = describe(op);
  if (cause.find(what) != std::string::npos) return cause;
  const std::string me = rankText() + ": ";
  return me + what + " failed: " + (cause.rfind(me, 0) == 0 ? cause.substr(me.size()) : cause);
}

void P2P::fail(const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_.empty()) return;
    failure_ = message;
    uint64_t one = 1;
    if (wakeFd_ >= 0) (void)!::write(wakeFd_, &one, sizeof(one));
  }
}

void P2P::loop() {
  int idle = 0;
  auto lastCheck = Clock::now();
  std::vector<pollfd> fds;
  for (;;) {
    std::deque<std::shared_ptr<Pending>> fresh;
    std::string failure;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
      fresh.swap(incoming_);
      failure = failure_;
    }
    if (!failure.empty()) {  // failed elsewhere (or by us): nothing more moves
      {  // failAll() fails them with the rest
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto& op : fresh) incoming_.push_back(op);
      }
      failAll(failure, false, false);
      fresh.clear();
    }
    bool moved = !fresh.empty();
    size_t adopted = 0;
    try {
      for (; adopted < fresh.size(); ++adopted) adopt(fresh[adopted]);
      moved |= acceptPeers();
      for (int peer = 0; peer < opt_.size; ++peer) {
        if (links_[peer]) moved |= pumpOut(peer, *links_[peer]);
        if (links_[peer]) moved |= pumpIn(peer, *links_[peer]);
      }
      if (secondsSince(lastCheck) > 0.05) {
        lastCheck = Clock::now();
        if (active_ > 0) checkDeadlines();
      }
    } catch (const std::exception& e) {
      {  // operations not adopted yet are failed with the rest (a finished one is skipped)
        std::lock_guard<std::mutex> lock(mutex_);
        for (size_t i = adopted; i < fresh.size(); ++i) incoming_.push_back(fresh[i]);
      }
      std::string what = e.what();
      failAll(what.rfind("rank ", 0) == 0 ? what : rankText() + ": " + what, true, false);
      continue;
    }
    if (moved) {
      idle = 0;
      continue;
    }
    bool shmBusy = false, tcpBusy = false;
    fds.clear();
    fds.push_back({wakeFd_, POLLIN, 0});
    if (listenFd_ >= 0) fds.push_back({listenFd_, POLLIN, 0});
    for (auto& intro : intros_) fds.push_back({intro.fd, POLLIN, 0});
    for (auto& slot : links_) {
      if (!slot) continue;
      if (slot->shm) {
        shmBusy |= active_ > 0 && (hasPending(*slot) || !slot->stash.empty() || slot->inPayload);
        continue;
      }
      tcpBusy |= active_ > 0 && hasPending(*slot);
      if (slot->in) fds.push_back({slot->in->fd(), POLLIN, 0});
      if (slot->out) fds.push_back({slot->out->fd(), static_cast<short>(POLLRDHUP | (slot->outq.empty() ? 0 : POLLOUT)), 0});
    }
    // A peer's answer is near: poll a while before sleeping (a wake-up from ppoll costs more
    // than the answer takes, through shared memory or a socket).
    if ((shmBusy || tcpBusy) && ++idle < spinRounds_) {
      cpuRelax();
      continue;
    }
    // Shared memory pending: 50 us naps, 1 ms once nothing moved for ~10 ms.
    timespec wait{0, shmBusy ? (idle - spinRounds_ < 200 ? 50000L : 1000000L) : (active_ > 0 ? 20000000L : 200000000L)};
    if (ppoll(fds.data(), fds.size(), &wait, nullptr) > 0) {
      if (fds[0].revents & POLLIN) {
        uint64_t drained;
        (void)!::read(wakeFd_, &drained, sizeof(drained));
      }
      checkPeers(fds);
    }
  }
}

// A connection this rank sends on never carries data back, so a peer that died or shut down
// shows as a hang-up there. Its ACKs travel on the other connection and may still be on
// their way, so the stream is only dropped here; messages still pending with that peer fail
// a second later (checkDeadlines), and a later send to it fails instead of reconnecting.
void P2P::checkPeers(const std::vector<pollfd>& fds) {
  for (int peer = 0; peer < opt_.size; ++peer) {
    auto& slot = links_[peer];
    if (!slot || slot->shm || !slot->out) continue;
    auto it = std::find_if(fds.begin(), fds.end(), [&](const pollfd& p) { return p.fd == slot->out->fd(); });
    if (it == fds.end() || !(it->revents & (POLLRDHUP | POLLHUP | POLLERR))) continue;
    slot->out.reset();
    slot->hungUp = true;
    slot->hungUpAt = Clock::now();
  }
}

// At shutdown: ACKs still queued (a stream was full when the recv completed) go out for up
// to a second over streams already open, so a peer's last send does not fail for want of them.
void P2P::flushAcks() {
  const auto start = Clock::now();
  for (;;) {
    bool waiting = false;
    for (int peer = 0; peer < opt_.size; ++peer) {
      auto& slot = links_[peer];
      if (!slot || !slot->out) continue;
      // Messages not started yet are dropped (their sends fail below); the rest is finished.
      auto& q = slot->outq;
      auto unstarted = std::stable_partition(q.begin() + (q.empty() || q.front().offset == 0 ? 0 : 1), q.end(),
                                             [](const OutItem& item) { return item.send == nullptr; });
      for (auto it = unstarted; it != q.end(); ++it) {
        it->send->work->finish({}, std::make_exception_ptr(TorchringError(
                                       rankText() + ": " + describe(*it->send) +
                                       " was not sent: torchring.shutdown() (or the group's destroy()) was called first")));
      }
      q.erase(unstarted, q.end());
      if (q.empty()) continue;
      try {
        pumpOut(peer, *slot);
      } catch (const std::exception&) {
        q.clear();  // the peer is gone: nobody to tell
      }
      waiting |= !q.empty();
    }
    if (!waiting || secondsSince(start) > 1.0) return;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void P2P::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  uint64_t one = 1;
  if (wakeFd_ >= 0) (void)!::write(wakeFd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  flushAcks();
  failAll("", false, true);
  std::lock_guard<std::mutex> lock(mutex_);
  for (int* fd : {&listenFd_, &wakeFd_}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
  for (auto& intro : intros_) ::close(intro.fd);
  intros_.clear();
}

}  // namespace torchring
