// Types shared by every part of the engine: dtypes, reduce ops, the per-operation
// header that ranks compare before moving data, and the engine's error type.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace torchring {

// A recoverable failure of a collective: a dead or silent peer, a timeout, or ranks that
// disagree on what to run. The communicator is unusable afterwards and must be rebuilt
// (torchring.shutdown(); torchring.init()). Surfaces in Python as torchring.TorchringError.
class TorchringError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class ReduceOp : uint8_t { SUM = 0, AVG = 1, MIN = 2, MAX = 3, PRODUCT = 4 };
enum class DType : uint8_t { F32 = 0, F64, F16, BF16, I8, U8, I32, I64, BOOL };
enum class OpKind : uint8_t { ALLREDUCE = 0, BROADCAST, ALLGATHER, REDUCE_SCATTER, BARRIER };

size_t elementSize(DType dtype);
const char* dtypeName(DType dtype);
const char* opName(ReduceOp op);
const char* kindName(OpKind kind);

// What one rank says it is about to run. Every rank publishes its header for operation
// number `seq` and checks all the others before any data moves, so a mismatch becomes an
// error on every rank instead of a hang or wrong numbers. Plain data: it is copied through
// shared memory and sockets as bytes.
struct OpHeader {
  uint64_t seq = 0;          // operation sequence number, counted per process from 0
  uint64_t count = 0;        // elements this rank contributes
  uint64_t rowElems = 0;     // allgather: elements per dim-0 row (must match); else 0
  uint64_t rows = 0;         // allgather: dim-0 size of this rank's tensor (may differ)
  uint64_t shapeHash = 0;    // allgather: trailing dims; reduce_scatter: all dims (must match)
  int64_t arenaOffset = -1;  // byte offset of the tensor in this rank's shm arena, -1 if none
  uint8_t kind = 0;          // OpKind
  uint8_t dtype = 0;         // DType
  uint8_t op = 0;            // ReduceOp (allreduce, reduce_scatter)
  uint8_t onGpu = 0;          // 1: the NCCL path moves the data; the engine only compares
  int32_t root = -1;         // broadcast source rank

  // "float32[1000] SUM", "float32[1000] root=2": the words used in mismatch errors.
  std::string describe() const;
  // "allreduce #17": how messages name the operation.
  std::string label() const;
  // True when the two headers describe the same collective (per-rank fields ignored).
  bool matches(const OpHeader& other) const;
};

// How many fork()s separate this process from the one the engine was loaded in (0 there,
// 1 in a forked child, ...). An object records it when created; a different value later
// means the caller is a forked child holding a copy (it shares the parent's sockets and
// shared memory, and has none of its threads), found without a system call.
uint64_t forkGeneration();

using Clock = std::chrono::steady_clock;

inline double secondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace torchring
