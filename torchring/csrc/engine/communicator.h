// The per-process communicator: topology, an ordered queue of collectives, the progress
// thread that runs them, and how the transports combine. communicator.cpp holds the queue,
// the header checks and failure handling; failure_board.cpp how failures are told and read
// through the store; hierarchy.cpp the algorithms that compose the shared-memory group and
// the leaders' TCP links (within a host, then between hosts) and which one each operation
// runs; fused.cpp the header exchange among hosts and the allreduces riding on it;
// p2p_ops.cpp send and recv; stragglers.cpp the per-rank wait totals and the warning that
// names a persistently late rank.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/common.h"
#include "core/tensor.h"
#include "transport/p2p/p2p.h"
#include "transport/shm/group.h"
#include "schedule/cost.h"
#include "transport/tcp/links.h"
#include "core/work.h"
#include "engine/flight_recorder.h"

namespace torchring {

// Everything a communicator is made from; Python fills it (bindings.cpp binds each field)
// from the rendezvous and torchring's settings.
struct CommOptions {
  // This process's rank in [0, size), and the number of ranks.
  int rank = 0;
  int size = 1;
  // Ranks of each host, hosts ordered by their smallest rank, ranks ascending. The first
  // rank of a host is its leader: the only one that talks TCP to other hosts.
  std::vector<std::vector<int>> hosts;
  // Seconds a rendezvous step or a collective may make no progress before it fails.
  double timeoutSec = kDefaultTimeoutSec;
  // Shared-memory staging segment per rank (two of them: double buffering); a message
  // larger than this moves in several segments. Tests set it small to reach those paths.
  size_t segmentBytes = kDefaultSegmentBytes;
  // Virtual size of this rank's shared-memory arena (torchring.empty); 0 for none.
  size_t arenaBytes = 0;
  // Busy-wait iterations before a waiting rank sleeps on a futex.
  int spinIters = 20000;
  // True when spinIters is the default rather than the user's (TORCHRING_SPIN): shared memory
  // then picks its own from the local ranks' CPU sets (ShmOptions::spinAuto).
  bool spinAuto = false;
  // Internal, for tests: the largest staged shared-memory allreduce that runs one-shot
  // (every rank reduces all of it; the default falls with the number of local ranks,
  // ShmOptions::oneShotFor). Tests set it to 0 to reach the chunked path with small
  // tensors, as segmentBytes (at least a page) reaches the multi-segment paths.
  size_t oneShotBytes = ShmOptions::kOneShotBySize;
  // Stores for the shared-memory staging writes: 0 measured while running, 1 cached,
  // 2 streaming (StorePolicy, stores.h; TORCHRING_SHM_STORES).
  int stagingStores = 0;
  // The cross-host algorithm every operation must use (Algo; 0: the cost model chooses per
  // operation; TORCHRING_ALGO).
  int algo = 0;
  // With algo Rabenseifner: its halvings (0: all; TORCHRING_ALGO=rabenseifner:K).
  int levels = 0;
  // The header exchange's shape (Algo; 0: the cost model's rule, cost.h headerAlgo;
  // TORCHRING_HEADER=doubling|multiplying).
  int header = 0;
  // Random per-job token every TCP handshake must present.
  std::string secret;
  // For a group's communicator: put in front of its operations' failure messages, e.g.
  // "group 2 of world ranks [0, 2] (the ranks in this message are group ranks): ".
  std::string label;
  // Operations the flight recorder keeps (engine/flight_recorder.h; 0: none; TORCHRING_TRACE).
  size_t traceEntries = kDefaultTraceEntries;
  // What the recorder's dumps call this communicator's group: a name, a description and its
  // world ranks (empty: 0..size-1).
  std::string traceName = "world", traceDesc = "torchring world";
  std::vector<int> traceRanks;
  // A peer that made this rank wait at least this long in at least half of the last 20
  // collectives is named once in a warning (0: never; TORCHRING_STRAGGLER_MS).
  double stragglerSec = 0.1;
  // Each host's name, by host index, for the messages ("" or missing: "host k").
  std::vector<std::string> hostNames;

  static constexpr size_t kDefaultSegmentBytes = 1 << 20;
  static constexpr size_t kDefaultTraceEntries = 512;
};

// Optional side channel through the rendezvous store: a failing rank posts its message, and
// a rank whose ring neighbour hung up reads why, so every survivor can name the first failure.
struct FailureBoard {
  std::function<void(int rank, const std::string& message)> post;
  std::function<std::string(int rank)> read;  // "" when the rank posted nothing
  std::function<std::string()> latest;        // a failure any rank posted ("" while none)
  // Where the store lives, for the message when it does not answer: "the rendezvous store on
  // trh0 (198.18.0.1, where rank 0 runs)"; its host is then the one that is cut off.
  std::string where = "the rendezvous store";
};

// What some collectives take besides the tensor (communicator.cpp's submit() checks them).
struct OpArgs {
  at::Tensor out;                  // reduce_scatter, alltoall, allgather: write the result here
  std::vector<at::Tensor> tensors;  // allreduce_many: the tensors; scatter: [the root's chunks]
  double prescale = 1.0, postscale = 1.0;  // allreduce, reduce_scatter, allreduce_many
  at::Tensor sendSplits;           // alltoall: int64[size], rows for each rank
  at::Tensor recvSplits;           // alltoall: int64[size], rows from each rank (filled or checked)
  bool recvSplitsKnown = false;    // alltoall: recvSplits holds what this rank expects
};

class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  explicit Communicator(CommOptions options);
  ~Communicator();

  // Bootstrap, in this order (Python exchanges the results through the store between steps).
  std::string createShm(const std::string& nameTag);      // when localSize() > 1
  int listen(const std::string& bindAddr);                  // when leader and numHosts() > 1
  void attachShm(const std::vector<std::string>& names);
  void unlinkShm();
  // Leaders of several hosts: connect to every partner leader (addrs/ports by host index),
  // then measure the links (every leader at once); every rank then gets the job's agreed
  // cost (the largest of each leader's figures) before start().
  void connectLinks(const std::vector<std::string>& addrs, const std::vector<int>& ports);
  LinkCost measureLinks();
  // The forced header shape (CommOptions::header) stays whatever the measured cost says.
  void setLinkCost(const LinkCost& cost) {
    cost_ = cost;
    if (opt_.header != 0) cost_.header = static_cast<Algo>(opt_.header);
  }
  // CommOptions::algo after start (benchmarks that interleave algorithms): only while no
  // operation is queued, and on every rank alike (a difference is a named mismatch).
  void setForcedAlgo(int algo) { opt_.algo = algo; }
  int forcedAlgo() const { return opt_.algo; }
  void setForcedLevels(int levels) { opt_.levels = levels; }
  int forcedLevels() const { return opt_.levels; }
  // The algorithm among hosts an allreduce of `tensor` runs ("" on one host).
  std::string allreduceAlgoOf(const at::Tensor& tensor) const;
  const LinkCost& linkCost() const { return cost_; }
  void start();
  void setFailureBoard(FailureBoard board);
  // Fails queued operations, stops the progress thread and closes every transport.
  void shutdown();
  // shutdown() for a group given up on, callable from any thread: the operation in flight
  // and every later one fail with `why`, which local peers read at once (the shared-memory
  // abort) and remote ones on the failure board, instead of waiting out the timeout.
  void abort(const std::string& why);
  // The first failure ("" while none): once set, every operation fails.
  std::string failure();

  // Queues a collective on `tensor` and returns its handle. Operations run in submission
  // order, which must be the same on every rank. With runInline, an idle communicator runs
  // it on the calling thread (no hand-off latency) and the handle is complete on return.
  // handleless (with runInline): the caller only waits, so an operation that runs inline gets
  // no handle (nullptr is returned, and its failure is thrown here); one that must queue
  // still gets one.
  std::shared_ptr<CpuWork> submit(OpKind kind, at::Tensor tensor, ReduceOp op, int root,
                               bool runInline, OpArgs args = {}, bool handleless = false);
  // torchring.allreduce's fast path: when `tensor` and `op` are what the Python API's checks
  // would pass unchanged (a contiguous CPU tensor of a supported dtype, an op valid for it)
  // and this is the process that made the communicator, runs the allreduce as submit(...,
  // runInline = true, handleless = true) and waits for it, then returns true; else returns
  // false and does nothing, and the caller takes the checked path, which words the error.
  bool allreduceNow(const at::Tensor& tensor, int op);
  // Point-to-point (p2p.h): not part of the ordered queue; ranks and tags as the caller gives.
  std::shared_ptr<CpuWork> send(at::Tensor tensor, int peer, int64_t tag);
  std::shared_ptr<CpuWork> recv(at::Tensor tensor, int peer, int64_t tag);
  // Bootstrap of point-to-point between hosts (every rank, when numHosts() > 1).
  int listenP2P(const std::string& bindAddr);
  void setP2PPeers(std::vector<std::string> addrs, std::vector<int> ports);
  // For a collective that NCCL runs on the CUDA tensor `like`: queues an operation that only
  // exchanges and compares its header (kind, dtype, count, op, root, shape) with the other
  // ranks, in order with every other operation. Its handle fails, on every rank, when ranks
  // disagree or a peer died; the NCCL watchdog then aborts NCCL with that message.
  std::shared_ptr<CpuWork> submitCheck(OpKind kind, const at::Tensor& like, ReduceOp op, int root);
  // A tensor in this rank's shared-memory arena, or an undefined tensor if none is left.
  at::Tensor emptyShared(at::IntArrayRef sizes, at::ScalarType dtype);
  // Moves the storage of a CPU tensor that torch's allocator made into this rank's arena, in
  // place (every view follows); false when it cannot (no arena, full, memory owned elsewhere,
  // already there). arena_move.cpp.
  bool moveIntoArena(const at::Tensor& tensor);

  int localIndex() const { return localIndex_; }
  int localSize() const { return static_cast<int>(opt_.hosts[hostIndex_].size()); }
  int hostIndex() const { return hostIndex_; }
  int numHosts() const { return static_cast<int>(opt_.hosts.size()); }
  bool isLeader() const { return localIndex_ == 0; }
  bool hasShm() const { return shm_ != nullptr; }
  // Seconds this rank waited for each rank (by rank; shared-memory waits for the ranks of its
  // host, TCP waits of a leader for the other hosts' leaders), since the communicator started.
  std::vector<double> waitedSeconds() const;
  // Seconds this rank (a host's leader) waited while its own link held its sent bytes back
  // (core/waits.h own()): waits no peer caused.
  double ownLinkSeconds() const;
  // This communicator's flight recorder (also listed in FlightRecorder::all()).
  const std::shared_ptr<FlightRecorder>& recorder() const { return recorder_; }

 private:
  struct Op {
    OpHeader header;
    at::Tensor tensor;
    OpArgs args;
    std::shared_ptr<CpuWork> work;  // null: run inline for a caller that waits (submit's handleless)
    std::exception_ptr error;       // how it failed, when it has no work to finish
    uint64_t traceId = 0;  // its flight recorder entry
    bool traceDeferred = false;  // the entry's slot is written only as the operation runs
    uint32_t traceFrame = 0;     // ... with this Python frame
  };
  // Writes the entry of the running operation whose slot was left to write (enqueue), if not
  // yet: the shared-memory header exchange calls it once this rank's header is out, while the
  // rank waits for its peers, and execute() before it marks the operation finished.
  void writeDeferredTrace();
  void checkArgs(OpKind kind, const at::Tensor& tensor, ReduceOp op, int root, const OpArgs& args) const;
  void checkPeer(const at::Tensor& tensor, int peer, int64_t tag, const char* what) const;
  void onP2PFailure(const std::string& message);
  // After an operation: which rank made this one wait longest, and the warning when one rank
  // is persistently late (CommOptions::stragglerSec).
  void noteWaits(const OpHeader& header);
  std::string hostText(int rank) const;
  // The flight recorder's entry of a send or recv, and its start and end on `work`.
  uint64_t recordP2P(OpKind kind, const at::Tensor& tensor, int peer, int64_t tag);
  std::shared_ptr<CpuWork> traced(std::shared_ptr<CpuWork> work, uint64_t traceId);
  void postFailure(const std::string& message);
  OpHeader makeHeader(OpKind kind, const at::Tensor& tensor, ReduceOp op, int root,
                      const OpArgs* args = nullptr) const;
  std::shared_ptr<CpuWork> enqueue(Op item, bool runInline, bool handleless = false);
  void workerLoop();
  // Runs `op` with busy_ set (the one operation in flight); `lock` holds mutex_ on entry and
  // on return, and is released while the operation runs. onWorker: on the progress thread.
  void runExclusive(Op& op, std::unique_lock<std::mutex>& lock, bool onWorker);
  void execute(Op& op);
  // Ends `op`: finishes its handle, or keeps the error for the inline caller that has none.
  void complete(Op& op, at::Tensor result, std::exception_ptr error);
  at::Tensor run(Op& op);
  // Every rank's header, in headers_ (valid until the next operation runs).
  const std::vector<OpHeader>& exchangeHeaders(const OpHeader& header, const at::Tensor& tensor = at::Tensor());
  void checkHeaders(const std::vector<OpHeader>& headers) const;
  void allreduce(char* data, const OpHeader& header, const std::vector<OpHeader>& headers);
  void broadcast(char* data, size_t bytes, int root);
  // `out`, when defined and of the result's size, receives the result (else a new tensor does).
  at::Tensor allgather(const at::Tensor& input, const std::vector<OpHeader>& headers,
                       const at::Tensor& out = at::Tensor());
  at::Tensor reduceScatter(const at::Tensor& input, const OpHeader& header,
                           const std::vector<OpHeader>& headers, const at::Tensor& out = at::Tensor());
  // rooted.cpp: the collectives added on top of the above and of point-to-point transfers.
  at::Tensor reduce(Op& op, const std::vector<OpHeader>& headers);
  at::Tensor gather(Op& op);
  at::Tensor scatter(Op& op);
  at::Tensor alltoall(Op& op);
  void allreduceMany(Op& op, const std::vector<OpHeader>& headers);
  // Waits for point-to-point transfers a collective posted (rethrows the first failure).
  static void waitAll(const std::vector<std::shared_ptr<CpuWork>>& works);
  std::string failedMessage(const OpHeader& header) const;
  // Keeps `message` as the communicator's failure unless one is kept already.
  void keepFailure(const std::string& message);
  AllreduceChoice allreduceAlgo(const OpHeader& header) const;
  // The op to fold with and the factor for the full sum: AVG folds as SUM, and its 1/size and
  // the postscale are applied once, to the full-precision sum.
  std::pair<ReduceOp, double> reductionOf(const OpHeader& header) const;
  // fused.cpp: the leaders' header exchange and the allreduces that ride on it: whether the
  // operation of `header` rides (schedule/cost.h ridesOnHeaders), and the schedule among hosts
  // that `member`, whose header is `header`, then carries (none: no steps).
  bool ridesOnHeaders(const OpHeader& header) const;
  Schedule carriedPlan(const OpHeader& header, int member) const;
  // Every host has several ranks: the host's reduce writes a riding allreduce's leader buffer,
  // so riding copies nothing more (cost.h carrySeconds). Alike on every rank.
  bool staged() const;
  // `all` holds this host's headers; fills the others (carry: what this operation carries;
  // its planOf is set here, from the headers, for every operation alike).
  void exchangeHostHeaders(std::vector<OpHeader>& all, const TcpLinks::Carry* carry);
  at::Tensor runCarried(Op& op);
  // Elements of each host's ranks' rows in a reduce_scatter (hierarchy.cpp).
  std::vector<std::vector<Range>> hostBlocks(const OpHeader& header) const;
  // hierarchy.cpp: the allgather and broadcast algorithm among hosts for these sizes.
  Algo allgatherAlgo(const std::vector<size_t>& hostBytes) const;
  Algo broadcastAlgo(size_t bytes) const;
  std::string rankText() const { return "rank " + std::to_string(opt_.rank); }
  std::string explainPeer(int peer, const std::string& message);
  // A failure another rank posted, asked of the board at most every 0.5 s on a thread of its
  // own ("" while none is known): a rank waiting on a healthy partner learns that the world
  // failed elsewhere without waiting out its own timeout.
  std::string boardNews();

  CommOptions opt_;
  uint64_t forkGeneration_;  // at creation; a forked child's copy never runs or closes
  int hostIndex_ = 0, localIndex_ = 0;
  std::vector<int> rankHost_, rankLocal_;
  std::unique_ptr<ShmGroup> shm_;
  std::unique_ptr<TcpLinks> tcp_;
  LinkCost cost_;  // the job's agreed cost model (setLinkCost)
  std::vector<char> carryWork_;  // fused.cpp: a riding allreduce's leader buffer (kept: no page faults)
  std::unique_ptr<P2P> p2p_;
  FailureBoard board_;
  struct News;
  std::shared_ptr<News> news_;  // boardNews()'s state, shared with its reading thread

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  bool busy_ = false, stopping_ = false;
  std::atomic<bool> runningDone_{false};  // the operation in flight (busy_) has finished
  std::vector<OpHeader> headers_;  // exchangeHeaders' table (one operation runs at a time: busy_)
  uint64_t nextSeq_ = 0;
  // The first failure; every later operation reports it (its errors add kRecoveryHint).
  std::string failure_;
  std::atomic<bool> failed_{false};  // failure_ is set: execute() looks at it only then
  std::thread worker_;
  std::shared_ptr<FlightRecorder> recorder_;
  Op* deferredTrace_ = nullptr;  // the running operation, while its entry waits to be written
  uint64_t nextP2P_ = 0;  // point-to-point operations recorded so far
  // The straggler warning (noteWaits): the late rank of each of the last kLateWindow
  // collectives (-1: none), how often each rank appears there, and who was named already.
  static constexpr int kLateWindow = 20;
  int lateWindow_[kLateWindow];
  int lateNext_ = 0;
  std::vector<int> lateCount_;
  std::vector<bool> lateNamed_;
  // nsPerTick() in seconds, read again when opsToCalibrate_ runs out (noteWaits).
  double secPerTick_ = 0;
  int opsToCalibrate_ = 0;
};

}  // namespace torchring
