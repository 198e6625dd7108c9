// Small SIMD helpers shared by the CPU kernels. The AVX2+FMA versions are used when the
// build targets such a CPU (-march=native defines __AVX2__ and __FMA__); every caller
// keeps a portable loop for other CPUs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDSERVE_AVX2 1
#endif

namespace pagedserve {

// exp written so the compiler vectorizes it (libm's expf stays scalar without
// -ffast-math): 2^n * e^f with |f| <= ln2/2 and a degree-6 polynomial, relative error
// about 2e-7, i.e. fp32 rounding. Inputs below -87 flush to 0, above 88 saturate.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  // Round to nearest by adding and removing 1.5 * 2^23 (std::nearbyint would not vectorize).
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float f = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Ask for the cache lines of [p, p + bytes) ahead of use: the hardware prefetcher stops
// at page boundaries and KV blocks are scattered, so each block would start cold.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

#ifdef PAGEDSERVE_AVX2
// Eight vectors to one vector of their eight horizontal sums: six hadds, two lane swaps
// and an add, where summing each vector alone would take about six operations apiece.
inline __m256 hsum8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}
#endif

}  // namespace pagedserve
