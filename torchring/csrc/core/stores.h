// How a rank writes the staging buffers its peers read: with ordinary (cached) stores or with
// streaming (non-temporal) stores, and the rule that picks one while the job runs.
//
// Why: an ordinary store to a cache line another core holds must first take the line from
// that core. The peers read every staging line a rank writes, so each segment's writes may wait
// on cross-core ownership transfers (fewer since the buffers rotate among the ranks, so that a
// rank writes the lines it read last: ShmGroup::nextBuffer). When the two CPUs sit close (a
// 2-vCPU guest whose vCPUs the host runs on one core's two threads, or in one core complex)
// that is cheap; when the host moves them apart, a cross-core round trip grows from ~50 to
// ~330-450 ns and a 1 MiB staged allreduce from ~45 to ~550 us (benchmarks/probes/
// staged_probe.c reproduces it without torchring).
// Streaming stores do not wait for ownership: ~1.5x slower than cached stores when the cores
// are close, 8x faster when they are far (the same probe). The host moves vCPUs without notice,
// so StoreChooser measures instead of guessing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace torchring {

// dst[0, n) = src[0, n) with streaming stores where the CPU has them (a plain memcpy
// elsewhere). The stores are weakly ordered: call streamFence() before publishing dst.
void streamCopy(void* dst, const void* src, size_t n);
void streamFence();

// streamCopy when `stream`, else memcpy.
inline void copyWith(bool stream, void* dst, const void* src, size_t n) {
  if (stream) {
    streamCopy(dst, src, n);
  } else {
    std::memcpy(dst, src, n);
  }
}

enum class StorePolicy : int { AUTO = 0, CACHED = 1, STREAMING = 2 };

// Picks cached or streaming stores for the staging writes of the next segment from the times
// of whole segments per byte copied in (copy in, reduce, copy out, and the waits between:
// streaming stores make the copy in cheaper when the cores are far apart, and the peers' reads
// of the staged data dearer when they are close, so only the whole segment tells). The current
// mode's time per byte is a moving average of its segments; every probeEvery_ segments a probe
// runs kProbeSegments segments in the other mode (every rank of the host probes on the same
// segments while their choosers agree, as they run the same collectives) and is judged by its
// last: the first kProbeWarm segments of a probe write staging buffers (segments alternate
// between two) whose lines the other mode left cold, in memory rather than in a cache after
// streaming stores, so a cached probe judged on its first segment could lose to streaming
// stores even where warm cached ones are faster. A probe faster than kSwitch of the average switches
// modes; a probe that loses doubles probeEvery_ (up to kMaxProbe), so the loser costs at most
// kProbeSegments segments in kMaxProbe once the choice is settled, and a host that moves the
// vCPUs is noticed within kMaxProbe segments. A pure class: tests feed it timings (bindings).
class StoreChooser {
 public:
  explicit StoreChooser(StorePolicy policy = StorePolicy::AUTO) : policy_(policy) {}
  // True when the staging writes of the next segment, which copies `copyBytes` in, should
  // stream; never for a copy under kMinBytes.
  bool streaming(size_t copyBytes) const;
  // That segment, in the mode streaming() returned, took `seconds`; ignored under kMinBytes.
  void record(bool streamed, size_t copyBytes, double seconds);

  static constexpr uint64_t kFirstProbe = 16, kMaxProbe = 1024, kProbeSegments = 3, kProbeWarm = 2;
  static constexpr double kSwitch = 0.8;
  // Segments that copy in less than this use ordinary stores and are not counted (their time
  // is mostly the synchronizations, and clock noise).
  static constexpr size_t kMinBytes = 64 << 10;

 private:
  StorePolicy policy_;
  bool current_ = false;      // streaming now (AUTO starts with cached stores)
  double perByte_ = 0;        // moving average of the current mode's seconds per byte; 0 = none yet
  uint64_t sinceProbe_ = 0;   // timed segments in the current mode since the last probe
  uint64_t probeEvery_ = kFirstProbe;
  uint64_t probed_ = 0;       // segments of the probe under way timed so far
};

}  // namespace torchring
