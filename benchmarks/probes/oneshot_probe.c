// oneshot_probe: the least a one-synchronization allreduce of a plain tensor costs on this
// machine, without torchring: the floor under torchring's small-message path.
//
// Two threads, pinned to CPU 0 and CPU 1, play two ranks. Per iteration rank `me` copies its
// BYTES-byte float32 tensor into its staging slot (slot = iteration parity, so a slot is not
// rewritten while the peer may still read it; copy-in), publishes the iteration number in its
// stamp (one release store), spins until the peer's stamp shows the same iteration (the single
// synchronization), then writes out[i] = tensor[i] + peerStaging[i] with AVX2 (reduce: reads
// its own tensor from its cache and the peer's staging lines from the peer's core). That is
// what any one-sync allreduce of memory the peer cannot see must do; torchring adds the header
// in the same lines, the checks and the Python call. Variants per block of kIters iterations:
//   full            copy-in + sync + reduce
//   sync            the stamp round only
//   no-copy         sync + reduce reading the peer's tensor in place, which nobody writes: lines
//                   stay shared in both caches, a lower bound no in-place allreduce reaches,
//                   since its result rewrites the tensor every call
//   copy-only       copy-in + sync: full less the reduce
//   full-nt         full with the copy-in's stores non-temporal
//   pull-movsb      full, but the peer's staging is first copied into a local buffer by
//                   `rep movsb`, then reduced from there (pull-memcpy: the same with memcpy)
//   two-shot-movsb  reduce-scatter + allgather: stage the half the peer reduces, reduce own
//                   half, publish it, sync again, copy the peer's half of the result (movsb)
//   movsb-in-add    full with the copy-in by `rep movsb` (movsb-in-pull: and pulled as above;
//                   nt-in-pull: streaming copy-in, pulled)
//   pipe8, pipe8-nt eight chunks, each copied in (cached or streaming), published with a stamp
//                   of its own and reduced as soon as the peer's chunk is there
//   clwb, clflushopt full, the copy-in's lines written back (CLWB) or flushed (CLFLUSHOPT)
//                   before the sync, so the peer reads them from memory, not from this core
//   one-way         full, but only rank 0 reduces (rank 1 waits for it): one direction's price
//   in-turn         rank 0 reduces, then rank 1: both directions, one at a time
//   root8, root1    reduce to rank 0 and release (MPICH's release_gather shape): rank 1 stages
//                   its chunks, rank 0 reduces each as it lands into a shared result and flags
//                   it, rank 1 copies each result chunk out; 8 chunks of BYTES/8, or one
//   pf-ahead, pf-nta full, the reduce asking for the peer's line 32 lines before it reads it
//                   (prefetcht0; prefetchnta); pf-all: every line asked for at once, then reduced
// full - copy-only is the price of reading BYTES the other core has just written; every
// allreduce of fresh data pays it for the peer's BYTES at world 2. The summary gives each
// variant's median and 10th/90th percentile per-iteration time over blocks run in random order.
//
//   gcc -O2 -mavx2 -mclwb -mclflushopt -pthread benchmarks/probes/oneshot_probe.c -o /tmp/oneshot_probe
//   /tmp/oneshot_probe [DURATION_S=20] [BYTES=65536]
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "copy.h"
#include "timer.h"

enum { kVariants = 22, kIters = 2000, kMaxBlocks = 100000 };
static const char* kNames[kVariants] = {"full", "sync", "no-copy", "copy-only", "full-nt", "pull-movsb", "two-shot-movsb", "pull-memcpy", "movsb-in-add", "movsb-in-pull", "nt-in-pull", "pipe8", "pipe8-nt", "clwb", "clflushopt", "pf-ahead", "pf-all", "pf-nta", "one-way", "in-turn", "root8", "root1"};

static size_t bytes;
static float* tensor[2];
static float* out[2];
static float* tmp[2];
static float* result[2][2];
static float* staging[2][2];
static _Alignas(64) atomic_ulong stamp[2][8];        // stamp[r][0] on its own cache line
static _Alignas(64) atomic_ulong cstamp[2][64][8];  // pipe8's per-chunk stamps, each on its own line
static atomic_int variant, go[2], done[2];
static double blockTime[kVariants][kMaxBlocks];
static int blocks[kVariants];
static double blockSeconds;  // rank 0's time for the last block

static void add(float* dst, const float* a, const float* b, size_t n) {
  for (size_t i = 0; i < n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  }
}

// The copy-in with non-temporal stores: the lines go to memory, not into this core's cache.
static void copyStream(float* dst, const float* src, size_t n) {
  for (size_t i = 0; i < n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
  _mm_sfence();
}

// add() with the peer's lines asked for `ahead` lines before they are read (hint: _MM_HINT_T0 or NTA).
static void addPrefetch(float* dst, const float* a, const float* b, size_t n, size_t ahead, int nta) {
  for (size_t i = 0; i < n; i += 16) {
    if (i + ahead * 16 < n) {
      if (nta) _mm_prefetch((const char*)(b + i + ahead * 16), _MM_HINT_NTA);
      else _mm_prefetch((const char*)(b + i + ahead * 16), _MM_HINT_T0);
    }
    _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    _mm256_storeu_ps(dst + i + 8, _mm256_add_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8)));
  }
}

static void* rank(void* arg) {
  const int me = (int)(long)arg, peer = 1 - me;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(me, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  unsigned long iter = 0;
  for (int round = 1;; ++round) {
    while (atomic_load(&go[me]) < round) {
      if (atomic_load(&go[me]) < 0) return NULL;
      nanosleep(&(struct timespec){0, 20000}, NULL);
    }
    const int v = atomic_load(&variant);
    const size_t n = bytes / sizeof(float);
    double t0 = 0;
    for (int k = -1; k < kIters; ++k) {  // k = -1: a bare synchronization, both ranks awake
      if (k == 0) t0 = now();
      ++iter;
      const int slot = iter & 1;
      if (k < 0) {
        atomic_store_explicit(&stamp[me][0], iter, memory_order_release);
        while (atomic_load_explicit(&stamp[peer][0], memory_order_acquire) < iter) _mm_pause();
        continue;
      }
      if (v == 11 || v == 12) {  // 8 chunks: copy chunk c in, publish it, add the peer's chunk c
        const size_t cn = n / 8;
        for (int c = 0; c < 8; ++c) {
          if (v == 11) memcpy(staging[me][slot] + c * cn, tensor[me] + c * cn, cn * sizeof(float));
          else copyStream(staging[me][slot] + c * cn, tensor[me] + c * cn, cn);
          atomic_store_explicit(&cstamp[me][c][0], iter, memory_order_release);
          while (atomic_load_explicit(&cstamp[peer][c][0], memory_order_acquire) < iter) _mm_pause();
          add(out[me] + c * cn, tensor[me] + c * cn, staging[peer][slot] + c * cn, cn);
        }
        continue;
      }
      if (v == 6) {  // two-shot: stage the half the peer reduces, pull the peer's staging of mine
        const size_t half = bytes / 2, hn = n / 2;
        float* mine = tensor[me] + me * hn;     // the half this rank reduces
        float* theirs = tensor[me] + peer * hn;  // the half the peer reduces
        movsb(staging[me][slot] + peer * hn, theirs, half);
        atomic_store_explicit(&stamp[me][0], iter, memory_order_release);
        while (atomic_load_explicit(&stamp[peer][0], memory_order_acquire) < iter) _mm_pause();
        movsb(tmp[me], staging[peer][slot] + me * hn, half);
        add(out[me] + me * hn, mine, tmp[me], hn);
        memcpy(result[me][slot], out[me] + me * hn, half);
        ++iter;
        atomic_store_explicit(&stamp[me][0], iter, memory_order_release);
        while (atomic_load_explicit(&stamp[peer][0], memory_order_acquire) < iter) _mm_pause();
        movsb(out[me] + peer * hn, result[peer][slot], half);
        continue;
      }
      if (v == 20 || v == 21) {  // reduce to rank 0, then release: chunks of BYTES/8 (root1: one)
        const int chunks = v == 20 ? 8 : 1;
        const size_t cn = n / chunks;
        float* res = result[0][slot];
        if (me == 1) {
          for (int c = 0; c < chunks; ++c) {
            memcpy(staging[1][slot] + c * cn, tensor[1] + c * cn, cn * sizeof(float));
            atomic_store_explicit(&cstamp[1][c][0], iter, memory_order_release);
          }
          for (int c = 0; c < chunks; ++c) {
            while (atomic_load_explicit(&cstamp[0][c][0], memory_order_acquire) < iter) _mm_pause();
            memcpy(out[1] + c * cn, res + c * cn, cn * sizeof(float));
          }
        } else {
          for (int c = 0; c < chunks; ++c) {
            while (atomic_load_explicit(&cstamp[1][c][0], memory_order_acquire) < iter) _mm_pause();
            add(res + c * cn, tensor[0] + c * cn, staging[1][slot] + c * cn, cn);
            atomic_store_explicit(&cstamp[0][c][0], iter, memory_order_release);
            memcpy(out[0] + c * cn, res + c * cn, cn * sizeof(float));
          }
        }
        ++iter;  // rank 0 must not rewrite res before rank 1 has copied it out
        atomic_store_explicit(&stamp[me][0], iter, memory_order_release);
        while (atomic_load_explicit(&stamp[peer][0], memory_order_acquire) < iter) _mm_pause();
        continue;
      }
      if (v == 18 || v == 19) {  // the peer's lines read by one rank at a time
        memcpy(staging[me][slot], tensor[me], bytes);
        atomic_store_explicit(&stamp[me][0], iter, memory_order_release);
        while (atomic_load_explicit(&stamp[peer][0], memory_order_acquire) < iter) _mm_pause();
        if (me == 0 || v == 19) {
          if (me == 1) {  // in-turn: rank 1 reads once rank 0 is done
            while (atomic_load_explicit(&stamp[peer][0], memory_order_acquire) < iter + 1) _mm_pause();
          }
          add(out[me], tensor[me], staging[peer][slot], n);
        }
        ++iter;
        atomic_store_explicit(&stamp[me][0], iter, memory_order_release);
        while (atomic_load_explicit(&stamp[peer][0], memory_order_acquire) < iter) _mm_pause();
        continue;
      }
      if (v >= 15) memcpy(staging[me][slot], tensor[me], bytes);
      if (v == 0 || v == 3 || v == 5 || v == 7) memcpy(staging[me][slot], tensor[me], bytes);
      if (v == 8 || v == 9) movsb(staging[me][slot], tensor[me], bytes);
      if (v == 10) copyStream(staging[me][slot], tensor[me], n);
      if (v == 13 || v == 14) {
        memcpy(staging[me][slot], tensor[me], bytes);
        char* p = (char*)staging[me][slot];
        if (v == 13) for (size_t o = 0; o < bytes; o += 64) _mm_clwb(p + o);
        else for (size_t o = 0; o < bytes; o += 64) _mm_clflushopt(p + o);
        _mm_sfence();
      }
      if (v == 4) copyStream(staging[me][slot], tensor[me], n);
      atomic_store_explicit(&stamp[me][0], iter, memory_order_release);
      while (atomic_load_explicit(&stamp[peer][0], memory_order_acquire) < iter) _mm_pause();
      if (v == 0 || v == 4 || v == 8 || v == 13 || v == 14) add(out[me], tensor[me], staging[peer][slot], n);
      if (v == 15) addPrefetch(out[me], tensor[me], staging[peer][slot], n, 32, 0);
      if (v == 17) addPrefetch(out[me], tensor[me], staging[peer][slot], n, 32, 1);
      if (v == 16) {
        for (size_t o = 0; o < bytes; o += 64) _mm_prefetch((const char*)staging[peer][slot] + o, _MM_HINT_T0);
        add(out[me], tensor[me], staging[peer][slot], n);
      }
      if (v == 2) add(out[me], tensor[me], tensor[peer], n);
      if (v == 5 || v == 9 || v == 10) { movsb(tmp[me], staging[peer][slot], bytes); add(out[me], tensor[me], tmp[me], n); }
      if (v == 7) { memcpy(tmp[me], staging[peer][slot], bytes); add(out[me], tensor[me], tmp[me], n); }
    }
    if (me == 0) blockSeconds = now() - t0;
    atomic_store(&done[me], round);
  }
}

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  const double duration = argc > 1 ? atof(argv[1]) : 20;
  bytes = argc > 2 ? strtoul(argv[2], NULL, 0) : 65536;
  for (int r = 0; r < 2; ++r) {
    tensor[r] = aligned_alloc(4096, bytes);
    out[r] = aligned_alloc(4096, bytes);
    tmp[r] = aligned_alloc(4096, bytes);
    for (int s = 0; s < 2; ++s) result[r][s] = aligned_alloc(4096, bytes);
    for (size_t i = 0; i < bytes / sizeof(float); ++i) tensor[r][i] = (float)(i % 13 + r);
    for (int s = 0; s < 2; ++s) staging[r][s] = aligned_alloc(4096, bytes), memset(staging[r][s], 0, bytes);
  }
  pthread_t th[2];
  for (long r = 0; r < 2; ++r) pthread_create(&th[r], NULL, rank, (void*)r);
  const double end = now() + duration;
  srand(12345);
  for (int round = 1; now() < end; ++round) {
    const int v = rand() % kVariants;
    atomic_store(&variant, v);
    atomic_store(&go[0], round);
    atomic_store(&go[1], round);
    while (atomic_load(&done[0]) < round || atomic_load(&done[1]) < round) {
      nanosleep(&(struct timespec){0, 20000}, NULL);  // two CPUs: the ranks own them
    }
    if (blocks[v] < kMaxBlocks) blockTime[v][blocks[v]++] = blockSeconds / kIters;
  }
  atomic_store(&go[0], -1);
  atomic_store(&go[1], -1);
  for (int r = 0; r < 2; ++r) pthread_join(th[r], NULL);
  for (size_t i = 0; i < bytes / sizeof(float); ++i) {
    if (out[0][i] != (float)(2 * (i % 13) + 1)) {
      printf("wrong result at %zu\n", i);
      return 1;
    }
  }
  printf("%zu bytes, %g s, per-iteration times over blocks of %d iterations\n", bytes, duration, kIters);
  for (int v = 0; v < kVariants; ++v) {
    qsort(blockTime[v], blocks[v], sizeof(double), cmp);
    const int b = blocks[v];
    if (b == 0) continue;
    printf("%-8s blocks %5d  median %7.2f us  p10 %7.2f  p90 %7.2f\n", kNames[v], b,
           blockTime[v][b / 2] * 1e6, blockTime[v][b / 10] * 1e6, blockTime[v][b * 9 / 10] * 1e6);
  }
  return 0;
}
