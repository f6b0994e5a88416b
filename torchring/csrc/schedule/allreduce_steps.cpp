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
// Rabenseifner (`levels` halvings, all log2(p2) of them unless fewer are asked for): the core's
// buffer is split into p2 blocks (chunkOf) and core member c holds a window [lo, hi) of them,
// all p2 at first. Recursive halving: for each of the first `levels` masks (1, 2, 4, ...), c
// keeps the lower half of its window when its bit `mask` is clear (else the upper half),
// sends the other half to c ^ mask and folds the partner's copy of the kept half. The
// remaining masks swap and fold the whole window, as Doubling does (with all levels there
// are none and the window is one block). The window is then complete (`owned`); the halvings
// are undone in reverse order: c sends its window to c ^ mask and receives the partner's
// half of the window that halving split. With all levels: 2·log2(p2) steps moving
// 2(p2 - 1)/p2 of the buffer, log-depth and bandwidth-optimal; with k levels the middle
// log2(p2) - k steps each move the p2/2^k-block window: fewer steps than all levels, fewer
// bytes than Doubling (halving(0)), the middle the cost model can pick.
//
// Radix4: Rabenseifner with radix-4 levels (radixLevels: one radix-2 level first when
// log2(p2) is odd). At the level of (shift, radix) core member c's digit is
// d = (c >> shift) & (radix - 1); its window [lo, hi) splits into `radix` parts of `part`
// blocks, and in one group it sends part d ^ j to core member c ^ (j << shift) and folds that
// member's copy of part d, for j = 1 .. radix - 1 at once; the window becomes part d. Back
// in reverse order, one group per level: c sends its part d to the same members and receives
// theirs. log4(p2) groups each way, each moving (radix - 1)/radix of the window: the bytes of
// Rabenseifner in half its steps, as the links carry the group's transfers side by side.
//
// Multiplying: Doubling with Radix4's levels (recursive multiplying in radix 4): at the level
// of (shift, radix) core member c sends its whole buffer to core member c ^ (j << shift) and
// folds that member's, for j = 1 .. radix - 1 at once. log4(p2) groups of (radix - 1)·n bytes
// each way: Doubling's result in half its steps. Radix4's first groups are Multiplying's
// (the same partners in the same order), so where the header exchange takes Multiplying's
// shape (cost.h headerAlgo) both ride on it as Doubling and Rabenseifner ride on Doubling's.
#include <algorithm>
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
    case Algo::Radix4: return "radix4";
    case Algo::Multiplying: return "multiplying";
  }
  return "?";
}

bool rangesOverlap(const std::vector<Range>& a, const std::vector<Range>& b) {
  for (const Range& x : a) {
    for (const Range& y : b) {
      if (x.count > 0 && y.count > 0 && x.first < y.first + y.count && y.first < x.first + x.count) return true;
    }
  }
  return false;
}

bool sameRanges(const std::vector<Range>& a, const std::vector<Range>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](const Range& x, const Range& y) {
           return x.first == y.first && x.count == y.count;
         });
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

int doublingSteps(int members) { return coreLevels(members) + (members > powerOfTwoBelow(members) ? 2 : 0); }

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

// Doubling is halving(0), Rabenseifner halving(levels); both keep Doubling's partners in
// Doubling's order (mask 1, 2, 4, ...), so the first steps of every one of them are the
// header exchange's (transport/tcp/headers.cpp) and can carry it.
Schedule halving(Algo algo, int members, int me, size_t count, int levels) {
  Schedule s;
  s.algo = algo;
  const int p2 = powerOfTwoBelow(members), c = coreOf(members, me);
  foldStep(s, members, me, count, true);
  if (c >= 0) {
    std::vector<std::pair<int, int>> windows;  // the window [lo, hi) each halving split
    int lo = 0, hi = p2, mask = 1;
    for (int level = 0; level < levels; ++level, mask <<= 1) {
      const int partner = memberOf(members, c ^ mask), mid = lo + (hi - lo) / 2;
      const bool lower = (c & mask) == 0;
      const Range keep = lower ? blocks(count, p2, lo, mid) : blocks(count, p2, mid, hi);
      const Range give = lower ? blocks(count, p2, mid, hi) : blocks(count, p2, lo, mid);
      s.steps.push_back({partner, partner, {give}, {keep}, true});
      windows.push_back({lo, hi});
      (lower ? hi : lo) = mid;
    }
    const Range window = blocks(count, p2, lo, hi);
    for (; mask < p2; mask <<= 1) {
      const int partner = memberOf(members, c ^ mask);
      s.steps.push_back({partner, partner, {window}, {window}, true});
    }
    s.owned = {window};
    for (int level = levels - 1; level >= 0; --level) {
      const int bit = 1 << level, partner = memberOf(members, c ^ bit);
      const int wlo = windows[level].first, whi = windows[level].second, mid = wlo + (whi - wlo) / 2;
      const bool lower = (c & bit) == 0;
      const Range mine = lower ? blocks(count, p2, wlo, mid) : blocks(count, p2, mid, whi);
      const Range theirs = lower ? blocks(count, p2, mid, whi) : blocks(count, p2, wlo, mid);
      s.steps.push_back({partner, partner, {mine}, {theirs}, false});
    }
  }
  foldStep(s, members, me, count, false);
  return s;
}

Schedule radix(int members, int me, size_t count) {
  Schedule s;
  s.algo = Algo::Radix4;
  const int p2 = powerOfTwoBelow(members), c = coreOf(members, me);
  foldStep(s, members, me, count, true);
  if (c >= 0) {
    const auto levels = radixLevels(members);
    std::vector<int> starts;  // the window's first block before each level (its length: radix parts)
    int lo = 0, len = p2;
    for (const auto& [shift, radix] : levels) {
      const int digit = (c >> shift) & (radix - 1), part = len / radix;
      const Range keep = blocks(count, p2, lo + digit * part, lo + (digit + 1) * part);
      for (int j = 1; j < radix; ++j) {
        const int partner = memberOf(members, c ^ (j << shift)), other = digit ^ j;
        s.steps.push_back({partner, partner, {blocks(count, p2, lo + other * part, lo + (other + 1) * part)}, {keep},
                           true, j + 1 < radix});
      }
      starts.push_back(lo);
      lo += digit * part;
      len = part;
    }
    s.owned = {blocks(count, p2, lo, lo + len)};
    for (int level = static_cast<int>(levels.size()) - 1; level >= 0; --level) {
      const auto [shift, radix] = levels[level];
      const int digit = (c >> shift) & (radix - 1), part = len, first = starts[level];
      const Range mine = blocks(count, p2, first + digit * part, first + (digit + 1) * part);
      for (int j = 1; j < radix; ++j) {
        const int partner = memberOf(members, c ^ (j << shift)), other = digit ^ j;
        const Range theirs = blocks(count, p2, first + other * part, first + (other + 1) * part);
        s.steps.push_back({partner, partner, {mine}, {theirs}, false, j + 1 < radix});
      }
      len *= radix;
    }
  }
  foldStep(s, members, me, count, false);
  return s;
}

Schedule multiplying(int members, int me, size_t count) {
  Schedule s;
  s.algo = Algo::Multiplying;
  const int c = coreOf(members, me);
  foldStep(s, members, me, count, true);
  if (c >= 0) {
    for (const auto& [shift, radix] : radixLevels(members)) {
      for (int j = 1; j < radix; ++j) {
        const int partner = memberOf(members, c ^ (j << shift));
        s.steps.push_back({partner, partner, {whole(count)}, {whole(count)}, true, j + 1 < radix});
      }
    }
    s.owned = {whole(count)};
  }
  foldStep(s, members, me, count, false);
  return s;
}

}  // namespace

std::vector<std::pair<int, int>> radixLevels(int members) {
  const int levels = coreLevels(members);
  std::vector<std::pair<int, int>> out;
  int shift = 0;
  if (levels % 2 == 1) out.push_back({shift++, 2});
  for (; shift < levels; shift += 2) out.push_back({shift, 4});
  return out;
}

size_t groupEnd(const std::vector<Step>& steps, size_t i) {
  while (i < steps.size() && steps[i].withNext) ++i;
  return std::min(i + 1, steps.size());
}

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

int coreLevels(int members) {
  int levels = 0;
  while ((2 << levels) <= members) ++levels;
  return levels;
}

int halvingsOf(Algo algo, int members, int levels) {
  if (algo != Algo::Rabenseifner) return 0;
  const int all = coreLevels(members);
  return levels <= 0 || levels > all ? all : levels;
}

Schedule allreduceSchedule(Algo algo, int members, int me, size_t count, int levels) {
  if (members < 1 || me < 0 || me >= members) throw std::invalid_argument("allreduceSchedule: bad member");
  if (members == 1) return Schedule{algo, {}, {whole(count)}};
  switch (algo) {
    case Algo::Ring: return ring(members, me, count);
    case Algo::Doubling:
    case Algo::Rabenseifner: return halving(algo, members, me, count, halvingsOf(algo, members, levels));
    case Algo::Radix4: return radix(members, me, count);
    case Algo::Multiplying: return multiplying(members, me, count);
    default: throw std::invalid_argument(std::string("allreduceSchedule: no allreduce named ") + algoName(algo));
  }
}

}  // namespace torchring
