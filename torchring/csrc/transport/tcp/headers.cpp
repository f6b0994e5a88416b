// The header exchange among the leaders (links.h exchangeHeaders), in two rounds, and the
// allreduce that rides on it.
//
// The summary round: the allreduce schedule of the header's shape (carry.shape, cost.h
// headerAlgo: Doubling, or Multiplying where a group of transfers at once costs less than
// Doubling's steps), its fold in and out included, run one group of steps at a time, whose
// every message is a HeaderSummary (the sender's own header and `agree`: every header the
// sender knows is sameForAll with it), then the data the sender's carried schedule sends in
// that step (carry.planOf of the sender's header; nothing when its operation rides on
// nothing). A member starts with agree = its host's headers are all sameForAll with its own;
// after each group it keeps agree && every sender's agree && every sender's header
// sameForAll its own (a group's messages all carry the summary from before the group).
// sameForAll is an equivalence and both shapes are allreduces, so after the core's last
// group every core member holds the same verdict: every header in the job is sameForAll
// with every other.
//
// A carried allreduce (cost.h carriedBy: Doubling or Rabenseifner on Doubling's shape,
// Multiplying or Radix4 on Multiplying's) keeps the shape's partners in the shape's order, so
// its fold in and its core's first groups are the header's: they carry its data, step j of
// the plan in header step j, and a member finds a sender's plan step the same way from the
// sender's side (partners at c ^ (j << shift) sit at the same place in their groups). With
// the verdict, its remaining steps (the way back) run as plain groups, and the fold out is
// the header round's last step again, whose summary brings the verdict to the member that
// sat out (and the data only when the verdict holds). The receiver reads a summary before
// the data it announces and sizes the data from the sender's header (into a buffer of its
// own to drop when the size is not this member's), so a message is always read whole and the
// next operation starts aligned, even when the ranks' operations differ. A group's folds
// run as whole segments arrive, in the group's order (steps.cpp stepAllreduce's rule).
//
// When the verdict holds, the member's own header stands for every rank of the other hosts.
// When it does not (a mismatch, or an operation whose per-rank sizes differ such as a ragged
// allgather), every member runs the full round: the same groups, each message carrying the
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
  if (headerSteps_.empty() || headerAlgo_ != carry.shape) {
    headerAlgo_ = carry.shape;
    headerSteps_ = allreduceSchedule(carry.shape, members(), opt_.member, 1).steps;
    headerBlocks_ = carriedAlong(carry.shape, members(), opt_.member);
  }
  const int me = opt_.member, rem = members() - powerOfTwoBelow(members());
  const OpHeader& own = all[ranksOf[me][0]];
  auto folds = [&](int member) { return member < 2 * rem; };  // has a fold in and a fold out
  const size_t last = headerSteps_.size() - 1;
  const size_t coreEnd = folds(me) ? last : headerSteps_.size();  // header steps before a fold out

  HeaderSummary mine;
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

  // Header steps [first, end), one group: each step's summary and this member's plan step
  // (the same index, or the plan's last for a fold out); the sender's plan step is found the
  // same way from its side.
  auto headerGroup = [&](size_t first, size_t end) {
    const size_t n = end - first;
    const bool foldOut = folds(me) && first == last && last > 0;
    std::vector<HeaderSummary> theirs(n);
    std::vector<const Step*> mineStep(n, nullptr);
    std::vector<std::vector<Span>> spans(2 * n);
    std::vector<std::vector<char>> drops(n);  // data of a size not this member's, dropped
    std::vector<size_t> expected(n), offset(n), received(n), folded(n);
    std::vector<char> sized(n, 0), same(n, 1), folding(n, 0), late(n, 0), follows(n, 0);
    std::vector<Range> sent;
    size_t total = 0;
    for (size_t k = 0; k < n; ++k) {
      const Step& step = headerSteps_[first + k];
      if (carrying) mineStep[k] = &plan.steps[foldOut ? plan.steps.size() - 1 : first + k];
      const Step* ms = mineStep[k];
      if (step.sendTo >= 0) {
        spans[2 * k].push_back({reinterpret_cast<char*>(&mine), sizeof(HeaderSummary)});
        if (ms && (!foldOut || mine.agree)) {
          for (const Span& s : spansOf(ms->send, ms->fold ? work : carry.data, ms->fold ? foldUnit : copyUnit)) {
            spans[2 * k].push_back(s);
          }
          sent.insert(sent.end(), ms->send.begin(), ms->send.end());
        }
      }
      if (step.recvFrom >= 0 && ms) {
        expected[k] = unitsOf(ms->recv) * (ms->fold ? foldUnit : copyUnit);
        folding[k] = ms->fold;
        if (ms->fold) offset[k] = total, total += expected[k];
      }
    }
    if (scratch_.size() < total) scratch_.resize(total);  // no stream's span moves after this
    for (size_t k = 0; k < n; ++k) {
      const Step& step = headerSteps_[first + k];
      if (step.recvFrom < 0) continue;
      spans[2 * k + 1].push_back({reinterpret_cast<char*>(&theirs[k]), sizeof(HeaderSummary)});
      const Step* ms = mineStep[k];
      if (!ms) continue;
      if (ms->fold) {
        spans[2 * k + 1].push_back({scratch_.data() + offset[k], expected[k]});
      } else {
        for (const Span& s : spansOf(ms->recv, carry.data, copyUnit)) spans[2 * k + 1].push_back(s);
      }
      // A step whose receive overlaps what the group sends (a swap of the whole window) folds
      // only once the sends are done; one that receives the units of the step before it folds
      // after that one.
      late[k] = rangesOverlap(sent, ms->recv);
      follows[k] = k > 0 && folding[k - 1] && sameRanges(ms->recv, mineStep[k - 1]->recv);
    }
    auto foldReady = [&](bool everything) {
      for (size_t k = 0; k < n; ++k) {
        if (!folding[k] || !same[k]) continue;
        size_t upTo = everything ? expected[k]
                      : late[k]  ? 0
                      : received[k] == expected[k] ? expected[k]
                                                   : received[k] / segBytes * segBytes;
        if (!everything && follows[k]) upTo = std::min(upTo, folded[k - 1]);
        if (upTo <= folded[k]) continue;
        foldRanges(work, mineStep[k]->recv, scratch_.data() + offset[k], workType, carry.op, folded[k], upTo);
        folded[k] = upTo;
      }
    };
    std::vector<Stream> streams;
    for (size_t k = 0; k < n; ++k) {
      const Step& step = headerSteps_[first + k];
      streams.push_back({step.sendTo, true, &spans[2 * k], nullptr, nullptr});
      // Once the summary is in, the data that follows is what the sender's header says.
      auto onRecv = [&, k, from = step.recvFrom, j = first + k](size_t got) {
        if (sized[k]) {
          if (same[k] && got > sizeof(HeaderSummary)) {
            received[k] = got - sizeof(HeaderSummary);
            foldReady(false);
          }
          return;
        }
        if (got < sizeof(HeaderSummary)) return;
        sized[k] = 1;
        size_t bytes = expected[k];
        if (!mineStep[k] || !theirs[k].header.sameForAll(own) || (foldOut && !theirs[k].agree)) {
          const Schedule theirPlan = carry.planOf ? carry.planOf(theirs[k].header, from) : Schedule{};
          bytes = 0;
          if (!theirPlan.steps.empty() && (!foldOut || theirs[k].agree)) {
            const size_t at = folds(me) && j == 0 ? 0
                              : foldOut          ? theirPlan.steps.size() - 1
                                                 : j - (folds(me) ? 1 : 0) + (folds(from) ? 1 : 0);
            bytes = sendBytes(theirPlan.steps.at(at), theirs[k].header);
          }
        }
        if (bytes == expected[k]) return;
        same[k] = 0;
        drops[k].resize(bytes);
        spans[2 * k + 1].resize(1);
        if (bytes > 0) spans[2 * k + 1].push_back({drops[k].data(), bytes});
      };
      streams.push_back({step.recvFrom, false, &spans[2 * k + 1], onRecv, nullptr});
    }
    exchangeStreams(streams);
    for (size_t k = 0; k < n; ++k) {
      if (headerSteps_[first + k].recvFrom < 0) continue;
      mine.agree = mine.agree && theirs[k].agree && theirs[k].header.sameForAll(own);
      if (!same[k]) fits = false;
    }
    foldReady(true);
  };

  for (size_t first = 0; first < coreEnd;) {
    const size_t end = groupEnd(headerSteps_, first);
    headerGroup(first, end);
    first = end;
  }
  if (carrying && mine.agree) {
    finishOwned(plan.owned, carry.data, work, dtype, carry.scale);
    const size_t end = plan.steps.size() - (folds(me) ? 1 : 0);
    std::vector<std::vector<Span>> spans;
    for (size_t i = coreEnd; i < end;) {  // the way back (Rabenseifner's, Radix4's)
      const size_t next = groupEnd(plan.steps, i);
      exchangeStreams(streamsOf(plan.steps, i, next, carry.data, copyUnit, spans));
      i = next;
    }
  }
  if (coreEnd == last) headerGroup(last, last + 1);

  if (mine.agree) {
    for (int m = 0; m < members(); ++m) {
      if (m == me) continue;
      for (int r : ranksOf[m]) all[r] = own;
    }
    return fits;
  }
  // The full round: every rank's own header, no data.
  auto blocks = [&](const std::vector<int>& members) {
    std::vector<Span> out;
    for (int m : members) {
      for (int r : ranksOf[m]) out.push_back({reinterpret_cast<char*>(&all[r]), sizeof(OpHeader)});
    }
    return out;
  };
  for (size_t first = 0; first < headerSteps_.size();) {
    const size_t end = groupEnd(headerSteps_, first);
    std::vector<std::vector<Span>> spans(2 * (end - first));
    std::vector<Stream> streams;
    for (size_t i = first; i < end; ++i) {
      const Step& step = headerSteps_[i];
      if (step.sendTo >= 0) spans[2 * (i - first)] = blocks(headerBlocks_[i].sent);
      if (step.recvFrom >= 0) spans[2 * (i - first) + 1] = blocks(headerBlocks_[i].received);
      streams.push_back({step.sendTo, true, &spans[2 * (i - first)], nullptr, nullptr});
      streams.push_back({step.recvFrom, false, &spans[2 * (i - first) + 1], nullptr, nullptr});
    }
    exchangeStreams(streams);
    first = end;
  }
  return false;
}

}  // namespace torchring
