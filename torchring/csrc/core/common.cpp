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
  static const char* kNames[] = {"SUM", "AVG", "MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == kNumReduceOps, "one name per ReduceOp");
  auto i = static_cast<size_t>(op);
  return i < static_cast<size_t>(kNumReduceOps) ? kNames[i] : "unknown-op";
}

// One row per OpKind, in its order.
static const OpSpec kOpSpecs[] = {
    // name             reduces rooted scalable inPlace nccl   ragged
    {"allreduce",       true,   false, true,    true,   true,  false},
    {"broadcast",       false,  true,  false,   true,   true,  false},
    {"allgather",       false,  false, false,   false,  true,  true},
    {"reduce_scatter",  true,   false, true,    false,  true,  false},
    {"barrier",         false,  false, false,   false,  false, false},
    {"reduce",          true,   true,  false,   true,   false, false},
    {"gather",          false,  true,  false,   false,  false, false},
    {"scatter",         false,  true,  false,   true,   false, false},
    {"alltoall",        false,  false, false,   false,  false, true},
    {"allreduce_many",  true,   false, true,    true,   false, false},
    {"send",            false,  false, false,   false,  false, false},
    {"recv",            false,  false, false,   true,   false, false},
};
static_assert(sizeof(kOpSpecs) / sizeof(kOpSpecs[0]) == kNumOpKinds, "one OpSpec row per OpKind");

const OpSpec& opSpec(OpKind kind) {
  static const OpSpec kUnknown{"unknown-collective", false, false, false, false, false, false};
  auto i = static_cast<size_t>(kind);
  return i < static_cast<size_t>(kNumOpKinds) ? kOpSpecs[i] : kUnknown;
}

const char* kindName(OpKind kind) { return opSpec(kind).name; }

bool isFloating(DType dtype) {
  return dtype == DType::F32 || dtype == DType::F64 || dtype == DType::F16 || dtype == DType::BF16;
}

bool isBitwise(ReduceOp op) { return op == ReduceOp::BAND || op == ReduceOp::BOR || op == ReduceOp::BXOR; }

Refusal reductionRefusal(OpKind kind, DType dtype, ReduceOp op, bool scaled) {
  if (!opSpec(kind).reduces) return Refusal::NONE;
  if (dtype == DType::BOOL && op != ReduceOp::MIN && op != ReduceOp::MAX && !isBitwise(op)) return Refusal::BOOL_OP;
  if (isBitwise(op) && isFloating(dtype)) return Refusal::BITWISE_FLOAT;
  if (op == ReduceOp::AVG && !isFloating(dtype)) return Refusal::AVG_INTEGER;
  if (scaled && !isFloating(dtype)) return Refusal::SCALED_INTEGER;
  return Refusal::NONE;
}

const char* refusalText(Refusal refusal) {
  switch (refusal) {
    case Refusal::NONE:
      return "";
    case Refusal::BOOL_OP:
      return "bool tensors reduce with MIN, MAX, BAND, BOR and BXOR only; convert to an integer dtype to sum or "
             "multiply";
    case Refusal::BITWISE_FLOAT:
      return "BAND, BOR and BXOR need an integer or bool tensor (bits of a floating-point number are not a "
             "number torch combines bitwise); view it as an integer dtype of the same size, or use another op";
    case Refusal::AVG_INTEGER:
      return "AVG needs a floating-point tensor (an integer average would be rounded); use SUM and divide, or "
             "convert to float";
    case Refusal::SCALED_INTEGER:
      return "prescale and postscale factors need a floating-point tensor (an integer tensor would be rounded); "
             "scale it yourself or convert it to float";
  }
  return "";
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
  // The same spelling as Python's torchring._core.types.describe(): float32[10, 100].
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
  const OpSpec& spec = opSpec(k);
  if (spec.reduces) out << " " << opName(static_cast<ReduceOp>(op));
  if (prescale != 1.0) out << " prescale=" << prescale;
  if (postscale != 1.0) out << " postscale=" << postscale;
  if (spec.rooted) out << " root=" << root;
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

// What must agree is read off the kind's OpSpec row: the dtype always; the rows' shape of a
// ragged kind (dim 0 may differ), else the count and the whole shape; the op of a reduction,
// the root of a rooted kind, the factors of a scalable one. allreduce_many's header describes
// its tensors by number and a hash of their shapes.
bool OpHeader::matches(const OpHeader& o) const {
  if (kind != o.kind || seq != o.seq || onGpu != o.onGpu) return false;
  const auto k = static_cast<OpKind>(kind);
  if (k == OpKind::BARRIER) return true;
  const OpSpec& spec = opSpec(k);
  if (dtype != o.dtype) return false;
  if (spec.ragged) return rowElems == o.rowElems && sameShape(o, 1);
  if (count != o.count) return false;
  if (spec.reduces && op != o.op) return false;
  if (algo != o.algo || levels != o.levels) return false;
  if (spec.rooted && root != o.root) return false;
  if (spec.scalable && (prescale != o.prescale || postscale != o.postscale)) return false;
  if (k == OpKind::ALLREDUCE_MANY) return rows == o.rows && shapesHash == o.shapesHash;
  return sameShape(o, 0);
}

bool OpHeader::sameForAll(const OpHeader& o) const {
  return matches(o) && count == o.count && rows == o.rows && sameShape(o, 0);
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
