// cpuTicks() and nsPerTick() (core/waits.h).
#include "core/waits.h"

#include <chrono>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace torchring {

namespace {

int64_t steadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// (ticks, steady ns) when the engine loaded: nsPerTick()'s first point.
const int64_t kTicks0 = cpuTicks();
const int64_t kSteady0 = steadyNs();

}  // namespace

int64_t cpuTicks() {
#if defined(__x86_64__)
  return static_cast<int64_t>(__rdtsc());
#else
  return steadyNs();
#endif
}

double nsPerTick(bool* settled) {
  const int64_t ticks = cpuTicks() - kTicks0, ns = steadyNs() - kSteady0;
  if (settled != nullptr) *settled = ns > 1000000000;
  return ticks > 0 && ns > 1000000 ? double(ns) / double(ticks) : 1.0;
}

}  // namespace torchring
