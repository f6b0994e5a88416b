// Streaming copies and the rule that picks them for staging writes (stores.h).
#include "core/stores.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace torchring {

// Ordinary copies up to the first 16-byte boundary of dst and after the last one; 16-byte
// streaming stores (SSE2, present on every x86-64) in between, four per 64-byte line.
void streamCopy(void* dst, const void* src, size_t n) {
  if (n == 0) return;  // an empty tensor's pointers may be null, which memcpy must not get
#if defined(__x86_64__)
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const size_t head = std::min(n, (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  const size_t body = n / 64 * 64;
  for (size_t i = 0; i < body; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + body, s + body, n - body);
#else
  std::memcpy(dst, src, n);
#endif
}

void streamFence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

bool StoreChooser::streaming(size_t copyBytes) const {
  if (copyBytes < kMinBytes) return false;
  if (policy_ != StorePolicy::AUTO) return policy_ == StorePolicy::STREAMING;
  return sinceProbe_ >= probeEvery_ ? !current_ : current_;
}

void StoreChooser::record(bool streamed, size_t copyBytes, double seconds) {
  if (policy_ != StorePolicy::AUTO || copyBytes < kMinBytes) return;
  const double perByte = seconds / static_cast<double>(copyBytes);
  if (streamed == current_) {
    perByte_ = perByte_ == 0 ? perByte : 0.75 * perByte_ + 0.25 * perByte;
    ++sinceProbe_;
    return;
  }
  if (++probed_ <= kProbeWarm) return;  // a probe's first segments warm its buffers
  sinceProbe_ = 0;  // the probe's last segment: the verdict
  probed_ = 0;
  if (perByte < kSwitch * perByte_) {
    current_ = streamed;
    perByte_ = perByte;
    probeEvery_ = kFirstProbe;
  } else {
    probeEvery_ = std::min(probeEvery_ * 2, kMaxProbe);
  }
}

}  // namespace torchring
