// Work: the completion handle of one operation, what torchring.Handle waits on. Abstract, as
// c10d's Work is: CpuWork is what the CPU engine completes from whichever thread ran the
// operation (and what the NCCL path's header checks are); NcclWork (cuda/nccl.h) completes
// with an event on the GPU. Python holds either through this one interface.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "core/common.h"

namespace torchring {

class Work {
 public:
  Work(OpKind kind, uint64_t seq, int rank) : kind_(kind), seq_(seq), rank_(rank) {}
  virtual ~Work() = default;

  // True once the operation finished, successfully or not.
  virtual bool isCompleted() = 0;
  // Blocks until done (timeoutSec <= 0: no limit) and returns the result or rethrows the
  // operation's failure (its own exception type: CommFailedError, MismatchError, ...). An
  // expired timeout throws WaitTimeoutError and leaves the operation running.
  virtual at::Tensor wait(double timeoutSec) = 0;
  // Like wait(); for device work it also blocks the host until the device finished it.
  virtual at::Tensor synchronize(double timeoutSec) { return wait(timeoutSec); }

  uint64_t seq() const { return seq_; }
  OpKind kind() const { return kind_; }
  int rank() const { return rank_; }

 private:
  OpKind kind_;
  uint64_t seq_;
  int rank_;
};

// `error` as the same exception class with `context` in front of its message (most derived
// classes first; any other exception, or an empty context, as it is).
std::exception_ptr withContext(std::exception_ptr error, const std::string& context);

// An operation of the CPU engine: finished once, by the thread that ran it.
class CpuWork : public Work {
 public:
  using Work::Work;
  bool isCompleted() override;
  at::Tensor wait(double timeoutSec) override;

  // Completes the operation: `error` null means it succeeded with `result`.
  void finish(at::Tensor result, std::exception_ptr error);
  // Put in front of every failure message (a group's communicator: which group, so that the
  // ranks a message names, which are the group's, are not read as world ranks).
  void setContext(std::string context) { context_ = std::move(context); }
  // The failure message of a completed operation; "" while it runs or when it succeeded.
  std::string error();
  // Runs `fn` once the operation finished: now if it has, else on the thread that finishes it,
  // right after finish(). `fn` must be quick and must not wait for other operations.
  void onDone(std::function<void()> fn);
  // A recv's sender: its peer, or for a recv from any source the rank whose message it took
  // (set before finish; -1 until matched, and for every other operation).
  void setSource(int rank) { source_.store(rank); }
  int source() const { return source_.load(); }

 private:
  std::atomic<int> source_{-1};
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  std::string message_;
  std::string context_;
  at::Tensor result_;
  std::vector<std::function<void()>> onDone_;
};

}  // namespace torchring
