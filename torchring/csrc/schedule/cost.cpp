// The closed forms of cost.h, step by step as the schedules run (schedule/*_steps.cpp):
// p2 = powerOfTwoBelow(members), rem = members - p2, n = count·esize, and the fold in and out
// (when rem > 0) costs the odd member of a pair (alpha + n·beta + n·gamma) + (alpha + n·beta).
//   ring:          2(members - 1) steps of one chunk, the first members - 1 folding it
//   doubling:      fold + log2(p2) steps of the whole buffer, each folded
//   rabenseifner:  fold + k halving steps (n/2, n/4, ... sent and folded), log2(p2) - k steps
//                  of the n/2^k window (sent and folded), k steps back (..., n/4, n/2 sent)
//   radix4:        fold + per level of radix r on a window of w bytes, a group there (sends
//                  and folds (r - 1)·w/r) and a group back (sends (r - 1)·w/r)
//   multiplying:   fold + per level of radix r a group that sends and folds (r - 1)·n
// A group of steps that run at once (schedule.h withNext) costs one alphaGroup (groupAlpha):
// its transfers share the leader's link (their bytes add up) and its folds add up.
// A chunk or block is the largest one (count split as chunkOf), so uneven splits cost what
// the slowest member pays.
#include "schedule/cost.h"

#include <algorithm>
#include <stdexcept>

namespace torchring {

double scheduleSeconds(const Schedule& schedule, const std::vector<size_t>& unitBytes, const LinkCost& cost) {
  auto bytesOf = [&](const std::vector<Range>& ranges) {
    size_t total = 0;
    for (const Range& r : ranges) {
      if (unitBytes.size() == 1) {
        total += r.count * unitBytes[0];
      } else {
        for (size_t u = r.first; u < r.first + r.count; ++u) total += unitBytes.at(u);
      }
    }
    return static_cast<double>(total);
  };
  double seconds = 0;
  const auto& steps = schedule.steps;
  for (size_t first = 0; first < steps.size();) {
    const size_t end = groupEnd(steps, first);
    double sent = 0, received = 0, folded = 0;
    for (size_t i = first; i < end; ++i) {
      sent += bytesOf(steps[i].send);
      received += bytesOf(steps[i].recv);
      if (steps[i].fold) folded += bytesOf(steps[i].recv);
    }
    seconds += (end - first > 1 ? groupAlpha(cost) : cost.alpha) + std::max(sent, received) * cost.beta +
               folded * cost.gamma;
    first = end;
  }
  return seconds;
}

double allreduceSeconds(Algo algo, int members, size_t count, size_t esize, const LinkCost& cost, int levels) {
  if (members <= 1 || count == 0) return 0;
  const double a = cost.alpha, b = cost.beta, g = cost.gamma;
  const int p2 = powerOfTwoBelow(members), logp2 = coreLevels(members);
  const double n = static_cast<double>(count * esize);
  const double fold = members > p2 ? (a + n * b + n * g) + (a + n * b) : 0.0;
  switch (algo) {
    case Algo::Ring: {
      const double chunk = static_cast<double>(chunkOf(count, members, 0).count * esize);
      return (members - 1) * (2 * a + 2 * chunk * b + chunk * g);
    }
    case Algo::Doubling:
    case Algo::Rabenseifner: {
      // Halving k moves the largest window of p2 >> (k + 1) blocks there and back.
      const int k = halvingsOf(algo, members, levels);
      const double block = static_cast<double>(chunkOf(count, p2, 0).count * esize);
      double halves = 0;
      for (int level = 0; level < k; ++level) {
        const double w = block * (p2 >> (level + 1));
        halves += 2 * a + 2 * w * b + w * g;
      }
      const double window = k == 0 ? n : block * (p2 >> k);
      return fold + halves + (logp2 - k) * (a + window * b + window * g);
    }
    case Algo::Radix4: {
      const double block = static_cast<double>(chunkOf(count, p2, 0).count * esize);
      double levels = 0, window = block * p2;
      for (const auto& [shift, radix] : radixLevels(members)) {
        const double moved = window / radix * (radix - 1), latency = radix > 2 ? groupAlpha(cost) : a;
        levels += 2 * latency + 2 * moved * b + moved * g;
        window /= radix;
      }
      return fold + levels;
    }
    case Algo::Multiplying: {
      double levels = 0;
      for (const auto& [shift, radix] : radixLevels(members)) {
        const double moved = n * (radix - 1), latency = radix > 2 ? groupAlpha(cost) : a;
        levels += latency + moved * b + moved * g;
      }
      return fold + levels;
    }
    default:
      throw std::invalid_argument(std::string("allreduceSeconds: no allreduce named ") + algoName(algo));
  }
}

double allgatherSeconds(Algo algo, const std::vector<size_t>& blockBytes, const LinkCost& cost) {
  const int members = static_cast<int>(blockBytes.size());
  double worst = 0;
  // Small member counts: the exact slowest member; large ones: member 0 (blocks are alike).
  for (int me = 0; me < (members <= 64 ? members : 1); ++me) {
    worst = std::max(worst, scheduleSeconds(allgatherSchedule(algo, members, me), blockBytes, cost));
  }
  return worst;
}

double broadcastSeconds(Algo algo, int members, size_t bytes, size_t segment, const LinkCost& cost) {
  if (members <= 1 || bytes == 0) return 0;
  const double n = static_cast<double>(bytes);
  int depth = 0;
  while ((1 << depth) < members) ++depth;
  if (algo == Algo::Tree) return depth * (cost.alpha + n * cost.beta);
  if (algo == Algo::Ring) {
    const size_t pieces = (bytes + segment - 1) / segment;
    const double piece = static_cast<double>(std::min(bytes, segment));
    return static_cast<double>(members - 2 + pieces) * (cost.alpha + piece * cost.beta);
  }
  throw std::invalid_argument(std::string("broadcastSeconds: no broadcast named ") + algoName(algo));
}

// Multiplying's header must cost at most this share of Doubling's (cost.h headerAlgo).
constexpr double kHeaderGroupsSave = 0.9;

Algo headerAlgo(int members, const LinkCost& cost) {
  if (cost.header == Algo::Doubling || cost.header == Algo::Multiplying) return cost.header;
  if (members <= 1) return Algo::Doubling;
  const LinkCost latency{cost.alpha, 0, 0, cost.alphaGroup};  // summaries: their steps alone
  return allreduceSeconds(Algo::Multiplying, members, 1, 1, latency) <=
                 kHeaderGroupsSave * allreduceSeconds(Algo::Doubling, members, 1, 1, latency)
             ? Algo::Multiplying
             : Algo::Doubling;
}

double headerSeconds(int members, const LinkCost& cost) {
  if (members <= 1) return 0;
  const LinkCost latency{cost.alpha, 0, 0, cost.alphaGroup};
  return allreduceSeconds(headerAlgo(members, cost), members, 1, 1, latency);  // (a forced shape's cost)
}

bool carriedBy(Algo header, Algo algo) {
  if (header == Algo::Multiplying) return algo == Algo::Multiplying || algo == Algo::Radix4;
  return algo == Algo::Doubling || algo == Algo::Rabenseifner;
}

double carrySeconds(size_t bytes, const LinkCost& cost, bool staged) {
  return staged ? 0.0 : static_cast<double>(bytes) * cost.gamma;
}

bool ridesOnHeaders(Algo algo, int members, size_t count, size_t esize, const LinkCost& cost, bool staged) {
  const size_t work = count * esize;
  return members > 1 && carriedBy(headerAlgo(members, cost), algo) && work > 0 && work <= kCarriedLimitBytes &&
         carrySeconds(work, cost, staged) < headerSeconds(members, cost);
}

AllreduceChoice chooseAllreduce(AllreduceChoice forced, int members, size_t count, size_t esize,
                                const LinkCost& cost, bool staged) {
  if (forced.algo != Algo::Auto) return forced;
  const double header = headerSeconds(members, cost);
  auto seconds = [&](Algo a, int levels) {
    const bool rides = ridesOnHeaders(a, members, count, esize, cost, staged);
    return allreduceSeconds(a, members, count, esize, cost, levels) +
           (rides ? carrySeconds(count * esize, cost, staged) : header);
  };
  AllreduceChoice best{Algo::Ring, 0};
  double bestSeconds = seconds(Algo::Ring, 0);
  auto consider = [&](Algo a, int levels) {
    const double s = seconds(a, levels);
    if (s < bestSeconds) best = {a, levels}, bestSeconds = s;
  };
  consider(Algo::Rabenseifner, 0);
  for (int k = 1; k < coreLevels(members); ++k) consider(Algo::Rabenseifner, k);
  consider(Algo::Doubling, 0);
  consider(Algo::Radix4, 0);
  consider(Algo::Multiplying, 0);
  return best;
}

std::string choiceName(AllreduceChoice choice) {
  std::string name = algoName(choice.algo);
  if (choice.algo == Algo::Rabenseifner && choice.levels > 0) name += ":" + std::to_string(choice.levels);
  return name;
}

double reduceScatterSeconds(const std::vector<size_t>& blockBytes, const LinkCost& cost) {
  const size_t members = blockBytes.size();
  if (members <= 1) return 0;
  const double largest = static_cast<double>(*std::max_element(blockBytes.begin(), blockBytes.end()));
  return static_cast<double>(members - 1) * (cost.alpha + largest * (cost.beta + cost.gamma));
}

AllreduceChoice chooseReduceScatter(Algo forced, int levels, size_t count, size_t esize,
                                    const std::vector<size_t>& blockBytes, const LinkCost& cost) {
  const int members = static_cast<int>(blockBytes.size());
  if (forced == Algo::Ring) return {Algo::Ring, 0};
  const AllreduceChoice whole = chooseAllreduce({forced, levels}, members, count, esize, cost);
  if (forced != Algo::Auto) return whole;
  return reduceScatterSeconds(blockBytes, cost) <=
                 allreduceSeconds(whole.algo, members, count, esize, cost, whole.levels)
             ? AllreduceChoice{Algo::Ring, 0}
             : whole;
}

Algo chooseAllgather(Algo forced, const std::vector<size_t>& blockBytes, const LinkCost& cost) {
  if (forced == Algo::Ring) return Algo::Ring;
  return allgatherSeconds(Algo::Bruck, blockBytes, cost) < allgatherSeconds(Algo::Ring, blockBytes, cost)
             ? Algo::Bruck
             : Algo::Ring;
}

Algo chooseBroadcast(Algo forced, int members, size_t bytes, size_t segment, const LinkCost& cost) {
  if (forced == Algo::Ring) return Algo::Ring;
  return broadcastSeconds(Algo::Tree, members, bytes, segment, cost) <
                 broadcastSeconds(Algo::Ring, members, bytes, segment, cost)
             ? Algo::Tree
             : Algo::Ring;
}

}  // namespace torchring
