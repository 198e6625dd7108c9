// The int8-activation kernels for the K-quants (Q4_K, Q5_K, Q6_K: 256-weight superblocks
// with per-sub-block scales), included by quant_a8.cpp.
#pragma once

#include <cstdint>
#include <cstring>

#include "a8.h"

namespace pagedserve {
namespace quant {
namespace a8 {

#ifdef PAGEDSERVE_AVX2
// The sixteen 16-lane halves' sums of eight int32x8 vectors, as two vectors: lo holds
// [v0 first half, v1 first, v2 first, v3 first | v0 second half, ..., v3 second], hi the
// same for v4..v7 (a 32-weight vector's lanes 0-3 are its weights 0-15).
inline void halves16(const __m256i* v, __m256i* lo, __m256i* hi) {
  *lo = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  *hi = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
}

// Eight bytes as eight floats.
inline __m256 u8x8(uint64_t v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v))); }

// Q4_K's eight 6-bit scales and mins (scale_min_k4 for j = 0..7) from its 12 bytes, at once.
inline void scales_mins_k4(const uint8_t* s, uint64_t* sc, uint64_t* mn) {
  uint32_t u[3];
  std::memcpy(u, s, 12);
  const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  *sc = (u[0] & six) | uint64_t((u[2] & four) | (((u[0] >> 6) & two) << 4)) << 32;
  *mn = (u[1] & six) | uint64_t(((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4)) << 32;
}

// R rows against PANEL output channels of Q4_K, Q5_K or Q6_K superblocks (256 weights). Each
// superblock's eight 32-weight sums are taken on integers (Q6_K's 16-weight scales
// multiplied in by madd), then gathered into one vector whose lanes are the sub-blocks,
// so that the per-32 scales (the weights' times the activations') and Q4_K's mins times
// the exact sums of x apply as three vector operations, not 8 scalar chains.
template <int64_t QT, int R>
void panel256(const Rows& x, const uint8_t* w, int64_t rb, float* y, int64_t ldy, int64_t cols) {
  constexpr int64_t bytes = block_bytes(QT);
  const int64_t far = ahead_bytes(rb);
  const int64_t nb32 = x.K / 32;
  const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03), one = _mm256_set1_epi8(1);
  __m256 acc[R][PANEL];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < PANEL; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.K / 256; ++b) {
    __m256 xd[R];  // the activations' eight per-32 scales of this superblock, per row
    for (int r = 0; r < R; ++r) xd[r] = _mm256_loadu_ps(x.d + r * nb32 + 8 * b);
    for (int c = 0; c < PANEL; ++c) {
      if (c >= cols) break;
      const uint8_t* blk = w + c * rb + b * bytes;
      for (int64_t o = 0; o < bytes; o += 64)  // every line of the superblock (quant.cpp says why)
        _mm_prefetch(reinterpret_cast<const char*>(blk + far + o), _MM_HINT_T0);
      __m256i q[8];  // the superblock's quants, 32 a vector, in weight order
      // Q4_K, Q5_K: the eight sub-blocks' scales and mins; Q6_K: its sixteen scales, halves16's order.
      __m256 wscale, wmin;
      if constexpr (QT == Q4_K || QT == Q5_K) {
        for (int g = 0; g < 4; ++g) {  // 64 weights: sub-block 2g in the low nibbles, 2g + 1 in the high
          const __m256i raw = load32(blk + (QT == Q5_K ? 48 : 16) + 32 * g);
          q[2 * g] = _mm256_and_si256(raw, low4);
          q[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        }
        if constexpr (QT == Q5_K) {  // bit j of each qh byte: the fifth bit of sub-block j's weights
          const __m256i qh = load32(blk + 16);
          for (int j = 0; j < 8; ++j)
            q[j] = _mm256_or_si256(q[j], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), one), 4));
        }
        uint64_t sc, mn;
        scales_mins_k4(blk + 4, &sc, &mn);
        wscale = _mm256_mul_ps(_mm256_set1_ps(half_to_float(load_u16(blk))), u8x8(sc));
        wmin = _mm256_mul_ps(_mm256_set1_ps(half_to_float(load_u16(blk + 2))), u8x8(mn));
      } else {  // Q6_K: 4 low bits in ql, 2 high in qh (the centring on 32 is applied to the sums)
        for (int half = 0; half < 2; ++half) {
          const uint8_t* ql = blk + 64 * half;
          const __m256i qa = load32(ql), qb = load32(ql + 32), qh = load32(blk + 128 + 32 * half);
          const __m256i lows[4] = {_mm256_and_si256(qa, low4), _mm256_and_si256(qb, low4),
                                   _mm256_and_si256(_mm256_srli_epi16(qa, 4), low4),
                                   _mm256_and_si256(_mm256_srli_epi16(qb, 4), low4)};
          for (int t = 0; t < 4; ++t) {  // weights 128 half + 32 t + [0, 32)
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), low2);
            q[4 * half + t] = _mm256_or_si256(lows[t], _mm256_slli_epi16(high, 4));
          }
        }
        // The sixteen 16-weight scales in the order of halves16's lanes.
        const __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)),
                                            _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
        const __m256 d = _mm256_set1_ps(half_to_float(load_u16(blk + 208)));
        wscale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        wmin = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q + r * x.K + 256 * b;
        __m256i isum[8];
        for (int j = 0; j < 8; ++j) isum[j] = dot_us(q[j], load32(xq + 32 * j));
        if constexpr (QT != Q6_K) {
          const __m256 s = _mm256_cvtepi32_ps(pagedserve::hsum8(isum));
          acc[r][c] = _mm256_fmadd_ps(s, _mm256_mul_ps(wscale, xd[r]), acc[r][c]);
          acc[r][c] = _mm256_fnmadd_ps(wmin, _mm256_loadu_ps(x.sum + r * nb32 + 8 * b), acc[r][c]);
        } else {  // sixteen 16-weight sums, less 32 times x's quants' sums (the centring)
          __m256i lo, hi;
          halves16(isum, &lo, &hi);
          const int32_t* bs = x.sum16 + r * 2 * nb32 + 16 * b;  // already in halves16's order, times 32
          lo = _mm256_sub_epi32(lo, load32(bs));
          hi = _mm256_sub_epi32(hi, load32(bs + 8));
          const float* d = x.d + r * nb32 + 8 * b;  // sub-block j's activation scale, for both its halves
          const __m256 dlo = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(d));
          const __m256 dhi = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(d + 4));
          acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(wscale, dlo), acc[r][c]);
          acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(wmin, dhi), acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < cols; ++c) y[r * ldy + c] = hsum(acc[r][c]);
}

// Where few_rows_a8 puts sub-block j of each superblock of activations for panel256_wide:
// the pairs (0, 2), (1, 3), (4, 6), (5, 7), one 64-byte vector each.
constexpr int kPairedSlot[8] = {0, 2, 1, 3, 4, 6, 5, 7};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// Q4_K and Q5_K on 512-bit vectors. The eight-wide panel256 above spends most of its
// instructions per superblock on 256-bit work (8 products, 12 nibble ops, 6 hadds): on
// two Zen 5 cores a decode row's Q4_K GEMMs streamed their 144-byte superblocks at 32-35
// GB/s from DRAM, where Q6_K's 210-byte ones reached 41-49 on the same shapes: Q4_K was
// bound by instructions, not memory. Here, with a8.h's further fetch, 35-50
// (scripts/bench_quant.py --cold; LOG, session 32). Here one vector
// holds 64 weights, two sub-blocks: 64 packed bytes' low nibbles are sub-blocks 2g and
// 2g + 2 (g = 0, 2), the high ones 2g + 1 and 2g + 3, so that four products cover the
// superblock. The activations are rounded into the same pairing once per call
// (kPairedSlot), and each product's lanes are scaled by its two sub-blocks' scales
// spread over them (one permute), so that no sum is gathered until the end.
constexpr bool kWideK = true;

// Vector i's first sub-block (the other is two on).
constexpr int kFirstSub[4] = {0, 1, 4, 5};

template <int64_t QT, int R>
void panel256_wide(const Rows& x, const uint8_t* w, int64_t rb, float* y, int64_t ldy, int64_t cols) {
  constexpr int64_t bytes = block_bytes(QT), qs_at = QT == Q5_K ? 48 : 16;
  const int64_t far = ahead_bytes(rb);
  const int64_t nb32 = x.K / 32;
  const __m512i low4 = _mm512_set1_epi8(0x0f), one = _mm512_set1_epi8(1);
  __m512i spread[4], shift[4];  // per vector: its lanes' sub-block (scale index, fifth-bit index)
  for (int i = 0; i < 4; ++i) {
    const int a = kFirstSub[i];
    spread[i] = _mm512_inserti64x4(_mm512_set1_epi32(a), _mm256_set1_epi32(a + 2), 1);
    shift[i] = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(a)),
                                  _mm256_set1_epi16(static_cast<int16_t>(a + 2)), 1);
  }
  __m512 acc[R][PANEL];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < PANEL; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.K / 256; ++b) {
    __m256 xd[R];
    for (int r = 0; r < R; ++r) xd[r] = _mm256_loadu_ps(x.d + r * nb32 + 8 * b);
    for (int c = 0; c < PANEL; ++c) {
      if (c >= cols) break;
      const uint8_t* blk = w + c * rb + b * bytes;
      for (int64_t o = 0; o < bytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + far + o), _MM_HINT_T0);
      __m512i q[4];
      for (int h = 0; h < 2; ++h) {
        const __m512i raw = _mm512_loadu_si512(blk + qs_at + 64 * h);
        q[2 * h] = _mm512_and_si512(raw, low4);
        q[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      }
      if constexpr (QT == Q5_K) {  // bit j of each qh byte: the fifth bit of sub-block j's weights
        const __m512i qh = _mm512_broadcast_i64x4(load32(blk + 16));
        for (int i = 0; i < 4; ++i)
          q[i] = _mm512_or_si512(q[i], _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift[i]), one), 4));
      }
      uint64_t sc, mn;
      scales_mins_k4(blk + 4, &sc, &mn);
      const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32(blk))));  // d, dmin
      const __m256 wscale = _mm256_mul_ps(_mm256_broadcastss_ps(dm), u8x8(sc));
      const __m512 wmin = _mm512_castps256_ps512(
          _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm)), u8x8(mn)));
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q + r * x.K + 256 * b;
        const __m512 s = _mm512_castps256_ps512(_mm256_mul_ps(wscale, xd[r]));
        __m512 a = acc[r][c];
        for (int i = 0; i < 4; ++i) {
          const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[i], _mm512_loadu_si512(xq + 64 * i));
          a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(spread[i], s), a);
        }
        const __m512 xs = _mm512_castps256_ps512(_mm256_loadu_ps(x.sum + r * nb32 + 8 * b));
        acc[r][c] = _mm512_mask3_fnmadd_ps(wmin, xs, a, 0x00ff);  // less the mins, lanes 0-7
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < cols; ++c) y[r * ldy + c] = _mm512_reduce_add_ps(acc[r][c]);
}
#else
constexpr bool kWideK = false;
#endif
#endif

}  // namespace a8
}  // namespace quant
}  // namespace pagedserve
