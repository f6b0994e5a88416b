// cma_probe: whether cross-memory attach (process_vm_readv, what Open MPI's "CMA" single-copy
// path uses) could move a plain tensor's bytes between ranks faster than the staged
// allreduce's two ordinary copies, on this machine.
//
// One process reads its own buffer through process_vm_readv (the kernel pins the source
// pages and copies, as it would for a peer's) and compares that with memcpy: `readv->tmp`
// reads BYTES in PIECE-sized calls into one cache-resident buffer (how a CMA reduce would
// fetch a peer's chunk piece by piece), `readv->dst` reads it whole into a second buffer (how a
// CMA allgather would fetch a peer's reduced chunk into place), `memcpy` and `memcpy->tmp` do
// the same with memcpy. With HUGE set in the environment both buffers are advised
// MADV_HUGEPAGE first (transparent huge pages in "madvise" mode): fewer pages to pin.
// Five rounds; the first warms up.
//
//   gcc -O2 benchmarks/probes/cma_probe.c -o /tmp/cma_probe
//   /tmp/cma_probe MIB PIECE_KIB        e.g. 32 256, 1 64;   HUGE=1 /tmp/cma_probe 32 256
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "timer.h"

// Reads [src, src + bytes) of process `pid` into dst in calls of `piece` bytes; 0 on success.
static int readPieces(pid_t pid, char* dst, size_t dstStride, const char* src, size_t bytes,
                      size_t piece) {
  for (size_t off = 0; off < bytes; off += piece) {
    struct iovec local = {dst + (dstStride ? off : 0), piece};
    struct iovec remote = {(void*)(src + off), piece};
    if (process_vm_readv(pid, &local, 1, &remote, 1, 0) != (ssize_t)piece) {
      perror("process_vm_readv");
      return 1;
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s MIB PIECE_KIB\n", argv[0]);
    return 2;
  }
  const size_t bytes = (size_t)atol(argv[1]) << 20, piece = (size_t)atol(argv[2]) << 10;
  if (bytes == 0 || piece == 0 || bytes % piece != 0) {
    fprintf(stderr, "MIB must be a positive multiple of PIECE_KIB\n");
    return 2;
  }
  char* src = aligned_alloc(2 << 20, bytes);
  char* dst = aligned_alloc(2 << 20, bytes);
  char* tmp = aligned_alloc(4096, piece);
  if (getenv("HUGE")) {
    madvise(src, bytes, MADV_HUGEPAGE);
    madvise(dst, bytes, MADV_HUGEPAGE);
  }
  memset(src, 1, bytes);
  memset(dst, 2, bytes);
  const pid_t me = getpid();
  for (int round = 0; round < 5; ++round) {
    double t = now();
    if (readPieces(me, tmp, 0, src, bytes, piece)) return 1;
    const double readvTmp = now() - t;
    t = now();
    if (readPieces(me, dst, 1, src, bytes, bytes)) return 1;
    const double readvDst = now() - t;
    t = now();
    memcpy(dst, src, bytes);
    const double copyDst = now() - t;
    t = now();
    for (size_t off = 0; off < bytes; off += piece) memcpy(tmp, src + off, piece);
    const double copyTmp = now() - t;
    printf("%zu MiB, pieces of %zu KiB%s: readv->tmp %.0f us (%.1f GB/s)  readv->dst %.0f us  "
           "memcpy %.0f us  memcpy->tmp %.0f us\n", bytes >> 20, piece >> 10,
           getenv("HUGE") ? ", huge pages" : "", readvTmp * 1e6, bytes / readvTmp / 1e9,
           readvDst * 1e6, copyDst * 1e6, copyTmp * 1e6);
  }
  return 0;
}
