// The TCP links among the hosts' leaders ("members", one per host, by host index): one
// connection, used both ways, to each partner that any cross-host schedule names
// (schedule/schedule.h partnersOf: ring neighbours, members at distance 2^k, the recursive
// doubling partners), and the algorithms that run over them: the streaming ring allreduce
// (ring.cpp) and every other schedule step by step (steps.cpp). The algorithm of each
// operation comes from the caller (the cost model, schedule/cost.h).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/common.h"
#include "core/waits.h"
#include "schedule/cost.h"
#include "schedule/schedule.h"

namespace torchring {

struct Span {
  char* data;
  size_t bytes;
};

// What every message of the header exchange's summary round carries (headers.cpp).
struct HeaderSummary {
  uint64_t agree = 0;  // 1: every header the sender knows is sameForAll with `header`
  OpHeader header;     // the sender's own
};

struct TcpOptions {
  int rank = 0;                  // global rank of this process
  int member = 0;                // this leader's host index
  std::vector<int> memberRanks;  // global rank of every member (each host's leader)
  std::string secret;            // per-job secret from the store, checked in the handshake
  double timeoutSec = kDefaultTimeoutSec;  // a transfer that makes no progress this long fails
  size_t segmentBytes = 256 << 10;  // unit of pipelining and folding as bytes arrive
  // A send stream of at least piecedStreamBytes goes to the kernel at most sendPieceBytes
  // per send() call (TcpLinks::exchange says why); a shorter one as much as the socket takes.
  size_t sendPieceBytes = 128 << 10;
  size_t piecedStreamBytes = 8 << 20;
};

class TcpLinks {
 public:
  explicit TcpLinks(TcpOptions options);
  ~TcpLinks();

  int members() const { return static_cast<int>(opt_.memberRanks.size()); }
  // How long this leader waited for each member's data (by member; core/waits.h).
  WaitLedger& waits() { return waits_; }
  const WaitLedger& waits() const { return waits_; }

  // Listens on `bindAddr` (all interfaces when empty) on a free port and returns it.
  int listen(const std::string& bindAddr);
  // Connects to every partner: dials the lower ones at addrs[m]:ports[m] (by member) and
  // accepts the higher ones. Connections that fail the handshake (garbage, wrong secret,
  // wrong rank) are logged, closed and ignored.
  void connect(const std::vector<std::string>& addrs, const std::vector<int>& ports);
  void close();
  // Unblocks a transfer in progress on another thread (it fails); close() comes after.
  void interrupt();
  // Called after every transfer that moved bytes (the leader's heartbeat for its host).
  void setOnProgress(std::function<void()> onProgress) { onProgress_ = std::move(onProgress); }
  // alpha and beta of these links, measured with one partner (links.cpp says how); every
  // member must call it at the same point (it exchanges messages).
  LinkCost measure();

  // The collectives over raw memory. allreduce: in place, result scaled by `scale`; for
  // 16-bit floats the folds run on float32 partial sums (`hostSum` when the caller has this
  // host's sum in float32, else `data` widened) and the result is rounded to 16 bits once.
  void allreduce(AllreduceChoice algo, char* data, size_t count, DType dtype, ReduceOp op, double scale,
                 float* hostSum = nullptr);
  // Reduce-scatter around the ring (reduceScatterSchedule): member m ends with blocks[m]
  // reduced and scaled (or rounded, as allreduce); the rest of `data` is left undefined.
  void reduceScatter(char* data, size_t count, DType dtype, ReduceOp op, double scale,
                     const std::vector<std::vector<Range>>& blocks, float* hostSum = nullptr);
  void broadcast(Algo algo, char* data, size_t bytes, int rootMember);
  // blocks[m] = the spans of member m; this member's block is already in place.
  void allgather(Algo algo, const std::vector<std::vector<Span>>& blocks);

  // The allreduce an operation's header exchange carries (engine/fused.cpp), for this
  // member's own header (its count and dtype), and the rule for every member's.
  struct Carry {
    char* data = nullptr;  // the result: written only once every header is known to agree
    char* work = nullptr;  // this host's sum, which the fold steps send and fold into (float32
                           // partial sums for 16-bit floats, else data's dtype; not `data`)
    ReduceOp op = ReduceOp::SUM;
    double scale = 1.0;        // applied once to the result (AVG's 1/size, the postscale)
    Algo shape = Algo::Doubling;  // the header exchange's schedule (cost.h headerAlgo), alike on every member
    // The allreduce schedule a member whose header is `header` carries (no steps: it carries
    // nothing). Every member computes the same from the same header, which arrives before
    // the data, so the streams stay aligned whatever the operations are.
    std::function<Schedule(const OpHeader& header, int member)> planOf;
  };
  // Every rank's header to every member: the allreduce schedule carry.shape (Doubling or
  // Multiplying, with its fold in and out) among the members, whose messages carry a summary
  // of the headers their sender knows, and the allreduce `carry` names (headers.cpp says how). all[r]: rank r's
  // header, filled for this member's ranks (ranksOf[member], its leader first); on return
  // every entry is filled (another host's ranks with this leader's own header when every
  // header in the job is sameForAll with it). Returns true when every header was sameForAll
  // and every carried part had this member's own size and was folded or placed.
  bool exchangeHeaders(std::vector<OpHeader>& all, const std::vector<std::vector<int>>& ranksOf,
                       const Carry& carry);

  // The operation that failure messages name (its words are made only when one fails).
  void setOp(const OpHeader& header) { op_ = header; hasOp_ = true; }
  // Called with (peer rank, this rank's message) when a partner fails us; returns what is
  // known of why that peer failed ("" if nothing), to be added to the message.
  void setExplain(std::function<std::string(int, const std::string&)> explain) {
    explain_ = std::move(explain);
  }
  // What another rank's failure says ("" while none): exchange() asks it after kNewsAfterSec
  // without progress and gives up waiting when there is an answer.
  void setNews(std::function<std::string()> news) { news_ = std::move(news); }
  // Whether a failure message of fail() says the partner's connection ended (closed, reset):
  // the partner then either said why on the failure board before it closed, or died.
  static bool connectionEnded(const std::string& message) {
    return message.find(kClosedBy) != std::string::npos || message.find(kLostFrom) != std::string::npos;
  }
  static constexpr const char* kClosedBy = "connection closed (the peer failed or exited) by";
  static constexpr const char* kLostFrom = "lost the connection (";
  static constexpr double kNewsAfterSec = 1.0;

 private:
  struct Link {
    int fd = -1;
    std::string desc;  // "rank 4 (leader of host 2, 198.18.0.3:40211)"
  };
  // Sends `send` to member `sendTo` while receiving `recv` from member `recvFrom` (each a
  // stream of spans sent or filled in order; -1 or an empty stream: nothing that way);
  // onRecv(bytes received so far) runs after every read so the caller can consume completed
  // segments, and sendable(), when given, says how many bytes of the send stream may go so
  // far (the rest depends on what was received).
  void exchange(int sendTo, const std::vector<Span>& send, int recvFrom, const std::vector<Span>& recv,
                const std::function<void(size_t)>& onRecv = nullptr,
                const std::function<size_t()>& sendable = nullptr);
  // One stream of bytes to or from one member, sent or filled in order (exchangeStreams).
  // `spans` is the caller's: onRecv may change the spans still to come (the header exchange
  // sizes the data once the summary before it is in).
  struct Stream {
    int member = -1;
    bool out = false;  // sent to `member`, else received from it
    const std::vector<Span>* spans = nullptr;
    std::function<void(size_t)> onRecv;  // received: called with the bytes received so far
    std::function<size_t()> sendable;    // sent: how many bytes may go so far (none: all)
  };
  // Moves every stream at once (a group of steps, schedule.h withNext); exchange() is its
  // case of one stream each way.
  void exchangeStreams(const std::vector<Stream>& streams);
  // ring.cpp: the ring allreduce as one stream each way (Algo::Ring).
  void ringAllreduce(char* data, size_t count, DType dtype, ReduceOp op, double scale, float* hostSum);
  // steps.cpp: `hostSum`, or for 16-bit floats without one `data` widened to float32 (what
  // the folds run on); nullptr for other dtypes.
  float* partialSums(char* data, size_t count, DType dtype, float* hostSum);
  // steps.cpp: the spans of `ranges` (in units of `unit` bytes) in the buffer at `base`.
  static std::vector<Span> spansOf(const std::vector<Range>& ranges, char* base, size_t unit);
  // steps.cpp: folds bytes [lo, hi) of `received` (a receive stream of `ranges` in order,
  // units of `type`) into `work` at those ranges.
  static void foldRanges(char* work, const std::vector<Range>& ranges, const char* received, DType type,
                         ReduceOp op, size_t lo, size_t hi);
  // steps.cpp: the fold steps are over: `owned` of `data` made from `work` (the float32
  // partial sums for 16-bit floats, rounded; else copied unless it is `data`), scaled once.
  static void finishOwned(const std::vector<Range>& owned, char* data, const char* work, DType dtype,
                          double scale);
  // steps.cpp: the streams of steps [first, end) (units of `unit` bytes at `base`), a send and
  // a receive each, their spans kept in `spans`.
  static std::vector<Stream> streamsOf(const std::vector<Step>& steps, size_t first, size_t end, char* base,
                                       size_t unit, std::vector<std::vector<Span>>& spans);
  // steps.cpp: any allreduce schedule, one group of steps at a time, folding as bytes arrive.
  void stepAllreduce(const Schedule& schedule, char* data, size_t count, DType dtype, ReduceOp op,
                     double scale, float* hostSum);
  // Throws CommFailedError: "rank R (this process): <op>: <why> <the partner>; <advice>",
  // then what the failure board says about the partner.
  [[noreturn]] void fail(const std::string& why, int member, const std::string& advice = "") const;
  std::string describe(int member) const;
  bool acceptOne(double remainingSec);

  TcpOptions opt_;
  int listenFd_ = -1;
  std::vector<Link> links_;  // by member; fd -1 for a member that is not a partner
  WaitLedger waits_;         // by member
  OpHeader op_;
  bool hasOp_ = false;  // no operation yet: messages say "setup"
  std::vector<char> scratch_;
  Algo headerAlgo_ = Algo::Doubling;
  std::vector<Step> headerSteps_;     // exchangeHeaders' schedule for this member (made per shape)
  std::vector<Carried> headerBlocks_;  // and the member blocks each of its steps carries
  std::vector<float> hostSum_;
  std::function<std::string(int, const std::string&)> explain_;
  std::function<void()> onProgress_;
  std::function<std::string()> news_;
};

}  // namespace torchring
