// The leaders' TCP links (links.h): connecting to every partner, the exchange loop every
// algorithm moves its bytes with, failures, and measuring the links for the cost model.
#include "transport/tcp/links.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>

#include "core/reduce.h"
#include "transport/tcp/socket.h"

namespace torchring {
namespace {

using namespace tcpsocket;

// What the leaders' connections speak (socket.h): its magic differs from point-to-point's.
constexpr Protocol kLinkProtocol{{'T', 'R', 'I', 'N', 'G', '0', '0', '2'}, "the torchring protocol"};
constexpr double kHelloTimeout = 5.0;  // a connecting peer must say hello within this

}  // namespace

TcpLinks::TcpLinks(TcpOptions options)
    : opt_(std::move(options)), links_(opt_.memberRanks.size()), waits_(static_cast<int>(opt_.memberRanks.size())) {}

TcpLinks::~TcpLinks() { close(); }

void TcpLinks::close() {
  if (listenFd_ >= 0) ::close(listenFd_);
  listenFd_ = -1;
  for (Link& link : links_) {
    if (link.fd >= 0) {
      ::shutdown(link.fd, SHUT_RDWR);
      ::close(link.fd);
    }
    link.fd = -1;
  }
}

void TcpLinks::interrupt() {
  for (const Link& link : links_) {
    if (link.fd >= 0) ::shutdown(link.fd, SHUT_RDWR);
  }
}

int TcpLinks::listen(const std::string& bindAddr) {
  int port = -1;
  listenFd_ = listenOn(bindAddr, "rank " + std::to_string(opt_.rank), "", &port);
  return port;
}

std::string TcpLinks::describe(int member) const {
  if (member >= 0 && member < members() && !links_[member].desc.empty()) return links_[member].desc;
  return "rank " + std::to_string(member >= 0 && member < members() ? opt_.memberRanks[member] : -1) +
         " (leader of host " + std::to_string(member) + ")";
}

// Takes one waiting connection: it must say a valid hello from the leader of a higher
// partner not yet connected.
bool TcpLinks::acceptOne(double remaining) {
  pollfd pfd{listenFd_, POLLIN, 0};
  int rc = poll(&pfd, 1, static_cast<int>(std::max(1.0, remaining * 1000)));
  if (rc <= 0) return false;
  int fd = acceptWaiting(listenFd_, false);
  if (fd < 0) return false;
  setTimeouts(fd, std::min(kHelloTimeout, std::max(0.001, remaining)));
  Hello hello{};
  std::string reason = readAll(fd, &hello, sizeof(hello)) ? refusal(hello, kLinkProtocol, opt_.secret)
                                                          : "it sent no complete handshake";
  const auto from = std::find(opt_.memberRanks.begin(), opt_.memberRanks.end(), hello.fromRank);
  const int member = from == opt_.memberRanks.end() ? -1 : static_cast<int>(from - opt_.memberRanks.begin());
  if (reason.empty() && (member <= opt_.member || hello.toRank != opt_.rank || links_[member].fd >= 0)) {
    reason = "it claims to be rank " + std::to_string(hello.fromRank) + " connecting to rank " +
             std::to_string(hello.toRank) + ", not a host leader that connects to this one";
  }
  if (reason.empty()) {
    const auto partners = partnersOf(members(), opt_.member);
    if (!std::binary_search(partners.begin(), partners.end(), member)) {
      reason = "rank " + std::to_string(hello.fromRank) + " (leader of host " + std::to_string(member) +
               ") is not a partner of this host in any schedule";
    }
  }
  if (!reason.empty()) {
    warn("rank " + std::to_string(opt_.rank) + ": refused connection from " + peerName(fd) + ": " + reason);
    ::close(fd);
    return false;
  }
  char ack = 'K';
  if (!writeAll(fd, &ack, 1)) {
    ::close(fd);
    return false;
  }
  links_[member].fd = fd;
  links_[member].desc = "rank " + std::to_string(hello.fromRank) + " (leader of host " + std::to_string(member) +
                        ", " + peerName(fd) + ")";
  return true;
}

// Every member dials its lower partners and sends their hellos (the kernel queues both even
// before the partner accepts), then accepts its higher partners, then reads the lower ones'
// answers: nobody waits on a partner that is itself waiting.
void TcpLinks::connect(const std::vector<std::string>& addrs, const std::vector<int>& ports) {
  const auto start = Clock::now();
  auto remaining = [&] { return opt_.timeoutSec - secondsSince(start); };
  const auto partners = partnersOf(members(), opt_.member);
  int expected = 0;
  for (int m : partners) {
    if (m > opt_.member) {
      ++expected;
      continue;
    }
    links_[m].desc = "rank " + std::to_string(opt_.memberRanks[m]) + " (leader of host " + std::to_string(m) +
                     ", " + addrs[m] + ":" + std::to_string(ports[m]) + ")";
    Dial dial;
    dial.timeoutSec = std::max(0.001, remaining());
    Dialed dialed = connectWithin(addrs[m], ports[m], dial);
    if (dialed.unresolved) fail("cannot resolve the address of", m);
    if (dialed.socketFailed) fail("socket() failed (" + dialed.error + ") connecting to", m);
    if (dialed.fd < 0) fail("cannot connect (" + dialed.error + ") to", m);
    links_[m].fd = dialed.fd;
    setNonBlocking(dialed.fd, false);
    setTimeouts(dialed.fd, std::max(0.001, remaining()));
    if (!sendHello(dialed.fd, kLinkProtocol, opt_.secret, opt_.rank, opt_.memberRanks[m])) {
      fail("cannot send the handshake to", m);
    }
  }
  for (int accepted = 0; accepted < expected;) {
    if (remaining() <= 0) {
      int missing = -1;
      for (int m : partners) {
        if (m > opt_.member && links_[m].fd < 0) missing = m;
      }
      fail("timed out during connection setup waiting for", missing);
    }
    if (acceptOne(remaining())) ++accepted;
  }
  ::close(listenFd_);
  listenFd_ = -1;
  for (int m : partners) {
    if (m > opt_.member) continue;
    char ack = 0;
    setTimeouts(links_[m].fd, std::max(0.001, remaining()));
    if (!readAll(links_[m].fd, &ack, 1) || ack != 'K') {
      fail("the handshake was not accepted (different job secret?) by", m);
    }
  }
  for (int m : partners) {
    setNoDelay(links_[m].fd);
    setNonBlocking(links_[m].fd, true);
  }
}

void TcpLinks::fail(const std::string& why, int member, const std::string& advice) const {
  std::ostringstream msg;
  msg << "rank " << opt_.rank << " (this process): " << (hasOp_ ? op_.what() : "setup") << ": " << why << " "
      << describe(member);
  if (!advice.empty()) msg << "; " << advice;
  std::string text = msg.str();
  if (explain_ && member >= 0 && member < members()) text += explain_(opt_.memberRanks[member], text);
  throw CommFailedError(text);
}

// alpha: what one step of a log-depth schedule costs whatever its size (the wire's latency
// plus the wake-ups and calls on both ends, with every member busy at once): the median of 5
// blocks of 8 runs of the recursive doubling schedule (schedule/schedule.h, with its fold)
// with 8-byte messages, after one run, per run and divided by the longest member's step
// count. beta: rounds in which every member sends 1 MiB to its right neighbour and receives
// 1 MiB from its left one: one round to warm the connections (a fresh connection's window and
// receive buffer grow over its first megabytes), then the faster of two blocks of four rounds,
// per round, less alpha, per byte. Each block starts with a run of the doubling schedule, which
// lines the members up: members of a ring drift apart by up to members - 1 rounds (each needs
// only its left neighbour's data), and a member whose neighbour is ahead finds megabytes
// already in its socket and times the link faster than it is. (One block of two rounds read
// 0.77-0.96 of a shaped link's rate: the connections still grew.) The probe's waits are no
// operation's: measure() leaves the wait ledger as it found it (empty).
LinkCost TcpLinks::measure() {
  LinkCost cost;
  if (members() < 2) return cost;
  const int right = (opt_.member + 1) % members(), left = (opt_.member + members() - 1) % members();
  // Runs `steps` group by group (a plain step is a group of one), every transfer one 8-byte
  // message whatever the ranges say.
  char out[8] = {}, in[8];
  std::vector<std::vector<Span>> spans;
  auto tiny = [&](const std::vector<Step>& steps) {
    for (size_t first = 0; first < steps.size();) {
      const size_t end = groupEnd(steps, first);
      spans.assign(2 * (end - first), {});
      std::vector<Stream> streams;
      for (size_t i = first; i < end; ++i) {
        std::vector<Span>& send = spans[2 * (i - first)];
        std::vector<Span>& recv = spans[2 * (i - first) + 1];
        if (steps[i].sendTo >= 0) send.push_back({out, sizeof(out)});
        if (steps[i].recvFrom >= 0) recv.push_back({in, sizeof(in)});
        streams.push_back({steps[i].sendTo, true, &send, nullptr, nullptr});
        streams.push_back({steps[i].recvFrom, false, &recv, nullptr, nullptr});
      }
      exchangeStreams(streams);
      first = end;
    }
  };
  // Blocks of runs, not single runs: members that start a run apart by more than a step
  // settle into runs that alternately take no time (the partner's message is already there)
  // and two steps (it waits a round trip), so a single run's time says little; a block of an
  // even number of runs takes what the runs take on average. The median block, per run.
  auto perRun = [](const std::function<void()>& run) {
    run();
    constexpr int kBlocks = 5, kRunsPerBlock = 8;
    std::vector<double> blocks;
    for (int b = 0; b < kBlocks; ++b) {
      const auto t0 = Clock::now();
      for (int i = 0; i < kRunsPerBlock; ++i) run();
      blocks.push_back(secondsSince(t0) / kRunsPerBlock);
    }
    std::nth_element(blocks.begin(), blocks.begin() + kBlocks / 2, blocks.end());
    return blocks[kBlocks / 2];
  };
  const auto doubling = allreduceSchedule(Algo::Doubling, members(), opt_.member, 1).steps;
  cost.alpha = perRun([&] { tiny(doubling); }) / static_cast<double>(doublingSteps(members()));
  // alphaGroup: the same with Radix4's schedule, 8-byte messages (every transfer of a group at
  // once), per group of three once its plain steps (the fold, a radix-2 level) are taken out at
  // alpha. Without a radix-4 level (fewer than 4 members) there is no group to measure.
  int groups = 0, plain = members() > powerOfTwoBelow(members()) ? 2 : 0;
  for (const auto& [shift, radix] : radixLevels(members())) (radix > 2 ? groups : plain) += 2;
  if (groups > 0) {
    const auto radix4 = allreduceSchedule(Algo::Radix4, members(), opt_.member, 1).steps;
    cost.alphaGroup = std::max(1e-9, (perRun([&] { tiny(radix4); }) - plain * cost.alpha) / groups);
  }
  // beta's rounds, after tiny(doubling) has brought every member to the block's start within
  // about a step of the others: none can have a round's megabyte on its way before that.
  auto perRound = [&](size_t bytes) {
    std::vector<char> mine(bytes, 1), theirs(bytes);
    auto round = [&] { exchange(right, {{mine.data(), bytes}}, left, {{theirs.data(), bytes}}); };
    round();
    constexpr int kBlocks = 2, kRoundsPerBlock = 4;
    double best = 1e30;
    for (int b = 0; b < kBlocks; ++b) {
      tiny(doubling);
      const auto t0 = Clock::now();
      for (int i = 0; i < kRoundsPerBlock; ++i) round();
      best = std::min(best, secondsSince(t0) / kRoundsPerBlock);
    }
    return best;
  };
  constexpr size_t kProbe = 1 << 20;
  cost.beta = std::max(1e-12, (perRound(kProbe) - cost.alpha) / kProbe);
  // gamma: the fastest of five float32 sums of the probe's size on this host. A single sum
  // read 40-90 times the host's speed where more ranks than cores share the host (8 test hosts
  // on 2 cores): a rank descheduled in the middle of it times the others' turns, and the job
  // takes the largest figure of any leader.
  std::vector<float> a(kProbe / 4, 1.0f), b(kProbe / 4, 2.0f);
  const void* srcs[2] = {a.data(), b.data()};
  reduceInto(a.data(), nullptr, srcs, 2, a.size(), DType::F32, ReduceOp::SUM);  // warm the pages
  double fastest = 1e30;
  for (int i = 0; i < 5; ++i) {
    const auto r0 = Clock::now();
    reduceInto(a.data(), nullptr, srcs, 2, a.size(), DType::F32, ReduceOp::SUM);
    fastest = std::min(fastest, secondsSince(r0));
  }
  cost.gamma = std::max(1e-13, fastest / kProbe);
  waits_.clear();
  return cost;
}

// One loop moves every stream: send what may go, read what came, and when no stream moved a
// byte, poll for room to send and bytes to read; repeat until every stream is done or no
// byte moves for the timeout. Messages name the first unfinished receiving stream's member
// (else the first sending one's): the one this member waits on.
// How much one send() hands the kernel (`piece`): a long stream (streamBytes at least
// opt_.piecedStreamBytes: a ring of two from 8 MiB up) goes in pieces of
// opt_.sendPieceBytes; a shorter one in whatever the socket takes. Measured between two
// network-namespace hosts on 5 Gbit/s links (benchmarks/RESULTS.md, "Issue #15, fourth
// session"): unpieced, one 16 MiB allreduce handed the kernel about two sends of 2-4 MiB
// and more (the empty send buffer at the call's start), and under bbr the ring ran at
// 0.97-1.00 of gloo; pieced, 0.99-1.01. A likely cause, not proven: a send() copying MiBs
// holds the socket, the acknowledgements that arrive meanwhile wait in its backlog, and a
// bbr sender limited by its congestion window (`ss`: unacked = cwnd) cannot send until they
// are processed. Short streams stay whole: on an unshaped link pieces made 1-4 MiB
// allreduces slower (1 MiB 1.6-2.8x; twice the context switches per call: the reader
// sleeps between pieces).
void TcpLinks::exchange(int sendTo, const std::vector<Span>& send, int recvFrom, const std::vector<Span>& recv,
                        const std::function<void(size_t)>& onRecv,
                        const std::function<size_t()>& sendable) {
  exchangeStreams({{sendTo, true, &send, nullptr, sendable}, {recvFrom, false, &recv, onRecv, nullptr}});
}

void TcpLinks::exchangeStreams(const std::vector<Stream>& streams) {
  struct Position {
    int fd = -1;
    size_t idx = 0, off = 0, moved = 0, piece = SIZE_MAX;
  };
  const size_t n = streams.size();
  std::vector<Position> at(n);
  for (size_t i = 0; i < n; ++i) {
    const Stream& s = streams[i];
    if (s.spans->empty()) continue;
    if (s.member < 0 || s.member >= members() || links_[s.member].fd < 0) {
      fail("internal error: the schedule names a member this host has no connection to:", s.member);
    }
    at[i].fd = links_[s.member].fd;
    size_t streamBytes = 0;
    for (const Span& span : *s.spans) streamBytes += span.bytes;
    if (s.out && streamBytes >= opt_.piecedStreamBytes) at[i].piece = opt_.sendPieceBytes;
  }
  auto skipEmpty = [&](size_t i) {
    const std::vector<Span>& spans = *streams[i].spans;
    while (at[i].idx < spans.size() && at[i].off == spans[at[i].idx].bytes) {
      ++at[i].idx;
      at[i].off = 0;
    }
  };
  std::vector<size_t> allowed(n);
  std::vector<pollfd> fds;
  auto lastProgress = Clock::now();
  bool idle = false;  // try the sockets first: a send usually goes and data may be waiting
  for (;;) {
    int waitingOn = -1, sendingTo = -1;  // the members messages name
    bool active = false, receiving = false;
    for (size_t i = 0; i < n; ++i) {
      skipEmpty(i);
      allowed[i] = 0;
      if (at[i].idx >= streams[i].spans->size()) continue;
      active = true;
      const Stream& s = streams[i];
      if (!s.out) {
        receiving = true;
        if (waitingOn < 0) waitingOn = s.member;
        continue;
      }
      if (sendingTo < 0) sendingTo = s.member;
      // What may go now: the rest of this span, or less where the stream waits for received data.
      allowed[i] = std::min((*s.spans)[at[i].idx].bytes - at[i].off, at[i].piece);
      if (s.sendable) {
        const size_t limit = s.sendable();
        allowed[i] = std::min(allowed[i], limit > at[i].moved ? limit - at[i].moved : 0);
      }
    }
    if (!active) return;
    const int named = receiving ? waitingOn : sendingTo;
    if (!receiving) {
      for (size_t i = 0; i < n; ++i) {
        if (streams[i].out && at[i].idx < streams[i].spans->size() && allowed[i] == 0) {
          fail("internal error: the send stream waits for data, but nothing is left to receive from", named);
        }
      }
    }
    if (idle) {  // the last round moved nothing: wait until a socket can (or 100 ms)
      fds.clear();
      for (size_t i = 0; i < n; ++i) {
        const short events = streams[i].out ? (allowed[i] > 0 ? POLLOUT : 0)
                                            : (at[i].idx < streams[i].spans->size() ? POLLIN : 0);
        if (events == 0) continue;
        auto same = std::find_if(fds.begin(), fds.end(), [&](const pollfd& p) { return p.fd == at[i].fd; });
        if (same != fds.end()) {
          same->events |= events;  // one partner both ways: one socket
        } else {
          fds.push_back({at[i].fd, events, 0});
        }
      }
      TimedWait timed(waits_, named);
      int rc = poll(fds.data(), fds.size(), 100);
      // A slow link hides behind the socket's buffer: its sender hands its bytes over, moves on
      // and then waits for a partner that is itself waiting for those bytes. When this rank's
      // own bytes are still held back as the wait ends, the wait is its link's, no partner's.
      for (size_t i = 0; i < n; ++i) {
        if (streams[i].out && at[i].fd >= 0 && tcpsocket::sendHeldByLink(at[i].fd)) {
          timed.onOwnLink();
          break;
        }
      }
      if (rc < 0 && errno != EINTR) fail(std::string("poll failed: ") + std::strerror(errno), named);
    }
    bool progressed = false;
    for (size_t i = 0; i < n; ++i) {
      const Stream& s = streams[i];
      const std::vector<Span>& spans = *s.spans;
      Position& p = at[i];
      if (!s.out || allowed[i] == 0) continue;
      // The rest of this span and, when nothing limits the stream, the next few spans in one
      // call: a short header span goes in the same segment as the data after it, so the
      // receiver wakes once for both.
      iovec iov[8];
      int k = 0;
      iov[k++] = {spans[p.idx].data + p.off, allowed[i]};
      if (!s.sendable && allowed[i] == spans[p.idx].bytes - p.off) {
        size_t total = allowed[i];
        for (size_t j = p.idx + 1; j < spans.size() && k < 8 && total < p.piece; ++j) {
          const size_t len = std::min(spans[j].bytes, p.piece - total);
          if (len > 0) iov[k++] = {spans[j].data, len};
          total += len;
        }
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = k;
      ssize_t w = ::sendmsg(p.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w > 0) {
        p.moved += static_cast<size_t>(w);
        for (size_t left = static_cast<size_t>(w); left > 0;) {  // advance over the spans sent
          skipEmpty(i);
          const size_t take = std::min(left, spans[p.idx].bytes - p.off);
          p.off += take;
          left -= take;
        }
        progressed = true;
      } else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        fail(std::string(kLostFrom) + std::strerror(errno) + "; the peer failed or exited) to", s.member);
      }
    }
    for (size_t i = 0; i < n; ++i) {
      const Stream& s = streams[i];
      Position& p = at[i];
      if (s.out || p.idx >= s.spans->size()) continue;
      const Span& r = (*s.spans)[p.idx];
      ssize_t got = ::recv(p.fd, r.data + p.off, r.bytes - p.off, MSG_DONTWAIT);
      if (got > 0) {
        p.off += static_cast<size_t>(got);
        p.moved += static_cast<size_t>(got);
        progressed = true;
        if (s.onRecv) s.onRecv(p.moved);
      } else if (got == 0) {
        fail(kClosedBy, s.member);
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        fail(std::string(kLostFrom) + std::strerror(errno) + ") from", s.member);
      }
    }
    idle = !progressed;
    if (progressed) {
      lastProgress = Clock::now();
      if (onProgress_) onProgress_();
    } else if (news_ && secondsSince(lastProgress) > kNewsAfterSec) {
      // A partner that stopped may be stuck on a third rank that failed already (a silent
      // host's neighbour gave up first): the board says so, and every survivor then notices
      // within about a second of the first instead of each waiting out its own timeout.
      const std::string news = news_();
      if (!news.empty()) {
        throw CommFailedError("rank " + std::to_string(opt_.rank) + " (this process): " +
                              (hasOp_ ? op_.what() : std::string("setup")) + ": stopped waiting for " +
                              describe(named) + " because another rank failed: " + news);
      }
    }
    if (!progressed && secondsSince(lastProgress) > opt_.timeoutSec) {
      std::ostringstream why;
      why << "hit the " << opt_.timeoutSec << " s timeout with no progress "
          << (receiving ? "receiving from" : "sending to");
      fail(why.str(), named,
           std::string("it is stuck, stopped, or issued different collectives; ") + kRaiseTimeout.torchring +
               " if the work between collectives is that slow");
    }
  }
}

}  // namespace torchring
