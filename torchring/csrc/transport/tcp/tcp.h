// TCP ring between hosts: each member sends to its right neighbour and receives from its
// left one, over two sockets (one per direction).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/common.h"

namespace torchring {

struct Span {
  char* data;
  size_t bytes;
};

struct TcpOptions {
  int rank = 0;              // global rank of this process
  int ringIndex = 0;         // position in the ring (host index)
  int ringSize = 1;
  int leftRank = 0, rightRank = 0;  // global ranks of the neighbours
  std::string secret;        // per-job secret from the store, checked in the handshake
  double timeoutSec = kDefaultTimeoutSec;  // a transfer that makes no progress this long fails
  size_t segmentBytes = 256 << 10;  // unit of pipelining in allreduce and broadcast
  // A send stream of at least piecedStreamBytes goes to the kernel at most sendPieceBytes
  // per send() call (TcpRing::exchange says why); a shorter one as much as the socket takes.
  size_t sendPieceBytes = 128 << 10;
  size_t piecedStreamBytes = 8 << 20;
};

class TcpRing {
 public:
  explicit TcpRing(TcpOptions options);
  ~TcpRing();

  // Listens on `bindAddr` (all interfaces when empty) on a free port and returns it.
  int listen(const std::string& bindAddr);
  // Connects to the right neighbour and accepts the left one. Connections that fail the
  // handshake (garbage, wrong secret, wrong rank) are logged, closed and ignored.
  void connect(const std::string& rightAddr, int rightPort);
  void close();
  // Unblocks a transfer in progress on another thread (it fails); close() comes after.
  void interrupt();
  // Called after every transfer that moved bytes (the leader's heartbeat for its host).
  void setOnProgress(std::function<void()> onProgress) { onProgress_ = std::move(onProgress); }

  // Ring collectives over raw memory, see tcp.cpp for the algorithms.
  // In place, result scaled by `scale`. For 16-bit floats the reduce-scatter runs on
  // float32 partial sums: `hostSum` when the caller has this host's sum in float32, else
  // `data` widened; the result is rounded to 16 bits once.
  void allreduce(char* data, size_t count, DType dtype, ReduceOp op, double scale,
                 float* hostSum = nullptr);
  void broadcast(char* data, size_t bytes, int rootIndex);
  // blocks[i] = the spans of ring member i; this member's block is already in place.
  void allgather(const std::vector<std::vector<Span>>& blocks);

  // The operation that failure messages name (its words are made only when one fails).
  void setOp(const OpHeader& header) { op_ = header; hasOp_ = true; }
  // Called with (peer rank, this rank's message) when a neighbour fails us; returns what is
  // known of why that peer failed ("" if nothing), to be added to the message.
  void setExplain(std::function<std::string(int, const std::string&)> explain) {
    explain_ = std::move(explain);
  }

 private:
  // Sends `send` to the right while receiving `recv` from the left (each a stream of spans
  // sent or filled in order); onRecv(bytes received so far) runs after every read so the
  // caller can consume completed segments, and sendable(), when given, says how many bytes
  // of the send stream may go so far (the rest depends on what was received).
  void exchange(const std::vector<Span>& send, const std::vector<Span>& recv,
                const std::function<void(size_t)>& onRecv = nullptr,
                const std::function<size_t()>& sendable = nullptr);
  // Throws CommFailedError: "rank R (this process): <op>: <why> <the neighbour>; <advice>",
  // then what the failure board says about the neighbour.
  [[noreturn]] void fail(const std::string& why, bool left, const std::string& advice = "") const;
  bool acceptOne(double deadlineSec);

  TcpOptions opt_;
  int listenFd_ = -1, sendFd_ = -1, recvFd_ = -1;
  std::string leftDesc_, rightDesc_;
  OpHeader op_;
  bool hasOp_ = false;  // no operation yet: messages say "setup"
  std::vector<char> scratch_;
  std::vector<float> hostSum_;
  std::function<std::string(int, const std::string&)> explain_;
  std::function<void()> onProgress_;
};

}  // namespace torchring
