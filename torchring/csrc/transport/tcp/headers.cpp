// The header exchange among the leaders (links.h exchangeHeaders), in two rounds.
//
// The summary round: recursive doubling (schedule Doubling, with its fold in and out) whose
// every message is a Summary (the sender's own header and `agree`: every header the sender
// knows is sameForAll with it), then the data that header says its sender carries
// (carry.bytesOf). A member starts with agree = its host's headers are all sameForAll with its
// own; on receiving it keeps agree && the sender's agree && the sender's header sameForAll its
// own. sameForAll is an equivalence, so after the last step every member holds the same
// verdict: every header in the job is sameForAll with every other. Messages keep one size
// (152 bytes and the data) whatever the host count and ranks per host.
//
// When the verdict holds, the member's own header stands for every rank of the other hosts.
// When it does not (a mismatch, or an operation whose per-rank sizes differ such as a ragged
// allgather), every member runs the full round: the same steps, each message carrying the
// header blocks schedule/carriedAlong names (member m's block: the headers of m's ranks), so
// that every member holds every rank's own header. Every member knows the verdict, so all
// run the same rounds; the receiver reads a Summary before the data it announces, so a
// message is always read whole and the next operation starts aligned, even when the ranks'
// operations differ.
#include "transport/tcp/links.h"

namespace torchring {

bool TcpLinks::exchangeHeaders(std::vector<OpHeader>& all, const std::vector<std::vector<int>>& ranksOf,
                               const Carry& carry) {
  if (members() == 1) return true;
  if (headerSteps_.empty()) {
    headerSteps_ = allreduceSchedule(Algo::Doubling, members(), opt_.member, 1).steps;
    headerBlocks_ = carriedAlong(Algo::Doubling, members(), opt_.member);
  }
  const int me = opt_.member;
  const OpHeader& own = all[ranksOf[me][0]];
  HeaderSummary mine, theirs;
  mine.header = own;
  mine.agree = 1;
  for (int r : ranksOf[me]) mine.agree = mine.agree && all[r].sameForAll(own);
  bool fits = true, finished = false;
  for (const Step& step : headerSteps_) {
    if (!step.fold && !finished) {  // the partial results are complete here
      if (carry.finish) carry.finish();
      finished = true;
    }
    std::vector<Span> send, recv;
    if (step.sendTo >= 0) {
      send.push_back({reinterpret_cast<char*>(&mine), sizeof(HeaderSummary)});
      const size_t bytes = carry.bytesOf ? carry.bytesOf(own, step.fold) : 0;
      if (bytes > 0) send.push_back({step.fold ? carry.work : carry.out, bytes});
    }
    if (step.recvFrom >= 0) recv.push_back({reinterpret_cast<char*>(&theirs), sizeof(HeaderSummary)});
    exchange(step.sendTo, send, step.recvFrom, recv);
    if (step.recvFrom < 0) continue;
    mine.agree = mine.agree && theirs.agree && theirs.header.sameForAll(own);
    const size_t bytes = carry.bytesOf ? carry.bytesOf(theirs.header, step.fold) : 0;
    if (bytes == 0) continue;
    const bool same = bytes == carry.bytesOf(own, step.fold);
    char* into = carry.out;
    if (!same || step.fold) {
      if (scratch_.size() < bytes) scratch_.resize(bytes);
      into = scratch_.data();
    }
    exchange(-1, {}, step.recvFrom, {{into, bytes}});
    if (!same) {
      fits = false;
    } else if (step.fold) {
      carry.fold(carry.work, scratch_.data());
    }
  }
  if (!finished && carry.finish) carry.finish();
  if (mine.agree) {
    for (int m = 0; m < members(); ++m) {
      if (m == me) continue;
      for (int r : ranksOf[m]) all[r] = own;
    }
    return fits;
  }
  // The full round: every rank's own header, no data.
  for (size_t i = 0; i < headerSteps_.size(); ++i) {
    const Step& step = headerSteps_[i];
    auto spans = [&](const std::vector<int>& blocks) {
      std::vector<Span> out;
      for (int m : blocks) {
        for (int r : ranksOf[m]) out.push_back({reinterpret_cast<char*>(&all[r]), sizeof(OpHeader)});
      }
      return out;
    };
    exchange(step.sendTo, step.sendTo >= 0 ? spans(headerBlocks_[i].sent) : std::vector<Span>{}, step.recvFrom,
             step.recvFrom >= 0 ? spans(headerBlocks_[i].received) : std::vector<Span>{});
  }
  return false;
}

}  // namespace torchring
