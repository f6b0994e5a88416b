// A communicator's point-to-point operations: send and recv over the p2p transport
// (transport/p2p), each checked, recorded by the flight recorder before it is posted and
// marked started and finished there as its transfer goes (traced), and the failure of a
// transfer made the communicator's failure (onP2PFailure).
#include <unistd.h>

#include <string>

#include "engine/communicator.h"

namespace torchring {

std::shared_ptr<CpuWork> Communicator::send(at::Tensor tensor, int peer, int64_t tag) {
  checkPeer(tensor, peer, tag, "send");
  const uint64_t traceId = recordP2P(OpKind::SEND, tensor, peer, tag);
  const auto* data = static_cast<const char*>(tensor.data_ptr());
  return traced(p2p_->send(peer, tag, data, tensor.nbytes(), tensorText(tensor), tensor), traceId);
}

std::shared_ptr<CpuWork> Communicator::recv(at::Tensor tensor, int peer, int64_t tag) {
  checkPeer(tensor, peer, tag, "recv");
  const uint64_t traceId = recordP2P(OpKind::RECV, tensor, peer, tag);
  auto* data = static_cast<char*>(tensor.data_ptr());
  return traced(p2p_->recv(peer, tag, data, tensor.nbytes(), tensorText(tensor), tensor), traceId);
}

uint64_t Communicator::recordP2P(OpKind kind, const at::Tensor& tensor, int peer, int64_t tag) {
  if (!recorder_->enabled()) return 0;
  const uint32_t frame = FlightRecorder::callerFrame();
  OpHeader header = makeHeader(kind, tensor, ReduceOp::SUM, -1);
  std::lock_guard<std::mutex> lock(mutex_);
  header.seq = nextP2P_++;
  return recorder_->record(header, frame, false, true, peer, tag);
}

std::shared_ptr<CpuWork> Communicator::traced(std::shared_ptr<CpuWork> work, uint64_t traceId) {
  if (!recorder_->enabled()) return work;
  recorder_->started(traceId);
  CpuWork* raw = work.get();  // onDone runs while the work is alive
  work->onDone([recorder = recorder_, traceId, raw] { recorder->finished(traceId, raw->error().empty()); });
  return work;
}

void Communicator::checkPeer(const at::Tensor& tensor, int peer, int64_t tag, const char* what) const {
  TORCH_CHECK_VALUE(tensor.defined() && tensor.device().is_cpu() && tensor.is_contiguous(), rankText(), ": ",
                    what, " needs a contiguous CPU tensor");
  (void)toDType(tensor.scalar_type());
  const bool anySource = peer == P2P::kAnySource && std::string(what) == "recv";
  TORCH_CHECK_VALUE(anySource || (peer >= 0 && peer < opt_.size && peer != opt_.rank), rankText(), ": ", what,
                    " of ", tensorText(tensor), ": the peer must be another rank in [0, ", opt_.size, ")",
                    std::string(what) == "recv" ? " or -1 (any source)" : "", ", got ", peer);
  TORCH_CHECK_VALUE(tag >= 0, rankText(), ": ", what, " of ", tensorText(tensor), ": tag must be >= 0, got ", tag);
  if (forkGeneration() != forkGeneration_) {
    throw TorchringError(rankText() + ": " + what + " called in a forked child process (pid " +
                         std::to_string(getpid()) + "): run it in the process that called " + kInitCall.torchring);
  }
}

void Communicator::onP2PFailure(const std::string& message) {
  keepFailure(message);
  if (shm_) shm_->abort(message);
  postFailure(message);  // before the links close (see execute)
  if (tcp_) tcp_->interrupt();
  recorder_->setFailure(message);
  FlightRecorder::notifyFailure();
}

}  // namespace torchring
