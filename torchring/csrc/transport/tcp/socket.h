// The TCP socket layer under both TCP users: the links among the hosts' leaders (TcpLinks, links.cpp) and
// the point-to-point streams (transport/p2p/stream.cpp). Listening, connecting within a
// deadline, and the hello a connecting rank says first; each user speaks its own protocol
// (its magic) and decides what a refused or failed connection means.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace torchring {
namespace tcpsocket {

// A protocol on torchring's TCP connections: the magic its hello starts with, and how a
// refusal names it ("the torchring protocol").
struct Protocol {
  char magic[8];
  const char* name;
};

// The first bytes on every connection. The acceptor checks all of it before the socket
// carries any data, so a stray or hostile connection never reaches a collective or a message.
struct Hello {
  char magic[8];
  char secret[64];
  int32_t fromRank;
  int32_t toRank;
};
constexpr size_t kHelloBytes = 80;
static_assert(sizeof(Hello) == kHelloBytes, "the hello's size");

// Sends rank `fromRank`'s hello to rank `toRank` (a fresh socket has room for it); false if
// the connection broke (or, non-blocking, took less than all of it).
bool sendHello(int fd, const Protocol& protocol, const std::string& secret, int fromRank, int toRank);
// Why `hello` is refused for its protocol or job secret ("" if it passes both); the caller
// checks the ranks it claims.
std::string refusal(const Hello& hello, const Protocol& protocol, const std::string& secret);

// A non-blocking listening socket on `bindAddr` ("" = every interface) on a free port
// (*port). `who` starts the messages ("rank 3"), `forWhom` says what listens
// (" for point-to-point peers", or ""). Throws CommFailedError.
int listenOn(const std::string& bindAddr, const std::string& who, const std::string& forWhom, int* port);
// A waiting connection on a non-blocking listener, or -1; `nonBlocking` for the new socket.
int acceptWaiting(int listenFd, bool nonBlocking);

// How connectWithin tries.
struct Dial {
  double timeoutSec = 0;  // give up after this many seconds of failed attempts
  bool stopWhenRefused = false;  // a refusal ends it (the peer's listener is gone), else retry
  std::function<bool()> cancelled;  // when given and true, give up (checked every 100 ms)
  std::function<bool(int)> greet;   // when given, says hello on a fresh connection; false: retry
};
// What connectWithin got: a connected non-blocking socket with TCP_NODELAY (fd >= 0), or why not.
struct Dialed {
  int fd = -1;
  bool unresolved = false;  // the address does not resolve
  bool socketFailed = false;  // socket() failed (error says why): retrying cannot help
  bool refused = false;     // refused, with stopWhenRefused
  bool cancelled = false;   // cancelled() turned true
  std::string error = "no attempt";  // strerror() of the last failed attempt
};
// Connects to host:port. Each attempt is a non-blocking connect that waits at most 5 s, so
// an address that drops packets cannot outlast the timeout; attempts repeat every 50 ms.
Dialed connectWithin(const std::string& host, int port, const Dial& dial);

void setNoDelay(int fd);
void setNonBlocking(int fd, bool on);
// SO_RCVTIMEO and SO_SNDTIMEO (at least 1 ms) for the blocking reads and writes below.
void setTimeouts(int fd, double seconds);
// Blocking full read (write) under the socket's timeout; false on EOF, error or timeout.
bool readAll(int fd, void* buf, size_t bytes);
bool writeAll(int fd, const void* buf, size_t bytes);
// True when TCP holds bytes of this socket it has not sent though the peer's receive window
// has room for them: the way out (the link, or its queue) is what holds them back, not the
// peer. False where the kernel's TCP_INFO lacks the fields (before Linux 5.4).
bool sendHeldByLink(int fd);
// "10.0.0.2:41234": the peer's address, "?" if unknown.
std::string peerName(int fd);

}  // namespace tcpsocket
}  // namespace torchring
