// Small SIMD helpers shared by the CPU kernels. The AVX2+FMA versions are used when the
// build targets such a CPU (-march=native defines __AVX2__ and __FMA__); every caller
// keeps a portable loop for other CPUs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
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

// Element loads and stores through fp32, written as plain bit operations for bf16:
// c10::BFloat16's own conversion rounds with a NaN branch the compiler does not
// vectorize, which made bf16 elementwise kernels three times slower than fp32 ones.
template <typename T>
inline float load_f(const T* p, int64_t i) { return static_cast<float>(p[i]); }

template <>
inline float load_f(const c10::BFloat16* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline void store_f(T* p, int64_t i, float v) { p[i] = static_cast<T>(v); }

// Round to nearest even, as c10::BFloat16 does; a NaN stays a (quiet) NaN.
template <>
inline void store_f(c10::BFloat16* p, int64_t i, float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

// A value rounded to T and back, as the model's own dtype would hold it.
template <typename T>
inline float round_f(float v) {
  T t;
  store_f(&t, 0, v);
  return load_f(&t, 0);
}

// Ask for the cache lines of [p, p + bytes) ahead of use: the hardware prefetcher stops
// at page boundaries and KV blocks are scattered, so each block would start cold.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

#if defined(__AVX512F__)
// The element types the sixteen-lane helpers take (not double).
template <typename T>
constexpr bool kLanes16 = std::is_same<T, float>::value || std::is_same<T, c10::BFloat16>::value ||
                          std::is_same<T, c10::Half>::value;

// Sixteen elements to fp32; a bf16 is the top half of its fp32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// pagedserve::fast_exp on sixteen lanes: the same range reduction and polynomial.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 round = _mm512_set1_ps(12582912.f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), round), round);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), f);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// store_f on sixteen lanes: round to nearest even, a NaN stays a quiet NaN, so a vector
// loop gives the same bits as the scalar one (vcvtneps2bf16 would flush denormals).
inline __m512i bf16_bits(__m512 v) {  // in the low half of each 32-bit lane
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
// round_f on sixteen lanes: the value as T would hold it, back in fp32.
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same<T, c10::BFloat16>::value) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
  } else if constexpr (std::is_same<T, c10::Half>::value) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    return v;
  }
}
#endif

#ifdef PAGEDSERVE_AVX2
// Eight vectors to one vector of their eight horizontal sums: six hadds, two lane swaps
// and an add, where summing each vector alone would take about six operations apiece.
inline __m256 hsum8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}
// The same for int32 lanes, exact (the int8-activation kernels' block sums).
inline __m256i hsum8(const __m256i* v) {
  const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}
#endif

}  // namespace pagedserve
