// The TCP socket layer (socket.h).
#include "transport/tcp/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "core/common.h"

namespace torchring {
namespace tcpsocket {

bool sendHello(int fd, const Protocol& protocol, const std::string& secret, int fromRank, int toRank) {
  Hello hello{};
  std::memcpy(hello.magic, protocol.magic, sizeof(hello.magic));
  std::memcpy(hello.secret, secret.data(), std::min(secret.size(), sizeof(hello.secret) - 1));
  hello.fromRank = fromRank;
  hello.toRank = toRank;
  return writeAll(fd, &hello, sizeof(hello));
}

std::string refusal(const Hello& hello, const Protocol& protocol, const std::string& secret) {
  if (std::memcmp(hello.magic, protocol.magic, sizeof(hello.magic)) != 0) {
    return std::string("it did not speak ") + protocol.name;
  }
  if (std::strncmp(hello.secret, secret.c_str(), sizeof(hello.secret)) != 0) {
    return "wrong job secret (a rank of another job, or a stray client)";
  }
  return "";
}

int listenOn(const std::string& bindAddr, const std::string& who, const std::string& forWhom, int* port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) throw CommFailedError(who + ": socket() failed: " + std::strerror(errno));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  if (!bindAddr.empty() && inet_pton(AF_INET, bindAddr.c_str(), &addr.sin_addr) != 1) {
    ::close(fd);
    throw CommFailedError(who + ": TORCHRING_BIND_ADDR '" + bindAddr + "' is not an IPv4 address");
  }
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 128) != 0) {
    std::string why = std::strerror(errno);
    ::close(fd);
    throw CommFailedError(who + ": cannot listen" + forWhom + " on " + (bindAddr.empty() ? "0.0.0.0" : bindAddr) +
                          ": " + why);
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

int acceptWaiting(int listenFd, bool nonBlocking) {
  return accept4(listenFd, nullptr, nullptr, SOCK_CLOEXEC | (nonBlocking ? SOCK_NONBLOCK : 0));
}

Dialed connectWithin(const std::string& host, int port, const Dial& dial) {
  Dialed out;
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) {
    out.unresolved = true;
    return out;
  }
  const auto start = Clock::now();
  auto cancelled = [&] { return dial.cancelled && dial.cancelled(); };
  while (secondsSince(start) < dial.timeoutSec && !cancelled()) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      out.socketFailed = true;
      out.error = std::strerror(errno);
      break;
    }
    int rc = ::connect(fd, res->ai_addr, res->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      int err = ETIMEDOUT;
      socklen_t len = sizeof(err);
      const auto attempt = Clock::now();
      while (secondsSince(attempt) < 5.0 && secondsSince(start) < dial.timeoutSec && !cancelled()) {
        pollfd pfd{fd, POLLOUT, 0};
        if (poll(&pfd, 1, 100) == 1) {
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
          break;
        }
      }
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc != 0 && errno == ECONNREFUSED && dial.stopWhenRefused) {
      ::close(fd);
      out.refused = true;
      out.error = std::strerror(ECONNREFUSED);
      break;
    }
    if (rc == 0) {
      setNoDelay(fd);
      if (!dial.greet || dial.greet(fd)) {
        out.fd = fd;
        break;
      }
    }
    out.error = std::strerror(errno);
    ::close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  freeaddrinfo(res);
  out.cancelled = out.fd < 0 && cancelled();
  return out;
}

void setNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void setNonBlocking(int fd, bool on) {
  const int flags = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, on ? flags | O_NONBLOCK : flags & ~O_NONBLOCK);
}

void setTimeouts(int fd, double seconds) {
  timeval tv{};
  tv.tv_sec = static_cast<long>(seconds);
  tv.tv_usec = static_cast<long>((seconds - tv.tv_sec) * 1e6);
  if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1000;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

bool readAll(int fd, void* buf, size_t bytes) {
  auto* p = static_cast<char*>(buf);
  while (bytes > 0) {
    ssize_t r = ::recv(fd, p, bytes, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    bytes -= static_cast<size_t>(r);
  }
  return true;
}

bool writeAll(int fd, const void* buf, size_t bytes) {
  auto* p = static_cast<const char*>(buf);
  while (bytes > 0) {
    ssize_t w = ::send(fd, p, bytes, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    bytes -= static_cast<size_t>(w);
  }
  return true;
}

std::string peerName(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (addr.ss_family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

}  // namespace tcpsocket
}  // namespace torchring
