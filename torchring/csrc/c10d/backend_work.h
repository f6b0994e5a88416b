// The Work objects of torchring's torch.distributed backend (backend.h) and the thread that
// completes them.
//
// A C10dWork waits for one or more engine operations (CpuWork). When the last one finishes, its
// callback hands the C10dWork to the Completer, a thread of the backend that runs the work's
// `post` step (copying results into the caller's output tensors, which may be views: they are
// written, never rebound) and then completes the c10d Work and its Future with the outputs, or
// with the error in torch.distributed's words (forTorch). Futures are completed there and not on
// an engine thread because a Future's callbacks (DDP communication hooks, fut.then in Python) run
// on the completing thread and may take the GIL.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

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

#include "core/work.h"

namespace torchring {

class C10dWork : public c10d::Work {
 public:
  // `outputs` is what the Future completes with; `nested` makes it a list of lists (list-form
  // allgather and gather, as torch's own backends do).
  C10dWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, bool nested,
           std::vector<std::vector<at::Tensor>> nestedOutputs);
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }
  // A recv's sender (recv from any source: the rank whose message it took), once complete.
  int sourceRank() const override;
  // Work.wait(timeout): as c10d's, but a wait that expires names the rank, the operation and
  // what it still waits for (the operation keeps running; the process group stays usable).
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  // Runs post() (unless an engine operation failed), then completes the Work and its Future.
  void complete();

  std::vector<std::shared_ptr<CpuWork>> engine;  // the engine operations it waits for
  std::function<void()> post;                    // after they all succeeded
  std::vector<at::Tensor> keep;                  // inputs and staging kept alive until then
  std::atomic<int> pending{0};

 private:
  std::vector<at::Tensor> outputs_;
  std::vector<std::vector<at::Tensor>> nested_;
  std::atomic<int> source_{-1};  // a recv's sender, read from its engine operation in complete()
  bool isNested_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class Completer {
 public:
  Completer();
  ~Completer();
  void push(c10::intrusive_ptr<C10dWork> work);
  void stop();

 private:
  void loop();
  static constexpr size_t kMaxThreads = 16;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<C10dWork>> ready_;
  bool stopping_ = false;
  int idle_ = 0;  // threads waiting for a work
  std::vector<std::thread> threads_;
};

}  // namespace torchring
