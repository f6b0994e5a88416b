// The header exchange among the leaders (links.h exchangeHeaders): recursive doubling whose
// messages carry every header block their sender knows, so that after log2(p2) steps (two
// more with the non-power-of-two fold) every member holds every header. A message is the
// header blocks schedule/carriedAlong names for that step, then the data its sender's own
// header says it carries (carry.bytesOf): the receiver reads the headers first and only
// then knows how much data follows, so a message is always read whole, and the next
// operation starts aligned, even when the ranks' operations differ.
#include "transport/tcp/links.h"

namespace torchring {

bool TcpLinks::exchangeHeaders(const std::vector<std::vector<Span>>& headers, const Carry& carry) {
  if (members() == 1) return true;
  if (headerSteps_.empty()) {
    headerSteps_ = allreduceSchedule(Algo::Doubling, members(), opt_.member, 1).steps;
    headerBlocks_ = carriedAlong(Algo::Doubling, members(), opt_.member);
  }
  const int me = opt_.member;
  bool ok = true, finished = false;
  for (size_t i = 0; i < headerSteps_.size(); ++i) {
    const Step& step = headerSteps_[i];
    if (!step.fold && !finished) {  // the partial results are complete here
      if (carry.finish) carry.finish();
      finished = true;
    }
    std::vector<Span> send, recv;
    if (step.sendTo >= 0) {
      for (int m : headerBlocks_[i].sent) send.insert(send.end(), headers[m].begin(), headers[m].end());
      const size_t bytes = carry.bytesOf(me, step.fold);
      if (bytes > 0) send.push_back({step.fold ? carry.work : carry.out, bytes});
    }
    if (step.recvFrom >= 0) {
      for (int m : headerBlocks_[i].received) recv.insert(recv.end(), headers[m].begin(), headers[m].end());
    }
    exchange(step.sendTo, send, step.recvFrom, recv);
    if (step.recvFrom < 0) continue;
    const size_t bytes = carry.bytesOf(step.recvFrom, step.fold);
    if (bytes == 0) continue;
    const bool fits = bytes == carry.bytesOf(me, step.fold);
    char* into = carry.out;
    if (!fits || step.fold) {
      if (scratch_.size() < bytes) scratch_.resize(bytes);
      into = scratch_.data();
    }
    exchange(-1, {}, step.recvFrom, {{into, bytes}});
    if (!fits) {
      ok = false;
    } else if (step.fold) {
      carry.fold(carry.work, scratch_.data());
    }
  }
  if (!finished && carry.finish) carry.finish();
  return ok;
}

}  // namespace torchring
