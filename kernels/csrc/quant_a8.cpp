// Decode GEMMs on quantized weights with int8 activations: y[M, N] = x[M, K] . W[N, K]^T
// for a few rows, W as GGUF blocks (every type quant.cpp takes) or int8 rows.
//
// Why: quant.cpp's few-rows kernel keeps activations in fp32, so every weight becomes a
// float before its FMA, four to six instructions per weight and row. That bound, not
// memory, set batch-1 decode on two Zen 3 cores (a Q4_K row read at 11 GB/s where fp32
// streams at 22). Here each row of x is first rounded to int8 in groups of 32 (one fp32
// scale max|x| / 127 per group, and the group's exact fp32 sum), and each block's dot
// product is taken on integers: unsigned-by-signed byte products summed in pairs
// (maddubs) then in fours (madd, or one VNNI dpbusd), 32 weights in two or three
// instructions. llama.cpp's and vLLM's GGUF kernels round activations the same way.
//
// The product is that of the rounded activations x' with the blocks' quants scaled, plus
// the blocks' offsets (Q4_0's -8d, Q5_0's -16d, Q4_1's and Q5_1's m, the K-quants'
// -dmin * min) times the exact sums of x, so the only rounding beyond fp32's is x's, at
// most half a step of max|x| / 127 per group of 32 (kernels/quant.py's a8_reference is the
// oracle).
#include <torch/library.h>
#include "aten.h"
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#include "qblocks.h"

namespace pagedserve {
namespace quant {

#ifdef PAGEDSERVE_AVX2
namespace {

// PANEL output channels stream together (qblocks.h). Each block is fetched one panel
// ahead: the same block of the next panel, PANEL rows on (quant.cpp fetches a fixed 4 KB
// ahead, which for rows longer than 1 KB lands in the next row of the same panel, already
// streaming, or further ahead than needed).

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

// The eight int32x8 vectors' own sums, in order: one vector of eight totals.
inline __m256i sums8(const __m256i* v) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// The fp16 at byte `at` of eight consecutive blocks, as floats.
template <int64_t BYTES>
inline __m256 halves8(const uint8_t* blk, int at) {
  const uint8_t* p = blk + at;
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_setr_epi16(load_u16(p), load_u16(p + BYTES), load_u16(p + 2 * BYTES),
                                        load_u16(p + 3 * BYTES), load_u16(p + 4 * BYTES), load_u16(p + 5 * BYTES),
                                        load_u16(p + 6 * BYTES), load_u16(p + 7 * BYTES)));
#else
  float f[8];
  for (int i = 0; i < 8; ++i) f[i] = half_to_float(load_u16(p + i * BYTES));
  return _mm256_loadu_ps(f);
#endif
}

// The 32-block types' traits: where the quants start, and whether they are unsigned with
// an offset (the value of a zero quant) or signed.
template <int64_t QT>
constexpr int64_t quants_at() {
  return QT == Q8_0 || QT == Q4_0 ? 2 : QT == Q4_1 ? 4 : QT == Q5_0 ? 6 : QT == Q5_1 ? 8 : QT == MXFP4 ? 1 : 0;
}
template <int64_t QT>
constexpr bool has_offset() {
  return QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1;
}

// One block's 32 quants as bytes: unsigned for the offset types, signed for the rest.
template <int64_t QT>
inline __m256i quants(const uint8_t* blk) {
  if constexpr (QT == Q5_0 || QT == Q5_1) return q5_bytes32(blk + quants_at<QT>(), load_u32(blk + quants_at<QT>() - 4));
  if constexpr (QT == Q4_0 || QT == Q4_1) return nibbles32(blk + quants_at<QT>());
  if constexpr (QT == MXFP4) return mxfp4_bytes32(blk + 1);
  return load32(blk + quants_at<QT>());
}

// Eight consecutive blocks' scales d and offsets m, as vectors.
template <int64_t QT>
inline __m256 scales8(const uint8_t* blk) {
  constexpr int64_t bytes = QT == INT8_ROWS ? 32 : block_bytes(QT);
  if constexpr (QT == INT8_ROWS) return _mm256_set1_ps(1.f);
  if constexpr (QT == MXFP4) {
    float f[8];
    for (int i = 0; i < 8; ++i) f[i] = e8m0_half(blk[i * bytes]);
    return _mm256_loadu_ps(f);
  }
  return halves8<bytes>(blk, 0);
}
template <int64_t QT>
inline __m256 offsets8(const uint8_t* blk, __m256 d) {
  if constexpr (QT == Q4_1 || QT == Q5_1) return halves8<block_bytes(QT)>(blk, 2);
  return _mm256_mul_ps(d, _mm256_set1_ps(QT == Q5_0 ? -16.f : -8.f));
}
template <int64_t QT>
inline float scale1(const uint8_t* blk) {
  return QT == INT8_ROWS ? 1.f : QT == MXFP4 ? e8m0_half(blk[0]) : half_to_float(load_u16(blk));
}
template <int64_t QT>
inline float offset1(const uint8_t* blk, float d) {
  return QT == Q4_1 || QT == Q5_1 ? half_to_float(load_u16(blk + 2)) : QT == Q5_0 ? -16.f * d : -8.f * d;
}

// R rows against PANEL output channels of a 32-block type (or int8 rows, their scale
// applied at the end). Eight blocks at a time, as the K-quants' superblocks: their eight
// integer sums gathered into one vector, then scaled (each block's d times each group's
// activation scale) and offset (Q4_0's -8d, Q5_0's -16d, Q4_1's and Q5_1's m, times the
// exact sums of x) as vectors; a tail of fewer than eight blocks goes one block at a time.
template <int64_t QT, int R>
void panel32(const Rows& x, const uint8_t* w, int64_t rb, const float* scales, float* y, int64_t ldy,
             int64_t cols) {
  constexpr int64_t bytes = QT == INT8_ROWS ? 32 : block_bytes(QT);
  constexpr bool offset = has_offset<QT>();
  const int64_t nb = x.K / 32, whole = nb / 8 * 8;
  __m256 acc[R][PANEL];
  float tail[R][PANEL];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < PANEL; ++c) acc[r][c] = _mm256_setzero_ps(), tail[r][c] = 0.f;
  for (int64_t b = 0; b < whole; b += 8) {
    for (int c = 0; c < PANEL; ++c) {
      if (c >= cols) break;
      const uint8_t* blk = w + c * rb + b * bytes;
      for (int64_t o = 0; o < 8 * bytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + PANEL * rb + o), _MM_HINT_T0);
      __m256i q[8];
      for (int j = 0; j < 8; ++j) q[j] = quants<QT>(blk + j * bytes);
      const __m256 d = scales8<QT>(blk);
      const __m256 m = offset ? offsets8<QT>(blk, d) : d;
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q + r * x.K + 32 * b;
        __m256i isum[8];
        for (int j = 0; j < 8; ++j)
          isum[j] = offset ? dot_us(q[j], load32(xq + 32 * j)) : dot_ss(q[j], load32(xq + 32 * j));
        const __m256 xd = _mm256_loadu_ps(x.d + r * nb + b);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums8(isum)), _mm256_mul_ps(d, xd), acc[r][c]);
        if constexpr (offset) acc[r][c] = _mm256_fmadd_ps(m, _mm256_loadu_ps(x.sum + r * nb + b), acc[r][c]);
      }
    }
  }
  for (int64_t b = whole; b < nb; ++b) {
    for (int c = 0; c < PANEL; ++c) {
      if (c >= cols) break;
      const uint8_t* blk = w + c * rb + b * bytes;
      const float d = scale1<QT>(blk);
      const float m = offset1<QT>(blk, d);
      const __m256i q = quants<QT>(blk);
      for (int r = 0; r < R; ++r) {
        const __m256i xq = load32(x.q + r * x.K + 32 * b);
        tail[r][c] += hsum(_mm256_cvtepi32_ps(offset ? dot_us(q, xq) : dot_ss(q, xq))) * d * x.d[r * nb + b];
        if constexpr (offset) tail[r][c] += m * x.sum[r * nb + b];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < cols; ++c) {
      const float v = hsum(acc[r][c]) + tail[r][c];
      y[r * ldy + c] = QT == INT8_ROWS ? v * scales[c] : v;
    }
}

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
        _mm_prefetch(reinterpret_cast<const char*>(blk + PANEL * rb + o), _MM_HINT_T0);
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
          const __m256 s = _mm256_cvtepi32_ps(sums8(isum));
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

template <int64_t QT, int R>
void panel(const Rows& x, const uint8_t* w, int64_t rb, const float* scales, float* y, int64_t ldy, int64_t cols) {
  if constexpr (block_len(QT) == 256)
    panel256<QT, R>(x, w, rb, y, ldy, cols);
  else
    panel32<QT, R>(x, w, rb, scales, y, ldy, cols);
}

template <int64_t QT>
void all_panels(const Rows& x, int64_t M, int64_t N, const uint8_t* wp, int64_t rb, const float* sp, float* yp) {
  const int64_t panels = (N + PANEL - 1) / PANEL;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * PANEL, cols = std::min(PANEL, N - n0);
      const float* s = sp ? sp + n0 : nullptr;
      const uint8_t* wpan = wp + n0 * rb;
      int64_t r = 0;
#if defined(__AVX512F__)
      for (; r + 4 <= M; r += 4)  // AVX-512's 32 vector registers hold four rows' sums
        panel<QT, 4>(x.from(r), wpan, rb, s, yp + r * N + n0, N, cols);
#endif
      for (; r + 2 <= M; r += 2) panel<QT, 2>(x.from(r), wpan, rb, s, yp + r * N + n0, N, cols);
      if (r < M) panel<QT, 1>(x.from(r), wpan, rb, s, yp + r * N + n0, N, cols);
    }
  });
}

// One row's 32 values rounded to int8 (round to nearest even, as torch.round) with their
// scale max|x| / 127 and their exact sum (and, for Q6_K, the integer sums of each 16).
inline void round32(const float* x, int8_t* q, float* d, float* sum, int32_t* sum16) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps(), s = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    s = _mm256_add_ps(s, v[i]);
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
  *d = top / 127.f;
  *sum = hsum(s);
  const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  if (sum16 != nullptr) {
    const __m256i a = _mm256_add_epi32(i32[0], i32[1]), b = _mm256_add_epi32(i32[2], i32[3]);
    __m128i h = _mm_hadd_epi32(_mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)),
                               _mm_add_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
    h = _mm_hadd_epi32(h, h);
    sum16[0] = _mm_cvtsi128_si32(h), sum16[1] = _mm_extract_epi32(h, 1);
  }
  // packs interleave the 128-bit lanes; the permute puts the 32 bytes back in order.
  const __m256i i16 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(i16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

}  // namespace

void few_rows_a8(const float* xp, int64_t M, int64_t N, int64_t K, const uint8_t* wp, int64_t rb, int64_t qtype,
                 const float* sp, float* yp) {
  const int64_t nb = K / 32;
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * nb), sum(M * nb);
  std::vector<int32_t> sum16(qtype == Q6_K ? 2 * M * nb : 0);
  for (int64_t i = 0; i < M * nb; ++i)
    round32(xp + 32 * i, q.data() + 32 * i, &d[i], &sum[i], sum16.empty() ? nullptr : sum16.data() + 2 * i);
  for (int64_t g = 0; g < static_cast<int64_t>(sum16.size()); g += 8) {  // per 128 weights
    int32_t* v = sum16.data() + g;
    const int32_t t[8] = {v[0], v[2], v[4], v[6], v[1], v[3], v[5], v[7]};
    for (int i = 0; i < 8; ++i) v[i] = 32 * t[i];
  }
  const Rows x{q.data(), d.data(), sum.data(), K, sum16.empty() ? nullptr : sum16.data()};
  switch (qtype) {
    case Q4_K: all_panels<Q4_K>(x, M, N, wp, rb, sp, yp); break;
    case Q5_K: all_panels<Q5_K>(x, M, N, wp, rb, sp, yp); break;
    case Q6_K: all_panels<Q6_K>(x, M, N, wp, rb, sp, yp); break;
    case Q8_0: all_panels<Q8_0>(x, M, N, wp, rb, sp, yp); break;
    case Q4_0: all_panels<Q4_0>(x, M, N, wp, rb, sp, yp); break;
    case Q4_1: all_panels<Q4_1>(x, M, N, wp, rb, sp, yp); break;
    case Q5_0: all_panels<Q5_0>(x, M, N, wp, rb, sp, yp); break;
    case Q5_1: all_panels<Q5_1>(x, M, N, wp, rb, sp, yp); break;
    case MXFP4: all_panels<MXFP4>(x, M, N, wp, rb, sp, yp); break;
    default: all_panels<INT8_ROWS>(x, M, N, wp, rb, sp, yp); break;
  }
}
#endif

}  // namespace quant
}  // namespace pagedserve
