// tcpsocket::sendHeldByLink (socket.h), apart from socket.cpp: it reads the kernel's own
// struct tcp_info (linux/tcp.h), whose fields past Linux 4.x the C library's netinet/tcp.h
// (which socket.cpp includes) does not declare; the two headers cannot be included together.
#include <linux/sockios.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>

#include "transport/tcp/socket.h"

namespace torchring {
namespace tcpsocket {

bool sendHeldByLink(int fd) {
  // Most waits end with every byte of the stream already sent: the unsent count (SIOCOUTQNSD,
  // read without the socket's lock) answers those; TCP_INFO (which takes the lock and fills
  // some 200 bytes, about a third of a small send's cost) is asked only when bytes are left.
  int unsent = 0;
  if (ioctl(fd, SIOCOUTQNSD, &unsent) == 0 && unsent <= 0) return false;
  tcp_info info{};
  socklen_t len = sizeof(info);
  if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return false;
  if (len < offsetof(tcp_info, tcpi_snd_wnd) + sizeof(info.tcpi_snd_wnd)) return false;
  const uint64_t inFlight = uint64_t{info.tcpi_unacked} * info.tcpi_snd_mss;
  return info.tcpi_notsent_bytes > 0 && inFlight + info.tcpi_snd_mss <= info.tcpi_snd_wnd;
}

}  // namespace tcpsocket
}  // namespace torchring
