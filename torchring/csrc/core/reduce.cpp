// Reduction kernels.
//
// The n-way reduction walks the inputs in blocks of kBlock elements. For each block it
// loads srcs[0] into an accumulator array `acc` (float32 for 16-bit floats), folds in
// srcs[1..n-1] one after another while the block stays in L1, optionally scales, and
// stores the block to dst (and copies it to dst2, with streaming stores when asked:
// core/stores.h). `acc` sits on the stack where its page offset is far from every stream's
// (placeAccumulator: 4K aliasing). Each inner loop is a plain loop over
// `acc`, which the compiler vectorizes (the build uses -O3 and the host's instruction set). bfloat16
// is widened by a shift and narrowed with round-to-nearest-even (16 at a time with AVX512-BF16
// where the CPU has it); float16 converts 8 at a time with F16C where the CPU has it
// (widenBlock/narrowBlock), else through _Float16 casts.
#include "core/reduce.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#if (defined(__F16C__) && defined(__AVX2__)) || (defined(__AVX512BF16__) && defined(__AVX512F__))
#include <immintrin.h>
#endif

#include "core/stores.h"

namespace torchring {
namespace {

constexpr size_t kBlock = 512;

struct BF16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

template <typename T>
struct Codec {  // identity: the accumulator is T itself
  using Acc = T;
  static inline Acc load(T v) { return v; }
  static inline T store(Acc v) { return v; }
};

template <>
struct Codec<BF16> {
  using Acc = float;
  static inline float load(BF16 v) {
    uint32_t u = static_cast<uint32_t>(v.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static inline BF16 store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x40u;  // keep NaN a (quiet) NaN
    bool isNan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    return BF16{static_cast<uint16_t>(isNan ? nan : rounded)};
  }
};

template <>
struct Codec<F16> {
  using Acc = float;
#ifdef __FLT16_MAX__
  static inline float load(F16 v) {
    _Float16 h;
    std::memcpy(&h, &v.bits, 2);
    return static_cast<float>(h);
  }
  static inline F16 store(float f) {
    _Float16 h = static_cast<_Float16>(f);
    F16 out;
    std::memcpy(&out.bits, &h, 2);
    return out;
  }
#else
  static inline float load(F16 v) { return static_cast<float>(c10::Half(v.bits, c10::Half::from_bits())); }
  static inline F16 store(float f) { return F16{c10::Half(f).x}; }
#endif
};

// Whole blocks to and from the accumulator type. float16 converts 8 at a time with F16C where
// the CPU has it: GCC has no vector type for _Float16 without AVX512-FP16, so the Codec loop
// converted one element at a time and a float16 reduction ran at a thirteenth of float32's
// speed per byte (now about a third, as bfloat16's, whose Codec loops GCC vectorizes). F16C's
// conversion with round-to-nearest-even is the one the _Float16 casts compile to: the same
// bits. float16 (kWidenFirst) widens each source a block at a time before folding it in and
// scales a block before narrowing it; the other types fold and narrow in one loop.
template <typename T>
inline void widenBlock(typename Codec<T>::Acc* out, const T* src, size_t len) {
  for (size_t i = 0; i < len; ++i) out[i] = Codec<T>::load(src[i]);
}

template <typename T>
inline void narrowBlock(T* out, const typename Codec<T>::Acc* src, size_t len) {
  for (size_t i = 0; i < len; ++i) out[i] = Codec<T>::store(src[i]);
}

#if defined(__F16C__) && defined(__AVX2__)
template <>
inline void widenBlock<F16>(float* out, const F16* src, size_t len) {
  size_t i = 0;
  for (; i + 8 <= len; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < len; ++i) out[i] = Codec<F16>::load(src[i]);
}

template <>
inline void narrowBlock<F16>(F16* out, const float* src, size_t len) {
  size_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < len; ++i) out[i] = Codec<F16>::store(src[i]);
}
#endif

// bfloat16 narrows 16 at a time with AVX512-BF16's convert (round to nearest even, NaNs
// quieted by setting bit 6: Codec<BF16>::store's rule), except that the instruction reads a
// subnormal float32 as zero: a group of 16 holding one goes through Codec<BF16>::store.
// 1 MiB, two sources: 100 -> 77 us on this project's benchmark VM.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
template <>
inline void narrowBlock<BF16>(BF16* out, const float* src, size_t len) {
  const __m512i expBits = _mm512_set1_epi32(0x7F800000), manBits = _mm512_set1_epi32(0x007FFFFF);
  size_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512 v = _mm512_loadu_ps(src + i);
    const __m512i u = _mm512_castps_si512(v);
    const __mmask16 subnormal = _mm512_mask_test_epi32_mask(
        _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, expBits), _mm512_setzero_si512()), u, manBits);
    if (subnormal != 0) {
      for (size_t k = i; k < i + 16; ++k) out[k] = Codec<BF16>::store(src[k]);
      continue;
    }
    const __m256bh h = _mm512_cvtneps_pbh(v);
    std::memcpy(out + i, &h, sizeof(h));
  }
  for (; i < len; ++i) out[i] = Codec<BF16>::store(src[i]);
}
#endif

template <typename T>
constexpr bool kWidenFirst = std::is_same_v<T, F16>;

// acc[0, len) = acc op src: the source widened into `wide` (kBlock long) first where
// kWidenFirst, else converted element by element in the fold.
template <typename T, typename Op>
inline void foldBlock(typename Codec<T>::Acc* acc, const T* src, size_t len, typename Codec<T>::Acc* wide) {
  if constexpr (kWidenFirst<T>) {
    widenBlock(wide, src, len);
    for (size_t i = 0; i < len; ++i) acc[i] = Op::apply(acc[i], wide[i]);
  } else {
    for (size_t i = 0; i < len; ++i) acc[i] = Op::apply(acc[i], Codec<T>::load(src[i]));
  }
}

struct Sum {
  template <typename A>
  static inline A apply(A a, A b) { return a + b; }
};
struct Prod {
  template <typename A>
  static inline A apply(A a, A b) { return a * b; }
};
// MIN and MAX propagate NaN as torch.minimum/maximum do, whichever rank holds it (b != b
// only for a NaN; the compiler drops it for integers, and it still vectorizes as a blend).
struct Min {
  template <typename A>
  static inline A apply(A a, A b) { return (b < a || b != b) ? b : a; }
};
struct Max {
  template <typename A>
  static inline A apply(A a, A b) { return (a < b || b != b) ? b : a; }
};

// BAND, BOR and BXOR: integer types only (reduceTyped never instantiates them for a float;
// reductionRefusal keeps floating dtypes away). bool is stored as uint8 0/1, which the three
// keep 0/1.
struct BitAnd {
  template <typename A>
  static inline A apply(A a, A b) { return a & b; }
};
struct BitOr {
  template <typename A>
  static inline A apply(A a, A b) { return a | b; }
};
struct BitXor {
  template <typename A>
  static inline A apply(A a, A b) { return a ^ b; }
};

// Where in `space` (a page longer than needed) the accumulator starts: the multiple of 256
// bytes whose page offset is farthest from those of every stream the kernel loads or stores
// (farthestPageShift). A load of src[i] right after the store to acc[i] stalls when the two
// addresses alias; a fixed place on the stack lines up with some tensors.
constexpr int kMaxStreams = 18;  // dst, dst2 and up to 16 sources

// Finding that place weighs 16 shifts against every stream: longer than a 4-byte allreduce's
// whole reduction (6 % of its time). A loop of operations on the same tensors asks the same
// question every call, so the last answer is kept, keyed by a hash of the offsets
// (lastPlacement: key << 8 | shift / 256). The cache may be raced or hit by a colliding key;
// either way the shift is a multiple of 256 below 4096, a valid place in `space` (a page
// longer than needed), at worst not the farthest one.
std::atomic<uint64_t> lastPlacement{0};

template <typename Acc>
Acc* placeAccumulator(Acc* space, const void* const* streams, int nstreams) {
  int offsets[kMaxStreams];
  int n = 0;
  const int origin = static_cast<int>(reinterpret_cast<uintptr_t>(space) % 4096);
  uint64_t hash = 0xcbf29ce484222325ull ^ static_cast<uint64_t>(origin);
  for (int i = 0; i < nstreams; ++i) {
    if (streams[i] == nullptr) continue;
    offsets[n] = static_cast<int>(reinterpret_cast<uintptr_t>(streams[i]) % 4096);
    hash = (hash ^ static_cast<uint64_t>(offsets[n++] + 4096 * i)) * 0x100000001b3ull;
  }
  const uint64_t key = hash >> 8, memo = lastPlacement.load(std::memory_order_relaxed);
  int shift;
  if ((memo >> 8) == key) {
    shift = static_cast<int>(memo & 0xff) * 256;
  } else {
    shift = farthestPageShift(origin, 256, offsets, n);
    lastPlacement.store(key << 8 | static_cast<uint64_t>(shift / 256), std::memory_order_relaxed);
  }
  return reinterpret_cast<Acc*>(reinterpret_cast<char*>(space) + shift);
}

template <typename T, typename Op>
void reduceBlocks(T* dst, T* dst2, const T* const* srcs, int nsrc, size_t count,
                  double scale, bool streamDst2) {
  using C = Codec<T>;
  using Acc = typename C::Acc;
  alignas(64) Acc space[kBlock + 4096 / sizeof(Acc)];
  alignas(64) Acc wide[kWidenFirst<T> ? kBlock : 1];  // a 16-bit source's block, widened
  const void* streams[kMaxStreams] = {dst, dst2};
  const int nstreams = 2 + std::min(nsrc, kMaxStreams - 2);
  for (int p = 0; p + 2 < nstreams; ++p) streams[p + 2] = srcs[p];
  Acc* acc = placeAccumulator(space, streams, nstreams);
  const bool doScale = scale != 1.0;
  const Acc s = static_cast<Acc>(scale);
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t len = std::min(kBlock, count - base);
    widenBlock(acc, srcs[0] + base, len);
    for (int p = 1; p < nsrc; ++p) foldBlock<T, Op>(acc, srcs[p] + base, len, wide);
    if (doScale) {
      for (size_t i = 0; i < len; ++i) acc[i] = acc[i] * s;
    }
    T* out = dst + base;
    narrowBlock(out, acc, len);
    if (dst2 == nullptr) continue;
    if (streamDst2) {
      streamCopy(dst2 + base, out, len * sizeof(T));
    } else {
      std::memcpy(dst2 + base, out, len * sizeof(T));
    }
  }
  if (streamDst2) streamFence();
}

template <typename T>
void reduceTyped(void* dst, void* dst2, const void* const* srcs, int nsrc, size_t count,
                 ReduceOp op, double scale, bool stream) {
  auto* d = static_cast<T*>(dst);
  auto* d2 = static_cast<T*>(dst2);
  auto* s = reinterpret_cast<const T* const*>(srcs);
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
      return reduceBlocks<T, Sum>(d, d2, s, nsrc, count, scale, stream);
    case ReduceOp::PRODUCT:
      return reduceBlocks<T, Prod>(d, d2, s, nsrc, count, scale, stream);
    case ReduceOp::MIN:
      return reduceBlocks<T, Min>(d, d2, s, nsrc, count, scale, stream);
    case ReduceOp::MAX:
      return reduceBlocks<T, Max>(d, d2, s, nsrc, count, scale, stream);
    case ReduceOp::BAND:
    case ReduceOp::BOR:
    case ReduceOp::BXOR:
      if constexpr (std::is_integral_v<T>) {
        if (op == ReduceOp::BAND) return reduceBlocks<T, BitAnd>(d, d2, s, nsrc, count, scale, stream);
        if (op == ReduceOp::BOR) return reduceBlocks<T, BitOr>(d, d2, s, nsrc, count, scale, stream);
        return reduceBlocks<T, BitXor>(d, d2, s, nsrc, count, scale, stream);
      }
      TORCH_INTERNAL_ASSERT(false, "reduceInto: ", opName(op), " of a floating-point dtype (reductionRefusal refuses it)");
  }
}

template <typename T, typename Op>
void reduceBlocksToFloat(float* dst, const T* const* srcs, int nsrc, size_t count) {
  alignas(64) float wide[kWidenFirst<T> ? kBlock : 1];
  widenBlock(dst, srcs[0], count);
  for (int p = 1; p < nsrc; ++p) {
    for (size_t base = 0; base < count; base += kBlock) {
      foldBlock<T, Op>(dst + base, srcs[p] + base, std::min(kBlock, count - base), wide);
    }
  }
}

template <typename T>
void reduceTypedToFloat(float* dst, const void* const* srcs, int nsrc, size_t count, ReduceOp op) {
  auto* s = reinterpret_cast<const T* const*>(srcs);
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG: return reduceBlocksToFloat<T, Sum>(dst, s, nsrc, count);
    case ReduceOp::PRODUCT: return reduceBlocksToFloat<T, Prod>(dst, s, nsrc, count);
    case ReduceOp::MIN: return reduceBlocksToFloat<T, Min>(dst, s, nsrc, count);
    case ReduceOp::MAX: return reduceBlocksToFloat<T, Max>(dst, s, nsrc, count);
    default:  // bitwise: reductionRefusal keeps 16-bit floats away
      TORCH_INTERNAL_ASSERT(false, "reduceToFloat: ", opName(op), " of a 16-bit float dtype");
  }
}

template <typename T>
void narrowTyped(void* dst, const float* src, size_t count, double scale) {
  auto* d = static_cast<T*>(dst);
  const float s = static_cast<float>(scale);
  if (scale == 1.0) return narrowBlock(d, src, count);
  if constexpr (kWidenFirst<T>) {
    alignas(64) float scaled[kBlock];
    for (size_t base = 0; base < count; base += kBlock) {
      const size_t len = std::min(kBlock, count - base);
      for (size_t i = 0; i < len; ++i) scaled[i] = src[base + i] * s;
      narrowBlock(d + base, scaled, len);
    }
  } else {
    for (size_t i = 0; i < count; ++i) d[i] = Codec<T>::store(src[i] * s);
  }
}

template <typename T>
void widenTyped(float* dst, const void* src, size_t count) {
  widenBlock(dst, static_cast<const T*>(src), count);
}

}  // namespace

void reduceToFloat(float* dst, const void* const* srcs, int nsrc, size_t count, DType dtype,
                   ReduceOp op) {
  if (dtype == DType::F16) return reduceTypedToFloat<F16>(dst, srcs, nsrc, count, op);
  return reduceTypedToFloat<BF16>(dst, srcs, nsrc, count, op);
}

void widenToFloat(float* dst, const void* src, size_t count, DType dtype) {
  if (dtype == DType::F16) return widenTyped<F16>(dst, src, count);
  return widenTyped<BF16>(dst, src, count);
}

void narrowFromFloat(void* dst, const float* src, size_t count, DType dtype, double scale) {
  if (dtype == DType::F16) return narrowTyped<F16>(dst, src, count, scale);
  return narrowTyped<BF16>(dst, src, count, scale);
}

void reduceInto(void* dst, void* dst2, const void* const* srcs, int nsrc, size_t count,
                DType dtype, ReduceOp op, double scale, bool streamDst2) {
  if (count == 0) return;
  switch (dtype) {
    case DType::F32: return reduceTyped<float>(dst, dst2, srcs, nsrc, count, op, scale, streamDst2);
    case DType::F64: return reduceTyped<double>(dst, dst2, srcs, nsrc, count, op, scale, streamDst2);
    case DType::F16: return reduceTyped<F16>(dst, dst2, srcs, nsrc, count, op, scale, streamDst2);
    case DType::BF16: return reduceTyped<BF16>(dst, dst2, srcs, nsrc, count, op, scale, streamDst2);
    case DType::I8: return reduceTyped<int8_t>(dst, dst2, srcs, nsrc, count, op, 1.0, streamDst2);
    case DType::U8:
    case DType::BOOL: return reduceTyped<uint8_t>(dst, dst2, srcs, nsrc, count, op, 1.0, streamDst2);
    case DType::I16: return reduceTyped<int16_t>(dst, dst2, srcs, nsrc, count, op, 1.0, streamDst2);
    case DType::I32: return reduceTyped<int32_t>(dst, dst2, srcs, nsrc, count, op, 1.0, streamDst2);
    case DType::I64: return reduceTyped<int64_t>(dst, dst2, srcs, nsrc, count, op, 1.0, streamDst2);
  }
}

void scaleInPlace(void* data, size_t count, DType dtype, double scale) {
  const void* srcs[1] = {data};
  reduceInto(data, nullptr, srcs, 1, count, dtype, ReduceOp::SUM, scale);
}

}  // namespace torchring
