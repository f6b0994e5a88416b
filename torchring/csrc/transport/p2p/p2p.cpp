// Point-to-point messages: posting, the progress thread's loop, deadlines, failures and
// shutdown (p2p.h explains the design; frames.cpp is what the loop does with one link,
// link.h the frames and links, stream.cpp the streams).
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
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "transport/p2p/link.h"
#include "transport/shm/group.h"

namespace torchring {
using namespace p2pwire;

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
  op->anySource = !isSend && peer == kAnySource;
  op->peer = peer;
  op->tag = tag;
  op->data = data;
  op->bytes = bytes;
  op->what = what;
  op->keep = std::move(keep);
  std::unique_lock<std::mutex> lock(mutex_);
  op->work = std::make_shared<CpuWork>(isSend ? OpKind::SEND : OpKind::RECV, nextSeq_++, opt_.rank);
  op->work->setContext(opt_.label);
  if (!isSend && !op->anySource) op->work->setSource(peer);
  auto work = op->work;
  if (!failure_.empty() || stopping_) {
    std::exception_ptr error =
        stopping_ ? std::make_exception_ptr(TorchringError(rankText() + ": " + describe(*op) +
                                                           ": torchring was shut down; call " +
                                                           kInitCall.torchring + " first"))
                  : std::make_exception_ptr(CommFailedError(rankText() + ": " + describe(*op) +
                                                            " was not run because the communicator failed earlier: " +
                                                            failure_, kRecoveryHint));
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
  if (op.anySource) {
    const std::string from = op.peer == kAnySource ? "any source" : "any source, matched rank " + std::to_string(op.peer);
    return "recv from " + from + " (tag " + std::to_string(op.tag) + ", " + op.what + ")";
  }
  if (op.tag < 0) {  // a collective's transfer: `what` names the collective
    return op.what + (op.isSend ? ", its transfer to rank " : ", its transfer from rank ") + std::to_string(op.peer);
  }
  return std::string(op.isSend ? "send to rank " : "recv from rank ") + std::to_string(op.peer) + " (tag " +
         std::to_string(op.tag) + ", " + op.what + ")";
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
  for (auto& op : anyPosted_) {  // no peer yet: late when nothing arrived for it
    if (secondsSince(op->last) > limit) {
      failAll(rankText() + ": " + describe(*op) + " got no message" + within + ": no rank sent one with tag " +
                  std::to_string(op->tag) + ", or the senders are stuck or dead",
              true, false);
      return;
    }
  }
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
      // A departed peer's last messages are read within a second of its leaving, as a TCP
      // peer's after it hung up.
      if (shm_->departed(opt_.rankLocal[peer]) && secondsSince(link.lastActive) > 1.0) {
        failAll(rankText() + ": point-to-point transfers with " + p + " failed: Connection closed by peer: " + p +
                    " (same host) shut its communicator down before they completed",
                true, false);
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
  ops.insert(ops.end(), anyPosted_.begin(), anyPosted_.end());
  anyPosted_.clear();
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
                           rankText() + ": " + describe(*op) + " was not completed: " + kShutdownCall.torchring +
                           " (or the group's destroy()) was called first"))
                     : std::make_exception_ptr(CommFailedError(failedText(*op, message), kRecoveryHint));
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
    // A recv from any source waits on every stream: poll them all as for a pending transfer.
    const bool anyWaiting = active_ > 0 && !anyPosted_.empty();
    bool shmBusy = false, tcpBusy = anyWaiting;
    fds.clear();
    fds.push_back({wakeFd_, POLLIN, 0});
    if (listenFd_ >= 0) fds.push_back({listenFd_, POLLIN, 0});
    for (auto& intro : intros_) fds.push_back({intro.fd, POLLIN, 0});
    for (auto& slot : links_) {
      if (!slot) continue;
      if (slot->shm) {
        shmBusy |= active_ > 0 && (hasPending(*slot) || !slot->stash.empty() || slot->inPayload || anyWaiting);
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
                                       rankText() + ": " + describe(*it->send) + " was not sent: " +
                                       kShutdownCall.torchring + " (or the group's destroy()) was called first")));
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
