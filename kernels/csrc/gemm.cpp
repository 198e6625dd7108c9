// GEMMs on weights packed once at load, for CPUs with AVX-512: y[M, N] = x[M, K] . W[N, K]^T
// + bias, fp32 (AVX-512F) or bf16 (AVX512_BF16, fp32 accumulation), output in x's dtype.
//
// oneDNN reaches this VM's peak from 256 rows up, but not at the 16-64 rows of a decode
// step, where each layer's weights are read once (RESULTS.md: bf16 133-250 GFLOP/s of
// ~430; fp32 113-207 of ~230 at 16-64 rows). Here each panel of NR output channels is
// stored as the tile reads it, [K / KP][NR][KP] with KP = 2 in bf16 (the two weights of
// a pair of k side by side, as vdpbf16ps takes them) and 1 in fp32, and R rows run over
// it in an R x NR register tile: per step of k, NV weight loads, one broadcast per row,
// R * NV products. The weights stream once, in order, whatever the row count.
// gemm_glu runs the same tile over a gate/up weight packed in pairs of half panels
// (gemm_pack_glu) and writes silu(gate) * up from the accumulators: the MLP's [M, 2 I]
// product is never stored. On CPUs with AMX, bf16 runs on its tiles over the same panels
// (amx_run).
#include <torch/library.h>
#include "aten.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "amx_tiles.h"  // defines PAGEDSERVE_AMX where the build has the tiles

#include "vec.h"

namespace {

constexpr int64_t NR = 48;  // output channels per panel: three vectors of 16
constexpr int64_t MB = 64;  // rows per block: a block's x rows stay in L2 across the panels

bool gemm_available(c10::ScalarType dtype) {
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return true;
#endif
  return false;
}

int64_t k_step(c10::ScalarType dtype) { return dtype == at::kBFloat16 ? 2 : 1; }

// Whether a GEMM of this dtype and K runs on AMX tiles (amx_run below): bf16 with K a
// multiple of 32, on a build and a CPU with AMX. It depends on the weight alone, never on
// the row count.
bool tiles_take(c10::ScalarType dtype, int64_t K) {
#if defined(PAGEDSERVE_AMX)
  return dtype == at::kBFloat16 && K % 32 == 0 && pagedserve::amx::enabled();
#else
  return false;
#endif
}

bool gemm_tiles(c10::ScalarType dtype, int64_t K) { return tiles_take(dtype, K); }

// [N, K] -> [G, K / KP, NR, KP]: channel c of panel g is row row_of(g, c) of w, or zeros
// where that is -1. A step of k is four bytes in either dtype, so the packing moves uint32s.
template <class RowOf>
at::Tensor pack_panels(const at::Tensor& w, int64_t G, RowOf row_of) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat),
              "gemm_pack: a 2-D bf16 or fp32 weight");
  const int64_t kp = k_step(w.scalar_type());
  TORCH_CHECK(w.size(1) % kp == 0, "gemm_pack: in_features must be even in bf16");
  const int64_t K2 = w.size(1) / kp;
  const at::Tensor wc = w.contiguous();
  at::Tensor out = at::zeros({G, K2, NR, kp}, w.options());
  const auto* src = reinterpret_cast<const uint32_t*>(wc.data_ptr());
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < NR; ++c) {
        const int64_t row = row_of(g, c);
        if (row < 0) continue;
        for (int64_t k2 = 0; k2 < K2; ++k2) dst[(g * K2 + k2) * NR + c] = src[row * K2 + k2];
      }
  });
  return out;
}

// Panels of NR consecutive output channels; channels past N are zeros.
at::Tensor gemm_pack(const at::Tensor& w) {
  const int64_t N = w.size(0);
  return pack_panels(w, (N + NR - 1) / NR, [N](int64_t g, int64_t c) { return g * NR + c < N ? g * NR + c : -1; });
}

// A gate/up weight [2 I, K] (gate rows, then up rows) for gemm_glu: panel g holds gate
// channels [HALF g, HALF g + HALF) then the same up channels, so that one tile has both
// halves of its outputs.
constexpr int64_t HALF = NR / 2;
at::Tensor gemm_pack_glu(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) % 2 == 0, "gemm_pack_glu: a [2 I, K] gate/up weight");
  const int64_t I = w.size(0) / 2;
  return pack_panels(w, (I + HALF - 1) / HALF, [I](int64_t g, int64_t c) {
    const int64_t ch = g * HALF + c % HALF;
    return ch < I ? (c < HALF ? ch : I + ch) : -1;
  });
}

#if defined(__AVX512F__)
constexpr int R = 8, NV = 3;  // 24 accumulators, 3 weight vectors, 1 broadcast
constexpr int64_t kAhead = 16384;  // bytes a streaming tile fetches ahead of its loads

// A dtype's step of k: the weights' load, one row's broadcast (kept in a register, not a
// memory operand per product), the products, the store.
struct F32 {
  using T = float;
  using Model = float;  // T as vec.h's helpers name it
  static constexpr int64_t KP = 1;  // k per step
  static __m512 splat(const float* x) {
    __m512 b = _mm512_set1_ps(*x);
    asm("" : "+v"(b));
    return b;
  }
  static __m512 load(const float* w) { return _mm512_loadu_ps(w); }
  static __m512 mul_add(__m512 acc, __m512 b, __m512 w) { return _mm512_fmadd_ps(b, w, acc); }
  static void store(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
  static __m512 round(__m512 v) { return v; }  // what store then a load would give
};

#if defined(__AVX512BF16__)
struct Bf16 {
  using T = uint16_t;
  using Model = c10::BFloat16;
  static constexpr int64_t KP = 2;
  static __m512 splat(const uint16_t* x) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    __m512i b = _mm512_set1_epi32(pair);
    asm("" : "+v"(b));
    return _mm512_castsi512_ps(b);
  }
  static __m512 load(const uint16_t* w) { return _mm512_castsi512_ps(_mm512_loadu_si512(w)); }
  static __m512 mul_add(__m512 acc, __m512 b, __m512 w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(b), (__m512bh)_mm512_castps_si512(w));
  }
  static void store(uint16_t* dst, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
  }
  static __m512 round(__m512 v) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
};
#endif

// silu(gate) * up for the HALF outputs of a row of a gemm_pack_glu panel: a[0] holds gate
// 0-15, a[1] gate 16-23 then up 0-7, a[2] up 8-23. Rounded where the unfused path rounds
// (the GEMM's outputs, then fused.cpp's silu_mul: the activation, the product), so the
// result is the same to the bit.
template <class E>
inline void glu(const __m512* a, typename E::T* dst) {
  static_assert(NR == 48, "the lane moves below assume three vectors a panel");
  using M = typename E::Model;
  const __m512i up_lo = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512 gate[2] = {E::round(a[0]), E::round(a[1])};
  const __m512 up[2] = {E::round(_mm512_permutex2var_ps(a[1], up_lo, a[2])),
                        E::round(_mm512_shuffle_f32x4(a[2], a[2], _MM_SHUFFLE(3, 2, 3, 2)))};
  __m512 out[2];
  for (int i = 0; i < 2; ++i) {
    const __m512 e = pagedserve::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate[i]));
    const __m512 act = pagedserve::round16<M>(_mm512_div_ps(gate[i], _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    out[i] = _mm512_mul_ps(act, up[i]);
  }
  M* d = reinterpret_cast<M*>(dst);
  M last[16];
  pagedserve::store16(d, out[0]);
  pagedserve::store16(last, out[1]);
  std::copy_n(last, HALF - 16, d + 16);
}

#if defined(PAGEDSERVE_AMX)
#include "amx_gemm.h"
#endif

// RR rows of x (ldx apart) against one panel of K2 steps; y gets the first `cols` outputs
// of each row: the panel's channels, or with Glu their silu(gate) * up. acc0: the bias for the panel's NR channels, or null. Kept out of line, as
// qgemm.cpp's tile: inlined, GCC may spill the accumulators on every k.
// Stream: the first tile over the panel in this block of rows, whose weights come from
// DRAM; it fetches kAhead bytes ahead of its loads (into the next panel at the end).
template <class E, int RR, bool Glu, bool Stream>
__attribute__((noinline)) void tile(const typename E::T* x, int64_t ldx, int64_t K2, const typename E::T* w,
                                    const float* acc0, typename E::T* y, int64_t ldy, int64_t cols) {
  constexpr int64_t KP = E::KP;
  constexpr int64_t ahead = kAhead / sizeof(typename E::T);
  __m512 acc[RR][NV];
  for (int r = 0; r < RR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = acc0 ? _mm512_loadu_ps(acc0 + 16 * v) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    __m512 wv[NV];
    if constexpr (Stream)
      for (int v = 0; v < NV; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(w + (k * NR + 16 * v) * KP + ahead), _MM_HINT_T0);
    for (int v = 0; v < NV; ++v) wv[v] = E::load(w + (k * NR + 16 * v) * KP);
    for (int r = 0; r < RR; ++r) {
      const __m512 b = E::splat(x + r * ldx + KP * k);
      for (int v = 0; v < NV; ++v) acc[r][v] = E::mul_add(acc[r][v], b, wv[v]);
    }
  }
  constexpr int64_t width = Glu ? HALF : NR;
  for (int r = 0; r < RR; ++r) {
    typename E::T out[NR];
    typename E::T* dst = cols == width ? y + r * ldy : out;
    if constexpr (Glu) {
      glu<E>(acc[r], dst);
    } else {
      for (int v = 0; v < NV; ++v) E::store(dst + 16 * v, acc[r][v]);
    }
    if (cols < width) std::copy_n(out, cols, y + r * ldy);
  }
}

template <class E, int RR, bool Glu, bool Stream>
void tail(int64_t left, const typename E::T* x, int64_t ldx, int64_t K2, const typename E::T* w, const float* acc0,
          typename E::T* y, int64_t ldy, int64_t cols) {
  if constexpr (RR > 0) {
    if (left == RR)
      tile<E, RR, Glu, Stream>(x, ldx, K2, w, acc0, y, ldy, cols);
    else
      tail<E, RR - 1, Glu, Stream>(left, x, ldx, K2, w, acc0, y, ldy, cols);
  }
}

// Rows [m0, m1) of x (ldx apart) against one panel, into y (ldy apart): the first tile
// streams the panel from memory, the others find it in L2.
template <class E, bool Glu>
void panel_rows(const typename E::T* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K2, const typename E::T* w,
                const float* acc0, typename E::T* y, int64_t ldy, int64_t cols) {
  int64_t r = m0;
  if (m1 - r < R) return tail<E, R - 1, Glu, true>(m1 - r, x + r * ldx, ldx, K2, w, acc0, y + r * ldy, ldy, cols);
  tile<E, R, Glu, true>(x + r * ldx, ldx, K2, w, acc0, y + r * ldy, ldy, cols);
  for (r += R; r + R <= m1; r += R) tile<E, R, Glu, false>(x + r * ldx, ldx, K2, w, acc0, y + r * ldy, ldy, cols);
  tail<E, R - 1, Glu, false>(m1 - r, x + r * ldx, ldx, K2, w, acc0, y + r * ldy, ldy, cols);
}

// y [M, N] from x and the panels; with Glu, N is I and each panel gives HALF outputs.
template <class E, bool Glu>
void run(const at::Tensor& x, const at::Tensor& panels, int64_t N, const float* b0, at::Tensor& y) {
  using T = typename E::T;
  const int64_t M = x.size(0), K2 = panels.size(1), G = panels.size(0), ldx = x.stride(0);
  const auto* xp = reinterpret_cast<const T*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const T*>(panels.data_ptr());
  auto* yp = reinterpret_cast<T*>(y.data_ptr());
  const int64_t panel = K2 * NR * E::KP;
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t m1 = std::min(M, m0 + MB);
      for (int64_t g = g0; g < g1; ++g) {
        constexpr int64_t width = Glu ? HALF : NR;
        const T* w = wp + g * panel;
        const int64_t cols = std::min(width, N - g * width);
        const float* bg = b0 ? b0 + g * NR : nullptr;
        panel_rows<E, Glu>(xp, ldx, m0, m1, K2, w, bg, yp + g * width, N, cols);
      }
    }
  });
}

// A mixture-of-experts layer's experts over tokens grouped by expert: rows [off[e],
// off[e + 1]) of x go through expert e, silu(gate) * up of x . gate_up_e^T (panels from
// gemm_pack_glu, stacked [E, G1, K2, NR, KP]), then . down_e^T ([E, G2, I2, NR, KP] from
// gemm_pack). One call a layer: at a decode step of 16 sequences most experts get two or
// three rows, and a call per expert GEMM (two per expert, 32 experts, 16 layers) paid its
// dispatch, its thread fork and its Python a thousand times a step. Each phase (gate/up
// for every expert, then down) spreads (expert, block of rows, panel) items over the
// threads, so the experts' weights stream in one pass.
// One parallel chunk's way through the panels: the AMX tiles (`tiles`, bf16 only) or the
// AVX-512 tile, with no bias.
template <class E, bool Glu>
struct Through {
  explicit Through(bool tiles) : tiles(tiles) {}
  bool tiles;
#if defined(PAGEDSERVE_AMX)
  TileScope scope{tiles};
  std::vector<uint16_t> pad;
#endif
  void operator()(const typename E::T* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K2, const typename E::T* w,
                  typename E::T* y, int64_t ldy, int64_t cols) {
#if defined(PAGEDSERVE_AMX)
    if constexpr (std::is_same_v<typename E::T, uint16_t>) {
      if (tiles) return amx_rows<Glu>(x, ldx, m0, m1, K2, w, nullptr, y, ldy, cols, pad);
    }
#endif
    panel_rows<E, Glu>(x, ldx, m0, m1, K2, w, nullptr, y, ldy, cols);
  }
};

// tiles1, tiles2: whether the gate/up and the down GEMMs run on the AMX tiles (tiles_take
// of their K), as gemm would run each expert's own.
template <class E>
void moe_run(const at::Tensor& x, const int64_t* off, int64_t experts, const at::Tensor& gate_up,
             const at::Tensor& down, at::Tensor& h, at::Tensor& y, bool tiles1, bool tiles2) {
  using T = typename E::T;
  const int64_t H = y.size(1), I = h.size(1);
  const int64_t G1 = gate_up.size(1), K1 = gate_up.size(2), G2 = down.size(1), K2 = down.size(2);
  const int64_t panel1 = K1 * NR * E::KP, panel2 = K2 * NR * E::KP;
  // Each expert's rows in blocks of MB, whose x rows stay in L2 across the panels, as run's.
  struct Block {
    int64_t e, m0, m1;
  };
  std::vector<Block> blocks;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t m0 = off[e]; m0 < off[e + 1]; m0 += MB) blocks.push_back({e, m0, std::min(off[e + 1], m0 + MB)});
  const int64_t n_blocks = blocks.size();
  const auto* xp = reinterpret_cast<const T*>(x.data_ptr());
  auto* hp = reinterpret_cast<T*>(h.data_ptr());
  auto* yp = reinterpret_cast<T*>(y.data_ptr());
  const auto* w1 = reinterpret_cast<const T*>(gate_up.data_ptr());
  const auto* w2 = reinterpret_cast<const T*>(down.data_ptr());
  at::parallel_for(0, n_blocks * G1, 1, [&](int64_t i0, int64_t i1) {
    Through<E, true> through(tiles1);
    for (int64_t i = i0; i < i1; ++i) {
      const Block& b = blocks[i / G1];
      const int64_t g = i % G1;
      through(xp, x.stride(0), b.m0, b.m1, K1, w1 + (b.e * G1 + g) * panel1, hp + g * HALF, I,
              std::min(HALF, I - g * HALF));
    }
  });
  at::parallel_for(0, n_blocks * G2, 1, [&](int64_t i0, int64_t i1) {
    Through<E, false> through(tiles2);
    for (int64_t i = i0; i < i1; ++i) {
      const Block& b = blocks[i / G2];
      const int64_t g = i % G2;
      through(hp, I, b.m0, b.m1, K2, w2 + (b.e * G2 + g) * panel2, yp + g * NR, H, std::min(NR, H - g * NR));
    }
  });
}
#endif

// x [T, K] in rows grouped by expert (offsets [E + 1], int64), each expert's silu GLU
// MLP: gate_up panels [E, G1, K / KP, NR, KP] (gemm_pack_glu's, stacked), down panels
// [E, G2, I / KP, NR, KP] (gemm_pack's); y [T, N].
at::Tensor moe_glu(const at::Tensor& x, const at::Tensor& offsets, const at::Tensor& gate_up, const at::Tensor& down,
                   int64_t N) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(gemm_available(dtype), "moe_glu needs AVX-512 (and AVX512_BF16 for bf16)");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "moe_glu: x is [T, K], rows dense");
  const int64_t kp = k_step(dtype), E = gate_up.size(0);
  TORCH_CHECK(gate_up.dim() == 5 && down.dim() == 5 && gate_up.is_contiguous() && down.is_contiguous() &&
                  gate_up.size(3) == NR && down.size(3) == NR && gate_up.size(4) == kp && down.size(4) == kp &&
                  down.size(0) == E && gate_up.scalar_type() == dtype && down.scalar_type() == dtype,
              "moe_glu: stacked panels from gemm_pack_glu and gemm_pack, in x's dtype");
  TORCH_CHECK(x.size(1) == kp * gate_up.size(2), "moe_glu: x and the gate/up panels disagree on K");
  const int64_t I = kp * down.size(2);
  TORCH_CHECK(I > (gate_up.size(1) - 1) * HALF && I <= gate_up.size(1) * HALF && N > (down.size(1) - 1) * NR &&
                  N <= down.size(1) * NR, "moe_glu: the panels disagree on the intermediate or output size");
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) == E + 1 && offsets.scalar_type() == at::kLong,
              "moe_glu: offsets are int64 [E + 1]");
  const at::Tensor off = offsets.contiguous();
  const int64_t* op = off.data_ptr<int64_t>();
  TORCH_CHECK(op[0] == 0 && op[E] == x.size(0), "moe_glu: offsets run from 0 to the row count");
  for (int64_t e = 0; e < E; ++e) TORCH_CHECK(op[e + 1] >= op[e], "moe_glu: offsets never decrease");
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return y;
  at::Tensor h = at::empty({x.size(0), I}, x.options());
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16)
    moe_run<Bf16>(x, op, E, gate_up, down, h, y, tiles_take(dtype, x.size(1)), tiles_take(dtype, I));
#endif
#if defined(__AVX512F__)
  if (dtype == at::kFloat) moe_run<F32>(x, op, E, gate_up, down, h, y, false, false);
#endif
  return y;
}

// y = x . W^T + bias (glu false), or silu(gate) * up of it (glu true, panels from
// gemm_pack_glu, N = I, bias [2 I] as the weight's rows).
at::Tensor gemm_any(const at::Tensor& x, const at::Tensor& panels, int64_t N, const c10::optional<at::Tensor>& bias,
                    bool glu) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "gemm: x is bf16 or fp32");
  TORCH_CHECK(gemm_available(dtype), "gemm needs AVX-512 (and AVX512_BF16 for bf16)");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "gemm: x is [M, K], rows dense");
  const int64_t kp = k_step(dtype), width = glu ? HALF : NR;
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == NR && panels.size(3) == kp && panels.is_contiguous() &&
                  panels.scalar_type() == dtype, "gemm: panels from gemm_pack, in x's dtype");
  const int64_t M = x.size(0), K = x.size(1), K2 = panels.size(1), G = panels.size(0);
  TORCH_CHECK(K == kp * K2 && N > (G - 1) * width && N <= G * width, "gemm: x and the panels disagree on the shape");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  std::vector<float> acc0;  // the bias per panel channel, in fp32; empty without one
  if (bias.has_value() && bias->defined()) {
    const int64_t rows = glu ? 2 * N : N;
    TORCH_CHECK(bias->numel() == rows, "gemm: bias has one value per weight row");
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    const float* bp = b.data_ptr<float>();
    acc0.assign(G * NR, 0.f);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t c = 0; c < NR; ++c) {
        const int64_t ch = glu ? g * HALF + c % HALF : g * NR + c;
        if (ch < N) acc0[g * NR + c] = bp[glu && c >= HALF ? N + ch : ch];
      }
  }
  const float* b0 = acc0.empty() ? nullptr : acc0.data();
#if defined(PAGEDSERVE_AMX)
  if (tiles_take(dtype, K)) {
    (glu ? amx_run<true> : amx_run<false>)(x, panels, N, b0, y);
    return y;
  }
#endif
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) (glu ? run<Bf16, true> : run<Bf16, false>)(x, panels, N, b0, y);
#endif
#if defined(__AVX512F__)
  if (dtype == at::kFloat) (glu ? run<F32, true> : run<F32, false>)(x, panels, N, b0, y);
#endif
  return y;
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& panels, int64_t N, const c10::optional<at::Tensor>& bias) {
  return gemm_any(x, panels, N, bias, false);
}

at::Tensor gemm_glu(const at::Tensor& x, const at::Tensor& panels, int64_t N, const c10::optional<at::Tensor>& bias) {
  return gemm_any(x, panels, N, bias, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("gemm_available(ScalarType dtype) -> bool");
  m.def("gemm_tiles(ScalarType dtype, int k) -> bool");
  m.def("gemm_pack(Tensor weight) -> Tensor");
  m.def("gemm(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def("gemm_pack_glu(Tensor weight) -> Tensor");
  m.def("gemm_glu(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def("moe_glu(Tensor x, Tensor offsets, Tensor gate_up, Tensor down, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("gemm_pack", &gemm_pack);
  m.impl("gemm", &gemm);
  m.impl("gemm_pack_glu", &gemm_pack_glu);
  m.impl("gemm_glu", &gemm_glu);
  m.impl("moe_glu", &moe_glu);
}

TORCH_LIBRARY_IMPL(pagedserve, CatchAll, m) {
  m.impl("gemm_available", &gemm_available);
  m.impl("gemm_tiles", &gemm_tiles);
}
