// The probes' `rep movsb` copy: dst[0, n) = src[0, n) as the string instruction does it (what
// Intel MPI's shared-memory copies use), for the probes that compare it with other copies.
#pragma once

#include <stddef.h>

static inline void movsb(void* dst, const void* src, size_t n) {
  __asm__ volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
}
