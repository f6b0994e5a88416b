#include "common.h"

#include <pthread.h>

#include <atomic>

#include <sstream>

namespace torchring {

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
                                 "uint8",   "int32",   "int64",   "bool"};
  auto i = static_cast<size_t>(dtype);
  return i < sizeof(kNames) / sizeof(kNames[0]) ? kNames[i] : "unknown-dtype";
}

const char* opName(ReduceOp op) {
  static const char* kNames[] = {"SUM", "AVG", "MIN", "MAX", "PRODUCT"};
  auto i = static_cast<size_t>(op);
  return i < 5 ? kNames[i] : "unknown-op";
}

const char* kindName(OpKind kind) {
  static const char* kNames[] = {"allreduce", "broadcast", "allgather", "reduce_scatter",
                                 "barrier"};
  auto i = static_cast<size_t>(kind);
  return i < 5 ? kNames[i] : "unknown-collective";
}

std::string OpHeader::describe() const {
  std::ostringstream out;
  auto k = static_cast<OpKind>(kind);
  if (k == OpKind::BARRIER) return "barrier";
  out << dtypeName(static_cast<DType>(dtype)) << "[" << count << "]";
  if (k == OpKind::ALLGATHER) out << " as " << rows << " rows of " << rowElems;
  if (k == OpKind::ALLREDUCE || k == OpKind::REDUCE_SCATTER) {
    out << " " << opName(static_cast<ReduceOp>(op));
  }
  if (k == OpKind::BROADCAST) out << " root=" << root;
  if (shapeHash != 0) out << " (shape #" << std::hex << (shapeHash & 0xffff) << std::dec << ")";
  out << (onGpu ? " on CUDA" : "");
  return out.str();
}

std::string OpHeader::label() const {
  return std::string(kindName(static_cast<OpKind>(kind))) + " #" + std::to_string(seq);
}

bool OpHeader::matches(const OpHeader& o) const {
  if (kind != o.kind || seq != o.seq || onGpu != o.onGpu) return false;
  switch (static_cast<OpKind>(kind)) {
    case OpKind::BARRIER:
      return true;
    case OpKind::ALLGATHER:
      return dtype == o.dtype && rowElems == o.rowElems && shapeHash == o.shapeHash;
    case OpKind::BROADCAST:
      return dtype == o.dtype && count == o.count && root == o.root;
    default:
      return dtype == o.dtype && count == o.count && op == o.op && shapeHash == o.shapeHash;
  }
}

namespace {
std::atomic<uint64_t> forks{0};
const int forkCounter = pthread_atfork(nullptr, nullptr, [] { forks.fetch_add(1); });
}  // namespace

uint64_t forkGeneration() { return forks.load(std::memory_order_relaxed); }

}  // namespace torchring
