// The int8-activation kernels' shared pieces (quant_a8.cpp says why activations are
// rounded to int8): how far ahead they fetch weights, the integer dot products, and the
// rounded rows.
#pragma once

#include <cstdint>

#include "qblocks.h"

namespace pagedserve {
namespace quant {
namespace a8 {

// How far ahead the few-rows int8 kernels fetch weights: the same block of a later panel
// (the kernels walk a panel's rows side by side, block by block), the first at least
// kAheadBytes on. One panel ahead, as these kernels had it, is 2.3 KB for a Q4_K row of
// 1,024: the fetch came too late, and Qwen3-0.6B's gate/up GEMM streamed at 26-32 GB/s
// against 44-52 at 16 KB; 8 KB fell between; 1.7B's longer rows and the 32-block types
// were no worse (scripts/bench_quant.py --cold; LOG, session 32).
constexpr int64_t kAheadBytes = 16384;
inline int64_t ahead_bytes(int64_t rb) {
  const int64_t panel = PANEL * rb;
  return (kAheadBytes + panel - 1) / panel * panel;
}

#ifdef PAGEDSERVE_AVX2
// 32 unsigned bytes times 32 signed ones, summed in fours: eight int32 partial sums. The
// pairs' int16 sums cannot saturate: callers keep u <= 128 and |s| <= 127 (2 * 128 * 127).
inline __m256i dot_us(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Signed weights (|w| <= 128 as unsigned magnitudes) times signed activations: the sign
// moves onto x so that maddubs gets its unsigned operand.
inline __m256i dot_ss(__m256i w, __m256i s) { return dot_us(_mm256_abs_epi8(w), _mm256_sign_epi8(s, w)); }

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The rounded activations of R rows: q [R, K] bytes, d and the exact sums [R, K / 32].
struct Rows {
  const int8_t* q;
  const float* d;
  const float* sum;
  int64_t K;
  // Q6_K only: 32 times each 16 quants' integer sum, [R, K / 16], each superblock's
  // sixteen in halves16's lane order (0, 2, 4, 6, 1, 3, 5, 7, then the same plus 8).
  const int32_t* sum16;

  Rows from(int64_t r) const {  // the rows from row r on
    const int64_t nb = K / 32;
    return {q + r * K, d + r * nb, sum + r * nb, K, sum16 ? sum16 + r * 2 * nb : nullptr};
  }
};

#endif

}  // namespace a8
}  // namespace quant
}  // namespace pagedserve
