// Types shared by every part of the engine: dtypes, reduce ops, the per-operation
// header that ranks compare before moving data, and the engine's error type.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

namespace torchring {

// Advice in engine messages that names torchring's own API (`torchring`), with what the c10d
// backend says instead under torch.distributed (`torch`). Engine messages say these words
// only through these constants, so the c10d backend replaces them by name (backend_work.cpp).
struct Advice {
  const char* torchring;
  const char* torch;
};
extern const Advice kRecoveryHint;  // how every CommFailedError ends: what to do about it
extern const Advice kRaiseTimeout;  // "raise TORCHRING_TIMEOUT" (if the work is that slow)
extern const Advice kShutdownCall;  // "torchring.shutdown()"
extern const Advice kInitCall;      // "torchring.init()"
// Every Advice, in the order a front end replaces them in a message (the recovery hint
// names the calls, so it goes first).
extern const Advice* const kAllAdvice[4];

// The engine's exceptions (docs/errors.md). Each surfaces in Python as the class of the same
// role in torchring/_core/errors.py; bindings.cpp maps them. Violated invariants are not among
// them: those are TORCH_INTERNAL_ASSERTs.
//
// TorchringError: the base, and on its own a failure that leaves the communicator as it was
// (a call in a forked child, an operation dropped or refused because of shutdown()).
class TorchringError : public std::runtime_error {
 public:
  explicit TorchringError(const std::string& message) : std::runtime_error(message), message_(message) {}
  // `message`; then what to do about it, kept apart: what() says "<message>; <advice>" in
  // torchring's words, and a front end with other words says its own (advice()->torch).
  TorchringError(const std::string& message, const Advice& advice)
      : std::runtime_error(message + "; " + advice.torchring), message_(message), advice_(&advice) {}

  const std::string& message() const { return message_; }  // what() without the advice
  const Advice* advice() const { return advice_; }          // nullptr: none of its own

 private:
  std::string message_;
  const Advice* advice_ = nullptr;
};

// The communicator failed and must be rebuilt (torchring.shutdown(); torchring.init()): a
// dead or silent peer, a timeout, a broken connection. Every later operation fails too.
class CommFailedError : public TorchringError {
 public:
  using TorchringError::TorchringError;
};

// Ranks issued different collectives (kind, dtype, shape, op or root) as one operation. Found
// by the header exchange before any data moved, the same way on every rank: each rank fails
// that operation with this error and the communicator stays usable for the next one.
class MismatchError : public TorchringError {
 public:
  using TorchringError::TorchringError;
};

// Handle.wait(timeout) expired: the operation is still running and nothing is broken.
class WaitTimeoutError : public TorchringError {
 public:
  using TorchringError::TorchringError;
};

// Python's torchring._core.types mirrors these three; it checks them against the names and values
// bindings.cpp publishes (REDUCE_OPS, DTYPES, OP_KINDS) when the engine loads.
// BAND, BOR and BXOR are bitwise: integer and bool tensors only (Refusal::BITWISE_FLOAT).
enum class ReduceOp : uint8_t { SUM = 0, AVG = 1, MIN = 2, MAX = 3, PRODUCT = 4, BAND = 5, BOR = 6, BXOR = 7 };
enum class DType : uint8_t { F32 = 0, F64, F16, BF16, I8, U8, I32, I64, BOOL, I16 };
// SEND and RECV name point-to-point Works (p2p.h); they never enter the ordered queue.
enum class OpKind : uint8_t {
  ALLREDUCE = 0, BROADCAST, ALLGATHER, REDUCE_SCATTER, BARRIER,
  REDUCE, GATHER, SCATTER, ALLTOALL, ALLREDUCE_MANY, SEND, RECV
};
constexpr int kNumReduceOps = 8, kNumDTypes = 10, kNumOpKinds = 12;

size_t elementSize(DType dtype);
const char* dtypeName(DType dtype);
const char* opName(ReduceOp op);
const char* kindName(OpKind kind);
bool isFloating(DType dtype);
bool isBitwise(ReduceOp op);

// What a kind of collective is: one row per OpKind (kOpSpecs, common.cpp), read by the checks
// (Communicator::checkArgs, plainAllreduceArgs, the c10d backend), the header comparison
// (OpHeader::matches) and the messages. Python reads the same rows (bindings.cpp publishes
// them as OP_SPECS; torchring/_core/types.py's OpKind, compared when the engine loads).
struct OpSpec {
  const char* name;  // how messages and the header name the kind: "allreduce"
  bool reduces;      // combines the ranks' values with a ReduceOp (the op is in the header)
  bool rooted;       // has a root rank (the root is in the header)
  bool scalable;     // takes prescale and postscale factors (in the header)
  bool inPlace;      // its result is written into its input tensor
  bool nccl;         // the NCCL path can run it (the world's CUDA tensors)
  bool ragged;       // dim 0 may differ per rank; the rows' shape may not (allgather, alltoall)
};
const OpSpec& opSpec(OpKind kind);

// The dtype x op rule of every reduction (Python's torchring._core.types.reduction_refusal):
// which rule a `kind` collective of `dtype`, reducing with `op` and `scaled` by factors other
// than 1, breaks; NONE for a kind that does not reduce.
enum class Refusal : uint8_t {
  NONE,
  BOOL_OP,         // bool reduces with MIN, MAX, BAND, BOR and BXOR only
  BITWISE_FLOAT,   // BAND, BOR and BXOR need an integer or bool dtype
  AVG_INTEGER,     // AVG needs a floating dtype
  SCALED_INTEGER,  // so do prescale and postscale factors
};
Refusal reductionRefusal(OpKind kind, DType dtype, ReduceOp op, bool scaled);
// Why, and what to do instead, in words that follow "<operation> of <tensor>: ".
const char* refusalText(Refusal refusal);

// What one rank says it is about to run. Every rank publishes its header for operation
// number `seq` and checks all the others before any data moves, so a mismatch becomes an
// error on every rank instead of a hang or wrong numbers. Plain data: it is copied through
// shared memory and sockets as bytes.
struct OpHeader {
  // Dims kept in the header; a tensor with more keeps the first kMaxDims - 1 and a hash of
  // the rest in the last slot (compared exactly, shown as "...").
  static constexpr int kMaxDims = 8;

  uint64_t seq = 0;          // operation sequence number, counted per process from 0
  uint64_t count = 0;        // elements this rank contributes
  uint64_t rowElems = 0;     // allgather, alltoall: elements per dim-0 row (must match); else 0
  uint64_t rows = 0;         // allgather, alltoall: dim-0 size of this rank's tensor (may differ);
                             // allreduce_many: the number of tensors
  uint64_t shapesHash = 0;   // allreduce_many: hash of every tensor's shape, in order
  double prescale = 1.0;     // allreduce, reduce_scatter, allreduce_many: factor before the sum
  double postscale = 1.0;    // ... and after it
  int64_t dims[kMaxDims] = {};  // the tensor's shape (see kMaxDims), compared across ranks
  int64_t arenaOffset = -1;  // byte offset of the tensor in this rank's shm arena, -1 if none
  uint8_t kind = 0;          // OpKind
  uint8_t dtype = 0;         // DType
  uint8_t op = 0;            // ReduceOp (allreduce, reduce_scatter)
  uint8_t onGpu = 0;         // 1: the NCCL path moves the data; the engine only compares
  uint8_t ndim = 0;          // the tensor's number of dims (0: a scalar, or no tensor)
  uint16_t pageOffset = 0;   // allreduce: the tensor's offset in its page, rounded down to 64
                             // (per rank: where shared memory stages it, transport/shm/group.cpp)
  int32_t root = -1;         // broadcast, reduce, gather, scatter: the root rank
  uint8_t algo = 0;          // allreduce among several hosts: the Algo (schedule/schedule.h)
                             // this rank's cost model chose; every rank must choose alike
  uint8_t levels = 0;        // ... and with Rabenseifner its halvings (0: all; schedule.h halvingsOf)

  // Fills ndim and dims from a tensor's sizes.
  void setShape(const int64_t* sizes, int n);
  // "float32[10, 100] SUM", "float32[1000] root=2", "barrier": the words of every message.
  std::string describe() const;
  // "allreduce #17": how messages name the operation.
  std::string label() const;
  // "allreduce #17 float32[10, 100] SUM", "barrier #3": label() and describe() without repeating a
  // barrier's name.
  std::string what() const;
  // True when the two headers describe the same collective (per-rank fields ignored).
  bool matches(const OpHeader& other) const;
  // matches(), and the per-rank fields other hosts read (count, rows) equal too: one of the
  // two can stand for both in the header exchange among hosts (transport/tcp/headers.cpp).
  bool sameForAll(const OpHeader& other) const;
  // True when both have the same number of dims and equal dims from `fromDim` on.
  bool sameShape(const OpHeader& other, int fromDim) const;
};

// 4K aliasing: a load right after a store whose address agrees with it in the low 12 bits
// stalls as if it read the stored address. Of the page offsets origin, origin + step, ...
// (mod 4096), returns the shift from `origin` whose offset is farthest (circular distance) from
// every offset in taken[0, n): where to put one more stream of a copy or reduction.
int farthestPageShift(int origin, int step, const int* taken, int n);

// How many fork()s separate this process from the one the engine was loaded in (0 there,
// 1 in a forked child, ...). An object records it when created; a different value later
// means the caller is a forked child holding a copy (it shares the parent's sockets and
// shared memory, and has none of its threads), found without a system call.
uint64_t forkGeneration();

// Something the user should see that is not an error of a call (a refused stray connection,
// the NCCL watchdog's abort): handed to the sink Python installs (the "torchring" logger),
// else printed to stderr. Callable from any thread.
void warn(const std::string& message);
// Installs the sink warn() calls; an empty function restores stderr.
void setWarningSink(std::function<void(const std::string&)> sink);

// Seconds without progress before an operation fails, in every transport's options
// (TORCHRING_TIMEOUT's default; Python passes the value it read).
constexpr double kDefaultTimeoutSec = 300;

using Clock = std::chrono::steady_clock;

// One pause of a busy-wait loop (lets the sibling hyperthread run, saves power).
inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline double secondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace torchring
