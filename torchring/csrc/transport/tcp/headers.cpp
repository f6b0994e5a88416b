// The header exchange among the leaders (links.h exchangeHeaders), in two rounds, and the
// allreduce that rides on it.
//
// The summary round: recursive doubling (schedule Doubling, with its fold in and out) whose
// every message is a HeaderSummary (the sender's own header and `agree`: every header the
// sender knows is sameForAll with it), then the data the sender's carried schedule sends in
// that step (carry.planOf of the sender's header; nothing when its operation rides on
// nothing). A member starts with agree = its host's headers are all sameForAll with its own;
// on receiving it keeps agree && the sender's agree && the sender's header sameForAll its
// own. sameForAll is an equivalence, so after the core's last step every core member holds
// the same verdict: every header in the job is sameForAll with every other.
//
// A carried allreduce (Doubling, or Rabenseifner with any number of halvings) keeps
// Doubling's partners in Doubling's order, so its fold in and its core's first log2(p2)
// steps are the header steps: they carry its data. With the verdict, its remaining steps
// (Rabenseifner's way back) run as plain messages, and the fold out is the header round's
// last step again, whose summary brings the verdict to the member that sat out (and the
// data only when the verdict holds). The receiver reads a summary before the data it
// announces and sizes the data from the sender's header, so a message is always read whole
// and the next operation starts aligned, even when the ranks' operations differ.
//
// When the verdict holds, the member's own header stands for every rank of the other hosts.
// When it does not (a mismatch, or an operation whose per-rank sizes differ such as a ragged
// allgather), every member runs the full round: the same steps, each message carrying the
// header blocks schedule/carriedAlong names (member m's block: the headers of m's ranks), so
// that every member holds every rank's own header.
#include <algorithm>

#include "core/reduce.h"
#include "transport/tcp/links.h"

namespace torchring {
namespace {

size_t unitsOf(const std::vector<Range>& ranges) {
  size_t units = 0;
  for (const Range& r : ranges) units += r.count;
  return units;
}

// Bytes a step of a carried schedule sends for a member whose header is `header`.
size_t sendBytes(const Step& step, const OpHeader& header) {
  const auto dtype = static_cast<DType>(header.dtype);
  const size_t unit = step.fold && isHalfFloat(dtype) ? 4 : elementSize(dtype);
  return unitsOf(step.send) * unit;
}

}  // namespace

bool TcpLinks::exchangeHeaders(std::vector<OpHeader>& all, const std::vector<std::vector<int>>& ranksOf,
                               const Carry& carry) {
  if (members() == 1) return true;
  if (headerSteps_.empty()) {
    headerSteps_ = allreduceSchedule(Algo::Doubling, members(), opt_.member, 1).steps;
    headerBlocks_ = carriedAlong(Algo::Doubling, members(), opt_.member);
  }
  const int me = opt_.member, rem = members() - powerOfTwoBelow(members());
  const OpHeader& own = all[ranksOf[me][0]];
  auto folds = [&](int member) { return member < 2 * rem; };  // has a fold in and a fold out
  const size_t last = headerSteps_.size() - 1;
  const size_t coreEnd = folds(me) ? last : headerSteps_.size();  // header steps before a fold out

  HeaderSummary mine, theirs;
  mine.header = own;
  mine.agree = 1;
  for (int r : ranksOf[me]) mine.agree = mine.agree && all[r].sameForAll(own);
  const Schedule plan = carry.planOf ? carry.planOf(own, me) : Schedule{};
  const bool carrying = !plan.steps.empty();
  const auto dtype = static_cast<DType>(own.dtype);
  const bool half = isHalfFloat(dtype);
  char* work = carry.work;
  const DType workType = half ? DType::F32 : dtype;
  const size_t foldUnit = elementSize(workType), copyUnit = elementSize(dtype);
  const size_t segBytes = std::max(foldUnit, opt_.segmentBytes / foldUnit * foldUnit);
  bool fits = true;

  // Header step j: the summary and this member's plan step (the same index, or the plan's
  // last for a fold out); the sender's plan step is found the same way from its side.
  auto headerStep = [&](size_t j) {
    const Step& step = headerSteps_[j];
    const bool foldOut = folds(me) && j == last && j > 0;
    const Step* mineStep = carrying ? &plan.steps[foldOut ? plan.steps.size() - 1 : j] : nullptr;
    std::vector<Span> send, recv;
    recv.reserve(8);
    if (step.sendTo >= 0) {
      send.push_back({reinterpret_cast<char*>(&mine), sizeof(HeaderSummary)});
      if (mineStep && (!foldOut || mine.agree)) {
        for (const Span& s : spansOf(mineStep->send, mineStep->fold ? work : carry.data,
                                   mineStep->fold ? foldUnit : copyUnit)) {
          send.push_back(s);
        }
      }
    }
    size_t expected = 0;
    if (step.recvFrom >= 0) {
      recv.push_back({reinterpret_cast<char*>(&theirs), sizeof(HeaderSummary)});
      if (mineStep) {
        expected = unitsOf(mineStep->recv) * (mineStep->fold ? foldUnit : copyUnit);
        if (mineStep->fold) {
          if (scratch_.size() < expected) scratch_.resize(expected);
          recv.push_back({scratch_.data(), expected});
        } else {
          for (const Span& s : spansOf(mineStep->recv, carry.data, copyUnit)) recv.push_back(s);
        }
      }
    }
    bool sized = false;
    bool same = true;
    // A fold step whose send and receive do not overlap (a halving) folds whole segments as
    // they arrive, as stepAllreduce does; one that swaps its window folds after its send.
    const bool folding = mineStep && mineStep->fold && step.recvFrom >= 0;
    const bool foldEarly = folding && !rangesOverlap(mineStep->send, mineStep->recv);
    size_t folded = 0;
    auto foldUpTo = [&](size_t upTo) {
      if (upTo <= folded) return;
      foldRanges(work, mineStep->recv, scratch_.data(), workType, carry.op, folded, upTo);
      folded = upTo;
    };
    // Once the summary is in, the data that follows is what the sender's header says.
    auto onRecv = [&](size_t received) {
      if (sized) {
        if (foldEarly && same && received > sizeof(HeaderSummary)) {
          const size_t got = received - sizeof(HeaderSummary);
          foldUpTo(got == expected ? expected : got / segBytes * segBytes);
        }
        return;
      }
      if (received < sizeof(HeaderSummary)) return;
      sized = true;
      const int from = step.recvFrom;
      size_t bytes = expected;
      if (!mineStep || !theirs.header.sameForAll(own) || (foldOut && !theirs.agree)) {
        const Schedule theirPlan = carry.planOf ? carry.planOf(theirs.header, from) : Schedule{};
        bytes = 0;
        if (!theirPlan.steps.empty() && (!foldOut || theirs.agree)) {
          const size_t k = folds(me) && j == 0 ? 0
                           : foldOut          ? theirPlan.steps.size() - 1
                                              : j - (folds(me) ? 1 : 0) + (folds(from) ? 1 : 0);
          bytes = sendBytes(theirPlan.steps.at(k), theirs.header);
        }
      }
      if (bytes == expected) return;
      same = false;
      if (scratch_.size() < bytes) scratch_.resize(bytes);
      recv.resize(1);
      recv.push_back({scratch_.data(), bytes});
    };
    exchange(step.sendTo, send, step.recvFrom, recv, onRecv);
    if (step.recvFrom < 0) return;
    mine.agree = mine.agree && theirs.agree && theirs.header.sameForAll(own);
    if (!same) {
      fits = false;
    } else if (folding) {
      foldUpTo(expected);
    }
  };

  for (size_t j = 0; j < coreEnd; ++j) headerStep(j);
  if (carrying && mine.agree) {
    finishOwned(plan.owned, carry.data, work, dtype, carry.scale);
    const size_t end = plan.steps.size() - (folds(me) ? 1 : 0);
    for (size_t i = coreEnd; i < end; ++i) {  // Rabenseifner's way back
      const Step& step = plan.steps[i];
      exchange(step.sendTo, spansOf(step.send, carry.data, copyUnit), step.recvFrom,
               spansOf(step.recv, carry.data, copyUnit));
    }
  }
  if (coreEnd == last) headerStep(last);

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
    auto blocks = [&](const std::vector<int>& members) {
      std::vector<Span> out;
      for (int m : members) {
        for (int r : ranksOf[m]) out.push_back({reinterpret_cast<char*>(&all[r]), sizeof(OpHeader)});
      }
      return out;
    };
    exchange(step.sendTo, step.sendTo >= 0 ? blocks(headerBlocks_[i].sent) : std::vector<Span>{}, step.recvFrom,
             step.recvFrom >= 0 ? blocks(headerBlocks_[i].received) : std::vector<Span>{});
  }
  return false;
}

}  // namespace torchring
