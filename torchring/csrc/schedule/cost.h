// The cost model that picks a cross-host algorithm per operation: each step of a schedule
// (schedule.h) costs alpha + (the larger of the bytes it sends and receives)·beta + (the
// bytes it folds)·gamma, steps add up (a group of steps that run at once: one alphaGroup, its
// bytes and folds added up). The closed forms below are that sum along the slowest
// member's steps (tests/unit/engine_rules checks them against the schedules themselves);
// choose*() takes the cheapest. alpha and beta are measured on the leaders' links when they
// connect (TcpLinks::measure), gamma on this host's reduction; the job agrees on the largest
// of each, so every rank chooses alike (and the choice is in every allreduce's header).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "schedule/schedule.h"

namespace torchring {

// The largest allreduce (its partial results' bytes) that may ride on the header exchange
// (engine/fused.cpp, ridesOnHeaders): its leader holds a buffer that large.
inline constexpr size_t kCarriedLimitBytes = 16 << 20;

// An allreduce's algorithm among hosts and, for Rabenseifner, its halvings (0: all of them;
// schedule.h halvingsOf). Both are in the operation's header and must agree on every rank.
struct AllreduceChoice {
  Algo algo = Algo::Auto;
  int levels = 0;
};
// "ring", "doubling", "rabenseifner", "rabenseifner:2": the words TORCHRING_ALGO takes.
std::string choiceName(AllreduceChoice choice);

struct LinkCost {
  double alpha = 50e-6;  // seconds one step costs whatever its size (latency, wake-ups, calls)
  double beta = 1e-9;    // seconds per byte through one leader's link (1 / bandwidth)
  double gamma = 0.5e-9;  // seconds per byte folded (the reduction kernel)
  // Seconds a group of steps that run at once (Radix4's three transfers) costs whatever its
  // size; 0: alpha (the latencies overlap and the calls are few). Measured apart, as the three
  // messages' calls and wake-ups add up where the leaders' CPUs, not the wire, set the time.
  double alphaGroup = 0;
  // The header exchange's shape when forced (TORCHRING_HEADER: Doubling or Multiplying);
  // Auto: headerAlgo's rule. Alike on every rank (each sets it from the same setting).
  Algo header = Algo::Auto;
};
// alphaGroup, or alpha when it is not set.
inline double groupAlpha(const LinkCost& cost) { return cost.alphaGroup > 0 ? cost.alphaGroup : cost.alpha; }

// Seconds `schedule` takes on its member: the sum of its steps' costs.
double scheduleSeconds(const Schedule& schedule, const std::vector<size_t>& unitBytes, const LinkCost& cost);
// The same in closed form for the slowest member: allreduce of count elements of esize bytes.
double allreduceSeconds(Algo algo, int members, size_t count, size_t esize, const LinkCost& cost,
                        int levels = 0);
// Allgather of blocks of these byte sizes (one per member), Ring or Bruck.
double allgatherSeconds(Algo algo, const std::vector<size_t>& blockBytes, const LinkCost& cost);
// Broadcast of `bytes` from one member, Ring (segment-byte pieces) or Tree.
double broadcastSeconds(Algo algo, int members, size_t bytes, size_t segment, const LinkCost& cost);

// Reduce-scatter into blocks of these byte sizes (one per member) around the ring.
double reduceScatterSeconds(const std::vector<size_t>& blockBytes, const LinkCost& cost);

// The header exchange's shape (transport/tcp/headers.cpp): cost.header when forced, else
// Multiplying where its groups cost at most 0.9 of Doubling's steps (alphaGroup below 1.8
// alpha), else Doubling. The tenth is the spread of alphaGroup / alpha between measurements
// (1.90–1.95 on 16 CPU-bound test hosts, where the two shapes took the same time for small
// allreduces and Radix4 riding on Multiplying's was slower at 64 KiB than Rabenseifner riding
// on Doubling's): near a tie the shape with fewer bytes per step stays. Every rank derives
// the same from the agreed cost.
Algo headerAlgo(int members, const LinkCost& cost);
// Seconds of the header exchange every operation among hosts starts with (headerAlgo's steps).
double headerSeconds(int members, const LinkCost& cost);
// Whether an allreduce under `algo` can ride on a header exchange of shape `header`: its first
// steps are the header's (Doubling and Rabenseifner on Doubling, Multiplying and Radix4 on
// Multiplying).
bool carriedBy(Algo header, Algo algo);

// The cheapest, or `forced` when it is not Auto (Ring forces the ring on every operation;
// the others force that allreduce and leave allgather and broadcast to the model). An
// allreduce's cost counts the header exchange, or for one that rides on it its copy
// (ridesOnHeaders; `staged`: every host has several ranks). Rabenseifner is weighed with
// every count of halvings, then Doubling, Radix4 and Multiplying.
AllreduceChoice chooseAllreduce(AllreduceChoice forced, int members, size_t count, size_t esize,
                                const LinkCost& cost, bool staged = false);
// Seconds of the copy an allreduce riding on the header exchange makes, at gamma per byte:
// the tensor into the leader's buffer on a host of one rank; none when `staged` (every host
// has several ranks, and the host's reduce writes the leader's buffer instead of its tensor).
double carrySeconds(size_t bytes, const LinkCost& cost, bool staged = false);
// True when an allreduce of `count` elements of `esize` bytes (float32 for 16-bit floats)
// under `algo` among `members` rides on the header exchange (engine/fused.cpp): carriedBy the
// header's shape, at most kCarriedLimitBytes, and its copy costs less than the header
// exchange's steps it saves. Every rank decides alike (the job agrees on `cost`, and every
// rank knows how many ranks each host has).
bool ridesOnHeaders(Algo algo, int members, size_t count, size_t esize, const LinkCost& cost, bool staged = false);
// Reduce-scatter among hosts: Algo::Ring for the ring reduce-scatter (reduceScatterSchedule),
// else the allreduce algorithm whose result each host slices (cheaper for small sizes, where
// log-depth steps win). `count` and `esize` describe the whole tensor, blockBytes the hosts' parts.
AllreduceChoice chooseReduceScatter(Algo forced, int levels, size_t count, size_t esize,
                                    const std::vector<size_t>& blockBytes, const LinkCost& cost);
Algo chooseAllgather(Algo forced, const std::vector<size_t>& blockBytes, const LinkCost& cost);
Algo chooseBroadcast(Algo forced, int members, size_t bytes, size_t segment, const LinkCost& cost);

}  // namespace torchring
