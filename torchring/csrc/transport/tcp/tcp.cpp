#include "transport/tcp/tcp.h"

#include <poll.h>
#include <sys/socket.h>
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

// What the ring's connections speak (socket.h): its magic differs from point-to-point's.
constexpr Protocol kRingProtocol{{'T', 'R', 'I', 'N', 'G', '0', '0', '1'}, "the torchring protocol"};
constexpr double kHelloTimeout = 5.0;  // a connecting peer must say hello within this

}  // namespace

TcpRing::TcpRing(TcpOptions options) : opt_(std::move(options)) {}

TcpRing::~TcpRing() { close(); }

void TcpRing::close() {
  for (int* fd : {&listenFd_, &sendFd_, &recvFd_}) {
    if (*fd >= 0) {
      ::shutdown(*fd, SHUT_RDWR);
      ::close(*fd);
    }
    *fd = -1;
  }
}

void TcpRing::interrupt() {
  for (int fd : {sendFd_, recvFd_}) {
    if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
  }
}

int TcpRing::listen(const std::string& bindAddr) {
  int port = -1;
  listenFd_ = listenOn(bindAddr, "rank " + std::to_string(opt_.rank), "", &port);
  return port;
}

bool TcpRing::acceptOne(double remaining) {
  pollfd pfd{listenFd_, POLLIN, 0};
  int rc = poll(&pfd, 1, static_cast<int>(std::max(1.0, remaining * 1000)));
  if (rc <= 0) return false;
  int fd = acceptWaiting(listenFd_, false);
  if (fd < 0) return false;
  setTimeouts(fd, std::min(kHelloTimeout, std::max(0.001, remaining)));
  Hello hello{};
  std::string reason = readAll(fd, &hello, sizeof(hello)) ? refusal(hello, kRingProtocol, opt_.secret)
                                                          : "it sent no complete handshake";
  if (reason.empty() && (hello.fromRank != opt_.leftRank || hello.toRank != opt_.rank)) {
    reason = "it claims to be rank " + std::to_string(hello.fromRank) + " connecting to rank " +
             std::to_string(hello.toRank) + ", expected rank " + std::to_string(opt_.leftRank);
  }
  if (!reason.empty()) {
    warn("rank " + std::to_string(opt_.rank) + ": refused connection from " + peerName(fd) + ": " +
         reason);
    ::close(fd);
    return false;
  }
  char ack = 'K';
  if (!writeAll(fd, &ack, 1)) {
    ::close(fd);
    return false;
  }
  recvFd_ = fd;
  leftDesc_ = "rank " + std::to_string(opt_.leftRank) + " (left neighbour in the TCP ring, " +
              peerName(fd) + ")";
  return true;
}

void TcpRing::connect(const std::string& rightAddr, int rightPort) {
  const auto start = Clock::now();
  auto remaining = [&] { return opt_.timeoutSec - secondsSince(start); };
  rightDesc_ = "rank " + std::to_string(opt_.rightRank) + " (right neighbour in the TCP ring, " +
               rightAddr + ":" + std::to_string(rightPort) + ")";
  Dial dial;
  dial.timeoutSec = opt_.timeoutSec;
  Dialed dialed = connectWithin(rightAddr, rightPort, dial);
  if (dialed.unresolved) fail("cannot resolve the address of", false);
  if (dialed.socketFailed) fail("socket() failed (" + dialed.error + ") connecting to", false);
  if (dialed.fd < 0) fail("cannot connect (" + dialed.error + ") to", false);
  sendFd_ = dialed.fd;
  setNonBlocking(sendFd_, false);
  setTimeouts(sendFd_, std::max(0.001, remaining()));
  if (!sendHello(sendFd_, kRingProtocol, opt_.secret, opt_.rank, opt_.rightRank)) {
    fail("cannot send the handshake to", false);
  }
  // Accept the left neighbour before waiting for the right one's answer: every member
  // does the same, so nobody waits on a neighbour that is itself waiting.
  while (recvFd_ < 0) {
    if (remaining() <= 0) fail("timed out during connection setup waiting for", true);
    acceptOne(remaining());
  }
  ::close(listenFd_);
  listenFd_ = -1;
  char ack = 0;
  setTimeouts(sendFd_, std::max(0.001, remaining()));
  if (!readAll(sendFd_, &ack, 1) || ack != 'K') {
    fail("the handshake was not accepted (different job secret?) by", false);
  }
  setNoDelay(recvFd_);
  setNonBlocking(sendFd_, true);
  setNonBlocking(recvFd_, true);
}

void TcpRing::fail(const std::string& why, bool left, const std::string& advice) const {
  std::ostringstream msg;
  msg << "rank " << opt_.rank << " (this process): " << (hasOp_ ? op_.what() : "setup") << ": " << why << " ";
  if (left) {
    msg << (leftDesc_.empty() ? "rank " + std::to_string(opt_.leftRank) + " (left neighbour)" : leftDesc_);
  } else {
    msg << rightDesc_;
  }
  if (!advice.empty()) msg << "; " << advice;
  std::string text = msg.str();
  if (explain_) text += explain_(left ? opt_.leftRank : opt_.rightRank, text);
  throw CommFailedError(text);
}

// One loop moves both streams: poll for room to send and bytes to read, send what may go,
// read what came, repeat until both streams are done or no byte moves for the timeout.
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
void TcpRing::exchange(const std::vector<Span>& send, const std::vector<Span>& recv,
                       const std::function<void(size_t)>& onRecv,
                       const std::function<size_t()>& sendable) {
  size_t sendIdx = 0, sendOff = 0, recvIdx = 0, recvOff = 0, received = 0, sent = 0;
  size_t streamBytes = 0;
  for (const Span& s : send) streamBytes += s.bytes;
  const size_t piece = streamBytes >= opt_.piecedStreamBytes ? opt_.sendPieceBytes : SIZE_MAX;
  auto skipEmpty = [](const std::vector<Span>& spans, size_t& idx, size_t& off) {
    while (idx < spans.size() && off == spans[idx].bytes) {
      ++idx;
      off = 0;
    }
  };
  auto lastProgress = Clock::now();
  for (;;) {
    skipEmpty(send, sendIdx, sendOff);
    skipEmpty(recv, recvIdx, recvOff);
    const bool sending = sendIdx < send.size(), receiving = recvIdx < recv.size();
    if (!sending && !receiving) return;
    // What may go now: the rest of this span, or less where the stream waits for received data.
    size_t allowed = sending ? std::min(send[sendIdx].bytes - sendOff, piece) : 0;
    if (sending && sendable) {
      const size_t limit = sendable();
      allowed = std::min(allowed, limit > sent ? limit - sent : 0);
    }
    if (sending && allowed == 0 && !receiving) {
      fail("internal error: the send stream waits for data, but nothing is left to receive from", true);
    }
    pollfd fds[2];
    int nfds = 0;
    if (allowed > 0) fds[nfds++] = {sendFd_, POLLOUT, 0};
    if (receiving) fds[nfds++] = {recvFd_, POLLIN, 0};
    int rc = poll(fds, nfds, 100);
    if (rc < 0 && errno != EINTR) fail(std::string("poll failed: ") + std::strerror(errno), receiving);
    bool progressed = false;
    if (allowed > 0) {
      const Span& s = send[sendIdx];
      ssize_t w = ::send(sendFd_, s.data + sendOff, allowed, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w > 0) {
        sendOff += static_cast<size_t>(w);
        sent += static_cast<size_t>(w);
        progressed = true;
      } else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        fail(std::string("lost the connection (") + std::strerror(errno) +
                 "; the peer failed or exited) to",
             false);
      }
    }
    if (receiving) {
      const Span& r = recv[recvIdx];
      ssize_t got = ::recv(recvFd_, r.data + recvOff, r.bytes - recvOff, MSG_DONTWAIT);
      if (got > 0) {
        recvOff += static_cast<size_t>(got);
        received += static_cast<size_t>(got);
        progressed = true;
        if (onRecv) onRecv(received);
      } else if (got == 0) {
        fail("connection closed (the peer failed or exited) by", true);
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        fail(std::string("lost the connection (") + std::strerror(errno) + ") from", true);
      }
    }
    if (progressed) {
      lastProgress = Clock::now();
      if (onProgress_) onProgress_();
    } else if (secondsSince(lastProgress) > opt_.timeoutSec) {
      std::ostringstream why;
      why << "hit the " << opt_.timeoutSec << " s timeout with no progress "
          << (receiving ? "receiving from" : "sending to");
      fail(why.str(), receiving,
           std::string("it is stuck, stopped, or issued different collectives; ") + kRaiseTimeout.torchring +
               " if the work between collectives is that slow");
    }
  }
}

// Ring allreduce (reduce-scatter, then allgather), as in the bandwidth-optimal ring: the
// buffer is split into one chunk per ring member (chunkOf(i)). In reduce-scatter step s
// member `me` sends chunk (me - s) to the right and receives chunk (me - s - 1) from the
// left into `scratch_`, folding it into its own copy of that chunk segment by segment as
// the bytes arrive (so reduction overlaps the transfer). After n-1 steps member `me` holds
// the complete chunk (me + 1). In allgather step s it sends chunk (me + 1 - s) and receives
// chunk (me - s) straight into place. Each member sends 2(n-1)/n of the buffer in total.
// The 2(n-1) steps are one stream each way, not one exchange per step: span j of the send
// stream is the chunk that span j-1 of the receive stream brings (folded in reduce-scatter,
// final in allgather), so its bytes may go as soon as they are folded or arrived (sendable);
// the link to the right then never waits for a step to end (at the step between the phases
// it used to idle until the last segment of the left's chunk had arrived).
// 16-bit floats travel as float32 partial sums in reduce-scatter (exact accumulation, 1.5x
// the bytes of a 16-bit ring) and are rounded once, segment by segment, before the 16-bit
// allgather; a scale is applied to the complete chunk the same way.
void TcpRing::allreduce(char* data, size_t count, DType dtype, ReduceOp op, double scale,
                        float* hostSum) {
  const int n = opt_.ringSize, me = opt_.ringIndex;
  if (n == 1 || count == 0) return;
  const bool half = isHalfFloat(dtype);
  if (half && hostSum == nullptr) {
    hostSum_.resize(count);
    widenToFloat(hostSum_.data(), data, count, dtype);
    hostSum = hostSum_.data();
  }
  char* work = half ? reinterpret_cast<char*>(hostSum) : data;  // what reduce-scatter runs on
  const DType workType = half ? DType::F32 : dtype;
  const size_t esize = elementSize(workType), outSize = elementSize(dtype);
  auto chunkOf = [&](int i) {
    i = ((i % n) + n) % n;
    size_t base = count / n, rem = count % n;
    size_t start = i * base + std::min<size_t>(i, rem);
    return std::make_pair(start, base + (static_cast<size_t>(i) < rem ? 1 : 0));
  };
  scratch_.resize((count / n + 1) * esize);
  const size_t segBytes = std::max(esize, opt_.segmentBytes / esize * esize);
  const int steps = 2 * (n - 1), lastFold = n - 2;  // spans 0..lastFold are reduce-scatter's
  std::vector<Span> send, recv;
  std::vector<size_t> foldStart(n - 1);  // first element of reduce-scatter's receive span j
  for (int s = 0; s < n - 1; ++s) {
    auto [sendStart, sendLen] = chunkOf(me - s);
    send.push_back({work + sendStart * esize, sendLen * esize});
    auto [recvStart, recvLen] = chunkOf(me - s - 1);
    foldStart[s] = recvStart;
    recv.push_back({scratch_.data(), recvLen * esize});
  }
  for (int s = 0; s < n - 1; ++s) {
    auto [sendStart, sendLen] = chunkOf(me + 1 - s);
    send.push_back({data + sendStart * outSize, sendLen * outSize});
    auto [recvStart, recvLen] = chunkOf(me - s);
    recv.push_back({data + recvStart * outSize, recvLen * outSize});
  }
  // Receive span `cur` is ready (folded, and for the last fold also scaled or rounded; or
  // arrived, in allgather) up to byte `ready`; every earlier span is ready whole.
  int cur = 0;
  size_t ready = 0, recvBefore = 0, sendBefore = 0;  // bytes of the spans before cur, each stream
  auto consume = [&](size_t received) {
    while (cur < steps) {
      const size_t bytes = recv[cur].bytes;
      const size_t got = std::min(bytes, received - std::min(received, recvBefore));
      size_t now = got;
      if (cur <= lastFold) {
        now = got == bytes ? bytes : got / segBytes * segBytes;
        if (now > ready) {
          char* target = work + foldStart[cur] * esize;
          const void* srcs[2] = {target + ready, scratch_.data() + ready};
          reduceInto(target + ready, nullptr, srcs, 2, (now - ready) / esize, workType, op);
          if (cur == lastFold) {  // the chunk is complete here: scale it once, round it once
            const size_t first = foldStart[cur] + ready / esize;
            const size_t len = (now - ready) / esize;
            if (half) {
              narrowFromFloat(data + first * outSize, hostSum + first, len, dtype, scale);
            } else if (scale != 1.0) {
              scaleInPlace(data + first * outSize, len, dtype, scale);
            }
          }
        }
      }
      ready = now;
      if (ready < bytes) return;
      recvBefore += bytes;
      sendBefore += send[cur].bytes;
      ++cur;
      ready = 0;
    }
  };
  // Send span j+1 carries receive span j's chunk: its ready elements, in the send span's units.
  auto sendable = [&]() -> size_t {
    if (cur + 1 >= steps) return SIZE_MAX;
    const size_t unitIn = cur <= lastFold ? esize : outSize, unitOut = cur < lastFold ? esize : outSize;
    return sendBefore + send[cur].bytes + ready / unitIn * unitOut;
  };
  consume(0);  // empty chunks (count < n) are ready at once
  exchange(send, recv, consume, sendable);
}

// Pipelined ring broadcast: the root streams the buffer to the right; every other member
// receives segment k from the left while forwarding segment k-1 to the right, unless its
// right neighbour is the root.
void TcpRing::broadcast(char* data, size_t bytes, int rootIndex) {
  const int n = opt_.ringSize, me = opt_.ringIndex;
  if (n == 1 || bytes == 0) return;
  if (me == rootIndex) return exchange({{data, bytes}}, {});
  const bool forwards = (me + 1) % n != rootIndex;
  const size_t seg = opt_.segmentBytes, nseg = (bytes + seg - 1) / seg;
  auto span = [&](size_t k) { return Span{data + k * seg, std::min(seg, bytes - k * seg)}; };
  for (size_t k = 0; k <= nseg; ++k) {
    std::vector<Span> send, recv;
    if (k < nseg) recv.push_back(span(k));
    if (forwards && k > 0) send.push_back(span(k - 1));
    exchange(send, recv);
  }
}

// Ring allgather: in step s member `me` sends block (me - s) and receives block (me - s - 1).
void TcpRing::allgather(const std::vector<std::vector<Span>>& blocks) {
  const int n = opt_.ringSize, me = opt_.ringIndex;
  for (int s = 0; s < n - 1; ++s) {
    exchange(blocks[((me - s) % n + n) % n], blocks[((me - s - 1) % n + n) % n]);
  }
}

}  // namespace torchring
