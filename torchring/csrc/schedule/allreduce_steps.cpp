// The allreduce schedules (schedule.h says what a schedule is).
//
// Ring: `members` chunks (chunkOf). In reduce-scatter step s member `me` sends chunk (me - s)
// to the right and folds chunk (me - s - 1) from the left; after members - 1 steps it owns
// chunk (me + 1). In allgather step s it sends chunk (me + 1 - s) and receives chunk (me - s).
// 2(members - 1) steps, each moving 1/members of the buffer.
//
// Doubling: the core (schedule.h) of p2 members; in step k core member c swaps its whole
// buffer with core member c ^ 2^k and folds what it receives. log2(p2) steps of the whole
// buffer: the fewest steps, so the choice for small messages.
//
// Rabenseifner: the core's buffer is split into p2 blocks (chunkOf). Recursive halving: with
// `mask` from p2/2 down to 1, core member c keeps the half of its window [lo, hi) of blocks
// that has c's bit `mask` (the lower half when it is clear), sends the other half to c ^ mask
// and folds the partner's copy of the kept half; after log2(p2) steps it owns block c.
// Recursive doubling then spreads the blocks back: with `mask` from 1 up to p2/2, c sends its
// window (the mask blocks that share c's high bits) to c ^ mask and receives the partner's.
// 2·log2(p2) steps moving 2(p2 - 1)/p2 of the buffer in all: log-depth and bandwidth-optimal.
#include <stdexcept>

#include "schedule/schedule.h"

namespace torchring {

const char* algoName(Algo algo) {
  switch (algo) {
    case Algo::Auto: return "auto";
    case Algo::Ring: return "ring";
    case Algo::Doubling: return "doubling";
    case Algo::Rabenseifner: return "rabenseifner";
    case Algo::Tree: return "tree";
    case Algo::Bruck: return "bruck";
  }
  return "?";
}

Range chunkOf(size_t count, int parts, int i) {
  i = ((i % parts) + parts) % parts;
  const size_t base = count / parts, rem = count % parts, idx = static_cast<size_t>(i);
  return {idx * base + std::min(idx, rem), base + (idx < rem ? 1 : 0)};
}

int powerOfTwoBelow(int members) {
  int p2 = 1;
  while (p2 * 2 <= members) p2 *= 2;
  return p2;
}

int coreOf(int members, int me) {
  const int rem = members - powerOfTwoBelow(members);
  if (me < 2 * rem) return me % 2 == 1 ? me / 2 : -1;
  return me - rem;
}

int memberOf(int members, int core) {
  const int rem = members - powerOfTwoBelow(members);
  return core < rem ? 2 * core + 1 : core + rem;
}

int doublingSteps(int members) {
  const int p2 = powerOfTwoBelow(members);
  int steps = members > p2 ? 2 : 0;
  for (int mask = 1; mask < p2; mask <<= 1) ++steps;
  return steps;
}

namespace {

Range whole(size_t count) { return {0, count}; }

// Elements of blocks [lo, hi) when the core's buffer is split into p2 blocks.
Range blocks(size_t count, int p2, int lo, int hi) {
  const size_t first = chunkOf(count, p2, lo).first;
  const Range last = chunkOf(count, p2, hi - 1);
  return {first, last.first + last.count - first};
}

Schedule ring(int members, int me, size_t count) {
  Schedule s;
  s.algo = Algo::Ring;
  const int right = (me + 1) % members, left = (me + members - 1) % members;
  for (int k = 0; k < members - 1; ++k) {
    s.steps.push_back({right, left, {chunkOf(count, members, me - k)}, {chunkOf(count, members, me - k - 1)}, true});
  }
  s.owned = {chunkOf(count, members, me + 1)};
  for (int k = 0; k < members - 1; ++k) {
    s.steps.push_back({right, left, {chunkOf(count, members, me + 1 - k)}, {chunkOf(count, members, me - k)}, false});
  }
  return s;
}

// Fold in (before the core's steps) or out (after them), for the pair members below 2*rem.
void foldStep(Schedule& s, int members, int me, size_t count, bool in) {
  const int rem = members - powerOfTwoBelow(members);
  if (me >= 2 * rem) return;
  const bool sitsOut = me % 2 == 0;
  Step step;
  if (sitsOut == in) {  // the even member sends in (partial results), the odd one sends out
    step.sendTo = in ? me + 1 : me - 1;
    step.send = {whole(count)};
    step.fold = in;
  } else {
    step.recvFrom = in ? me - 1 : me + 1;
    step.recv = {whole(count)};
    step.fold = in;
  }
  s.steps.push_back(step);
}

Schedule doubling(int members, int me, size_t count) {
  Schedule s;
  s.algo = Algo::Doubling;
  const int p2 = powerOfTwoBelow(members), c = coreOf(members, me);
  foldStep(s, members, me, count, true);
  if (c >= 0) {
    for (int mask = 1; mask < p2; mask <<= 1) {
      const int partner = memberOf(members, c ^ mask);
      s.steps.push_back({partner, partner, {whole(count)}, {whole(count)}, true});
    }
    s.owned = {whole(count)};
  }
  foldStep(s, members, me, count, false);
  return s;
}

Schedule rabenseifner(int members, int me, size_t count) {
  Schedule s;
  s.algo = Algo::Rabenseifner;
  const int p2 = powerOfTwoBelow(members), c = coreOf(members, me);
  foldStep(s, members, me, count, true);
  if (c >= 0) {
    int lo = 0, hi = p2;
    for (int mask = p2 / 2; mask >= 1; mask /= 2) {
      const int partner = memberOf(members, c ^ mask), mid = lo + (hi - lo) / 2;
      const bool lower = (c & mask) == 0;
      const Range keep = lower ? blocks(count, p2, lo, mid) : blocks(count, p2, mid, hi);
      const Range give = lower ? blocks(count, p2, mid, hi) : blocks(count, p2, lo, mid);
      s.steps.push_back({partner, partner, {give}, {keep}, true});
      (lower ? hi : lo) = mid;
    }
    s.owned = {chunkOf(count, p2, c)};
    for (int mask = 1; mask < p2; mask <<= 1) {
      const int partner = memberOf(members, c ^ mask);
      const int mine = c & ~(mask - 1), theirs = (c ^ mask) & ~(mask - 1);
      s.steps.push_back({partner, partner, {blocks(count, p2, mine, mine + mask)},
                         {blocks(count, p2, theirs, theirs + mask)}, false});
    }
  }
  foldStep(s, members, me, count, false);
  return s;
}

}  // namespace

// The ring's reduce-scatter shifted by one, so that member `me` ends owning its own block:
// in step s it sends block (me - s - 1) to the right and folds block (me - s - 2) from the left.
Schedule reduceScatterSchedule(int members, int me, const std::vector<std::vector<Range>>& blocks) {
  if (members < 1 || me < 0 || me >= members || static_cast<int>(blocks.size()) != members) {
    throw std::invalid_argument("reduceScatterSchedule: bad member or blocks");
  }
  Schedule s;
  s.algo = Algo::Ring;
  auto block = [&](int i) { return blocks[((i % members) + members) % members]; };
  const int right = (me + 1) % members, left = (me + members - 1) % members;
  for (int k = 0; k < members - 1; ++k) s.steps.push_back({right, left, block(me - k - 1), block(me - k - 2), true});
  s.owned = blocks[me];
  return s;
}

Schedule allreduceSchedule(Algo algo, int members, int me, size_t count) {
  if (members < 1 || me < 0 || me >= members) throw std::invalid_argument("allreduceSchedule: bad member");
  if (members == 1) return Schedule{algo, {}, {whole(count)}};
  switch (algo) {
    case Algo::Ring: return ring(members, me, count);
    case Algo::Doubling: return doubling(members, me, count);
    case Algo::Rabenseifner: return rabenseifner(members, me, count);
    default: throw std::invalid_argument(std::string("allreduceSchedule: no allreduce named ") + algoName(algo));
  }
}

}  // namespace torchring
