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

#include "a8.h"
#include "a8_kquants.h"
#include "qblocks.h"

namespace pagedserve {
namespace quant {

#ifdef PAGEDSERVE_AVX2
namespace {

using namespace a8;

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
  const int64_t far = ahead_bytes(rb);
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
        _mm_prefetch(reinterpret_cast<const char*>(blk + far + o), _MM_HINT_T0);
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
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pagedserve::hsum8(isum)), _mm256_mul_ps(d, xd), acc[r][c]);
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

template <int64_t QT, int R>
void panel(const Rows& x, const uint8_t* w, int64_t rb, const float* scales, float* y, int64_t ldy, int64_t cols) {
  if constexpr ((QT == Q4_K || QT == Q5_K) && kWideK)
    panel256_wide<QT, R>(x, w, rb, y, ldy, cols);
  else if constexpr (block_len(QT) == 256)
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
  // panel256_wide reads Q4_K's and Q5_K's activations with each superblock's sub-blocks paired.
  const bool paired = kWideK && (qtype == Q4_K || qtype == Q5_K);
  for (int64_t i = 0; i < M * nb; ++i) {
    const int64_t slot = paired ? i / 8 * 8 + kPairedSlot[i % 8] : i;
    round32(xp + 32 * i, q.data() + 32 * slot, &d[i], &sum[i], sum16.empty() ? nullptr : sum16.data() + 2 * i);
  }
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
