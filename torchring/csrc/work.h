// Work: the completion handle of one operation, what torchring.Handle waits on. The CPU
// engine finishes it from whichever thread ran the operation; the NCCL path derives from it
// (cuda/nccl.h) so Python holds one kind of handle.
#pragma once

#include <ATen/ATen.h>

#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>

#include "common.h"

namespace torchring {

class Work {
 public:
  Work(OpKind kind, uint64_t seq, int rank) : kind_(kind), seq_(seq), rank_(rank) {}
  virtual ~Work() = default;

  // True once the operation finished, successfully or not.
  virtual bool isCompleted();
  // Blocks until done (timeoutSec <= 0: no limit) and returns the result or rethrows the
  // operation's failure (its own exception type: CommFailedError, MismatchError, ...). An
  // expired timeout throws WaitTimeoutError and leaves the operation running.
  virtual at::Tensor wait(double timeoutSec);
  // Like wait(); for device work it also blocks the host until the device finished it.
  virtual at::Tensor synchronize(double timeoutSec) { return wait(timeoutSec); }

  // Completes the operation: `error` null means it succeeded with `result`.
  void finish(at::Tensor result, std::exception_ptr error);
  // The failure message of a completed operation; "" while it runs or when it succeeded.
  std::string error();
  uint64_t seq() const { return seq_; }
  OpKind kind() const { return kind_; }

 private:
  OpKind kind_;
  uint64_t seq_;
  int rank_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  std::string message_;
  at::Tensor result_;
};

}  // namespace torchring
