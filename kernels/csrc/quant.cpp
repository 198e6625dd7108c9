// GEMMs on quantized weights, for the CPU: y[M, N] = x[M, K] . W[N, K]^T with W kept as
// GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) or as int8 rows with one fp32 scale each.
// Activations stay fp32 and so do the sums; the weights' values are exactly the blocks'.
//
// - Up to 32 rows (decode) with a 32-block type or int8 rows, AVX2 or AVX-512: the blocks
//   stream through registers, panel of four output channels by panel, each row's sums
//   scaled after the block (one row) or the block expanded once for a group of rows;
//   past one group, Q4 panels keep their expanded weights in L1 for the other rows.
// - Otherwise (the K-quants, the portable build): each panel is dequantized into an
//   L1-sized scratch and every row runs over it in a 3x4 register tile.
// - Past that (prefill), engine/models/quantize.py dequantizes the whole matrix with
//   dequant_into and hands it to oneDNN, which is faster there.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace pagedserve {
namespace {

// GGML's type numbers for the block types, and ours for int8 rows.
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14, INT8_ROWS = 1000;
constexpr int64_t PANEL = 4;     // output channels dequantized together
constexpr int64_t ROW_CHUNK = 64;
constexpr int64_t FEW_ROWS = 32;  // the most rows the block-streaming kernel takes
// How far ahead of a block its row is fetched: a few KB, i.e. the next panels. Without it,
// a decode step's four interleaved row streams per thread reached 10 GB/s of the
// machine's 30 (bench_quant.py, the Q8_0 head).
constexpr int64_t PREFETCH = 4096;

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      uint32_t m = man;
      do { m <<= 1; ++e; } while (!(m & 0x400));
      bits = sign | ((112 - e) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Bytes of one row of K weights in each format.
int64_t row_bytes(int64_t qtype, int64_t K) {
  switch (qtype) {
    case Q8_0: return K / 32 * 34;
    case Q4_0: return K / 32 * 18;
    case Q4_1: return K / 32 * 20;
    case Q4_K: return K / 256 * 144;
    case Q6_K: return K / 256 * 210;
    case INT8_ROWS: return K;
  }
  TORCH_CHECK(false, "unsupported quantized type ", qtype);
}

// 16 packed nibbles -> 32 floats q * d + m: low nibbles are weights 0-15, high ones 16-31.
inline void nibbles(const uint8_t* qs, float d, float m, float* out) {
#ifdef PAGEDSERVE_AVX2
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int i = 0; i < 4; ++i) {
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
    _mm256_storeu_ps(out + 8 * i, _mm256_fmadd_ps(f, vd, vm));
  }
#else
  for (int j = 0; j < 16; ++j) {
    out[j] = (qs[j] & 0x0f) * d + m;
    out[j + 16] = (qs[j] >> 4) * d + m;
  }
#endif
}

// n signed bytes -> floats q * d (n a multiple of 8 on the AVX2 path's main loop).
inline void bytes_scaled(const int8_t* q, float d, float* out, int64_t n) {
  int64_t j = 0;
#ifdef PAGEDSERVE_AVX2
  const __m256 vd = _mm256_set1_ps(d);
  for (; j + 8 <= n; j += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vd));
  }
#endif
  for (; j < n; ++j) out[j] = q[j] * d;
}

// Q4_K: 256 weights, two fp16 super-scales and eight 6-bit (scale, min) pairs.
inline void scale_min_k4(int j, const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void dequant_q4_k(const uint8_t* b, float* out) {
  const float d = half_to_float(load_u16(b)), dmin = half_to_float(load_u16(b + 2));
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int g = 0; g < 4; ++g) {  // 64 weights: 32 low nibbles, then 32 high ones
    uint8_t s0, m0, s1, m1;
    scale_min_k4(2 * g, scales, &s0, &m0);
    scale_min_k4(2 * g + 1, scales, &s1, &m1);
    const float d0 = d * s0, n0 = dmin * m0, d1 = d * s1, n1 = dmin * m1;
    for (int l = 0; l < 32; ++l) {
      out[64 * g + l] = d0 * (q[l] & 0x0f) - n0;
      out[64 * g + 32 + l] = d1 * (q[l] >> 4) - n1;
    }
    q += 32;
  }
}

// Q6_K: 256 weights of 4 low bits (ql) and 2 high bits (qh), sixteen int8 scales, fp16 d.
void dequant_q6_k(const uint8_t* b, float* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_to_float(load_u16(b + 208));
  for (int half = 0; half < 2; ++half) {
    for (int l = 0; l < 32; ++l) {
      const int s = l / 16;
      const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      out[l] = d * sc[s] * q1;
      out[l + 32] = d * sc[s + 2] * q2;
      out[l + 64] = d * sc[s + 4] * q3;
      out[l + 96] = d * sc[s + 6] * q4;
    }
    out += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

// One weight row of K values, dequantized into out.
void dequant_row(const uint8_t* row, int64_t qtype, int64_t K, float scale, float* out) {
  switch (qtype) {
    case Q8_0:
      for (int64_t k = 0; k < K; k += 32, row += 34)
        bytes_scaled(reinterpret_cast<const int8_t*>(row + 2), half_to_float(load_u16(row)), out + k, 32);
      return;
    case Q4_0:
      for (int64_t k = 0; k < K; k += 32, row += 18) {
        const float d = half_to_float(load_u16(row));
        nibbles(row + 2, d, -8.f * d, out + k);
      }
      return;
    case Q4_1:
      for (int64_t k = 0; k < K; k += 32, row += 20)
        nibbles(row + 4, half_to_float(load_u16(row)), half_to_float(load_u16(row + 2)), out + k);
      return;
    case Q4_K:
      for (int64_t k = 0; k < K; k += 256, row += 144) dequant_q4_k(row, out + k);
      return;
    case Q6_K:
      for (int64_t k = 0; k < K; k += 256, row += 210) dequant_q6_k(row, out + k);
      return;
    case INT8_ROWS:
      bytes_scaled(reinterpret_cast<const int8_t*>(row), scale, out, K);
      return;
  }
}

#ifdef PAGEDSERVE_AVX2
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

// y[r, c] = sum_k x[r, k] * w[c, k] for R rows of x against a panel of PANEL dequantized
// weight rows. Registers: R x-vectors, R * PANEL accumulators and one weight vector
// (16 for R = 3), so nothing spills.
template <int R>
void tile(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy, int64_t cols) {
  float sums[R][PANEL];
  int64_t k = 0;
#ifdef PAGEDSERVE_AVX2
  __m256 acc[R][PANEL];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < PANEL; ++c) acc[r][c] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * ldx + k);
    for (int c = 0; c < PANEL; ++c) {
      const __m256 wv = _mm256_loadu_ps(w + c * K + k);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < PANEL; ++c) sums[r][c] = hsum(acc[r][c]);
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < PANEL; ++c) sums[r][c] = 0.f;
#endif
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < PANEL; ++c) sums[r][c] += x[r * ldx + k] * w[c * K + k];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < cols; ++c) y[r * ldy + c] = sums[r][c];
}

// -- few rows: dequantize in registers, scales after the block sums ------------------------
// For a decode step every weight is used by one to four rows, so the cost is reading and
// expanding the blocks. Each block's sum of q * x is taken on the raw integers (as floats),
// then scaled once: y += d * sum(q x) + m * sum(x), with sum(x) per block computed once
// per row for every output channel. The values are the blocks' exactly; only the order
// of the fp32 additions differs from the dequantized product.
#ifdef PAGEDSERVE_AVX2
// Vectors of VL floats: 16 with AVX-512 (half the conversions per block), else 8.
#if defined(__AVX512F__)
constexpr int VL = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vset(float v) { return _mm512_set1_ps(v); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
inline vf from_i8(const uint8_t* p) {  // 16 signed bytes
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf from_u8(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
// The 32 values of one block's quants, QT a 32-block type, as 32 / VL vectors.
template <int64_t QT>
inline void block_q(const uint8_t* b, vf* q) {
  if constexpr (QT == Q8_0 || QT == INT8_ROWS) {
    const uint8_t* p = b + (QT == Q8_0 ? 2 : 0);
    q[0] = from_i8(p), q[1] = from_i8(p + 16);
  } else {  // a nibble indexes a table of its value (less 8 for Q4_0): permutes read 4 index bits
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (QT == Q4_1 ? 4 : 2)));
    const __m512i v = _mm512_cvtepu8_epi32(raw);
    const vf table = QT == Q4_1 ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                                : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    q[0] = _mm512_permutexvar_ps(v, table), q[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
  }
}
constexpr bool Q4_0_CENTRED = true;  // block_q returns Q4_0's quants less 8
#else
constexpr int VL = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vset(float v) { return _mm256_set1_ps(v); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline float vsum(vf v) { return hsum(v); }
inline vf from_i8(const uint8_t* p) {  // 8 signed bytes
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf from_u8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
template <int64_t QT>
inline void block_q(const uint8_t* b, vf* q) {
  if constexpr (QT == Q8_0 || QT == INT8_ROWS) {
    const uint8_t* p = b + (QT == Q8_0 ? 2 : 0);
    for (int i = 0; i < 4; ++i) q[i] = from_i8(p + 8 * i);
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (QT == Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    q[0] = from_u8(lo), q[1] = from_u8(_mm_srli_si128(lo, 8));
    q[2] = from_u8(hi), q[3] = from_u8(_mm_srli_si128(hi, 8));
  }
}
constexpr bool Q4_0_CENTRED = false;
#endif
constexpr int NV = 32 / VL;  // vectors per 32 weights

// R rows against PANEL output channels, QT one of Q8_0, Q4_0, Q4_1 or int8 rows (taken
// 32 weights at a time, its one scale per row applied at the end). The type is a template
// argument so that each inner loop has no branch and Q8_0 no offset term.
template <int64_t QT, int R>
void few_rows(const float* x, const float* xsum, int64_t K, const uint8_t* w, int64_t rb, const float* scales,
              float* y, int64_t ldy, int64_t cols, float* keep = nullptr) {
  constexpr bool has_m = QT == Q4_1 || (QT == Q4_0 && !Q4_0_CENTRED);
  constexpr int64_t bytes = QT == Q8_0 ? 34 : QT == Q4_1 ? 20 : QT == Q4_0 ? 18 : 32;
  const int64_t nb = K / 32;
  vf acc[R][PANEL];
  float macc[R][PANEL];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < PANEL; ++c) acc[r][c] = vzero(), macc[r][c] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    vf xv[R][NV];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NV; ++i) xv[r][i] = vload(x + r * K + 32 * b + VL * i);
    for (int c = 0; c < PANEL; ++c) {
      if (c >= cols) break;
      const uint8_t* blk = w + c * rb + b * bytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH), _MM_HINT_T0);
      vf q[NV];
      block_q<QT>(blk, q);
      if constexpr (QT == INT8_ROWS) {
        for (int r = 0; r < R; ++r)
          for (int i = 0; i < NV; ++i) acc[r][c] = vfma(q[i], xv[r][i], acc[r][c]);
      } else if constexpr (R >= 2) {
        // Several rows share each block: expand it to its weights once (q * d + m, the
        // dequantized values) and give every row plain FMAs, no per-row scaling.
        const float d = half_to_float(load_u16(blk));
        const vf vd = vset(d);
        vf wv[NV];
        if constexpr (has_m) {
          const vf vm = vset(QT == Q4_1 ? half_to_float(load_u16(blk + 2)) : -8.f * d);
          for (int i = 0; i < NV; ++i) wv[i] = vadd(vmul(q[i], vd), vm);
        } else {
          for (int i = 0; i < NV; ++i) wv[i] = vmul(q[i], vd);
        }
        for (int r = 0; r < R; ++r)
          for (int i = 0; i < NV; ++i) acc[r][c] = vfma(wv[i], xv[r][i], acc[r][c]);
        if (keep != nullptr)  // the panel's weights for the next rows (from_kept)
          for (int i = 0; i < NV; ++i) vstore(keep + c * K + 32 * b + VL * i, wv[i]);
      } else {
        const float d = half_to_float(load_u16(blk));
        const vf vd = vset(d);
        for (int r = 0; r < R; ++r) {
          vf s = vmul(q[0], xv[r][0]);
          for (int i = 1; i < NV; ++i) s = vfma(q[i], xv[r][i], s);
          acc[r][c] = vfma(s, vd, acc[r][c]);
        }
        if constexpr (has_m) {  // one row: scale the block sum, add the offset times the x sum
          const float m = QT == Q4_1 ? half_to_float(load_u16(blk + 2)) : -8.f * d;
          for (int r = 0; r < R; ++r) macc[r][c] += m * xsum[r * nb + b];
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < cols; ++c)
      y[r * ldy + c] = QT == INT8_ROWS ? vsum(acc[r][c]) * scales[c] : vsum(acc[r][c]) + macc[r][c];
}

// R rows against a panel's weights that few_rows kept in fp32 (in L1): the rows after a
// panel's first group reuse them instead of expanding the blocks again.
template <int R>
void from_kept(const float* x, int64_t K, const float* kept, float* y, int64_t ldy, int64_t cols) {
  vf acc[R][PANEL];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < PANEL; ++c) acc[r][c] = vzero();
  for (int64_t k = 0; k < K; k += VL) {
    vf xv[R];
    for (int r = 0; r < R; ++r) xv[r] = vload(x + r * K + k);
    for (int c = 0; c < PANEL; ++c) {
      const vf wv = vload(kept + c * K + k);
      for (int r = 0; r < R; ++r) acc[r][c] = vfma(wv, xv[r], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < cols; ++c) y[r * ldy + c] = vsum(acc[r][c]);
}

template <int64_t QT>
void few_rows_all(const float* xp, const float* xsum, int64_t M, int64_t N, int64_t K, const uint8_t* wp,
                  int64_t rb, const float* sp, float* yp) {
  const int64_t nb = K / 32, panels = (N + PANEL - 1) / PANEL;
  constexpr int G = VL == 16 ? 4 : 2;  // rows in a group: 32 vector registers hold four, 16 two
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    // Past one group of rows, the first group keeps the panel's expanded weights and the
    // other rows read them back (int8 rows expand in one conversion: they stream again).
    std::vector<float> kept(M > G && (QT == Q4_0 || QT == Q4_1) ? PANEL * K : 0);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * PANEL, cols = std::min(PANEL, N - n0);
      const float* s = sp ? sp + n0 : nullptr;
      const uint8_t* wpan = wp + n0 * rb;
      float* ypan = yp + n0;
      int64_t r = 0;
      if (!kept.empty()) {
        few_rows<QT, G>(xp, xsum, K, wpan, rb, s, ypan, N, cols, kept.data());
        for (r = G; r + G <= M; r += G) from_kept<G>(xp + r * K, K, kept.data(), ypan + r * N, N, cols);
        for (; r < M; ++r) from_kept<1>(xp + r * K, K, kept.data(), ypan + r * N, N, cols);
        continue;
      }
#if defined(__AVX512F__)
      for (; r + 4 <= M; r += 4)
        few_rows<QT, 4>(xp + r * K, xsum + r * nb, K, wpan, rb, s, ypan + r * N, N, cols);
#endif
      for (; r + 2 <= M; r += 2)
        few_rows<QT, 2>(xp + r * K, xsum + r * nb, K, wpan, rb, s, ypan + r * N, N, cols);
      for (; r < M; ++r)
        few_rows<QT, 1>(xp + r * K, xsum + r * nb, K, wpan, rb, s, ypan + r * N, N, cols);
    }
  });
}
#endif

bool few_rows_kernel(int64_t qtype, int64_t M, int64_t K) {
#ifdef PAGEDSERVE_AVX2
  return M <= FEW_ROWS && (qtype == Q8_0 || qtype == Q4_0 || qtype == Q4_1 || (qtype == INT8_ROWS && K % 32 == 0));
#else
  return false;
#endif
}

void check_weights(const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && (w.scalar_type() == at::kByte || w.scalar_type() == at::kChar),
              "quantized weights must be a contiguous [N, row_bytes] byte tensor");
  const int64_t block = (qtype == Q4_K || qtype == Q6_K) ? 256 : (qtype == INT8_ROWS ? 1 : 32);
  TORCH_CHECK(K % block == 0, "K (", K, ") must be a multiple of the block length ", block);
  TORCH_CHECK(w.size(1) == row_bytes(qtype, K), "weight rows hold ", w.size(1), " bytes, type ", qtype,
              " with K ", K, " needs ", row_bytes(qtype, K));
}

at::Tensor qlinear(const at::Tensor& x_in, const at::Tensor& w, const c10::optional<at::Tensor>& scales,
                   int64_t qtype, int64_t K) {
  check_weights(w, qtype, K);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K && x_in.scalar_type() == at::kFloat,
              "x must be fp32 [M, ", K, "]");
  TORCH_CHECK(qtype != INT8_ROWS || (scales.has_value() && scales->numel() == w.size(0)),
              "int8 rows need one fp32 scale per row");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), N = w.size(0), rb = w.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const float* sp = qtype == INT8_ROWS ? scales->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t panels = (N + PANEL - 1) / PANEL;
#ifdef PAGEDSERVE_AVX2
  if (few_rows_kernel(qtype, M, K)) {
    const int64_t nb = K / 32;
    std::vector<float> xsum(M * nb);  // each row's sum over each block
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        float s = 0.f;
        for (int i = 0; i < 32; ++i) s += xp[r * K + 32 * b + i];
        xsum[r * nb + b] = s;
      }
    switch (qtype) {
      case Q8_0: few_rows_all<Q8_0>(xp, xsum.data(), M, N, K, wp, rb, sp, yp); break;
      case Q4_0: few_rows_all<Q4_0>(xp, xsum.data(), M, N, K, wp, rb, sp, yp); break;
      case Q4_1: few_rows_all<Q4_1>(xp, xsum.data(), M, N, K, wp, rb, sp, yp); break;
      default: few_rows_all<INT8_ROWS>(xp, xsum.data(), M, N, K, wp, rb, sp, yp); break;
    }
    return y;
  }
#endif
  for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
    const int64_t mc = std::min(ROW_CHUNK, M - m0);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      std::vector<float> scratch(PANEL * K);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * PANEL, cols = std::min(PANEL, N - n0);
        for (int64_t c = 0; c < PANEL; ++c) {
          if (c < cols)
            dequant_row(wp + (n0 + c) * rb, qtype, K, sp ? sp[n0 + c] : 1.f, scratch.data() + c * K);
          else
            std::fill_n(scratch.data() + c * K, K, 0.f);
        }
        const float* xr = xp + m0 * K;
        float* yr = yp + m0 * N + n0;
        int64_t r = 0;
        for (; r + 3 <= mc; r += 3) tile<3>(xr + r * K, K, scratch.data(), K, yr + r * N, N, cols);
        for (; r < mc; ++r) tile<1>(xr + r * K, K, scratch.data(), K, yr + r * N, N, cols);
      }
    });
  }
  return y;
}

// Rows `ids` of a quantized matrix as fp32 [len(ids), K]: an embedding lookup.
at::Tensor dequant_rows(const at::Tensor& w, const c10::optional<at::Tensor>& scales, const at::Tensor& ids,
                        int64_t qtype, int64_t K) {
  check_weights(w, qtype, K);
  const at::Tensor idx = ids.to(at::kLong).contiguous();
  const int64_t n = idx.numel(), rows = w.size(0), rb = w.size(1);
  at::Tensor out = at::empty({n, K}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "row id ", ip[i], " out of range");
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const float* sp = qtype == INT8_ROWS ? scales->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) dequant_row(wp + ip[i] * rb, qtype, K, sp ? sp[ip[i]] : 1.f, op + i * K);
  });
  return out;
}

// The whole matrix, dequantized into `out` (at least N * K floats, reused by the caller
// so that no page is faulted in per call), for GEMMs with many rows.
at::Tensor dequant_into(const at::Tensor& w, const c10::optional<at::Tensor>& scales, at::Tensor out,
                        int64_t qtype, int64_t K) {
  check_weights(w, qtype, K);
  const int64_t N = w.size(0), rb = w.size(1);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.numel() >= N * K,
              "out must be a contiguous fp32 buffer of at least N * K values");
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const float* sp = qtype == INT8_ROWS ? scales->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 8, [&](int64_t a, int64_t b) {
    for (int64_t n = a; n < b; ++n) dequant_row(wp + n * rb, qtype, K, sp ? sp[n] : 1.f, op + n * K);
  });
  return out.narrow(0, 0, N * K).view({N, K});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("qlinear(Tensor x, Tensor w, Tensor? scales, int qtype, int K) -> Tensor");
  m.def("dequant_rows(Tensor w, Tensor? scales, Tensor ids, int qtype, int K) -> Tensor");
  m.def("dequant_into(Tensor w, Tensor? scales, Tensor(a!) out, int qtype, int K) -> Tensor(a)");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("qlinear", &qlinear);
  m.impl("dequant_rows", &dequant_rows);
  m.impl("dequant_into", &dequant_into);
}

}  // namespace pagedserve
