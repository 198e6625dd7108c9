// Prefill attention on bf16 caches on the AMX tiles. Included by paged_attention.cpp for
// work items with at least a tile's worth of query rows, on CPUs with AMX.
//
// prefill512.h runs Q K^T and P V on vdpbf16ps, which Intel issues at one a cycle: 105-150
// GFLOP/s over two cores of an AMX Xeon at 2,048-4,096-token prompts, where a Qwen3-0.6B
// prompt then spent 79% of its prefill in attention. The tiles take 16 query rows against
// 64 keys as sixteen 16 x 16 x 32 products for the scores and sixteen for P V. A KV
// head's keys and values are packed 512 at a time into the B tiles' own layouts,
// kt[grp][D/2][16] (pairs of dims per key) for Q K^T and vt[grp][8][D] (pairs of keys per
// dim) for P V, two groups of keys following each other as the sixteen pair rows of one
// tile. Scores come out of the tiles in fp32; the online softmax runs on them a row at a
// time with AVX-512; P enters P V rounded to bf16, as in prefill512.h and FlashAttention,
// with the row sums l kept from the fp32 values.
//
// A row's keys are bounded below as well as above, so sliding windows (key steps wholly
// before every row's window are skipped) and tanh soft-capping take the tiles too.
#pragma once

#include "amx_tiles.h"

#if defined(PAGEDSERVE_AMX)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <c10/util/BFloat16.h>

#include "prefill512.h"
#include "vec.h"

namespace pagedserve::prefill_amx {

constexpr int kKeys = 64;  // keys per softmax step: four C tiles of scores

// cap * tanh(x / cap) on sixteen lanes, as 1 - 2 / (exp(2y) + 1) (exp16 clamps, so both
// tails end at +-1).
inline __m512 softcap16(__m512 x, float cap) {
  const __m512 e = exp16(_mm512_mul_ps(x, _mm512_set1_ps(2.f / cap)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
  return _mm512_mul_ps(t, _mm512_set1_ps(cap));
}

// A 16 x 16 matrix of 32-bit elements transposed in registers: r[i] lane j becomes r[j]
// lane i. Unpacks within 128-bit lanes, then two rounds of lane shuffles: 64 instructions.
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int a = 0; a < 4; ++a) {  // u[4a + j], 128-bit lane L: column 4L + j of rows 4a..4a+3
    u[4 * a] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
    u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), w = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i w2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_shuffle_i32x4(v, v2, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(v, v2, 0xDD);
    r[4 + j] = _mm512_shuffle_i32x4(w, w2, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(w, w2, 0xDD);
  }
}

// Keys [kv0, kv1) of KV head g in the B tiles' layouts (kt[grp][D/2][16], key t's
// dims 2dp, 2dp+1 at lane t of pair row dp; vt[grp][8][D], keys 2tp, 2tp+1 side by side
// per dim), keys past kv1 zeros. K is transposed in registers, 16 pair rows at a time,
// where prefill512.h gathers each pair row (level with the gathers within this VM's noise).
template <int D, int BS>
void pack(const c10::BFloat16* kc, const c10::BFloat16* vc, const int32_t* table, int kv0, int kv1, int g,
          int64_t tok, uint32_t* kt, uint32_t* vt) {
  const int64_t blk_stride = tok * BS;
  for (int kv = kv0, grp = 0; kv < kv1; kv += 16, ++grp) {
    const int n = std::min(16, kv1 - kv);
    const c10::BFloat16* krow[16];
    const c10::BFloat16* vrow[16];
    for (int t = 0; t < n; ++t) {
      const int key = kv + t;
      const int64_t at = table[key / BS] * blk_stride + (key % BS) * tok + g * D;
      krow[t] = kc + at;
      vrow[t] = vc + at;
    }
    uint32_t* kg = kt + static_cast<int64_t>(grp) * (D / 2) * 16;
    for (int c = 0; c < D / 32; ++c) {  // pair rows 16c .. 16c + 15
      __m512i r[16];
      for (int t = 0; t < 16; ++t) r[t] = t < n ? _mm512_loadu_si512(krow[t] + 32 * c) : _mm512_setzero_si512();
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(kg + (16 * c + i) * 16, r[i]);
    }
    pagedserve::prefill512::pack_value_pairs<D>(vrow, n, vt + static_cast<int64_t>(grp) * 8 * D);
  }
}

// One tile of 16 query rows against one chunk of packed keys: key j of the packing is
// the chunk's key c0 + j, and row k sees the keys [lo[k], hi[k]) (a row with lo == hi,
// padding, sees none). o [16][D] (unnormalised), mx [16] and the lane sums lv [16][16]
// carry the rows' state from chunk to chunk.
template <int ND>
void rows(const uint16_t* qb, const int* lo, const int* hi, int c0, int c1, float scale, float softcap,
          const uint32_t* kt, const uint32_t* vt, float* o, float* mx, float (*lv)[16]) {
  constexpr int D = ND * 16;
  alignas(64) float s[16][kKeys];
  alignas(64) uint16_t p[16][kKeys];
  int first = c1, last = c0;
  for (int k = 0; k < 16; ++k)
    if (lo[k] < hi[k]) {
      first = std::min(first, std::max(lo[k], c0));
      last = std::max(last, std::min(hi[k], c1));
    }
  const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int kb = c0 + (first - c0) / kKeys * kKeys; kb < last; kb += kKeys) {
    const int grp = (kb - c0) / 16;
    // S = Q K^T: per 32 dims one A tile of queries against the four groups' B tiles.
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int ks = 0; ks < D / 32; ++ks) {
      const uint32_t* kk = kt + static_cast<int64_t>(grp) * (D / 2) * 16 + ks * 16 * 16;
      constexpr int64_t group = (D / 2) * 16;
      _tile_loadd(4, qb + ks * 32, D * sizeof(uint16_t));
      _tile_loadd(5, kk, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, kk + group, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, kk + 2 * group, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, kk + 3 * group, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, &s[0][0], kKeys * sizeof(float));
    _tile_stored(1, &s[0][16], kKeys * sizeof(float));
    _tile_stored(2, &s[0][32], kKeys * sizeof(float));
    _tile_stored(3, &s[0][48], kKeys * sizeof(float));
    // The online softmax, a row at a time over its visible keys of the step.
    for (int k = 0; k < 16; ++k) {
      const int a = std::max(lo[k] - kb, 0), b = std::min(hi[k] - kb, kKeys);
      if (a >= b) {  // nothing of this step: p is zero, the row unchanged
        std::memset(p[k], 0, sizeof(p[k]));
        continue;
      }
      const bool whole = a == 0 && b == kKeys;  // most steps of a long prompt: no mask to build
      __m512 x[4];
      __m512 top = ninf;
      for (int v = 0; v < 4; ++v) {
        __m512 y = _mm512_mul_ps(_mm512_load_ps(&s[k][16 * v]), sc);
        if (softcap > 0.f) y = softcap16(y, softcap);
        if (!whole) {
          const int va = std::clamp(a - 16 * v, 0, 16), vb = std::clamp(b - 16 * v, 0, 16);
          y = _mm512_mask_mov_ps(ninf, static_cast<__mmask16>(((1u << vb) - 1u) & ~((1u << va) - 1u)), y);
        }
        x[v] = y;
        top = _mm512_max_ps(top, y);
      }
      const float mnew = _mm512_reduce_max_ps(top);
      if (mnew > mx[k]) {
        const float c = fast_exp(mx[k] - mnew);  // 0 on the row's first step (-inf clamps)
        mx[k] = mnew;
        const __m512 cv = _mm512_set1_ps(c);
        _mm512_store_ps(lv[k], _mm512_mul_ps(_mm512_load_ps(lv[k]), cv));
        for (int d = 0; d < ND; ++d)
          _mm512_store_ps(o + k * D + 16 * d, _mm512_mul_ps(_mm512_load_ps(o + k * D + 16 * d), cv));
      }
      const __m512 m = _mm512_set1_ps(mx[k]);
      __m512 e[4];
      __m512 sum = _mm512_load_ps(lv[k]);
      for (int v = 0; v < 4; ++v) {  // masked keys (-inf) drop out
        e[v] = exp16(_mm512_sub_ps(x[v], m));
        if (!whole) e[v] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x[v], ninf, _CMP_NEQ_OQ), e[v]);
        sum = _mm512_add_ps(sum, e[v]);
      }
      _mm512_store_ps(lv[k], sum);
      _mm512_store_si512(p[k], (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
      _mm512_store_si512(p[k] + 32, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
    }
    // O += P V: P as two A tiles of 32 keys, each 16 dims of O one C tile through L1.
    const uint32_t* v0 = vt + static_cast<int64_t>(grp) * 8 * D;
    const uint32_t* v1 = v0 + 16 * D;
    _tile_loadd(4, &p[0][0], kKeys * sizeof(uint16_t));
    _tile_loadd(5, &p[0][32], kKeys * sizeof(uint16_t));
    for (int d = 0; d < ND; d += 4) {  // four C tiles in flight
      constexpr int64_t os = D * sizeof(float), vs = D * sizeof(uint32_t);
      _tile_loadd(0, o + 16 * d, os);
      _tile_loadd(1, o + 16 * d + 16, os);
      _tile_loadd(2, o + 16 * d + 32, os);
      _tile_loadd(3, o + 16 * d + 48, os);
      _tile_loadd(6, v0 + 16 * d, vs);
      _tile_loadd(7, v0 + 16 * d + 16, vs);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(6, v0 + 16 * d + 32, vs);
      _tile_loadd(7, v0 + 16 * d + 48, vs);
      _tile_dpbf16ps(2, 4, 6);
      _tile_dpbf16ps(3, 4, 7);
      _tile_loadd(6, v1 + 16 * d, vs);
      _tile_loadd(7, v1 + 16 * d + 16, vs);
      _tile_dpbf16ps(0, 5, 6);
      _tile_dpbf16ps(1, 5, 7);
      _tile_loadd(6, v1 + 16 * d + 32, vs);
      _tile_loadd(7, v1 + 16 * d + 48, vs);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
      _tile_stored(0, o + 16 * d, os);
      _tile_stored(1, o + 16 * d + 16, os);
      _tile_stored(2, o + 16 * d + 32, os);
      _tile_stored(3, o + 16 * d + 48, os);
    }
  }
}

// One work item as prefill512.h's attend takes it (query tokens i < nq at positions
// first_pos + i, rows i * H + h, keys [kv0, kv1)), a query at p seeing keys
// (p - window, p] when window > 0; acc, m and l are written whole. The caller holds the
// tiles (amx::TileScope) and checked amx::enabled(). A KV head's keys are packed
// kChunk at a time and each chunk serves all of the head's rows before the next: packed
// whole, a 4,096-token context's keys and values (2 MiB at head_dim 128) left L2 before
// the next tile of rows came back to them.
template <int ND, int BS>
void attend(const c10::BFloat16* q, float scale, const c10::BFloat16* kc, const c10::BFloat16* vc,
            const int32_t* table, int kv0, int kv1, int nq, int first_pos, int H, int Hkv, int window,
            float softcap, float* acc, float* m, float* l) {
  constexpr int D = ND * 16, kChunk = 512;
  const int G = H / Hkv, rows_g = nq * G, tiles = (rows_g + 15) / 16, span = kv1 - kv0;
  constexpr int64_t group_words = D * 8;  // a group of 16 keys, packed: [D/2][16] or [8][D] pairs
  thread_local std::vector<__m512i> kt, vt;  // a chunk of one KV head's packed keys and values
  thread_local std::vector<uint16_t> qb;     // the head's query rows, 16 a tile
  thread_local std::vector<float> ob;        // their unnormalised outputs, [row][D]
  thread_local std::vector<float> lv;        // their lane sums, [row][16]
  const size_t chunk_vecs = kChunk / 16 * group_words / 16;
  if (kt.size() < chunk_vecs) {
    kt.resize(chunk_vecs);
    vt.resize(chunk_vecs);
  }
  if (qb.size() < static_cast<size_t>(tiles) * 16 * D + 32) {
    qb.resize(static_cast<size_t>(tiles) * 16 * D + 32);
    ob.resize(static_cast<size_t>(tiles) * 16 * D + 16);
    lv.resize(static_cast<size_t>(tiles) * 16 * 16 + 16);
  }
  // 64-byte aligned views: the tiles and the aligned vector loads read them.
  auto align = [](auto* p) { return reinterpret_cast<decltype(p)>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63}); };
  uint16_t* qp = align(qb.data());
  float* op = align(ob.data());
  float(*lp)[16] = reinterpret_cast<float(*)[16]>(align(lv.data()));
  uint32_t* kp = reinterpret_cast<uint32_t*>(kt.data());
  uint32_t* vp = reinterpret_cast<uint32_t*>(vt.data());
  const uint16_t* qs = reinterpret_cast<const uint16_t*>(q);
  std::vector<int> lo(tiles * 16), hi(tiles * 16);
  std::vector<float> mx(tiles * 16);
  for (int g = 0; g < Hkv; ++g) {
    for (int k = 0; k < tiles * 16; ++k) {
      mx[k] = -std::numeric_limits<float>::infinity();
      if (k >= rows_g) {  // padding: a row of zeros that sees nothing
        std::memset(qp + k * D, 0, D * sizeof(uint16_t));
        lo[k] = hi[k] = 0;
        continue;
      }
      const int i = k / G, row = i * H + g * G + k % G, pos = first_pos + i;
      std::memcpy(qp + static_cast<int64_t>(k) * D, qs + static_cast<int64_t>(row) * D, D * sizeof(uint16_t));
      hi[k] = std::min(kv1, pos + 1) - kv0;
      lo[k] = std::min(hi[k], std::max(kv0, window > 0 ? pos - window + 1 : kv0) - kv0);
    }
    std::fill(op, op + static_cast<int64_t>(tiles) * 16 * D, 0.f);
    std::fill(&lp[0][0], &lp[0][0] + tiles * 16 * 16, 0.f);
    for (int c0 = 0; c0 < span; c0 += kChunk) {
      const int c1 = std::min(span, c0 + kChunk);
      const int64_t packed = (c1 - c0 + 15) / 16, groups = (c1 - c0 + kKeys - 1) / kKeys * (kKeys / 16);
      pack<D, BS>(kc, vc, table, kv0 + c0, kv0 + c1, g, static_cast<int64_t>(Hkv) * D, kp, vp);
      // A last step's groups past the keys: zeros, so that their scores and products are finite.
      std::memset(kp + packed * group_words, 0, (groups - packed) * group_words * sizeof(uint32_t));
      std::memset(vp + packed * group_words, 0, (groups - packed) * group_words * sizeof(uint32_t));
      for (int t = 0; t < tiles; ++t)
        rows<ND>(qp + t * 16 * D, &lo[t * 16], &hi[t * 16], c0, c1, scale, softcap, kp, vp, op + t * 16 * D,
                 &mx[t * 16], lp + t * 16);
    }
    for (int k = 0; k < rows_g; ++k) {
      const int i = k / G, row = i * H + g * G + k % G;
      std::memcpy(acc + static_cast<int64_t>(row) * D, op + static_cast<int64_t>(k) * D, D * sizeof(float));
      m[row] = mx[k];
      l[row] = _mm512_reduce_add_ps(_mm512_load_ps(lp[k]));
    }
  }
}

}  // namespace pagedserve::prefill_amx

#endif  // PAGEDSERVE_AMX
