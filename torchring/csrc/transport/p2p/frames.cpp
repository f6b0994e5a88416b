// What the progress thread does with one peer's Link (p2p.h explains the protocol, p2p.cpp
// the loop around this): adopting a posted send or recv, writing the queued frames, reading
// frames and matching them (DATA into a recv or the stash, RTS cleared by a CTS, PAYLOAD into
// the cleared recv, ACK completing a send), and queueing the answers.
#include <algorithm>
#include <cstring>

#include "transport/p2p/link.h"
#include "transport/shm/group.h"

namespace torchring {
using namespace p2pwire;

namespace {
void finishOk(const std::shared_ptr<CpuWork>& work, const at::Tensor& result) { work->finish(result, nullptr); }
}  // namespace

P2P::Link& P2P::linkTo(int peer) {
  auto& slot = links_[peer];
  if (!slot) {
    slot = std::make_unique<Link>();
    if (sameHost(peer)) {  // rings in the receiver's region: theirs for sending, ours for receiving
      const int me = opt_.rankLocal[opt_.rank], them = opt_.rankLocal[peer];
      slot->shm = true;
      slot->out = p2pstream::shmOut(shm_->p2pRing(them, me));
      slot->in = p2pstream::shmIn(shm_->p2pRing(me, them), "rank " + std::to_string(peer));
    }
  }
  return *slot;
}

void P2P::adopt(std::shared_ptr<Pending> op) {
  if (op->anySource) return adoptAnySource(std::move(op));
  Link& link = linkTo(op->peer);
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

// A recv from any source: the earliest arrived unclaimed message of its tag, from whichever
// peer, or it waits in anyPosted_ (and every local peer's ring is read from now on; a peer on
// another host connects when it first sends).
void P2P::adoptAnySource(std::shared_ptr<Pending> op) {
  ++active_;
  op->last = Clock::now();
  int from = -1;
  Stashed* oldest = nullptr;
  for (int peer = 0; peer < opt_.size; ++peer) {
    if (peer == opt_.rank) continue;
    if (sameHost(peer)) linkTo(peer);
    if (!links_[peer]) continue;
    for (auto& stashed : links_[peer]->stash) {  // a link's stash is in arrival order
      if (stashed->waiter || stashed->frame.tag != op->tag) continue;
      if (!oldest || stashed->arrival < oldest->arrival) {
        oldest = stashed.get();
        from = peer;
      }
      break;
    }
  }
  if (!oldest) {
    anyPosted_.push_back(std::move(op));
    return;
  }
  op->peer = from;
  op->work->setSource(from);
  oldest->waiter = op;
  if (oldest->complete) deliver(from, *links_[from], *oldest, op);
}

std::shared_ptr<P2P::Pending> P2P::takePosted(int peer, Link& link, int64_t tag) {
  auto mine = std::find_if(link.posted.begin(), link.posted.end(), [&](const auto& op) { return op->tag == tag; });
  auto any = std::find_if(anyPosted_.begin(), anyPosted_.end(), [&](const auto& op) { return op->tag == tag; });
  std::shared_ptr<Pending> recv;
  if (any != anyPosted_.end() && (mine == link.posted.end() || (*any)->work->seq() < (*mine)->work->seq())) {
    recv = *any;  // posted before this peer's own recv of the tag
    anyPosted_.erase(any);
    recv->peer = peer;
    recv->work->setSource(peer);
  } else if (mine != link.posted.end()) {
    recv = *mine;
    link.posted.erase(mine);
  }
  return recv;
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
  std::shared_ptr<Pending> recv = takePosted(peer, link, f.tag);
  if (f.type == kRts) {  // no payload follows: clear it now, or keep it for a later recv
    auto announced = std::make_unique<Stashed>();
    announced->frame = f;
    announced->arrival = arrivals_++;
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
    stashed->arrival = arrivals_++;
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


}  // namespace torchring
