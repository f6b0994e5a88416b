// Cross-host schedules: who sends which part of the buffer to whom in which step, for every
// algorithm the hosts' leaders run among themselves. The engine runs these steps
// (transport/tcp/steps.cpp, ring.cpp) and the scale model replays the same ones (bindings.cpp
// binds them; benchmarks/scale_model.py), so the two cannot drift apart.
//
// A schedule is written for one member (`me`, a host index in [0, members)) and counts its
// buffer in units: elements for allreduce, member blocks for allgather (unit b is member b's
// part of the result), bytes for broadcast. Each Step sends some units to one member and
// receives some units from one member (either may be absent), at the same time; received
// units are folded (reduced) into the buffer when `fold` is set, else copied into place.
// Steps run in order; a step starts when the previous one has ended on this member. A step
// marked `withNext` runs at the same time as the next one: such a run of steps is a group
// (all fold or all copy), whose transfers go at once and which ends when all of them have;
// steps of a group that receive the same units fold them in the group's step order.
//
// Allreduce schedules fold first and copy after: once the last fold step has ended, `owned`
// units are complete (the engine scales or rounds them there, once), and the copy steps
// spread them. Non-power-of-two member counts fold in and out as MPI implementations do:
// with p2 the largest power of two <= members and rem = members - p2, members below 2*rem
// pair up, the even one of a pair sends its buffer to the odd one (fold in) and sits out;
// the odd one and every member from 2*rem on form the power-of-two core (core index
// coreOf(me)); at the end each odd member sends the result back to its even partner.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace torchring {

// The algorithms among hosts. Auto lets the cost model choose (schedule/cost.h).
enum class Algo : uint8_t {
  Auto = 0,
  Ring = 1,          // allreduce: reduce-scatter + allgather around a ring; broadcast: pipelined ring
  Doubling = 2,      // allreduce: recursive doubling (whole buffer, log2 steps)
  Rabenseifner = 3,  // allreduce: recursive-halving reduce-scatter + recursive-doubling allgather
  Tree = 4,          // broadcast: binomial tree from the root
  Bruck = 5,         // allgather: Bruck's concatenation (distance 1, 2, 4, ...), any member count
  Radix4 = 6,        // allreduce: Rabenseifner in radix 4: each level swaps quarters with 3 members at once
  Multiplying = 7,   // allreduce: Doubling in radix 4: each level swaps the whole buffer with 3 members at once
};
// "ring", "doubling", ...: the words TORCHRING_ALGO takes and messages use.
const char* algoName(Algo algo);

struct Range {
  size_t first = 0, count = 0;  // units
};

struct Step {
  int sendTo = -1;    // member this step sends to, -1: none
  int recvFrom = -1;  // member this step receives from, -1: none
  std::vector<Range> send, recv;
  // The step belongs to the reduce phase: it sends partial results and folds (reduces) what
  // it receives into the buffer. Else it spreads results: received units are copied into place.
  bool fold = false;
  bool withNext = false;  // runs at the same time as the next step (one group)
};

struct Schedule {
  Algo algo = Algo::Ring;
  std::vector<Step> steps;
  std::vector<Range> owned;  // allreduce: units complete after the last fold step
};

// True when some unit is in both (a step whose send and receive overlap must not fold into
// units it has yet to send).
bool rangesOverlap(const std::vector<Range>& a, const std::vector<Range>& b);
// True when both name the same units in the same order (a group's steps that receive the
// same units fold them in the group's order).
bool sameRanges(const std::vector<Range>& a, const std::vector<Range>& b);

// Element range of chunk `i` when `count` elements are split into `parts` chunks, the first
// count % parts chunks one element longer.
Range chunkOf(size_t count, int parts, int i);

// The non-power-of-two fold (see above): largest power of two <= members, and core indices.
int powerOfTwoBelow(int members);
int coreOf(int members, int me);        // -1 for a member that sits out
int memberOf(int members, int core);    // the member with core index `core`
// The longest member's step count under Doubling: log2(p2), and two more with the fold.
int doublingSteps(int members);

// log2(powerOfTwoBelow(members)): the core's halvings (Rabenseifner's levels) and doublings.
int coreLevels(int members);
// The halvings Rabenseifner runs when `levels` are asked for: all of them for 0 (or more than
// there are), else `levels`; 0 for other algorithms.
int halvingsOf(Algo algo, int members, int levels);
// Radix4's core levels, from the lowest bits of the core index up: (shift, radix), one of
// radix 2 first when log2(p2) is odd, then radix 4.
std::vector<std::pair<int, int>> radixLevels(int members);
// The index of the first step after step `i`'s group.
size_t groupEnd(const std::vector<Step>& steps, size_t i);
// Ring, Doubling, Rabenseifner (with `levels` halvings, halvingsOf), Radix4 or Multiplying,
// for `count` elements.
Schedule allreduceSchedule(Algo algo, int members, int me, size_t count, int levels = 0);
// Reduce-scatter around the ring: member m ends owning `blocks[m]` (element ranges, any
// sizes, member blocks disjoint) reduced over every member; nothing is spread after.
Schedule reduceScatterSchedule(int members, int me, const std::vector<std::vector<Range>>& blocks);
// Ring or Bruck; units are member blocks.
Schedule allgatherSchedule(Algo algo, int members, int me);
// Ring (pipelined in `segment`-byte pieces) or Tree, for `bytes` bytes from member `root`.
Schedule broadcastSchedule(Algo algo, int members, int me, int root, size_t bytes, size_t segment);

// When every message of a schedule also carries the blocks its sender knows so far (each
// member starts knowing its own), which members' blocks each of `me`'s steps sends and
// receives (a group's steps all send what their member knows when the group starts). Under
// Doubling and Multiplying every member ends knowing every block: an allgather riding on the
// allreduce (the header exchange, engine/fused.cpp).
struct Carried {
  std::vector<int> sent, received;  // member blocks, ascending
};
std::vector<Carried> carriedAlong(Algo algo, int members, int me);

// Every member any schedule above can make `me` talk to, ascending: the leaders' connections.
std::vector<int> partnersOf(int members, int me);

}  // namespace torchring
