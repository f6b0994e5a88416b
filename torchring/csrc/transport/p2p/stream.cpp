// The byte streams of point-to-point messages (p2p.h): shared-memory rings within a host,
// TCP connections between hosts, and how a connection is opened and introduced.
//
// A ring is one sender and one receiver over `capacity` bytes: the sender owns `head` (bytes
// written so far), the receiver `tail` (bytes read so far); both only grow. The sender may
// write while head - tail < capacity, at offset head % capacity, wrapping around; the
// receiver may read while tail < head. Release on the owner's store, acquire on the
// other's load: bytes are visible before the counter that publishes them. Each side moves
// at most a 32 KiB piece per call, so the two copies overlap.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "transport/p2p/p2p.h"
#include "transport/shm/group.h"
#include "transport/tcp/socket.h"

namespace torchring {
namespace p2pstream {
namespace {

struct RingHead {
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
};
constexpr size_t kRingData = 128;  // the payload starts here
constexpr size_t kCapacity = ShmGroup::kP2PRingBytes - kRingData;
// Bytes published at a time: the ring is a pipeline of pieces, so the receiver copies one
// piece out while the sender copies the next one in (a whole ring per step would alternate).
constexpr size_t kPiece = 32 << 10;
static_assert(sizeof(RingHead) <= kRingData, "ring header");

class ShmOut : public OutStream {
 public:
  explicit ShmOut(char* ring) : head_(reinterpret_cast<RingHead*>(ring)), data_(ring + kRingData) {}
  size_t write(const char* src, size_t bytes) override {
    const uint64_t head = head_->head.load(std::memory_order_relaxed);
    const uint64_t tail = head_->tail.load(std::memory_order_acquire);
    size_t n = std::min<size_t>({bytes, kCapacity - (head - tail), kPiece});
    if (n == 0) return 0;
    const size_t at = head % kCapacity, first = std::min(n, kCapacity - at);
    std::memcpy(data_ + at, src, first);
    std::memcpy(data_, src + first, n - first);
    head_->head.store(head + n, std::memory_order_release);
    return n;
  }

 private:
  RingHead* head_;
  char* data_;
};

class ShmIn : public InStream {
 public:
  ShmIn(char* ring, std::string peer) : head_(reinterpret_cast<RingHead*>(ring)), data_(ring + kRingData), peer_(std::move(peer)) {}
  size_t read(char* dst, size_t bytes) override {
    const uint64_t tail = head_->tail.load(std::memory_order_relaxed);
    const uint64_t head = head_->head.load(std::memory_order_acquire);
    size_t n = std::min<size_t>({bytes, head - tail, kPiece});
    if (n == 0) return 0;
    const size_t at = tail % kCapacity, first = std::min(n, kCapacity - at);
    std::memcpy(dst, data_ + at, first);
    std::memcpy(dst + first, data_, n - first);
    head_->tail.store(tail + n, std::memory_order_release);
    return n;
  }

 private:
  RingHead* head_;
  char* data_;
  std::string peer_;
};

class TcpOut : public OutStream {
 public:
  TcpOut(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {}
  ~TcpOut() override { ::close(fd_); }
  size_t write(const char* src, size_t bytes) override {
    ssize_t w = ::send(fd_, src, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w >= 0) return static_cast<size_t>(w);
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
    throw CommFailedError("the connection to " + peer_ + " broke while sending (" + std::strerror(errno) +
                          "): it died or shut down");
  }
  int fd() const override { return fd_; }

 private:
  int fd_;
  std::string peer_;
};

class TcpIn : public InStream {
 public:
  TcpIn(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {}
  ~TcpIn() override { ::close(fd_); }
  size_t read(char* dst, size_t bytes) override {
    if (!closed_.empty()) return 0;
    ssize_t r = ::recv(fd_, dst, bytes, MSG_DONTWAIT);
    if (r > 0) return static_cast<size_t>(r);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
    closed_ = "the connection from " + peer_ + " closed" +
              (r < 0 ? std::string(" (") + std::strerror(errno) + ")" : std::string()) + ": it died or shut down";
    return 0;
  }
  std::string closed() const override { return closed_; }
  int fd() const override { return fd_; }

 private:
  int fd_;
  std::string peer_;
  std::string closed_;
};

// What point-to-point connections speak (transport/tcp/socket.h): its magic differs from
// the leaders' links', so neither accepts the other's connections.
constexpr tcpsocket::Protocol kP2PProtocol{{'T', 'R', 'P', '2', 'P', '0', '0', '1'},
                                           "torchring's point-to-point protocol"};

}  // namespace

std::unique_ptr<OutStream> shmOut(char* ring) { return std::make_unique<ShmOut>(ring); }
std::unique_ptr<InStream> shmIn(char* ring, const std::string& peerText) {
  return std::make_unique<ShmIn>(ring, peerText);
}
std::unique_ptr<OutStream> tcpOut(int fd, const std::string& peerText) {
  return std::make_unique<TcpOut>(fd, peerText);
}
std::unique_ptr<InStream> tcpIn(int fd, const std::string& peerText) {
  return std::make_unique<TcpIn>(fd, peerText);
}

int tcpListen(const std::string& bindAddr, int rank, int* port) {
  return tcpsocket::listenOn(bindAddr, "rank " + std::to_string(rank), " for point-to-point peers", port);
}

int tcpConnect(const std::string& host, int port, int fromRank, int toRank, const std::string& secret,
               double timeoutSec, const std::function<bool()>& cancelled) {
  const std::string who = "rank " + std::to_string(fromRank) + ": cannot connect to rank " +
                          std::to_string(toRank) + " at " + host + ":" + std::to_string(port);
  tcpsocket::Dial dial;
  dial.timeoutSec = timeoutSec;
  dial.stopWhenRefused = true;  // its listener is gone: retrying cannot help
  dial.cancelled = cancelled;
  dial.greet = [&](int fd) { return tcpsocket::sendHello(fd, kP2PProtocol, secret, fromRank, toRank); };
  tcpsocket::Dialed dialed = tcpsocket::connectWithin(host, port, dial);
  if (dialed.fd >= 0) return dialed.fd;
  if (dialed.unresolved) throw CommFailedError(who + ": the address does not resolve");
  if (dialed.socketFailed) throw CommFailedError(who + ": socket() failed (" + dialed.error + ")");
  if (dialed.refused) {
    throw CommFailedError(who + ": connection refused: it shut down or died (or TORCHRING_ADDR names "
                          "another host)");
  }
  if (dialed.cancelled) throw TorchringError(who + ": " + kShutdownCall.torchring + " was called while connecting");
  throw CommFailedError(who + " within " + std::to_string(static_cast<int>(timeoutSec)) + " s (" + dialed.error +
                        "): it died, or the address is not reachable from this host (TORCHRING_ADDR)");
}

int tcpAcceptRaw(int listenFd) { return tcpsocket::acceptWaiting(listenFd, true); }

int readIntro(int fd, char* bytes, size_t* got, int rank, int size, const std::string& secret, int* fromRank,
              std::string* why) {
  using tcpsocket::Hello;
  static_assert(sizeof(Hello) == kIntroBytes, "the introduction's size");
  while (*got < sizeof(Hello)) {
    ssize_t r = ::recv(fd, bytes + *got, sizeof(Hello) - *got, MSG_DONTWAIT);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
    if (r <= 0) {
      *why = "it closed before a complete introduction";
      return -1;
    }
    *got += static_cast<size_t>(r);
  }
  Hello hello;
  std::memcpy(&hello, bytes, sizeof(hello));
  *why = tcpsocket::refusal(hello, kP2PProtocol, secret);
  if (why->empty() &&
      (hello.toRank != rank || hello.fromRank < 0 || hello.fromRank >= size || hello.fromRank == rank)) {
    *why = "it claims to be rank " + std::to_string(hello.fromRank) + " connecting to rank " +
           std::to_string(hello.toRank);
  }
  if (!why->empty()) return -1;
  tcpsocket::setNoDelay(fd);
  *fromRank = hello.fromRank;
  return 1;
}

}  // namespace p2pstream
}  // namespace torchring
