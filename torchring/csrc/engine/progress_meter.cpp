// ProgressMeter (progress_meter.h): the in-flight union, the current and the last operation.
#include "engine/progress_meter.h"

#include <algorithm>
#include <map>

namespace torchring {

namespace {

bool finished(const TraceEntry& e) {
  return e.state == TraceState::COMPLETED || e.state == TraceState::FAILED;
}

}  // namespace

ProgressReport ProgressMeter::measure() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (startNs_ == 0) startNs_ = FlightRecorder::nowNs();
  const int64_t before = std::max(coveredUntil_, startNs_);  // where the counted time ended
  ProgressReport report;
  std::vector<std::pair<int64_t, int64_t>> intervals;  // [enqueued, finished], new since last call
  uint64_t lost = 0;
  int64_t lostGapEnd = 0;  // where the first interval seen after a lost stretch starts
  std::map<int, double> waited;
  std::vector<std::pair<std::weak_ptr<FlightRecorder>, uint64_t>> next;
  for (const auto& recorder : FlightRecorder::all()) {
    uint64_t from = 0;
    for (const auto& [weak, id] : accounted_) {
      if (weak.lock() == recorder) from = id;
    }
    const std::vector<TraceEntry> entries = recorder->snapshot();
    const std::vector<int> ranks = recorder->ranks();
    const WaitTotals waits = recorder->waits();
    for (size_t i = 0; i < waits.byRank.size() && i < ranks.size(); ++i) {
      if (waits.byRank[i] > 0) waited[ranks[i]] += waits.byRank[i];
    }
    report.ownLinkSeconds += waits.ownLink;
    uint64_t frontier = from;
    bool open = false;  // an unfinished entry was met: the frontier stays before it
    if (!entries.empty()) {
      report.ops += entries.back().id + 1;
      if (entries.front().id > from) {
        lost += entries.front().id - from;
        if (lostGapEnd == 0 || entries.front().enqueuedNs < lostGapEnd) lostGapEnd = entries.front().enqueuedNs;
      }
    }
    for (const TraceEntry& e : entries) {
      if (!finished(e)) {
        if (!report.hasCurrent || e.enqueuedNs < report.current.enqueuedNs) {
          report.hasCurrent = true;
          report.current = e;
          report.currentGroup = recorder->name();
        }
        open = true;
        continue;
      }
      if (!report.hasLast || e.finishedNs > report.last.finishedNs) {
        report.hasLast = true;
        report.last = e;
        report.lastGroup = recorder->name();
      }
      if (e.id < from) continue;
      intervals.emplace_back(e.enqueuedNs, e.finishedNs);
      if (!open) frontier = e.id + 1;
    }
    next.emplace_back(recorder, frontier);
  }
  accounted_ = std::move(next);
  report.nowNs = FlightRecorder::nowNs();
  std::sort(intervals.begin(), intervals.end());
  int64_t seen = 0;
  for (const auto& [start, end] : intervals) {
    const int64_t from = std::max(start, coveredUntil_);
    if (end > from) {
      inFlightNs_ += end - from;
      seen += end - from;
    }
    coveredUntil_ = std::max(coveredUntil_, end);
  }
  if (lost > 0 && !intervals.empty() && coveredUntil_ > 0) {
    const int64_t mean = seen / static_cast<int64_t>(intervals.size());
    const int64_t gap = std::max<int64_t>(0, lostGapEnd - before);
    inFlightNs_ += std::min<int64_t>(mean * static_cast<int64_t>(lost), gap);
  }
  report.inFlightNs = inFlightNs_;
  if (report.hasCurrent) {
    report.inFlightNs += std::max<int64_t>(0, report.nowNs - std::max(coveredUntil_, report.current.enqueuedNs));
  }
  report.waited.assign(waited.begin(), waited.end());
  return report;
}

}  // namespace torchring
