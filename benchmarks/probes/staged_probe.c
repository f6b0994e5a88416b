// staged_probe: the staged allreduce's memory pattern without torchring, to tell the engine's
// slow mode from the machine's.
//
// Two threads, pinned to CPU 0 and CPU 1, play two ranks of the engine's staged allreduce of
// BYTES (shm/allreduce.cpp, one segment): rank `me` copies the half of its tensor that the
// peer reduces into its staging buffer (copy-in), both synchronize on two stamps, each reduces
// its own half from its tensor and the peer's staging buffer into its tensor and its staging
// buffer (reduce), both synchronize again, and each copies the peer's reduced half out of the
// peer's staging buffer (copy-out). Staging buffers alternate between two per rank, as in the
// engine. Zero-filled float32 data, like the benchmark's.
//
// The copy routine varies per block of kIters iterations: glibc memcpy (rep movsb on this
// machine), a plain AVX2 loop, non-temporal stores for the writes into staging buffers (the
// lines the other rank reads), and the AVX2 loop with a prefetch-for-write
// kPrefetch bytes ahead (the reduce prefetches its staging writes the same way). Before each
// block, `rtt` times a synchronization round trip between the two threads: the distance
// between the two CPUs as the host placed them at that moment. Blocks run in a random order
// per round for DURATION seconds; the summary gives, per routine, the median block time and
// the fraction of blocks slower than 4x the fastest routine's median ("slow"), and the same
// split by round trip.
//
//   gcc -O2 -mavx2 -mprfchw -pthread benchmarks/probes/staged_probe.c -o /tmp/staged_probe
//   /tmp/staged_probe [DURATION_S=120] [BYTES=1048576]
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "timer.h"

enum { kRoutines = 4, kIters = 300, kMaxBlocks = 200000, kPrefetch = 2048, kRttRounds = 2000 };
static const char* kNames[kRoutines] = {"memcpy", "avx2", "nt-staging", "avx2+prefetchw"};

static size_t bytes, half;
static char* tensor[2];
static char* staging[2][2];
static _Alignas(64) atomic_uint stamp[2][16];  // stamp[r][0] on its own cache line
static _Alignas(64) atomic_int command;         // routine to run next, kRoutines: rtt, -1: stop
static unsigned own[2];

static void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void arriveAndWait(int me) {
  atomic_store(&stamp[me][0], ++own[me]);
  while ((int)(atomic_load(&stamp[1 - me][0]) - own[me]) < 0) _mm_pause();
}

static void copyWith(int routine, char* dst, const char* src, size_t n) {
  if (routine == 0) {
    memcpy(dst, src, n);
    return;
  }
  for (size_t i = 0; i < n; i += 64) {
    if (routine == 3 && i + kPrefetch < n) __builtin_prefetch(dst + i + kPrefetch, 1, 3);
    __m256i a = _mm256_loadu_si256((const __m256i*)(src + i));
    __m256i b = _mm256_loadu_si256((const __m256i*)(src + i + 32));
    if (routine == 2) {
      _mm256_stream_si256((__m256i*)(dst + i), a);
      _mm256_stream_si256((__m256i*)(dst + i + 32), b);
    } else {
      _mm256_storeu_si256((__m256i*)(dst + i), a);
      _mm256_storeu_si256((__m256i*)(dst + i + 32), b);
    }
  }
  if (routine == 2) _mm_sfence();
}

// out = out2 = a + b, float32, n bytes.
static void reduceWith(int routine, char* out, char* out2, const char* a, const char* b, size_t n) {
  for (size_t i = 0; i < n; i += 32) {
    if (routine == 3 && i + kPrefetch < n) __builtin_prefetch(out2 + i + kPrefetch, 1, 3);
    __m256 x = _mm256_add_ps(_mm256_loadu_ps((const float*)(a + i)), _mm256_loadu_ps((const float*)(b + i)));
    _mm256_storeu_ps((float*)(out + i), x);
    if (routine == 2) {
      _mm256_stream_ps((float*)(out2 + i), x);
    } else {
      _mm256_storeu_ps((float*)(out2 + i), x);
    }
  }
  if (routine == 2) _mm_sfence();
}

static void allreduceOnce(int me, int routine, int buffer) {
  const size_t lo = me * half, peerLo = (1 - me) * half;
  copyWith(routine, staging[me][buffer] + peerLo, tensor[me] + peerLo, half);
  arriveAndWait(me);
  reduceWith(routine, tensor[me] + lo, staging[me][buffer] + lo, tensor[me] + lo,
             staging[1 - me][buffer] + lo, half);
  arriveAndWait(me);
  // Into this rank's own tensor: non-temporal stores would only push it out of the cache.
  copyWith(routine == 2 ? 1 : routine, tensor[me] + peerLo, staging[1 - me][buffer] + peerLo, half);
}

// Runs the command both threads agreed on; returns seconds per iteration.
static double runBlock(int me, int what) {
  double start = now();
  if (what == kRoutines) {
    for (int i = 0; i < kRttRounds; ++i) arriveAndWait(me);
    return (now() - start) / kRttRounds;
  }
  for (int i = 0; i < kIters; ++i) allreduceOnce(me, what, i & 1);
  return (now() - start) / kIters;
}

static void* peerThread(void* unused) {
  (void)unused;
  pin(1);
  for (;;) {
    arriveAndWait(1);
    int what = atomic_load(&command);
    arriveAndWait(1);
    if (what < 0) return NULL;
    runBlock(1, what);
  }
}

static double leaderBlock(int what) {
  atomic_store(&command, what);
  arriveAndWait(0);
  arriveAndWait(0);
  return what < 0 ? 0 : runBlock(0, what);
}

static int cmpDouble(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static double median(double* xs, int n) {
  if (n == 0) return 0;
  qsort(xs, n, sizeof *xs, cmpDouble);
  return xs[n / 2];
}

static double blockTime[kRoutines][kMaxBlocks], blockRtt[kRoutines][kMaxBlocks];
static int blocks[kRoutines];

int main(int argc, char** argv) {
  double duration = argc > 1 ? atof(argv[1]) : 120;
  bytes = argc > 2 ? (size_t)atol(argv[2]) : (1u << 20);
  bytes = (bytes + 127) / 128 * 128;
  half = bytes / 2;
  for (int r = 0; r < 2; ++r) {
    tensor[r] = aligned_alloc(4096, bytes);
    memset(tensor[r], 0, bytes);
    for (int b = 0; b < 2; ++b) {
      staging[r][b] = aligned_alloc(4096, bytes + 4096);
      memset(staging[r][b], 0, bytes + 4096);
    }
  }
  pthread_t peer;
  pthread_create(&peer, NULL, peerThread, NULL);
  pin(0);
  srand(1);
  double start = now();
  while (now() - start < duration) {
    int order[kRoutines] = {0, 1, 2, 3};
    for (int k = kRoutines - 1; k > 0; --k) {
      int j = rand() % (k + 1), x = order[k];
      order[k] = order[j];
      order[j] = x;
    }
    for (int k = 0; k < kRoutines; ++k) {
      const int r = order[k];
      if (blocks[r] == kMaxBlocks) continue;
      double rtt = leaderBlock(kRoutines);
      blockRtt[r][blocks[r]] = rtt * 1e9;
      blockTime[r][blocks[r]++] = leaderBlock(r) * 1e6;
    }
  }
  leaderBlock(-1);
  pthread_join(peer, NULL);

  static double scratch[kMaxBlocks];
  double fastest = 1e30;
  for (int r = 0; r < kRoutines; ++r) {
    memcpy(scratch, blockTime[r], blocks[r] * sizeof(double));
    double m = median(scratch, blocks[r]);
    if (m < fastest) fastest = m;
  }
  printf("%zu bytes, %d iterations per block, %.0f s; slow = block over 4x %.1f us\n", bytes, kIters,
         duration, fastest);
  printf("%-16s %7s %10s %8s %12s %13s %14s %15s\n", "routine", "blocks", "median us", "slow", "slow|rtt<200",
         "slow|rtt>=200", "median|rtt<200", "median|rtt>=200");
  for (int r = 0; r < kRoutines; ++r) {
    int slow = 0, near = 0, nearSlow = 0, far = 0, farSlow = 0;
    for (int i = 0; i < blocks[r]; ++i) {
      int s = blockTime[r][i] > 4 * fastest;
      slow += s;
      if (blockRtt[r][i] < 200) {
        near++;
        nearSlow += s;
      } else {
        far++;
        farSlow += s;
      }
    }
    static double nearTimes[kMaxBlocks], farTimes[kMaxBlocks];
    for (int i = 0, a = 0, b = 0; i < blocks[r]; ++i) {
      if (blockRtt[r][i] < 200) nearTimes[a++] = blockTime[r][i]; else farTimes[b++] = blockTime[r][i];
    }
    memcpy(scratch, blockTime[r], blocks[r] * sizeof(double));
    printf("%-16s %7d %10.1f %7.2f%% %5d/%-6d %6d/%-6d %14.1f %15.1f\n", kNames[r], blocks[r],
           median(scratch, blocks[r]), 100.0 * slow / (blocks[r] ? blocks[r] : 1), nearSlow, near,
           farSlow, far, median(nearTimes, near), median(farTimes, far));
  }
  return 0;
}
