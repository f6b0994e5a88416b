// Point-to-point messages between two ranks of a communicator: send/recv for users, and the
// transfers that gather, scatter and alltoall are made of (engine/communicator.cpp, engine/rooted.cpp).
//
// Each pair of ranks talks over two one-way byte streams, one per direction: within a host a
// ring in the receiver's shared-memory region (ShmGroup::p2pRing), between hosts a TCP
// connection the sender opens on its first message to that peer (not through the ring).
// Everything on a stream is a Frame: DATA (a message: header, then `bytes` of payload) or
// ACK (the receiver's answer to one message, by id).
//
// Matching: a message carries (tag, id); the receiver hands it to its first posted recv from
// that peer with the same tag, so order is kept per (peer, tag) and tags may be received in
// any order. A recv from any source (peer kAnySource) matches a message of its tag from every
// peer, as MPI_ANY_SOURCE does: an arriving message goes to the earliest posted of the recvs
// that match it (its peer's and the any-source ones, by posting number), and a recv from any
// source posted later takes the earliest arrived unclaimed message of its tag (arrival
// number), so each peer's messages are still taken in the order sent. The recv's Work
// records the sender (CpuWork::source). A small message nobody waits for yet is read into a stash (the stream never
// blocks behind it) and taken by the next recv of its tag; a large one (over 64 KiB) is only
// announced, and its payload follows once the receiver posted the recv for it (rendezvous). A send completes when its ACK comes
// back, i.e. once the peer's recv took it (as MPI_Ssend): a send with no matching recv fails
// after the timeout, naming the peer and the tag. A recv whose size differs from the
// message's fails both sides with a MismatchError and leaves the communicator usable.
//
// One progress thread per communicator moves every stream (non-blocking), so any number of
// sends and recvs can be in flight in any direction without deadlock. Any other failure (a
// timeout, a peer's connection lost) fails the whole communicator, as a collective's does.
#pragma once

#include <ATen/ATen.h>
#include <poll.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/common.h"
#include "core/work.h"

namespace torchring {

class ShmGroup;

struct P2POptions {
  int rank = 0, size = 1;
  std::vector<int> rankHost, rankLocal;  // host index and local index of every rank
  double timeoutSec = kDefaultTimeoutSec;
  std::string secret;
  int spinIters = 20000;  // CommOptions.spinIters: how long to poll before sleeping
  std::string label;      // CommOptions.label
};

// A non-blocking one-way byte stream to (Out) or from (In) one peer; stream.cpp.
class OutStream {
 public:
  virtual ~OutStream() = default;
  // Writes up to `bytes`, returns how many were written (0: no room now).
  virtual size_t write(const char* data, size_t bytes) = 0;
  virtual int fd() const { return -1; }  // a socket to poll for room, or -1
};
class InStream {
 public:
  virtual ~InStream() = default;
  // Reads up to `bytes`, returns how many were read (0: nothing yet, or closed()).
  virtual size_t read(char* data, size_t bytes) = 0;
  // Why the peer's end is gone ("" while it is open): then nothing more will arrive.
  virtual std::string closed() const { return ""; }
  virtual int fd() const { return -1; }
};

// The streams and the TCP plumbing (stream.cpp).
namespace p2pstream {
// Shared-memory rings: `ring` is ShmGroup::p2pRing(receiver, sender).
std::unique_ptr<OutStream> shmOut(char* ring);
std::unique_ptr<InStream> shmIn(char* ring, const std::string& peerText);
std::unique_ptr<OutStream> tcpOut(int fd, const std::string& peerText);
std::unique_ptr<InStream> tcpIn(int fd, const std::string& peerText);
// A listening socket on `bindAddr` ("" = every interface); *port gets its port.
int tcpListen(const std::string& bindAddr, int rank, int* port);
int tcpConnect(const std::string& addr, int port, int fromRank, int toRank, const std::string& secret,
               double timeoutSec, const std::function<bool()>& cancelled);
// A waiting connection (non-blocking), or -1.
int tcpAcceptRaw(int listenFd);
constexpr size_t kIntroBytes = 80;  // what a connecting rank says first
// Reads more of a connection's introduction into bytes[*got...]: 1 complete and valid
// (*fromRank set, the socket made non-blocking), 0 not complete yet, -1 refused (*why).
int readIntro(int fd, char* bytes, size_t* got, int rank, int size, const std::string& secret, int* fromRank,
              std::string* why);
// Connects to rank `toRank` at addr:port and introduces this rank; throws CommFailedError
// after `timeoutSec` of failed attempts, at once when refused (the peer's listener is gone:
// it shut down or died), or when `cancelled()` turns true (checked every 100 ms).
}  // namespace p2pstream

class P2P {
 public:
  static constexpr int kAnySource = -1;  // recv's peer: a message from any rank

  P2P(P2POptions options, ShmGroup* shm);
  ~P2P();

  // Between hosts: listens for peers' connections (returns the port), then learns where
  // every rank listens (addrs/ports by rank; entries of this host are unused).
  int listen(const std::string& bindAddr);
  void setPeers(std::vector<std::string> addrs, std::vector<int> ports);

  // Posts a message of `bytes` at `data` to / from `peer`; `what` names it in messages
  // ("float32[10, 4]"). The memory must stay valid until the Work completes; `keep` holds it.
  // User tags are >= 0; collectives use negative tags of their own.
  std::shared_ptr<CpuWork> send(int peer, int64_t tag, const char* data, size_t bytes,
                                const std::string& what, at::Tensor keep = {});
  // recv's `peer` may be kAnySource.
  std::shared_ptr<CpuWork> recv(int peer, int64_t tag, char* data, size_t bytes,
                                const std::string& what, at::Tensor keep = {});

  // Called (once, from the progress thread) when p2p fails the communicator.
  void setOnFailure(std::function<void(const std::string&)> onFailure) { onFailure_ = std::move(onFailure); }
  // The communicator failed elsewhere: fail every pending and later operation with `message`.
  void fail(const std::string& message);
  // Fails pending operations (torchring.shutdown()), stops the thread, closes the streams.
  void shutdown();

 private:
  struct Frame;
  struct Pending;
  struct Link;
  struct OutItem;
  struct Stashed;

  std::shared_ptr<CpuWork> post(bool isSend, int peer, int64_t tag, char* data, size_t bytes,
                                const std::string& what, at::Tensor keep);
  void loop();
  void adopt(std::shared_ptr<Pending> op);
  void adoptAnySource(std::shared_ptr<Pending> op);
  Link& linkTo(int peer);
  // The recv an arriving message of `tag` from `peer` goes to (removed from its list), or null.
  std::shared_ptr<Pending> takePosted(int peer, Link& link, int64_t tag);
  bool pumpOut(int peer, Link& link);
  bool pumpIn(int peer, Link& link);
  bool pumpFrames(int peer, Link& link);
  void onHeader(int peer, Link& link);
  void onPayloadDone(int peer, Link& link);
  void deliver(int peer, Link& link, Stashed& stashed, const std::shared_ptr<Pending>& recv);
  void ack(Link& link, uint64_t id, bool ok, const Pending* recv);
  std::exception_ptr pumpNow(int peer, Link& link);
  std::string failedText(const Pending& op, const std::string& cause) const;
  void control(Link& link, OutItem item);
  bool acceptPeers();
  bool hasPending(const Link& link) const;
  void checkPeers(const std::vector<pollfd>& fds);
  void checkDeadlines();
  void flushAcks();
  void failAll(const std::string& message, bool notify, bool shuttingDown);
  OutStream& outStream(int peer, Link& link);
  std::string rankText() const { return "rank " + std::to_string(opt_.rank); }
  std::string describe(const Pending& op) const;
  bool sameHost(int peer) const { return opt_.rankHost[peer] == opt_.rankHost[opt_.rank]; }

  P2POptions opt_;
  ShmGroup* shm_;
  std::vector<std::unique_ptr<Link>> links_;  // by peer rank
  int listenFd_ = -1, wakeFd_ = -1;
  std::vector<std::string> addrs_;
  std::vector<int> ports_;
  std::function<void(const std::string&)> onFailure_;

  std::mutex mutex_;  // guards the fields below, shared with posting threads
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Pending>> incoming_;
  std::string failure_;
  bool stopping_ = false;
  uint64_t nextSeq_ = 0;
  std::thread thread_;
  int active_ = 0;  // progress thread only: operations not yet completed
  std::deque<std::shared_ptr<Pending>> anyPosted_;  // progress thread: recvs from any source, unmatched
  uint64_t arrivals_ = 0;                           // progress thread: numbers stashed messages
  bool notified_ = false;  // onFailure_ was called
  struct Intro {
    int fd;
    Clock::time_point start;
    char bytes[p2pstream::kIntroBytes];
    size_t got;
  };
  std::vector<Intro> intros_;  // accepted connections whose introduction is still arriving
  int spinRounds_ = 2000;
};

}  // namespace torchring
