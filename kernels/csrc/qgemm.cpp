// GEMMs with many rows on quantized weights (prefill, large decode batches, and every row
// count for the K-quants): y[M, N] = x[M, K] . W[N, K]^T with W kept as blocks.
//
// A group of NR output channels is dequantized and laid out k-major ([K][NR]) in a
// scratch that stays in L2, then every row runs over it in R x NR register tiles: per k,
// the NR weights are NV vector loads and each row's x[k] one broadcast, so the FMAs, not
// the loads, set the pace, as in a BLAS micro-kernel. The weights exist in fp32
// only in that scratch: memory delivers the blocks' bytes, each dequantized value serves
// every row of the block, and no buffer the size of a matrix is written and read back, as
// dequantizing it whole for oneDNN did. Each output is one fp32 FMA chain in k order.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx_tiles.h"
#include "qblocks.h"

namespace pagedserve {
namespace quant {
namespace {

// R x NR tiles of NV vectors across: R * NV accumulators, NV weight vectors and the
// broadcast (28 of AVX-512's 32 registers, 15 of AVX2's 16).
#if defined(__AVX512F__)
constexpr int R = 8, NV = 3;
#elif defined(PAGEDSERVE_AVX2)
constexpr int R = 6, NV = 2;
#else
constexpr int R = 4;
#endif
#ifdef PAGEDSERVE_AVX2
constexpr int64_t NR = NV * VL;
#else
constexpr int64_t NR = 16;
#endif

// dst[k * NR + c] = src[c * lds + k] for c < NR, k < K: a group's dequantized rows laid out
// k-major, by square transposes in registers.
void to_k_major(const float* src, int64_t lds, int64_t K, float* dst) {
  int64_t k0 = 0;
#if defined(__AVX512F__)
  for (; k0 + 16 <= K; k0 += 16)
    for (int64_t c0 = 0; c0 < NR; c0 += 16) {
      __m512 r[16], t[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + (c0 + i) * lds + k0);
      for (int i = 0; i < 16; i += 2)
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
      // Then r[4g + j], 128-bit lane L, holds rows 4g..4g+3 at column 4L + j.
      for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44), r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44), r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      for (int j = 0; j < 4; ++j) {
        const __m512 even = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), odd = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
        const __m512 even2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        const __m512 odd2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
        float* d = dst + (k0 + j) * NR + c0;
        _mm512_storeu_ps(d, _mm512_shuffle_f32x4(even, even2, 0x88));
        _mm512_storeu_ps(d + 4 * NR, _mm512_shuffle_f32x4(odd, odd2, 0x88));
        _mm512_storeu_ps(d + 8 * NR, _mm512_shuffle_f32x4(even, even2, 0xDD));
        _mm512_storeu_ps(d + 12 * NR, _mm512_shuffle_f32x4(odd, odd2, 0xDD));
      }
    }
#elif defined(PAGEDSERVE_AVX2)
  for (; k0 + 8 <= K; k0 += 8)
    for (int64_t c0 = 0; c0 < NR; c0 += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + (c0 + i) * lds + k0);
      for (int i = 0; i < 8; i += 2)
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      for (int j = 0; j < 4; ++j) {  // r[j]: rows 0-3, r[4 + j]: rows 4-7, at columns j and 4 + j
        float* d = dst + (k0 + j) * NR + c0;
        _mm256_storeu_ps(d, _mm256_permute2f128_ps(r[j], r[4 + j], 0x20));
        _mm256_storeu_ps(d + 4 * NR, _mm256_permute2f128_ps(r[j], r[4 + j], 0x31));
      }
    }
#endif
  for (int64_t k = k0; k < K; ++k)
    for (int64_t c = 0; c < NR; ++c) dst[k * NR + c] = src[c * lds + k];
}

// y[r, c] = sum_k x[r, k] * w[k, c] for RR rows of x (K apart) and the NR columns of a
// k-major group; only the first `cols` outputs of each row are written. Never inlined:
// inside the caller, GCC's AVX2 build kept the accumulators in registers but also stored
// all twelve to the stack on every k (a third of the FMA rate).
template <int RR>
__attribute__((noinline)) void tile(const float* x, int64_t K, const float* w, float* y, int64_t ldy, int64_t cols) {
#ifdef PAGEDSERVE_AVX2
  vf acc[RR][NV];
  for (int r = 0; r < RR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    vf wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = vload(w + k * NR + v * VL);
    for (int r = 0; r < RR; ++r) {
      vf b = vset(x[r * K + k]);
      // Broadcast once into a register: left alone, GCC folds it into every FMA as a
      // memory operand, which multiplies the loads.
      asm("" : "+v"(b));
      for (int v = 0; v < NV; ++v) acc[r][v] = vfma(b, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < RR; ++r) {
    float out[NR];
    float* dst = cols == NR ? y + r * ldy : out;
    for (int v = 0; v < NV; ++v) vstore(dst + v * VL, acc[r][v]);
    if (cols < NR) std::copy_n(out, cols, y + r * ldy);
  }
#else
  float acc[RR][NR] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < RR; ++r)
      for (int64_t c = 0; c < NR; ++c) acc[r][c] += x[r * K + k] * w[k * NR + c];
  for (int r = 0; r < RR; ++r) std::copy_n(acc[r], cols, y + r * ldy);
#endif
}

// The last rows, fewer than R: the tile that fits them exactly.
template <int RR>
void tail(int64_t left, const float* x, int64_t K, const float* w, float* y, int64_t ldy, int64_t cols) {
  if constexpr (RR > 0) {
    if (left == RR)
      tile<RR>(x, K, w, y, ldy, cols);
    else
      tail<RR - 1>(left, x, K, w, y, ldy, cols);
  }
}

}  // namespace

void many_rows(const float* x, int64_t M, int64_t N, int64_t K, const uint8_t* w, int64_t qtype,
               const float* scales, float* y) {
  // Each group is dequantized once and every row runs over it; the rows come from L3 when
  // there are many, which costs less than dequantizing a group again per block of rows
  // (blocks sized for L2 measured 5-15% slower at 256 and 1,024 rows).
  const int64_t rb = row_bytes(qtype, K), groups = (N + NR - 1) / NR;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    // The group's rows as dequantized, then k-major; a short group's missing columns are
    // zeros, whose outputs are not written.
    std::vector<float> rows_buf(NR * K, 0.f), panel(NR * K);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * NR, cols = std::min(NR, N - n0);
      for (int64_t c = 0; c < cols; ++c)
        dequant_row(w + (n0 + c) * rb, qtype, K, scales ? scales[n0 + c] : 1.f, rows_buf.data() + c * K);
      if (cols < NR) std::fill(rows_buf.begin() + cols * K, rows_buf.end(), 0.f);
      to_k_major(rows_buf.data(), K, K, panel.data());
      int64_t r = 0;
      for (; r + R <= M; r += R) tile<R>(x + r * K, K, panel.data(), y + r * N + n0, N, cols);
      tail<R - 1>(M - r, x + r * K, K, panel.data(), y + r * N + n0, N, cols);
    }
  });
}

#if defined(PAGEDSERVE_AMX)
namespace {

static_assert(NR == amx::kNR, "a group is one panel of the tiles");

// A dequantized row of K fp32 values as K / 2 bf16 pairs, each pair of k in one 32-bit
// lane (the even k in its low half), rounded to nearest even as torch rounds a finite
// float. A group's rows so paired, to_k_major moves the lanes as it moves floats, into
// the B tile's layout [K / 2][NR][2]: half the values a fp32 transpose moves.
void to_pairs(const float* row, int64_t K, uint16_t* pairs) {
  for (int64_t k = 0; k < K; k += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + k + 16), _mm512_loadu_ps(row + k));
    _mm512_storeu_si512(pairs + k, (__m512i)v);
  }
}

}  // namespace

bool many_rows_tiles(int64_t K) { return K % 32 == 0 && amx::enabled(); }

// Why: many_rows takes fp32 FMAs, 32 products a cycle a core, where the tiles take 512 in
// bf16; a bf16 model's prefill on a GGUF's blocks otherwise ran at fp32's rate. Each group
// is dequantized once, rounded into a panel, and every row passes over it 16 at a time.
void many_rows_bf16(const uint16_t* x, int64_t M, int64_t N, int64_t K, const uint8_t* w, int64_t qtype,
                    const float* scales, uint16_t* y) {
  const int64_t rb = row_bytes(qtype, K), groups = (N + NR - 1) / NR, K2 = K / 2;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    amx::TileScope tiles(true);
    std::vector<float> row(K);  // one channel's values, paired while still in L1
    std::vector<uint16_t> pairs(NR * K), panel(NR * K), pad;
    alignas(64) float acc[16 * NR];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * NR, cols = std::min(NR, N - n0);
      for (int64_t c = 0; c < cols; ++c) {
        dequant_row(w + (n0 + c) * rb, qtype, K, scales ? scales[n0 + c] : 1.f, row.data());
        to_pairs(row.data(), K, pairs.data() + c * K);
      }
      if (cols < NR) std::fill(pairs.begin() + cols * K, pairs.end(), 0);
      to_k_major(reinterpret_cast<const float*>(pairs.data()), K2, K2, reinterpret_cast<float*>(panel.data()));
      for (int64_t s = 0; s < M; s += 16) {
        const int64_t rows = std::min<int64_t>(16, M - s);
        std::fill_n(acc, 16 * NR, 0.f);
        if (rows == 16) {
          amx::panel_pass(x + s * K, K, K2, panel.data(), acc);
        } else {  // the last rows, in a zeroed block of 16
          pad.assign(16 * K, 0);
          std::copy_n(x + s * K, rows * K, pad.data());
          amx::panel_pass(pad.data(), K, K2, panel.data(), acc);
        }
        for (int64_t r = 0; r < rows; ++r) {
          alignas(64) uint16_t out[NR];
          for (int64_t c = 0; c < NR; c += 16)
            _mm256_store_si256(reinterpret_cast<__m256i*>(out + c),
                               (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + r * NR + c)));
          std::copy_n(out, cols, y + (s + r) * N + n0);
        }
      }
    }
  });
}
#else
bool many_rows_tiles(int64_t) { return false; }

void many_rows_bf16(const uint16_t*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, const float*, uint16_t*) {
  TORCH_CHECK(false, "many_rows_bf16 needs a build with AMX");
}
#endif

}  // namespace quant
}  // namespace pagedserve
