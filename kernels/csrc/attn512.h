// Paged attention with AVX-512, decode and prefill alike: one work item (a sequence's
// chunk of query tokens, every head) against its keys. Included by paged_attention.cpp,
// which keeps its AVX2 and portable paths for other head sizes and CPUs.
//
// The AVX2 path reduced each query-key dot product horizontally on its own and ran the
// softmax one score at a time; its prefill transposed each K block with scalar copies.
// Here sixteen keys' dot products are reduced together into one vector of sixteen scores
// (45 shuffles and adds for the sixteen), the online softmax works on that vector, and
// P V keeps up to 16 accumulator vectors (4 query heads x 64 dims) in registers across
// the keys of a block. bf16 caches take q . k on vdpbf16ps where the CPU has AVX512_BF16.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "aten.h"

#include "vec.h"

namespace pagedserve::attn512 {

constexpr int kMaxG = 16;  // query heads per KV head this path takes

using pagedserve::exp16;
using pagedserve::load16;

// Sixteen vectors to one vector of their sixteen horizontal sums, lane t = sum of a[t]:
// pairs within 128-bit lanes, then pairs of pairs, then across the four 128-bit lanes.
inline __m512 hsum16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], kEven), _mm512_shuffle_f32x4(c[0], c[1], kOdd));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], kEven), _mm512_shuffle_f32x4(c[2], c[3], kOdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, kEven), _mm512_shuffle_f32x4(e0, e1, kOdd));
}

// The K and V blocks `kDist` ahead of the one in use, into L2, a few lines at a time as
// the keys are computed. Blocks are scattered, so the hardware prefetcher starts each
// one cold; the whole next block asked for at once (384 lines for SmolLM2 in fp32)
// filled the miss queues and held up the compute until most of it had arrived, so
// memory and compute took turns. Paced at one line per key's dot product and 32 per
// head's P V, they overlap: decode over 30 layers' caches reads 17-22 GB/s against
// 17-18 in fp32, 17-19 against 13-14 in bf16 (scripts/bench_cpu_attention.py --cold;
// RESULTS.md, session 17). Into L1 (T0) instead, paced or not, it was slower than no
// prefetch at all.
struct Ahead {
  static constexpr int kDist = 2;
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t next = 0, lines = 0;

  void start(const void* kb, const void* vb, int64_t bytes) {
    k = static_cast<const char*>(kb);
    v = static_cast<const char*>(vb);
    next = 0;
    lines = bytes / 64;
  }
  void issue(int64_t count) {
    for (; count > 0 && next < 2 * lines; --count, ++next)
      _mm_prefetch(next < lines ? k + next * 64 : v + (next - lines) * 64, _MM_HINT_T1);
  }
};

// o[j] = o[j] * c[j] + sum over t < n of p[j][t] * v[t] for J query heads, the J x ND
// accumulators in registers for the whole group of keys.
template <int J, int ND, typename V>
inline void pv(const float (*p)[16], const float* c, const V* v, int64_t vs, int n, float* o) {
  constexpr int D = ND * 16;
  __m512 a[J][ND];
  for (int j = 0; j < J; ++j) {
    const __m512 cj = _mm512_set1_ps(c[j]);
    for (int d = 0; d < ND; ++d) a[j][d] = _mm512_mul_ps(_mm512_loadu_ps(o + j * D + 16 * d), cj);
  }
  for (int t = 0; t < n; ++t) {
    __m512 vr[ND];
    for (int d = 0; d < ND; ++d) vr[d] = load16(v + t * vs + 16 * d);
    for (int j = 0; j < J; ++j) {
      const __m512 pj = _mm512_set1_ps(p[j][t]);
      for (int d = 0; d < ND; ++d) a[j][d] = _mm512_fmadd_ps(pj, vr[d], a[j][d]);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int d = 0; d < ND; ++d) _mm512_storeu_ps(o + j * D + 16 * d, a[j][d]);
}

// One work item: query tokens i < nq (token i at position first_pos + i, causal) of one
// sequence, every query head (row i * H + h), against its keys [kv0, kv1). qf: the rows
// in fp32, pre-scaled; q: the same rows as given (bf16 caches take q . k on vdpbf16ps
// where the CPU has it: exact products, fp32 sums, scaled after). Writes the
// unnormalised acc [nq * H][D], the running max m and the sum l per row, which the caller
// initialised (-inf, 0, 0).
template <typename scalar_t, int ND, int BS>
void attend(const float* qf, const scalar_t* q, float scale, const scalar_t* kc, const scalar_t* vc,
            const int32_t* table, int kv0, int kv1, int nq, int first_pos, int H, int Hkv, float* acc, float* m,
            float* l) {
  constexpr int D = ND * 16;
  constexpr int JC = 16 / ND;  // query heads whose accumulators fit in registers at once
  const int G = H / Hkv;
  const int64_t tok = static_cast<int64_t>(Hkv) * D, blk_stride = tok * BS;
  const int64_t block_bytes = blk_stride * static_cast<int64_t>(sizeof(scalar_t));
  alignas(64) float p[kMaxG][16];
  float c[kMaxG];
  Ahead ahead;
  for (int kv = kv0; kv < kv1;) {
    const int blk = kv / BS, off = kv % BS;
    const int n = std::min({16, BS - off, kv1 - kv});  // a group of keys inside one block
    const scalar_t* kb = kc + table[blk] * blk_stride + off * tok;
    const scalar_t* vb = vc + table[blk] * blk_stride + off * tok;
    if (off == 0 && (blk + Ahead::kDist) * BS < kv1)
      ahead.start(kc + table[blk + Ahead::kDist] * blk_stride, vc + table[blk + Ahead::kDist] * blk_stride,
                  block_bytes);
    for (int i = 0; i < nq; ++i) {
      const int vis = std::max(0, std::min(n, first_pos + i - kv + 1));  // keys this token sees
      if (vis == 0) continue;  // a group wholly after the token: nothing from it
      const __mmask16 valid = static_cast<__mmask16>((1u << vis) - 1u);
      for (int g = 0; g < Hkv; ++g) {
        const scalar_t* kg = kb + g * D;
        for (int j = 0; j < G; ++j) {
          const int r = i * H + g * G + j;
          __m512 a[16];
          __m512 s;
#if defined(__AVX512BF16__)
          if constexpr (std::is_same<scalar_t, c10::BFloat16>::value) {
            __m512bh qb[ND / 2];  // 32 bf16 a vector
            for (int d = 0; d < ND / 2; ++d) qb[d] = (__m512bh)_mm512_loadu_si512(q + r * D + 32 * d);
            for (int t = 0; t < 16; ++t) {
              a[t] = _mm512_setzero_ps();
              if (t < vis) {
                ahead.issue(1);
                for (int d = 0; d < ND / 2; ++d)
                  a[t] = _mm512_dpbf16_ps(a[t], qb[d], (__m512bh)_mm512_loadu_si512(kg + t * tok + 32 * d));
              }
            }
            s = _mm512_mul_ps(hsum16(a), _mm512_set1_ps(scale));
          } else
#endif
          {
            __m512 qv[ND];
            for (int d = 0; d < ND; ++d) qv[d] = _mm512_loadu_ps(qf + r * D + 16 * d);
            for (int t = 0; t < 16; ++t) {
              if (t < vis) {
                const scalar_t* kr = kg + t * tok;
                ahead.issue(1);
                __m512 x = _mm512_mul_ps(qv[0], load16(kr));
                for (int d = 1; d < ND; ++d) x = _mm512_fmadd_ps(qv[d], load16(kr + 16 * d), x);
                a[t] = x;
              } else {
                a[t] = _mm512_setzero_ps();
              }
            }
            s = hsum16(a);
          }
          s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), s);
          const float mx = std::max(m[r], _mm512_reduce_max_ps(s));
          c[j] = pagedserve::fast_exp(m[r] - mx);  // 0 on the first group: m is -inf, clamped
          const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
          l[r] = l[r] * c[j] + _mm512_reduce_add_ps(e);
          m[r] = mx;
          _mm512_store_ps(p[j], e);
        }
        const scalar_t* vg = vb + g * D;
        ahead.issue(32);
        for (int j = 0; j < G; j += JC) {
          float* o = acc + static_cast<int64_t>(i * H + g * G + j) * D;
          switch (std::min(JC, G - j)) {
            case 1: pv<1, ND>(p + j, c + j, vg, tok, vis, o); break;
            case 2: pv<2, ND>(p + j, c + j, vg, tok, vis, o); break;
            case 3: if constexpr (JC >= 3) pv<3, ND>(p + j, c + j, vg, tok, vis, o); break;
            default: if constexpr (JC >= 4) pv<4, ND>(p + j, c + j, vg, tok, vis, o);
          }
        }
      }
    }
    if (off + n == BS) ahead.issue(ahead.lines * 2);  // what the block's keys left over
    kv += n;
  }
}

}  // namespace pagedserve::attn512
