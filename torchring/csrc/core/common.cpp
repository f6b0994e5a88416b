#include "core/common.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstdio>
#include <mutex>

#include <sstream>

namespace torchring {

const Advice kRecoveryHint = {
    "the communicator failed: call torchring.shutdown() and torchring.init() on every rank to "
    "start over (or let torchrun --max-restarts restart the job)",
    "the process group failed: call dist.destroy_process_group() and dist.init_process_group() on "
    "every rank to start over (or let torchrun --max-restarts restart the job)"};
const Advice kRaiseTimeout = {"raise TORCHRING_TIMEOUT", "raise init_process_group(timeout=...)"};
const Advice kShutdownCall = {"torchring.shutdown()", "dist.destroy_process_group()"};
const Advice kInitCall = {"torchring.init()", "dist.init_process_group()"};
const Advice* const kAllAdvice[4] = {&kRecoveryHint, &kRaiseTimeout, &kShutdownCall, &kInitCall};

size_t elementSize(DType dtype) {
  switch (dtype) {
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::F16:
    case DType::BF16:
    case DType::I16:
      return 2;
    case DType::I8:
    case DType::U8:
    case DType::BOOL:
      return 1;
  }
  return 0;
}

const char* dtypeName(DType dtype) {
  static const char* kNames[] = {"float32", "float64", "float16", "bfloat16", "int8",
                                 "uint8",   "int32",   "int64",   "bool",     "int16"};
  auto i = static_cast<size_t>(dtype);
  return i < sizeof(kNames) / sizeof(kNames[0]) ? kNames[i] : "unknown-dtype";
}

const char* opName(ReduceOp op) {
  static const char* kNames[] = {"SUM", "AVG", "MIN", "MAX", "PRODUCT"};
  auto i = static_cast<size_t>(op);
  return i < 5 ? kNames[i] : "unknown-op";
}

const char* kindName(OpKind kind) {
  static const char* kNames[] = {"allreduce", "broadcast",     "allgather", "reduce_scatter",
                                 "barrier",   "reduce",        "gather",    "scatter",
                                 "alltoall",  "allreduce_many", "send",     "recv"};
  auto i = static_cast<size_t>(kind);
  return i < static_cast<size_t>(kNumOpKinds) ? kNames[i] : "unknown-collective";
}

void OpHeader::setShape(const int64_t* sizes, int n) {
  ndim = static_cast<uint8_t>(n);
  for (int d = 0; d < n && d < kMaxDims; ++d) dims[d] = sizes[d];
  if (n > kMaxDims) {
    uint64_t hash = 1469598103934665603ull;  // FNV-1a over the dims that do not fit
    for (int d = kMaxDims - 1; d < n; ++d) hash = (hash ^ static_cast<uint64_t>(sizes[d])) * 1099511628211ull;
    dims[kMaxDims - 1] = static_cast<int64_t>(hash);
  }
}

std::string OpHeader::describe() const {
  std::ostringstream out;
  auto k = static_cast<OpKind>(kind);
  if (k == OpKind::BARRIER) return "barrier";
  // The same spelling as Python's torchring._types.describe(): float32[10, 100].
  out << dtypeName(static_cast<DType>(dtype)) << "[";
  for (int d = 0; d < ndim && d < kMaxDims; ++d) {
    if (d > 0) out << ", ";
    if (d == kMaxDims - 1 && ndim > kMaxDims) {
      out << "...";
    } else {
      out << dims[d];
    }
  }
  out << "]";
  if (k == OpKind::ALLREDUCE_MANY) out << " in " << rows << " tensors";
  if (k == OpKind::ALLREDUCE || k == OpKind::REDUCE_SCATTER || k == OpKind::REDUCE ||
      k == OpKind::ALLREDUCE_MANY) {
    out << " " << opName(static_cast<ReduceOp>(op));
  }
  if (prescale != 1.0) out << " prescale=" << prescale;
  if (postscale != 1.0) out << " postscale=" << postscale;
  if (k == OpKind::BROADCAST || k == OpKind::REDUCE || k == OpKind::GATHER || k == OpKind::SCATTER) {
    out << " root=" << root;
  }
  out << (onGpu ? " on CUDA" : "");
  return out.str();
}

bool OpHeader::sameShape(const OpHeader& o, int fromDim) const {
  if (ndim != o.ndim) return false;
  for (int d = fromDim; d < ndim && d < kMaxDims; ++d) {
    if (dims[d] != o.dims[d]) return false;
  }
  return true;
}

std::string OpHeader::label() const {
  return std::string(kindName(static_cast<OpKind>(kind))) + " #" + std::to_string(seq);
}

std::string OpHeader::what() const {
  if (static_cast<OpKind>(kind) == OpKind::BARRIER) return label();
  return label() + " " + describe();
}

bool OpHeader::matches(const OpHeader& o) const {
  if (kind != o.kind || seq != o.seq || onGpu != o.onGpu) return false;
  switch (static_cast<OpKind>(kind)) {
    case OpKind::BARRIER:
      return true;
    case OpKind::ALLGATHER:  // dim 0 may differ per rank; the rows' shape may not
    case OpKind::ALLTOALL:
      return dtype == o.dtype && rowElems == o.rowElems && sameShape(o, 1);
    case OpKind::BROADCAST:
    case OpKind::GATHER:
    case OpKind::SCATTER:
      return dtype == o.dtype && count == o.count && root == o.root && sameShape(o, 0);
    case OpKind::REDUCE:
      return dtype == o.dtype && count == o.count && op == o.op && root == o.root && sameShape(o, 0);
    case OpKind::ALLREDUCE_MANY:
      return dtype == o.dtype && count == o.count && op == o.op && rows == o.rows &&
             shapesHash == o.shapesHash && prescale == o.prescale && postscale == o.postscale;
    default:
      return dtype == o.dtype && count == o.count && op == o.op && sameShape(o, 0) &&
             prescale == o.prescale && postscale == o.postscale;
  }
}

namespace {
std::mutex sinkMutex;
std::function<void(const std::string&)>* warningSink = nullptr;  // leaked: outlives every caller
}  // namespace

void setWarningSink(std::function<void(const std::string&)> sink) {
  std::lock_guard<std::mutex> lock(sinkMutex);
  if (warningSink == nullptr) warningSink = new std::function<void(const std::string&)>();
  *warningSink = std::move(sink);
}

void warn(const std::string& message) {
  std::function<void(const std::string&)> sink;
  {
    std::lock_guard<std::mutex> lock(sinkMutex);
    if (warningSink != nullptr) sink = *warningSink;  // called without the lock held
  }
  if (sink) {
    sink(message);
  } else {
    std::fprintf(stderr, "torchring: %s\n", message.c_str());
  }
}

namespace {
std::atomic<uint64_t> forks{0};
const int forkCounter = pthread_atfork(nullptr, nullptr, [] { forks.fetch_add(1); });
}  // namespace

int farthestPageShift(int origin, int step, const int* taken, int n) {
  constexpr int kPage = 4096;
  int best = 0, bestGap = -1;
  for (int shift = 0; shift < kPage; shift += step) {
    const int at = (origin + shift) % kPage;
    int gap = kPage;
    for (int i = 0; i < n; ++i) {
      const int d = std::abs(at - taken[i] % kPage);
      gap = std::min(gap, std::min(d, kPage - d));
    }
    if (gap > bestGap) best = shift, bestGap = gap;
  }
  return best;
}

uint64_t forkGeneration() { return forks.load(std::memory_order_relaxed); }

}  // namespace torchring
