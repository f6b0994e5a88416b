// The probes' clock: seconds since an arbitrary point, from CLOCK_MONOTONIC.
#pragma once

#include <time.h>

static inline double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
