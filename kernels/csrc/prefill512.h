// Prefill attention on bf16 caches with AVX512_BF16, tiled as a small GEMM. Included by
// paged_attention.cpp for work items with many query rows; decode keeps attn512.h.
//
// attn512.h takes a query row at a time: sixteen dot products reduced across lanes (45
// shuffles) and P V as fp32 FMAs, 80-115 GFLOP/s on a 2-core Zen 4 at 256-2,048-token
// prompts. Here each group of sixteen keys of a KV head is repacked once per work item
// (K transposed into bf16 pairs, V with key pairs interleaved) and then serves every
// query row of that head: a row's sixteen scores come out of D/2 vdpbf16ps with no
// reduction, and P V is D/16 vdpbf16ps per key pair, about twice as fast. P enters P V
// rounded to bf16, as in FlashAttention, with the row sum l kept from the fp32 values.
// Splitting P into a bf16 part and its remainder kept attn512.h's accuracy (mean
// relative error 0.0014 against float64, 0.0036 rounded) but cost a third of the gain.
#pragma once

#if defined(__AVX512BF16__)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include <c10/util/BFloat16.h>

#include "tiles.h"
#include "vec.h"

namespace pagedserve::prefill512 {

// acc + the bf16 pairs of v times the pair at p, broadcast to every lane.
inline __m512 dot_bcast(__m512 acc, __m512bh v, const uint32_t* p) {
  return _mm512_dpbf16_ps(acc, v, (__m512bh)_mm512_set1_epi32(*p));
}

// One group of sixteen keys' values as [8][D] bf16 pairs (pair row tp, lane d = dim d of
// keys 2tp and 2tp+1), from the rows vrow[t] of its first n keys; the others are zeros.
// The B tiles of prefill_amx.h read the same layout.
template <int D>
inline void pack_value_pairs(const c10::BFloat16* const* vrow, int n, uint32_t* vg) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                      37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int tp = 0; tp < 8; ++tp) {
    for (int c = 0; c < D / 32; ++c) {
      const __m512i a = 2 * tp < n ? _mm512_loadu_si512(vrow[2 * tp] + 32 * c) : _mm512_setzero_si512();
      const __m512i b = 2 * tp + 1 < n ? _mm512_loadu_si512(vrow[2 * tp + 1] + 32 * c) : _mm512_setzero_si512();
      _mm512_store_si512(vg + tp * D + 32 * c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(vg + tp * D + 32 * c + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// Keys [kv0, kv1) of KV head g, in groups of sixteen: kt[grp][D/2][16] (lane t of pair
// row dp = key t's dims 2dp, 2dp+1) and vt[grp][8][D] (pair row tp, lane d = dims d of
// keys 2tp and 2tp+1). Keys past kv1 are zeros, so a padded lane is finite.
template <int D, int BS>
void pack(const c10::BFloat16* kc, const c10::BFloat16* vc, const int32_t* table, int kv0, int kv1, int g,
          int64_t tok, uint32_t* kt, uint32_t* vt) {
  const int64_t blk_stride = tok * BS;
  for (int kv = kv0, grp = 0; kv < kv1; kv += 16, ++grp) {
    const int n = std::min(16, kv1 - kv);
    alignas(64) int32_t off[16];
    const c10::BFloat16* vrow[16];
    for (int t = 0; t < 16; ++t) {
      const int key = kv + std::min(t, n - 1);
      const int64_t at = table[key / BS] * blk_stride + (key % BS) * tok + g * D;
      off[t] = static_cast<int32_t>(at / 2);  // in bf16 pairs from the cache's start
      vrow[t] = vc + at;
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
    const __m512i idx = _mm512_load_si512(off);
    uint32_t* kg = kt + static_cast<int64_t>(grp) * (D / 2) * 16;
    for (int dp = 0; dp < D / 2; ++dp)
      _mm512_store_si512(kg + dp * 16, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid,
                                                                   _mm512_add_epi32(idx, _mm512_set1_epi32(dp)),
                                                                   kc, 4));
    pack_value_pairs<D>(vrow, n, vt + static_cast<int64_t>(grp) * 8 * D);
  }
}

// R query rows against every packed group they see. Scores are in registers, two
// partial sums a row so that eight vdpbf16ps chains run at once (four ran at the
// instruction's latency); the accumulators stay in acc (L1), each loaded, rescaled and
// stored once a group, since R x D/16 of them with the scores would not fit in
// registers and the compiler spilled them on every key pair. qr[j]: row j's query as
// bf16 pairs, pos[j]: its position; writes acc (unnormalised), m and l as
// attn512::attend does.
template <int R, int ND>
inline void rows(const uint32_t* const* qr, const int* pos, float scale, const uint32_t* kt, const uint32_t* vt,
                 int kv0, int kv1, float* const* acc, float* const* m, float* const* l) {
  constexpr int D = ND * 16;
  alignas(64) float lv[R][16] = {};
  alignas(64) uint32_t p[R][8];  // a group's probabilities, bf16 pairs
  float mx[R], c[R];
  for (int j = 0; j < R; ++j) {
    std::fill(acc[j], acc[j] + D, 0.f);
    mx[j] = -std::numeric_limits<float>::infinity();
  }
  const int end = std::min(kv1, *std::max_element(pos, pos + R) + 1);  // keys any row sees
  const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int kv = kv0, grp = 0; kv < end; kv += 16, ++grp) {
    const uint32_t* kg = kt + static_cast<int64_t>(grp) * (D / 2) * 16;
    const uint32_t* vg = vt + static_cast<int64_t>(grp) * 8 * D;
    __m512 s[R][2];
    for (int j = 0; j < R; ++j) s[j][0] = s[j][1] = _mm512_setzero_ps();
    for (int dp = 0; dp < D / 2; dp += 2) {
      for (int h = 0; h < 2; ++h) {
        const __m512bh k = (__m512bh)_mm512_load_si512(kg + (dp + h) * 16);
        for (int j = 0; j < R; ++j)
          s[j][h] = dot_bcast(s[j][h], k, qr[j] + dp + h);
      }
    }
    int pairs = 0;
    bool rescale = false;
    for (int j = 0; j < R; ++j) {
      const int vis = std::max(0, std::min({16, kv1 - kv, pos[j] - kv + 1}));
      c[j] = 1.f;
      if (vis == 0) {  // the row sees none of this group: nothing changes
        std::fill(p[j], p[j] + 8, 0u);
        continue;
      }
      pairs = std::max(pairs, (vis + 1) / 2);
      const __mmask16 valid = static_cast<__mmask16>((1u << vis) - 1u);
      const __m512 x = _mm512_mask_mul_ps(ninf, valid, _mm512_add_ps(s[j][0], s[j][1]), sc);
      const __m512 e = softmax_group(x, valid, mx[j], c[j], lv[j], rescale);
      _mm256_store_si256(reinterpret_cast<__m256i*>(p[j]), (__m256i)_mm512_cvtneps_pbh(e));
    }
    for (int d = 0; d < ND; d += 2) {  // two column blocks of every row: 2R chains
      __m512 a[R][2];
      for (int j = 0; j < R; ++j)
        for (int h = 0; h < 2; ++h) {
          a[j][h] = _mm512_loadu_ps(acc[j] + 16 * (d + h));
          if (rescale) a[j][h] = _mm512_mul_ps(a[j][h], _mm512_set1_ps(c[j]));
        }
      for (int tp = 0; tp < pairs; ++tp) {
        for (int h = 0; h < 2; ++h) {
          const __m512bh v = (__m512bh)_mm512_load_si512(vg + tp * D + 16 * (d + h));
          for (int j = 0; j < R; ++j) a[j][h] = dot_bcast(a[j][h], v, p[j] + tp);
        }
      }
      for (int j = 0; j < R; ++j)
        for (int h = 0; h < 2; ++h) _mm512_storeu_ps(acc[j] + 16 * (d + h), a[j][h]);
    }
  }
  for (int j = 0; j < R; ++j) {
    *m[j] = mx[j];
    *l[j] = _mm512_reduce_add_ps(_mm512_load_ps(lv[j]));
  }
}

// One work item as attn512::attend takes it (query tokens i < nq at positions first_pos
// + i, rows i * H + h, keys [kv0, kv1)), for bf16 caches of under 2^31 bf16 pairs (pack's
// gather takes int32 offsets); acc, m and l are written whole.
template <int ND, int BS>
void attend(const c10::BFloat16* q, float scale, const c10::BFloat16* kc, const c10::BFloat16* vc,
            const int32_t* table, int kv0, int kv1, int nq, int first_pos, int H, int Hkv, float* acc, float* m,
            float* l) {
  constexpr int D = ND * 16;
  const int64_t groups = (kv1 - kv0 + 15) / 16;
  thread_local std::vector<__m512i> kt, vt;  // one KV head's packed keys and values, reused
  if (static_cast<int64_t>(kt.size()) < groups * D / 2) {
    kt.resize(groups * D / 2);
    vt.resize(groups * D / 2);
  }
  uint32_t* kp = reinterpret_cast<uint32_t*>(kt.data());
  uint32_t* vp = reinterpret_cast<uint32_t*>(vt.data());
  const uint32_t* qp = reinterpret_cast<const uint32_t*>(q);  // bf16 pairs: D / 2 a row
  for (int g = 0; g < Hkv; ++g) {
    pack<D, BS>(kc, vc, table, kv0, kv1, g, static_cast<int64_t>(Hkv) * D, kp, vp);
    row_tiles(qp, D / 2, D, nq, first_pos, H, Hkv, g, acc, m, l,
              [&](auto n, const uint32_t* const* qr, const int* pos, float* const* ar, float* const* mr,
                  float* const* lr) { rows<decltype(n)::value, ND>(qr, pos, scale, kp, vp, kv0, kv1, ar, mr, lr); });
  }
}

}  // namespace pagedserve::prefill512

#endif  // __AVX512BF16__
