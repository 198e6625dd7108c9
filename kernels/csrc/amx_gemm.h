// bf16 GEMMs on the AMX tiles, over gemm_pack's panels. Included by gemm.cpp inside its
// anonymous namespace, after NR, NV, HALF, Bf16 and glu, where the build has AMX
// (PAGEDSERVE_AMX, from amx_tiles.h).
#pragma once

// On CPUs with AMX (Xeon from Sapphire Rapids on) every bf16 GEMM whose K is a multiple of
// 32 runs on the tiles instead (moe_glu's experts too), at every row count, so that a
// row's values never depend on how many rows share its call (tests/unit/test_gemm.py):
// the panels already hold each pair of k side by side per channel, which is the B tile's
// layout, so a tile reads 16 steps of k (K2 rows of a panel, NR * 2 values apart) as they
// lie. Per 16 rows of x and panel: three C tiles (16 x 16 fp32) over the panel's three
// vectors of channels, one A tile (16 rows x 32 k), three B tiles. A block of fewer than
// 16 rows is copied into a zeroed one.
constexpr int64_t kAmxRows = 256;  // rows a panel serves from L2 before the next panel

using pagedserve::amx::TileScope;
static_assert(NR == pagedserve::amx::kNR, "a panel is three C tiles of channels");

// Rows [m0, m1) of x (ldx apart) through one panel on the tiles, into y (ldy apart; the
// first `cols` outputs of each row: the panel's channels, or with Glu their silu(gate) *
// up). bias: the panel's NR channel biases, or null. pad: the thread's 16 rows of zeros,
// into which a last block of fewer than 16 rows is copied (and cleared again after).
template <bool Glu>
void amx_rows(const uint16_t* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K2, const uint16_t* w,
              const float* bias, uint16_t* y, int64_t ldy, int64_t cols, std::vector<uint16_t>& pad) {
  constexpr int64_t width = Glu ? HALF : NR;
  const int64_t K = 2 * K2;
  alignas(64) float acc[16 * NR];
  for (int64_t s = m0; s < m1; s += 16) {
    const int64_t rows = std::min<int64_t>(16, m1 - s);
    for (int r = 0; r < 16; ++r) {
      if (bias)
        std::copy_n(bias, NR, acc + r * NR);
      else
        std::fill_n(acc + r * NR, NR, 0.f);
    }
    if (rows == 16) {
      pagedserve::amx::panel_pass(x + s * ldx, ldx, K2, w, acc);
    } else {
      if (static_cast<int64_t>(pad.size()) != 16 * K) pad.assign(16 * K, 0);
      for (int64_t r = 0; r < rows; ++r) std::copy_n(x + (s + r) * ldx, K, pad.data() + r * K);
      pagedserve::amx::panel_pass(pad.data(), K, K2, w, acc);
      std::fill_n(pad.data(), rows * K, 0);
    }
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t out[NR];
      uint16_t* dst = cols == width ? y + (s + r) * ldy : out;
      __m512 a[NV];
      for (int v = 0; v < NV; ++v) a[v] = _mm512_loadu_ps(acc + r * NR + 16 * v);
      if constexpr (Glu) {
        glu<Bf16>(a, dst);
      } else {
        for (int v = 0; v < NV; ++v) Bf16::store(dst + 16 * v, a[v]);
      }
      if (cols < width) std::copy_n(out, cols, y + (s + r) * ldy);
    }
  }
}

template <bool Glu>
void amx_run(const at::Tensor& x, const at::Tensor& panels, int64_t N, const float* b0, at::Tensor& y) {
  const int64_t M = x.size(0), K2 = panels.size(1), G = panels.size(0), ldx = x.stride(0);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t panel = K2 * NR * 2;
  constexpr int64_t width = Glu ? HALF : NR;
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    TileScope tiles(true);
    std::vector<uint16_t> pad;
    for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {  // a block of rows stays in L2 while each panel passes
      const int64_t m1 = std::min(M, m0 + kAmxRows);
      for (int64_t g = g0; g < g1; ++g)
        amx_rows<Glu>(xp, ldx, m0, m1, K2, wp + g * panel, b0 ? b0 + g * NR : nullptr, yp + g * width, N,
                      std::min(width, N - g * width), pad);
    }
  });
}
