// Prefill attention on fp32 caches with AVX-512, tiled as a small GEMM: prefill512.h's
// scheme without bf16. Included by paged_attention.cpp for work items with many query
// rows; decode keeps attn512.h.
//
// attn512.h takes a query row at a time: each of a group's sixteen dot products is
// reduced across lanes (45 shuffles and adds for the sixteen) and every row reloads the
// keys. Here each group of sixteen keys of a KV head is repacked once per work item, K
// transposed to [D][16] and V gathered to [16][D], and then serves every query row of
// that head, four rows at a time: a row's sixteen scores are D FMAs with its query
// broadcast, with no reduction, and P V is D/16 FMAs per key with the probability
// broadcast, each key and value vector loaded once for the four rows. All in fp32.
#pragma once

#if defined(__AVX512F__)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "tiles.h"
#include "vec.h"

namespace pagedserve::prefill_f32 {

// Keys [kv0, kv1) of KV head g, in groups of sixteen: kt[grp][D][16] (lane t of row d =
// key t's dim d) and vt[grp][16][D]. Keys past kv1 are zeros, so a padded lane is finite.
template <int D, int BS>
void pack(const float* kc, const float* vc, const int32_t* table, int kv0, int kv1, int g, int64_t tok, float* kt,
          float* vt) {
  const int64_t blk_stride = tok * BS;
  for (int kv = kv0, grp = 0; kv < kv1; kv += 16, ++grp) {
    const int n = std::min(16, kv1 - kv);
    alignas(64) int32_t off[16];
    for (int t = 0; t < 16; ++t) {
      const int key = kv + std::min(t, n - 1);
      off[t] = static_cast<int32_t>(table[key / BS] * blk_stride + (key % BS) * tok + g * D);
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
    const __m512i idx = _mm512_load_si512(off);
    float* kg = kt + static_cast<int64_t>(grp) * D * 16;
    for (int d = 0; d < D; ++d)
      _mm512_store_ps(kg + d * 16, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid,
                                                            _mm512_add_epi32(idx, _mm512_set1_epi32(d)), kc, 4));
    float* vg = vt + static_cast<int64_t>(grp) * 16 * D;
    for (int t = 0; t < 16; ++t)
      for (int c = 0; c < D / 16; ++c)
        _mm512_store_ps(vg + t * D + 16 * c, t < n ? _mm512_loadu_ps(vc + off[t] + 16 * c) : _mm512_setzero_ps());
  }
}

// R query rows against every packed group they see. Scores are in registers, two
// partial sums a row so that 2R FMA chains run at once; the accumulators stay in acc
// (L1), loaded, rescaled and stored once a group, four column blocks at a time. qr[j]:
// row j's query, pre-scaled; pos[j]: its position. Writes acc (unnormalised), m and l
// as attn512::attend does.
template <int R, int ND>
inline void rows(const float* const* qr, const int* pos, const float* kt, const float* vt, int kv0, int kv1,
                 float* const* acc, float* const* m, float* const* l) {
  constexpr int D = ND * 16;
  constexpr int CB = ND < 4 ? ND : 4;  // column blocks a pass of P V: R x CB accumulators
  alignas(64) float lv[R][16] = {};
  alignas(64) float p[R][16];  // a group's probabilities
  float mx[R], c[R];
  for (int j = 0; j < R; ++j) {
    std::fill(acc[j], acc[j] + D, 0.f);
    mx[j] = -std::numeric_limits<float>::infinity();
  }
  const int end = std::min(kv1, *std::max_element(pos, pos + R) + 1);  // keys any row sees
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int kv = kv0, grp = 0; kv < end; kv += 16, ++grp) {
    const float* kg = kt + static_cast<int64_t>(grp) * D * 16;
    const float* vg = vt + static_cast<int64_t>(grp) * 16 * D;
    __m512 s[R][2];
    for (int j = 0; j < R; ++j) s[j][0] = s[j][1] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 2)
      for (int h = 0; h < 2; ++h) {
        const __m512 k = _mm512_load_ps(kg + (d + h) * 16);
        for (int j = 0; j < R; ++j) s[j][h] = _mm512_fmadd_ps(_mm512_set1_ps(qr[j][d + h]), k, s[j][h]);
      }
    int keys = 0;
    bool rescale = false;
    for (int j = 0; j < R; ++j) {
      const int vis = std::max(0, std::min({16, kv1 - kv, pos[j] - kv + 1}));
      c[j] = 1.f;
      if (vis == 0) {  // the row sees none of this group: nothing changes
        std::fill(p[j], p[j] + 16, 0.f);
        continue;
      }
      keys = std::max(keys, vis);
      const __mmask16 valid = static_cast<__mmask16>((1u << vis) - 1u);
      const __m512 x = _mm512_mask_mov_ps(ninf, valid, _mm512_add_ps(s[j][0], s[j][1]));
      _mm512_store_ps(p[j], softmax_group(x, valid, mx[j], c[j], lv[j], rescale));
    }
    for (int d = 0; d < ND; d += CB) {
      __m512 a[R][CB];
      for (int j = 0; j < R; ++j)
        for (int b = 0; b < CB; ++b) {
          a[j][b] = _mm512_loadu_ps(acc[j] + 16 * (d + b));
          if (rescale) a[j][b] = _mm512_mul_ps(a[j][b], _mm512_set1_ps(c[j]));
        }
      for (int t = 0; t < keys; ++t) {
        __m512 v[CB];
        for (int b = 0; b < CB; ++b) v[b] = _mm512_load_ps(vg + t * D + 16 * (d + b));
        for (int j = 0; j < R; ++j) {
          const __m512 pj = _mm512_set1_ps(p[j][t]);
          for (int b = 0; b < CB; ++b) a[j][b] = _mm512_fmadd_ps(pj, v[b], a[j][b]);
        }
      }
      for (int j = 0; j < R; ++j)
        for (int b = 0; b < CB; ++b) _mm512_storeu_ps(acc[j] + 16 * (d + b), a[j][b]);
    }
  }
  for (int j = 0; j < R; ++j) {
    *m[j] = mx[j];
    *l[j] = _mm512_reduce_add_ps(_mm512_load_ps(lv[j]));
  }
}

// One work item as attn512::attend takes it (query tokens i < nq at positions first_pos
// + i, rows i * H + h, keys [kv0, kv1)); qf: its rows in fp32, pre-scaled. For caches of
// under 2^31 floats (pack's gather takes int32 offsets); acc, m and l are written whole.
template <int ND, int BS>
void attend(const float* qf, const float* kc, const float* vc, const int32_t* table, int kv0, int kv1, int nq,
            int first_pos, int H, int Hkv, float* acc, float* m, float* l) {
  constexpr int D = ND * 16;
  const int64_t groups = (kv1 - kv0 + 15) / 16;
  thread_local std::vector<__m512> kt, vt;  // one KV head's packed keys and values, reused
  if (static_cast<int64_t>(kt.size()) < groups * D) {
    kt.resize(groups * D);
    vt.resize(groups * D);
  }
  float* kp = reinterpret_cast<float*>(kt.data());
  float* vp = reinterpret_cast<float*>(vt.data());
  for (int g = 0; g < Hkv; ++g) {
    pack<D, BS>(kc, vc, table, kv0, kv1, g, static_cast<int64_t>(Hkv) * D, kp, vp);
    row_tiles(qf, D, D, nq, first_pos, H, Hkv, g, acc, m, l,
              [&](auto n, const float* const* qr, const int* pos, float* const* ar, float* const* mr,
                  float* const* lr) { rows<decltype(n)::value, ND>(qr, pos, kp, vp, kv0, kv1, ar, mr, lr); });
  }
}

}  // namespace pagedserve::prefill_f32

#endif  // __AVX512F__
