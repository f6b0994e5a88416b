#include "engine/communicator.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "core/reduce.h"

namespace torchring {

Communicator::Communicator(CommOptions options)
    : opt_(std::move(options)), forkGeneration_(forkGeneration()), recorder_(FlightRecorder::create(opt_.traceEntries)) {
  if (opt_.size < 1 || opt_.rank < 0 || opt_.rank >= opt_.size) {
    throw std::invalid_argument("CommOptions: rank " + std::to_string(opt_.rank) +
                                " must be in [0, size) with size >= 1, got size " + std::to_string(opt_.size));
  }
  std::vector<int> traceRanks = opt_.traceRanks;
  if (traceRanks.empty()) {
    for (int r = 0; r < opt_.size; ++r) traceRanks.push_back(r);
  }
  recorder_->setIdentity(opt_.traceName, opt_.traceDesc, std::move(traceRanks));
  if (opt_.header != 0 && opt_.header != static_cast<int>(Algo::Doubling) &&
      opt_.header != static_cast<int>(Algo::Multiplying)) {
    throw std::invalid_argument("CommOptions: header must be 0 (auto), doubling or multiplying, got " +
                                std::to_string(opt_.header));
  }
  setLinkCost(cost_);  // the forced header shape, before any measurement
  std::fill(std::begin(lateWindow_), std::end(lateWindow_), -1);
  lateCount_.assign(opt_.size, 0);
  lateNamed_.assign(opt_.size, false);
  rankHost_.assign(opt_.size, -1);
  rankLocal_.assign(opt_.size, -1);
  for (size_t h = 0; h < opt_.hosts.size(); ++h) {
    for (size_t i = 0; i < opt_.hosts[h].size(); ++i) {
      int r = opt_.hosts[h][i];
      if (r < 0 || r >= opt_.size || rankHost_[r] != -1) {
        throw std::invalid_argument(rankText() + ": CommOptions.hosts lists rank " + std::to_string(r) +
                                    " twice or outside [0, " + std::to_string(opt_.size) + ")");
      }
      rankHost_[r] = static_cast<int>(h);
      rankLocal_[r] = static_cast<int>(i);
    }
  }
  for (int r = 0; r < opt_.size; ++r) {
    if (rankHost_[r] < 0) {
      throw std::invalid_argument(rankText() + ": CommOptions.hosts misses rank " + std::to_string(r));
    }
  }
  hostIndex_ = rankHost_[opt_.rank];
  localIndex_ = rankLocal_[opt_.rank];
  if (localSize() > 1) {
    ShmOptions so;
    so.worldSize = opt_.size;
    so.localRanks = opt_.hosts[hostIndex_];
    so.localIndex = localIndex_;
    so.segmentBytes = opt_.segmentBytes;
    so.oneShotBytes = opt_.oneShotBytes;
    so.stagingStores = static_cast<StorePolicy>(opt_.stagingStores);
    so.arenaBytes = opt_.arenaBytes;
    so.timeoutSec = opt_.timeoutSec;
    so.spinIters = opt_.spinIters;
    so.spinAuto = opt_.spinAuto;
    shm_ = std::make_unique<ShmGroup>(so);
  }
  if (numHosts() > 1 && isLeader()) {
    TcpOptions to;
    to.rank = opt_.rank;
    to.member = hostIndex_;
    for (const auto& host : opt_.hosts) to.memberRanks.push_back(host[0]);
    to.secret = opt_.secret;
    to.timeoutSec = opt_.timeoutSec;
    tcp_ = std::make_unique<TcpLinks>(to);
  }
  if (opt_.size > 1) {
    P2POptions po;
    po.rank = opt_.rank;
    po.size = opt_.size;
    po.rankHost = rankHost_;
    po.rankLocal = rankLocal_;
    po.timeoutSec = opt_.timeoutSec;
    po.secret = opt_.secret;
    po.spinIters = opt_.spinIters;
    po.label = opt_.label;
    p2p_ = std::make_unique<P2P>(po, shm_.get());
  }
}

Communicator::~Communicator() { shutdown(); }

std::string Communicator::createShm(const std::string& nameTag) {
  return shm_ ? shm_->create(nameTag) : std::string();
}

int Communicator::listen(const std::string& bindAddr) { return tcp_ ? tcp_->listen(bindAddr) : -1; }

void Communicator::attachShm(const std::vector<std::string>& names) {
  if (shm_) shm_->attach(names);
}

void Communicator::unlinkShm() {
  if (shm_) shm_->unlinkOwn();
}

void Communicator::connectLinks(const std::vector<std::string>& addrs, const std::vector<int>& ports) {
  if (tcp_) tcp_->connect(addrs, ports);
}

LinkCost Communicator::measureLinks() { return tcp_ ? tcp_->measure() : LinkCost(); }


int Communicator::listenP2P(const std::string& bindAddr) { return p2p_ ? p2p_->listen(bindAddr) : -1; }

void Communicator::setP2PPeers(std::vector<std::string> addrs, std::vector<int> ports) {
  if (p2p_) p2p_->setPeers(std::move(addrs), std::move(ports));
}

void Communicator::start() {
  recorder_->setWaits([weak = weak_from_this()] {
    auto comm = weak.lock();
    return comm ? WaitTotals{comm->waitedSeconds(), comm->ownLinkSeconds()} : WaitTotals();
  });
  if (tcp_ && shm_) tcp_->setOnProgress([this] { shm_->heartbeat(); });
  if (shm_) shm_->setOnArrived([this] { writeDeferredTrace(); });
  if (p2p_) p2p_->setOnFailure([this](const std::string& message) { onP2PFailure(message); });
  worker_ = std::thread([this] { workerLoop(); });
}

void Communicator::setFailureBoard(FailureBoard board) {
  board_ = std::move(board);
  if (tcp_) {
    tcp_->setExplain([this](int peer, const std::string& message) { return explainPeer(peer, message); });
    if (board_.latest) tcp_->setNews([this] { return boardNews(); });
  }
}

void Communicator::shutdown() {
  if (forkGeneration() != forkGeneration_) {
    // A forked child's copy: it has no worker thread and shares the parent's sockets and
    // shared memory, so closing or aborting anything would break the parent's job, and
    // destroying its mutex and condition variable (a parent thread may have waited on them
    // at fork time) can block forever. Keep the object for the rest of the child's life.
    static auto* forked = new std::vector<std::shared_ptr<Communicator>>();
    try {
      forked->push_back(shared_from_this());
    } catch (const std::bad_weak_ptr&) {  // already being destroyed: touch the least we can
      new (&worker_) std::thread();
      (void)tcp_.release();
      (void)shm_.release();
      (void)p2p_.release();
    }
    return;
  }
  std::deque<Op> dropped;
  bool inFlight = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
    dropped.swap(queue_);
    // An operation already complete (complete(): its handle finished, or its error kept for
    // the inline caller) is only clearing busy_ (its caller may have seen the result and shut
    // down in that instant): waiting for it is immediate, and aborting would fail the peers
    // still finishing that very operation.
    inFlight = busy_ && !runningDone_.load();
  }
  cv_.notify_all();
  if (!inFlight) {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return !busy_; });
  } else {
    // An operation is running (on the worker or inline on another thread): make it fail
    // now instead of after the timeout, and wait for it before tearing the transports down.
    if (shm_) {
      shm_->abort("rank " + std::to_string(opt_.rank) + " called " + kShutdownCall.torchring + " during a collective");
    }
    if (tcp_) tcp_->interrupt();
    if (p2p_) p2p_->shutdown();  // its pending transfers fail: a collective waiting on them returns
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return !busy_; });
  }
  if (p2p_) p2p_->shutdown();
  for (auto& op : dropped) {
    op.work->finish({}, std::make_exception_ptr(TorchringError(
                            rankText() + ": " + op.header.label() +
                            " was not run: " + kShutdownCall.torchring + " was called while it was queued")));
  }
  if (worker_.joinable()) worker_.join();
  if (shm_) shm_->depart();  // every operation this rank started is over: peers stop waiting
  if (tcp_) tcp_->close();
  if (shm_) shm_->unlinkOwn();
}

OpHeader Communicator::makeHeader(OpKind kind, const at::Tensor& tensor, ReduceOp op, int root,
                                  const OpArgs* args) const {
  OpHeader header;
  header.kind = static_cast<uint8_t>(kind);
  header.op = static_cast<uint8_t>(op);
  header.root = root;
  if (args != nullptr) {
    header.prescale = args->prescale;
    header.postscale = args->postscale;
  }
  if (kind == OpKind::ALLREDUCE_MANY && args != nullptr) {
    uint64_t hash = 1469598103934665603ull;  // FNV-1a over every tensor's rank and dims
    for (const auto& t : args->tensors) {
      header.count += static_cast<uint64_t>(t.numel());
      hash = (hash ^ static_cast<uint64_t>(t.dim())) * 1099511628211ull;
      for (int64_t d : t.sizes()) hash = (hash ^ static_cast<uint64_t>(d)) * 1099511628211ull;
    }
    header.rows = args->tensors.size();
    header.shapesHash = hash;
    header.dtype = static_cast<uint8_t>(toDType(args->tensors[0].scalar_type()));
    const int64_t total = static_cast<int64_t>(header.count);
    header.setShape(&total, 1);
    return header;
  }
  if (!tensor.defined()) return header;
  header.dtype = static_cast<uint8_t>(toDType(tensor.scalar_type()));
  header.count = static_cast<uint64_t>(tensor.numel());
  header.setShape(tensor.sizes().data(), static_cast<int>(tensor.dim()));
  if (opSpec(kind).ragged) {  // allgather, alltoall: the rows may differ, their shape may not
    header.rows = tensor.dim() > 0 ? static_cast<uint64_t>(tensor.size(0)) : 1;
    header.rowElems = 1;
    for (int d = 1; d < tensor.dim(); ++d) header.rowElems *= static_cast<uint64_t>(tensor.size(d));
  }
  if (shm_ && kind == OpKind::ALLREDUCE && tensor.device().is_cpu()) {
    header.pageOffset = static_cast<uint16_t>(reinterpret_cast<uintptr_t>(tensor.data_ptr()) % 4096 & ~uintptr_t{63});
    header.arenaOffset = shm_->arenaOffsetOf(tensor.data_ptr(), tensor.nbytes());
  }
  return header;
}

std::shared_ptr<CpuWork> Communicator::submit(OpKind kind, at::Tensor tensor, ReduceOp op, int root,
                                           bool runInline, OpArgs args, bool handleless) {
  try {
    checkArgs(kind, tensor, op, root, args);
  } catch (...) {
    FlightRecorder::clearCallerFrame();  // the frame was the refused call's
    throw;
  }
  Op item;
  item.header = makeHeader(kind, tensor, op, root, &args);
  const AllreduceChoice choice = allreduceAlgo(item.header);
  item.header.algo = static_cast<uint8_t>(choice.algo);
  item.header.levels = static_cast<uint8_t>(choice.levels);
  item.tensor = std::move(tensor);
  item.args = std::move(args);
  return enqueue(std::move(item), runInline, handleless);
}

// The Python checks of allreduce (collectives/_checks.py check_tensor, check_op), in C++.
static bool plainAllreduceArgs(const at::Tensor& t, int op) {
  if (!t.defined() || t.layout() != at::kStrided || !t.device().is_cpu() || !t.is_contiguous()) return false;
  if (op < 0 || op >= kNumReduceOps) return false;
  DType dtype;
  return engineDType(t.scalar_type(), &dtype) &&
         reductionRefusal(OpKind::ALLREDUCE, dtype, static_cast<ReduceOp>(op), false) == Refusal::NONE;
}

bool Communicator::allreduceNow(const at::Tensor& tensor, int op) {
  if (!plainAllreduceArgs(tensor, op) || forkGeneration() != forkGeneration_) return false;
  // No handle when it runs inline: its allocation, locks and wake-up were ~90 of a world-1 call's 410 ns.
  auto work = submit(OpKind::ALLREDUCE, tensor, static_cast<ReduceOp>(op), -1, true, {}, true);
  if (work) work->wait(0);
  return true;
}

void Communicator::abort(const std::string& why) {
  if (forkGeneration() == forkGeneration_) {  // a forked child's copy only lets go (shutdown)
    keepFailure(why);
    if (shm_) shm_->abort(why);
    postFailure(why);  // before the links close (see execute)
    if (tcp_) tcp_->interrupt();
  }
  shutdown();
}

void Communicator::keepFailure(const std::string& message) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_.empty()) failure_ = message;
  failed_.store(true, std::memory_order_release);
}

std::string Communicator::failure() {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

std::shared_ptr<CpuWork> Communicator::submitCheck(OpKind kind, const at::Tensor& like, ReduceOp op,
                                                int root) {
  Op item;
  item.header = makeHeader(kind, like, op, root);
  item.header.onGpu = 1;  // no tensor is kept: run() compares headers and moves nothing
  return enqueue(std::move(item), false);
}

std::shared_ptr<CpuWork> Communicator::enqueue(Op item, bool runInline, bool handleless) {
  const auto kind = static_cast<OpKind>(item.header.kind);
  const uint32_t frame = recorder_->enabled() ? FlightRecorder::callerFrame() : 0;
  if (forkGeneration() != forkGeneration_) {
    throw TorchringError("rank " + std::to_string(opt_.rank) + ": " + kindName(kind) +
                         " called in a forked child process (pid " + std::to_string(getpid()) +
                         ") of that rank: collectives run only in the process that called " + kInitCall.torchring +
                         "; run them in the main process, not in DataLoader "
                         "workers or other forks");
  }
  std::unique_lock<std::mutex> lock(mutex_);
  item.header.seq = nextSeq_++;
  const bool runNow = runInline && queue_.empty() && !busy_ && !stopping_;
  // One that runs now on one host, where its first step is the shared-memory header exchange:
  // its entry's slot is written there, once this rank's header is out (writeDeferredTrace),
  // away from this lock and where the stores can overlap the wait for the peers (a point of a
  // 4 KiB allreduce's time, benchmarks/RESULTS.md). Its times then start at that moment. It is
  // written before the rank can block, so a hang still shows it.
  item.traceId = recorder_->reserve();
  if (runNow && shm_ && numHosts() == 1 && recorder_->enabled()) {
    item.traceDeferred = true;
    item.traceFrame = frame;
  } else {
    recorder_->fill(item.traceId, item.header, frame, runNow);
  }
  if (runNow && handleless) {
    runExclusive(item, lock, false);
    lock.unlock();
    if (item.error) std::rethrow_exception(withContext(item.error, opt_.label));
    return nullptr;
  }
  item.work = std::make_shared<CpuWork>(kind, item.header.seq, opt_.rank);
  item.work->setContext(opt_.label);
  auto work = item.work;
  if (stopping_) {
    lock.unlock();
    recorder_->finished(item.traceId, false);
    work->finish({}, std::make_exception_ptr(TorchringError(
                         rankText() + ": " + kindName(kind) +
                         ": torchring was shut down; call " + kInitCall.torchring + " first")));
    return work;
  }
  if (runNow) {
    runExclusive(item, lock, false);
    return work;
  }
  queue_.push_back(std::move(item));
  lock.unlock();
  cv_.notify_all();
  return work;
}

void Communicator::workerLoop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || (!queue_.empty() && !busy_); });
    if (stopping_) return;
    Op op = std::move(queue_.front());
    queue_.pop_front();
    runExclusive(op, lock, true);
  }
}

void Communicator::runExclusive(Op& op, std::unique_lock<std::mutex>& lock, bool onWorker) {
  busy_ = true;
  runningDone_.store(false);
  lock.unlock();
  if (shm_) shm_->setOnProgressThread(onWorker);
  execute(op);
  lock.lock();
  busy_ = false;
  // shutdown() may wait for busy_ to clear, the worker for a free slot when work is queued.
  // Only then: waking the idle worker after every inline call would cost each call a
  // context switch on the caller's core.
  if (stopping_ || !queue_.empty()) cv_.notify_all();
}

std::string Communicator::failedMessage(const OpHeader& header) const {
  return rankText() + ": " + header.label() + " was not run because the communicator failed earlier: " +
         failure_;
}

// Runs one operation and completes it (complete(): its handle, or the error an inline caller
// without one throws). A mismatch (thrown by checkHeaders, after the header exchange and
// before any data moved) fails only this operation: every rank saw the
// same table of headers, so every rank fails it the same way and the next operation starts
// from the same state everywhere. Any other failure fails the communicator: the peers are
// told (shared-memory abort, ring sockets closed, failure board), and every later operation
// reports the first failure.
void Communicator::execute(Op& op) {
  if (op.traceDeferred) {
    deferredTrace_ = &op;
  } else {
    recorder_->started(op.traceId);
  }
  if (shm_) shm_->waits().startOp();
  if (tcp_) tcp_->waits().startOp();
  if (failed_.load(std::memory_order_acquire)) {  // set with failure_ (keepFailure): no lock per operation
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_.empty()) {
      writeDeferredTrace();
      recorder_->finished(op.traceId, false);
      complete(op, {}, std::make_exception_ptr(CommFailedError(failedMessage(op.header), kRecoveryHint)));
      return;
    }
  }
  std::exception_ptr error;
  std::string failure;
  at::Tensor result;
  try {
    // A local peer aborted the group (Communicator::abort, or its own failure): every wait of
    // this operation may already be satisfied by what that peer staged before, so look first.
    const std::string aborted = shm_ ? shm_->abortMessage() : std::string();
    if (!aborted.empty()) {
      throw CommFailedError(rankText() + ": " + op.header.label() + " aborted because another rank failed: " + aborted);
    }
    result = run(op);
    noteWaits(op.header);
  } catch (const MismatchError&) {
    if (shm_) shm_->markDone(op.header.seq);
    noteWaits(op.header);
    error = std::current_exception();
    FlightRecorder::notifyFailure();
  } catch (const std::exception& e) {
    failure = e.what();
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_.empty()) {  // failed elsewhere first (point-to-point): say that, not the echo
      failure = rankText() + ": " + op.header.label() + " failed because the communicator failed: " + failure_;
    }
  }
  if (!failure.empty()) {
    keepFailure(failure);
    if (shm_) shm_->abort(failure);
    postFailure(failure);  // before the links close: a partner that sees them close reads it at once
    if (tcp_) tcp_->close();
    if (p2p_) p2p_->fail(failure);
    error = std::make_exception_ptr(CommFailedError(failure, kRecoveryHint));
    recorder_->setFailure(failure);
    FlightRecorder::notifyFailure();
  }
  writeDeferredTrace();  // an operation that failed before its header went out
  recorder_->finished(op.traceId, error == nullptr);
  op.tensor = at::Tensor();
  op.args = OpArgs();
  complete(op, std::move(result), error);
}

void Communicator::writeDeferredTrace() {
  if (Op* op = deferredTrace_) {
    deferredTrace_ = nullptr;
    recorder_->fill(op->traceId, op->header, op->traceFrame, true);
  }
}

void Communicator::complete(Op& op, at::Tensor result, std::exception_ptr error) {
  // Before the handle wakes its waiter: one that then shuts down must find the operation over.
  runningDone_.store(true);
  if (op.work) {
    op.work->finish(std::move(result), error);
  } else {
    op.error = std::move(error);
  }
}

at::Tensor Communicator::run(Op& op) {
  const OpHeader& header = op.header;
  if (shm_) shm_->setCurrent(header);
  if (tcp_) {
    tcp_->setOp(header);
  }
  if (numHosts() > 1 && ridesOnHeaders(header)) return runCarried(op);
  const std::vector<OpHeader>& headers = exchangeHeaders(header, op.tensor);
  checkHeaders(headers);
  if (header.onGpu) {  // NCCL moves this operation's data
    if (shm_) shm_->markDone(header.seq);
    return {};
  }
  at::Tensor result = op.tensor;
  char* data = op.tensor.defined() ? static_cast<char*>(op.tensor.data_ptr()) : nullptr;
  switch (static_cast<OpKind>(header.kind)) {
    case OpKind::REDUCE_SCATTER:
      result = reduceScatter(op.tensor, header, headers, op.args.out);
      if (op.args.out.defined() && !result.is_same(op.args.out)) result = op.args.out.copy_(result);
      break;
    case OpKind::ALLREDUCE:
      if (header.prescale != 1.0) scaleInPlace(data, header.count, static_cast<DType>(header.dtype), header.prescale);
      allreduce(data, header, headers);
      break;
    case OpKind::REDUCE:
      result = reduce(op, headers);
      break;
    case OpKind::GATHER:
      result = gather(op);
      break;
    case OpKind::SCATTER:
      result = scatter(op);
      break;
    case OpKind::ALLTOALL:
      result = alltoall(op);
      break;
    case OpKind::ALLREDUCE_MANY:
      allreduceMany(op, headers);
      result = at::Tensor();
      break;
    case OpKind::SEND:
    case OpKind::RECV:
      TORCH_INTERNAL_ASSERT(false, "point-to-point operations are not queued");
    case OpKind::BROADCAST:
      broadcast(data, op.tensor.nbytes(), header.root);
      break;
    case OpKind::ALLGATHER:
      result = allgather(op.tensor, headers, op.args.out);
      break;
    case OpKind::BARRIER:
      break;
  }
  if (shm_) shm_->markDone(header.seq);
  return result;
}

// Every rank learns every rank's header: within a host through shared memory, between
// hosts by the leaders' header exchange (fused.cpp), who then publish the full table locally. On
// one host a small allreduce stages `tensor`'s data with its header (one synchronization
// for both, ShmGroup::fitsOneSync).
const std::vector<OpHeader>& Communicator::exchangeHeaders(const OpHeader& header, const at::Tensor& tensor) {
  std::vector<OpHeader>& all = headers_;
  all.assign(opt_.size, OpHeader());
  all[opt_.rank] = header;
  if (shm_ && numHosts() == 1 && tensor.defined() && shm_->fitsOneSync(header)) {
    shm_->exchangeHeadersWithData(header, static_cast<const char*>(tensor.data_ptr()), all);
    return all;
  }
  if (shm_) shm_->exchangeHeaders(header, all);
  if (numHosts() == 1) return all;
  exchangeHostHeaders(all, nullptr);
  return all;
}

// "allreduce float32[10, 100] SUM", "barrier": what a rank sent, in a mismatch message.
static std::string sentText(const OpHeader& header) {
  const auto kind = static_cast<OpKind>(header.kind);
  return kind == OpKind::BARRIER ? kindName(kind) : std::string(kindName(kind)) + " " + header.describe();
}

// Compares every rank's header with rank 0's. Every rank holds the same table, so every
// rank throws the same MismatchError, naming the first rank that differs and what each sent.
void Communicator::checkHeaders(const std::vector<OpHeader>& headers) const {
  const OpHeader& first = headers[0];
  for (int r = 1; r < opt_.size; ++r) {
    const OpHeader& other = headers[r];
    if (other.matches(first)) continue;
    std::ostringstream msg;
    OpHeader sameAlgo = other;
    sameAlgo.algo = first.algo;
    sameAlgo.levels = first.levels;
    if (sameAlgo.matches(first)) {  // only the cross-host algorithm differs
      msg << rankText() << ": collective #" << first.seq << " (" << sentText(first)
          << "): ranks chose different algorithms among hosts: rank 0 "
          << choiceName({static_cast<Algo>(first.algo), first.levels}) << ", rank " << r << " "
          << choiceName({static_cast<Algo>(other.algo), other.levels})
          << "; set TORCHRING_ALGO to the same value on every rank (or leave it unset). Nothing was "
             "sent: this operation failed on every rank and the next collective runs normally";
      throw MismatchError(msg.str());
    }
    msg << rankText() << ": collective #" << first.seq << " does not match across ranks: rank 0 sent "
        << sentText(first) << ", rank " << r << " sent " << sentText(other)
        << "; every rank must issue the same collectives in the same order with the same dtype, "
           "shape, op and root (allgather: dim 0 may differ). Nothing was sent: this operation "
           "failed on every rank and the next collective runs normally";
    throw MismatchError(msg.str());
  }
}

at::Tensor Communicator::emptyShared(at::IntArrayRef sizes, at::ScalarType dtype) {
  if (!shm_ || !shm_->arena()) return at::Tensor();
  auto options = at::TensorOptions().dtype(dtype);
  int64_t numel = 1;
  for (auto s : sizes) numel *= s;
  size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  auto arena = shm_->arena();
  int64_t offset = arena->alloc(bytes);
  if (offset < 0) return at::Tensor();
  return at::from_blob(arena->base() + offset, sizes, [arena, offset](void*) { arena->free(offset); },
                       options);
}

}  // namespace torchring
