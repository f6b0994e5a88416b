// The progress meter: what a rank's status line says about its communication, read from the
// flight recorders (flight_recorder.h) about once a second by torchring/trace's status writer.
//
// measure() walks every live recorder's snapshot and answers:
// - ops: the operations recorded so far, every communicator together;
// - inFlightNs: the wall time during which at least one operation of this rank was in flight
//   (enqueued and not yet finished), since the meter was made. Operations overlap (a bucket's
//   allreduce runs while the next is queued, a group's while the world's does), so the meter
//   keeps the union, not the sum: coveredUntil_ is the end of the time already counted, and an
//   interval [enqueued, finished] adds only its part past coveredUntil_. Intervals are taken
//   in order of their start, which makes the union exact within one call; an interval counted
//   once ends before coveredUntil_, so seeing it again adds nothing. accounted_ remembers, per
//   recorder, the first id not yet finished, where the next call starts reading. Ids that the
//   ring overwrote before a call saw them (more than `capacity` operations in one interval) are
//   counted at the mean duration of those it did see, at most the gap they left.
//   The operation still in flight adds its time so far to the answer, not to the meter.
// - current: the oldest operation not finished (scheduled or started), and its group;
// - last: the operation that finished last, and its group.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/flight_recorder.h"

namespace torchring {

struct ProgressReport {
  uint64_t ops = 0;
  int64_t inFlightNs = 0;
  int64_t nowNs = 0;  // steady clock, what the entries' times are in
  bool hasCurrent = false, hasLast = false;
  TraceEntry current, last;
  std::string currentGroup, lastGroup;
  std::vector<std::pair<int, double>> waited;  // (world rank, seconds), every group's waits added
  double ownLinkSeconds = 0;  // waits on this rank's own link, every group's added
};

class ProgressMeter {
 public:
  ProgressReport measure();

 private:
  std::mutex mutex_;
  std::vector<std::pair<std::weak_ptr<FlightRecorder>, uint64_t>> accounted_;
  int64_t coveredUntil_ = 0;
  int64_t inFlightNs_ = 0;
  int64_t startNs_ = 0;  // the first measure(): ops lost before it count from there
};

}  // namespace torchring
