// The K-quants (Q4_K, Q5_K, Q6_K: 256-weight superblocks with a scale per 32 or 16
// weights, as Q4_K_M and Q5_K_M files hold them) for few rows with fp32 activations, in
// 8-lane AVX2 vectors on every AVX2 build: each sub-block's quants become floats in
// registers, its sum against x is taken on the raw integers, then scaled once (the mins
// enter as min * sum(x) per sub-block, as the 32-block types' offsets do in quant.cpp).
// Before this, one decode row went through qgemm.cpp's many-rows kernel, which packs the
// weights for a tile of rows it does not have.
#include "aten.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "qblocks.h"

namespace pagedserve {
namespace quant {

#ifdef PAGEDSERVE_AVX2
namespace {

inline __m256 dot16(const __m256* q, const float* x) {
  return _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x + 8), _mm256_mul_ps(q[0], _mm256_loadu_ps(x)));
}

template <int64_t QT, int R>
void panel_k(const float* x, const float* xsum, int64_t K, const uint8_t* w, int64_t rb, float* y, int64_t ldy,
             int64_t cols) {
  constexpr int64_t bytes = block_bytes(QT);
  const int64_t nb32 = K / 32;
  const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03), one = _mm256_set1_epi8(1);
  const __m256i bias32 = _mm256_set1_epi8(32);
  __m256 acc[R][PANEL];
  float macc[R][PANEL];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < PANEL; ++c) acc[r][c] = _mm256_setzero_ps(), macc[r][c] = 0.f;
  for (int64_t b = 0; b < K / 256; ++b) {
    for (int c = 0; c < PANEL; ++c) {
      if (c >= cols) break;
      const uint8_t* blk = w + c * rb + b * bytes;
      // Every cache line of the superblock (3-4 of them), not one: fetching one line a
      // block left the Q6_K head of a 150k vocabulary at 4 GB/s from memory.
      for (int64_t o = 0; o < bytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH + o), _MM_HINT_T0);
      if constexpr (QT == Q4_K || QT == Q5_K) {
        const float d = half_to_float(load_u16(blk)), dmin = half_to_float(load_u16(blk + 2));
        const uint8_t* qs = blk + (QT == Q5_K ? 48 : 16);
        // Q5_K: bit j of each of the 32 qh bytes is the fifth bit of sub-block j's weights.
        const __m256i qh = QT == Q5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16))
                                      : _mm256_setzero_si256();
        for (int g = 0; g < 4; ++g) {  // 64 weights: sub-block 2g in the low nibbles, 2g + 1 in the high
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * g));
          __m256i halves[2] = {_mm256_and_si256(raw, low4), _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4)};
          for (int h = 0; h < 2; ++h) {
            const int sub = 2 * g + h;
            if constexpr (QT == Q5_K) {
              const __m256i fifth = _mm256_and_si256(_mm256_srli_epi16(qh, sub), one);
              halves[h] = _mm256_or_si256(halves[h], _mm256_slli_epi16(fifth, 4));
            }
            uint8_t sc, mn;
            scale_min_k4(sub, blk + 4, &sc, &mn);
            __m256 q[4];
            bytes32_floats(halves[h], false, q);  // Q4_K, Q5_K: unsigned
            const __m256 vd = _mm256_set1_ps(d * sc);
            for (int r = 0; r < R; ++r) {
              const float* xs = x + r * K + 256 * b + 32 * sub;
              const __m256 s = _mm256_add_ps(dot16(q, xs), dot16(q + 2, xs + 16));
              acc[r][c] = _mm256_fmadd_ps(s, vd, acc[r][c]);
              macc[r][c] += dmin * mn * xsum[r * nb32 + 8 * b + sub];
            }
          }
        }
      } else {  // Q6_K: 4 low bits in ql, 2 high in qh, centred on 32; a scale per 16 weights
        const float d = half_to_float(load_u16(blk + 208));
        const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
        for (int half = 0; half < 2; ++half) {
          const uint8_t* ql = blk + 64 * half;
          const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
          const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
          const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * half));
          const __m256i lows[4] = {_mm256_and_si256(qa, low4), _mm256_and_si256(qb, low4),
                                   _mm256_and_si256(_mm256_srli_epi16(qa, 4), low4),
                                   _mm256_and_si256(_mm256_srli_epi16(qb, 4), low4)};
          for (int t = 0; t < 4; ++t) {  // weights 128 half + 32 t + [0, 32)
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), low2);
            const __m256i v = _mm256_sub_epi8(_mm256_or_si256(lows[t], _mm256_slli_epi16(high, 4)), bias32);
            __m256 q[4];
            bytes32_floats(v, true, q);
            const int8_t* sc = scales + 8 * half + 2 * t;
            const __m256 d0 = _mm256_set1_ps(d * sc[0]), d1 = _mm256_set1_ps(d * sc[1]);
            for (int r = 0; r < R; ++r) {
              const float* xs = x + r * K + 256 * b + 128 * half + 32 * t;
              acc[r][c] = _mm256_fmadd_ps(dot16(q, xs), d0, acc[r][c]);
              acc[r][c] = _mm256_fmadd_ps(dot16(q + 2, xs + 16), d1, acc[r][c]);
            }
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < cols; ++c) y[r * ldy + c] = hsum(acc[r][c]) - macc[r][c];
}

template <int64_t QT>
void all_panels(const float* xp, const float* xsum, int64_t M, int64_t N, int64_t K, const uint8_t* wp, int64_t rb,
                float* yp) {
  const int64_t nb32 = K / 32;
  const int64_t panels = (N + PANEL - 1) / PANEL;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * PANEL, cols = std::min(PANEL, N - n0);
      const uint8_t* wpan = wp + n0 * rb;
      float* ypan = yp + n0;
      int64_t r = 0;
      for (; r + 2 <= M; r += 2) panel_k<QT, 2>(xp + r * K, xsum + r * nb32, K, wpan, rb, ypan + r * N, N, cols);
      for (; r < M; ++r) panel_k<QT, 1>(xp + r * K, xsum + r * nb32, K, wpan, rb, ypan + r * N, N, cols);
    }
  });
}

}  // namespace

void few_rows_k(const float* xp, const float* xsum, int64_t M, int64_t N, int64_t K, const uint8_t* wp, int64_t rb,
                int64_t qtype, float* yp) {
  switch (qtype) {
    case Q4_K: all_panels<Q4_K>(xp, xsum, M, N, K, wp, rb, yp); break;
    case Q5_K: all_panels<Q5_K>(xp, xsum, M, N, K, wp, rb, yp); break;
    case Q6_K: all_panels<Q6_K>(xp, xsum, M, N, K, wp, rb, yp); break;
    default: TORCH_CHECK(false, "few_rows_k takes Q4_K, Q5_K or Q6_K, not type ", qtype);
  }
}
#endif

}  // namespace quant
}  // namespace pagedserve
