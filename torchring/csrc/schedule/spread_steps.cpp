// The schedules that spread data without reducing it: allgather and broadcast (schedule.h
// says what a schedule is), and the set of members any schedule makes a member talk to.
//
// Allgather, Ring: in step s member `me` sends block (me - s) to the right and receives
// block (me - s - 1) from the left; members - 1 steps.
// Allgather, Bruck: before step k (dist = 2^k) member `me` holds the `dist` blocks me,
// me + 1, ... (mod members); it sends them to me - dist and receives blocks me + dist, ...
// from me + dist, each time at most members - dist of them (so the last step completes the
// set exactly). ceil(log2 members) steps for any member count, no fold needed.
// Broadcast, Tree: the binomial tree on v = (me - root) mod members. With `mask` = 1, 2, 4,
// ...: a member with v < mask (it has the data) sends it to v + mask; the member v with
// mask <= v < 2·mask receives it from v - mask. ceil(log2 members) steps.
// Broadcast, Ring: the root sends `bytes` to the right, a `segment` piece per step; in step k every
// other member receives piece k from the left and forwards piece k - 1 to the right, unless
// its right neighbour is the root.
#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <stdexcept>

#include "schedule/schedule.h"

namespace torchring {
namespace {

int wrap(int i, int members) { return ((i % members) + members) % members; }

std::vector<Range> blockList(int first, int n, int members) {
  std::vector<Range> out;
  for (int i = 0; i < n; ++i) out.push_back({static_cast<size_t>(wrap(first + i, members)), 1});
  return out;
}

}  // namespace

Schedule allgatherSchedule(Algo algo, int members, int me) {
  if (members < 1 || me < 0 || me >= members) throw std::invalid_argument("allgatherSchedule: bad member");
  Schedule s;
  s.algo = algo;
  if (algo == Algo::Ring) {
    for (int k = 0; k < members - 1; ++k) {
      s.steps.push_back({wrap(me + 1, members), wrap(me - 1, members), blockList(me - k, 1, members),
                         blockList(me - k - 1, 1, members), false});
    }
  } else if (algo == Algo::Bruck) {
    for (int dist = 1; dist < members; dist *= 2) {
      const int n = std::min(dist, members - dist);
      s.steps.push_back({wrap(me - dist, members), wrap(me + dist, members), blockList(me, n, members),
                         blockList(me + dist, n, members), false});
    }
  } else {
    throw std::invalid_argument(std::string("allgatherSchedule: no allgather named ") + algoName(algo));
  }
  return s;
}

Schedule broadcastSchedule(Algo algo, int members, int me, int root, size_t bytes, size_t segment) {
  if (members < 1 || me < 0 || me >= members || root < 0 || root >= members) {
    throw std::invalid_argument("broadcastSchedule: bad member or root");
  }
  Schedule s;
  s.algo = algo;
  if (members == 1 || bytes == 0) return s;
  if (algo == Algo::Tree) {
    const int v = wrap(me - root, members);
    for (int mask = 1; mask < members; mask *= 2) {
      if (v < mask && v + mask < members) {
        s.steps.push_back({wrap(me + mask, members), -1, {{0, bytes}}, {}, false});
      } else if (v >= mask && v < 2 * mask) {
        s.steps.push_back({-1, wrap(me - mask, members), {}, {{0, bytes}}, false});
      }
    }
  } else if (algo == Algo::Ring) {
    const int right = wrap(me + 1, members), left = wrap(me - 1, members);
    segment = std::max<size_t>(segment, 1);
    const size_t pieces = (bytes + segment - 1) / segment;
    auto piece = [&](size_t k) { return Range{k * segment, std::min(segment, bytes - k * segment)}; };
    if (me == root) {
      for (size_t k = 0; k < pieces; ++k) s.steps.push_back({right, -1, {piece(k)}, {}, false});
      return s;
    }
    const bool forwards = right != root;
    for (size_t k = 0; k <= pieces; ++k) {
      Step step;
      if (k < pieces) {
        step.recvFrom = left;
        step.recv = {piece(k)};
      }
      if (forwards && k > 0) {
        step.sendTo = right;
        step.send = {piece(k - 1)};
      }
      s.steps.push_back(step);
    }
  } else {
    throw std::invalid_argument(std::string("broadcastSchedule: no broadcast named ") + algoName(algo));
  }
  return s;
}

// Replays every member's steps as messages (a group of steps posts its sends, then each step
// waits for the matching receive from its partner, messages between two members kept in
// order), each message carrying the set of blocks its sender knows when the group starts.
std::vector<Carried> carriedAlong(Algo algo, int members, int me) {
  std::vector<Schedule> all;
  for (int m = 0; m < members; ++m) all.push_back(allreduceSchedule(algo, members, m, 1));
  std::vector<std::vector<bool>> known(members, std::vector<bool>(members, false));
  for (int m = 0; m < members; ++m) known[m][m] = true;
  std::map<std::pair<int, int>, std::deque<std::vector<bool>>> queue;  // (from, to) -> messages
  std::vector<size_t> pos(members, 0);
  std::vector<bool> posted(members, false);  // the sends of the group pos[m] is in
  std::vector<Carried> out(all[me].steps.size());
  auto members_of = [&](const std::vector<bool>& set) {
    std::vector<int> list;
    for (int b = 0; b < members; ++b) {
      if (set[b]) list.push_back(b);
    }
    return list;
  };
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int m = 0; m < members; ++m) {
      const std::vector<Step>& steps = all[m].steps;
      if (pos[m] == steps.size()) continue;
      if (!posted[m]) {
        for (size_t i = pos[m]; i < groupEnd(steps, pos[m]); ++i) {
          if (steps[i].sendTo < 0) continue;
          queue[{m, steps[i].sendTo}].push_back(known[m]);
          if (m == me) out[i].sent = members_of(known[m]);
        }
        posted[m] = true;
      }
      const Step& step = steps[pos[m]];
      if (step.recvFrom >= 0) {
        auto& from = queue[{step.recvFrom, m}];
        if (from.empty()) continue;
        const std::vector<bool> got = std::move(from.front());
        from.pop_front();
        if (m == me) out[pos[m]].received = members_of(got);
        for (int b = 0; b < members; ++b) known[m][b] = known[m][b] || got[b];
      }
      if (!step.withNext) posted[m] = false;
      ++pos[m];
      progressed = true;
    }
  }
  if (pos[me] != all[me].steps.size()) throw std::logic_error("carriedAlong: the schedule deadlocks");
  return out;
}

// Ring neighbours, members at distance 2^k either way (Bruck, the tree from any root), the
// fold and core partners of Doubling and Rabenseifner (the same for both), and Radix4's and
// Multiplying's (those and, at each radix-4 level, core member c ^ (3 << shift)). The relation
// is symmetric, so each pair agrees that the lower member dials.
std::vector<int> partnersOf(int members, int me) {
  std::set<int> out;
  for (int dist = 1; dist < members; dist *= 2) {
    out.insert(wrap(me + dist, members));
    out.insert(wrap(me - dist, members));
  }
  const int p2 = powerOfTwoBelow(members), rem = members - p2, c = coreOf(members, me);
  if (me < 2 * rem) out.insert(me % 2 == 0 ? me + 1 : me - 1);
  if (c >= 0) {
    for (int mask = 1; mask < p2; mask <<= 1) out.insert(memberOf(members, c ^ mask));
    for (const auto& [shift, radix] : radixLevels(members)) {
      for (int j = 1; j < radix; ++j) out.insert(memberOf(members, c ^ (j << shift)));
    }
  }
  out.erase(me);
  return {out.begin(), out.end()};
}

}  // namespace torchring
