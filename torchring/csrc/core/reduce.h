// Element-wise reduction kernels used by every transport.
#pragma once

#include "core/common.h"

namespace torchring {

// dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i], for i < count, then
// multiplied by `scale` when scale != 1 (floating dtypes only; AVG uses 1/world).
// Reads each source once and writes dst (and dst2 when not null) once: the n-way
// reduction is one pass, not n-1 pairwise passes. dst and dst2 may alias any source.
// float16/bfloat16 accumulate in float32 and are rounded once, to nearest even.
// streamDst2: write dst2 with streaming stores (stores.h; fenced before returning).
void reduceInto(void* dst, void* dst2, const void* const* srcs, int nsrc, size_t count,
                DType dtype, ReduceOp op, double scale = 1.0, bool streamDst2 = false);

// dst[i] = float(srcs[0][i] op ... op srcs[nsrc-1][i]) for 16-bit float sources: the
// float32 partial sums that leaders send around the TCP ring.
void reduceToFloat(float* dst, const void* const* srcs, int nsrc, size_t count, DType dtype,
                   ReduceOp op);

// Converts between a 16-bit float dtype and float32 (dst = src * scale when narrowing).
void widenToFloat(float* dst, const void* src, size_t count, DType dtype);
void narrowFromFloat(void* dst, const float* src, size_t count, DType dtype, double scale);

inline bool isHalfFloat(DType dtype) { return dtype == DType::F16 || dtype == DType::BF16; }

// data[i] *= scale for a floating dtype (used once at the end of a multi-stage AVG).
void scaleInPlace(void* data, size_t count, DType dtype, double scale);

}  // namespace torchring
