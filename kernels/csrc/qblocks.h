// The quantized weight formats for the CPU kernels (quant.cpp: few rows; qgemm.cpp: many
// rows): GGML's block layouts, the exact dequantization of a row, and the vector helpers
// both kernels are written in (16 floats with AVX-512, 8 with AVX2).
#pragma once

#include "aten.h"

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace pagedserve {
namespace quant {

// Output channels the few-rows kernels (quant.cpp, quant_k.cpp, quant_a8.cpp) stream together.
constexpr int64_t PANEL = 4;

// How far ahead of a block the fp32-activation few-rows kernels (quant.cpp, quant_k.cpp)
// fetch its row: a few KB, i.e. the next panels. Without it, a decode step's four
// interleaved row streams per thread reached 10 GB/s of the machine's 30 (bench_quant.py,
// the Q8_0 head). The int8-activation kernels fetch further ahead (a8.h ahead_bytes).
constexpr int64_t PREFETCH = 4096;

// GGML's type numbers for the block types, and ours for int8 rows.
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, MXFP4 = 39,
                  INT8_ROWS = 1000;

// MXFP4's E2M1 values doubled, so that they are integers; its scale byte e then stands
// for 2^(e - 128) (e8m0_half), half the format's own 2^(e - 127).
constexpr int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

inline float e8m0_half(uint8_t e) {
  // 2^(e - 128): a normal float from e = 2 up, a subnormal one below.
  const uint32_t bits = e < 2 ? 0x00200000u << e : uint32_t(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Weights per block, and bytes per block, of each type (int8 rows: one weight a "block").
constexpr int64_t block_len(int64_t qtype) {
  return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K ? 256 : qtype == INT8_ROWS ? 1 : 32;
}
constexpr int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case MXFP4: return 17;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    case INT8_ROWS: return 1;
  }
  return 0;
}

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
inline int64_t row_bytes(int64_t qtype, int64_t K) {
  TORCH_CHECK(block_bytes(qtype) > 0, "unsupported quantized type ", qtype);
  return K / block_len(qtype) * block_bytes(qtype);
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#ifdef PAGEDSERVE_AVX2
// 16 packed nibbles -> 32 unsigned bytes: low nibbles are weights 0-15, high ones 16-31.
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

// A 32-bit word's bits as 32 bytes, bit i -> byte i: 16 where it is set, else 0.
inline __m256i sixteens32(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(  // byte i <- the word's byte i / 8
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i mask = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));  // byte i <- bit i % 8
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), _mm256_set1_epi8(16));
}

// Q5_0's and Q5_1's 32 quants (0-31) as unsigned bytes: nibbles at qs, fifth bits in qh.
inline __m256i q5_bytes32(const uint8_t* qs, uint32_t qh) { return _mm256_or_si256(nibbles32(qs), sixteens32(qh)); }

// MXFP4's 32 values (doubled E2M1, -12..12) as signed bytes: each nibble looked up.
inline __m256i mxfp4_bytes32(const uint8_t* qs) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(MXFP4_VALUES));
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), nibbles32(qs));
}

// 32 bytes (unsigned, or signed) as four 8-float vectors, in order.
inline void bytes32_floats(__m256i v, bool is_signed, __m256* q) {
  const __m128i a = _mm256_castsi256_si128(v), b = _mm256_extracti128_si256(v, 1);
  const __m128i parts[4] = {a, _mm_srli_si128(a, 8), b, _mm_srli_si128(b, 8)};
  for (int i = 0; i < 4; ++i)
    q[i] = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(parts[i]) : _mm256_cvtepu8_epi32(parts[i]));
}

// 32 bytes (unsigned, or signed) as floats q * d + m.
inline void bytes32_to(__m256i v, bool is_signed, float d, float m, float* out) {
  __m256 q[4];
  bytes32_floats(v, is_signed, q);
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_fmadd_ps(q[i], vd, vm));
}
#endif

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

// Q4_K, and Q5_K (the same with 32 bytes of fifth bits, qh, before the nibbles: bit j of
// qh[l] is the fifth bit of sub-block j's weight l). d0 * q is exact (an fp16 times a 6-bit
// scale times a 5-bit quant), so with or without a fused subtraction the value is the same.
template <bool FIVE>
inline void dequant_k(const uint8_t* b, float* out) {
  const float d = half_to_float(load_u16(b)), dmin = half_to_float(load_u16(b + 2));
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* q = b + (FIVE ? 48 : 16);
#ifdef PAGEDSERVE_AVX2
  const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
  const __m256i high = FIVE ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)) : _mm256_setzero_si256();
#endif
  for (int g = 0; g < 4; ++g) {  // 64 weights: 32 low nibbles, then 32 high ones
    uint8_t s0, m0, s1, m1;
    scale_min_k4(2 * g, scales, &s0, &m0);
    scale_min_k4(2 * g + 1, scales, &s1, &m1);
    const float d0 = d * s0, n0 = dmin * m0, d1 = d * s1, n1 = dmin * m1;
#ifdef PAGEDSERVE_AVX2
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    if constexpr (FIVE) {
      const __m256i b0 = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * g)), one);
      const __m256i b1 = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * g + 1)), one);
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
    }
    bytes32_to(lo, false, d0, -n0, out + 64 * g);
    bytes32_to(hi, false, d1, -n1, out + 64 * g + 32);
#else
    for (int l = 0; l < 32; ++l) {
      const int h0 = FIVE ? ((qh[l] >> (2 * g)) & 1) << 4 : 0, h1 = FIVE ? ((qh[l] >> (2 * g + 1)) & 1) << 4 : 0;
      out[64 * g + l] = d0 * ((q[l] & 0x0f) | h0) - n0;
      out[64 * g + 32 + l] = d1 * ((q[l] >> 4) | h1) - n1;
    }
#endif
    q += 32;
  }
}

// Q5_0 and Q5_1: Q4's nibbles with a fifth bit per weight (bit i of qh on weight i), the
// values q * d + m (Q5_0's m is -16d).
inline void dequant_q5(const uint8_t* qs, uint32_t qh, float d, float m, float* out) {
#ifdef PAGEDSERVE_AVX2
  bytes32_to(q5_bytes32(qs, qh), false, d, m, out);  // q * d is exact (a 5-bit q, an fp16 d): one rounding either way
  return;
#endif
  for (int j = 0; j < 16; ++j) {
    out[j] = ((qs[j] & 0x0f) | (((qh >> j) & 1) << 4)) * d + m;
    out[j + 16] = ((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) * d + m;
  }
}

inline void dequant_mxfp4(const uint8_t* b, float* out) {
  const float s = e8m0_half(b[0]);
#ifdef PAGEDSERVE_AVX2
  bytes32_to(mxfp4_bytes32(b + 1), true, s, 0.f, out);
  return;
#endif
  for (int j = 0; j < 16; ++j) {
    out[j] = MXFP4_VALUES[b[1 + j] & 0x0f] * s;
    out[j + 16] = MXFP4_VALUES[b[1 + j] >> 4] * s;
  }
}

// Q6_K: 256 weights of 4 low bits (ql) and 2 high bits (qh), sixteen int8 scales, fp16 d.
// d * sc is exact (an fp16 times an int8), so each value is rounded once, here as there.
inline void dequant_q6_k(const uint8_t* b, float* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_to_float(load_u16(b + 208));
  for (int half = 0; half < 2; ++half) {
#ifdef PAGEDSERVE_AVX2
    // Weights 32 j + l (l < 32) take ql[l] (j even) or ql[l + 32] (j odd), its low nibble
    // for j < 2 and its high one after, and bits 2 j of qh[l]; scale sc[2 j + l / 16].
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
    const __m256i low[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                            _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
    for (int j = 0; j < 4; ++j) {
      const __m256i top = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * j)), m2);
      const __m256i v = _mm256_sub_epi8(_mm256_or_si256(low[j], _mm256_slli_epi16(top, 4)), bias);
      __m256 f[4];
      bytes32_floats(v, true, f);
      const __m256 s0 = _mm256_set1_ps(d * sc[2 * j]), s1 = _mm256_set1_ps(d * sc[2 * j + 1]);
      _mm256_storeu_ps(out + 32 * j, _mm256_mul_ps(f[0], s0));
      _mm256_storeu_ps(out + 32 * j + 8, _mm256_mul_ps(f[1], s0));
      _mm256_storeu_ps(out + 32 * j + 16, _mm256_mul_ps(f[2], s1));
      _mm256_storeu_ps(out + 32 * j + 24, _mm256_mul_ps(f[3], s1));
    }
#else
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
#endif
    out += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

// One weight row of K values, dequantized into out.
inline void dequant_row(const uint8_t* row, int64_t qtype, int64_t K, float scale, float* out) {
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
    case Q5_0:
      for (int64_t k = 0; k < K; k += 32, row += 22) {
        const float d = half_to_float(load_u16(row));
        dequant_q5(row + 6, load_u32(row + 2), d, -16.f * d, out + k);
      }
      return;
    case Q5_1:
      for (int64_t k = 0; k < K; k += 32, row += 24)
        dequant_q5(row + 8, load_u32(row + 4), half_to_float(load_u16(row)), half_to_float(load_u16(row + 2)),
                   out + k);
      return;
    case MXFP4:
      for (int64_t k = 0; k < K; k += 32, row += 17) dequant_mxfp4(row, out + k);
      return;
    case Q4_K:
      for (int64_t k = 0; k < K; k += 256, row += 144) dequant_k<false>(row, out + k);
      return;
    case Q5_K:
      for (int64_t k = 0; k < K; k += 256, row += 176) dequant_k<true>(row, out + k);
      return;
    case Q6_K:
      for (int64_t k = 0; k < K; k += 256, row += 210) dequant_q6_k(row, out + k);
      return;
    case INT8_ROWS:
      bytes_scaled(reinterpret_cast<const int8_t*>(row), scale, out, K);
      return;
  }
}

inline void check_weights(const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && (w.scalar_type() == at::kByte || w.scalar_type() == at::kChar),
              "quantized weights must be a contiguous [N, row_bytes] byte tensor");
  TORCH_CHECK(block_bytes(qtype) > 0, "unsupported quantized type ", qtype);
  const int64_t block = block_len(qtype);
  TORCH_CHECK(K % block == 0, "K (", K, ") must be a multiple of the block length ", block);
  TORCH_CHECK(w.size(1) == row_bytes(qtype, K), "weight rows hold ", w.size(1), " bytes, type ", qtype,
              " with K ", K, " needs ", row_bytes(qtype, K));
}

#ifdef PAGEDSERVE_AVX2
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

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
#endif
#endif

// y[M, N] = x[M, K] . W[N, K]^T for many rows (qgemm.cpp); any type, any build.
void many_rows(const float* x, int64_t M, int64_t N, int64_t K, const uint8_t* w, int64_t qtype,
               const float* scales, float* y);

// Whether many bf16 rows run on the AMX tiles (many_rows_bf16): K a multiple of 32, on a
// build and a CPU with AMX.
bool many_rows_tiles(int64_t K);

// The same with x and y in bf16, on the AMX tiles (qgemm.cpp; only where many_rows_tiles):
// each group of channels dequantized as many_rows does, then rounded to bf16, the values a
// bf16 model dequantized from the same file holds.
void many_rows_bf16(const uint16_t* x, int64_t M, int64_t N, int64_t K, const uint8_t* w, int64_t qtype,
                    const float* scales, uint16_t* y);

#ifdef PAGEDSERVE_AVX2
// The same for a few rows of the K-quants with x in fp32 (quant_k.cpp); xsum holds each
// row's sums over 32 values, [M, K / 32].
void few_rows_k(const float* x, const float* xsum, int64_t M, int64_t N, int64_t K, const uint8_t* w, int64_t rb,
                int64_t qtype, float* y);

// The same for a few rows with x rounded to int8 per 32 values (quant_a8.cpp); the types
// and shapes of quant.cpp's few-rows kernel (few_rows_fit).
void few_rows_a8(const float* x, int64_t M, int64_t N, int64_t K, const uint8_t* w, int64_t rb, int64_t qtype,
                 const float* scales, float* y);
#endif

}  // namespace quant
}  // namespace pagedserve
