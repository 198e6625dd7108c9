// bf16 GEMM for CPUs with AVX512_BF16: y[M, N] = x[M, K] . W[N, K]^T + bias, bf16 in and
// out, fp32 accumulation, on a weight packed once at load.
//
// oneDNN's bf16 GEMM reaches about 400 GFLOP/s on two Zen 4 cores from 256 rows up, but
// 133-250 GFLOP/s at the 16-64 rows of a decode step (RESULTS.md, session 8), where the
// weights are read once per step. Here each panel of NR output channels is stored as
// vdpbf16ps reads it ([K/2][NR][2]: the two weights of a pair of k side by side), and
// R rows run over it in an R x NR register tile: per pair of k, NV weight loads, one
// 32-bit broadcast per row, R * NV dot products. The weights stream from memory once,
// in order, whatever the row count.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t NR = 48;  // output channels per panel: three vectors of 16
constexpr int64_t MB = 64;  // rows per block: a block's x rows stay in L2 across the panels

bool available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// [N, K] -> [ceil(N / NR), K / 2, NR, 2]; channels past N are zeros.
at::Tensor bgemm_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "bgemm_pack: a 2-D bf16 weight");
  TORCH_CHECK(w.size(1) % 2 == 0, "bgemm_pack: in_features must be even");
  const int64_t N = w.size(0), K = w.size(1), K2 = K / 2, G = (N + NR - 1) / NR;
  const at::Tensor wc = w.contiguous();
  at::Tensor out = at::zeros({G, K2, NR, 2}, w.options());
  const auto* src = reinterpret_cast<const uint32_t*>(wc.data_ptr());  // one pair of k per uint32
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < std::min(NR, N - g * NR); ++c)
        for (int64_t k2 = 0; k2 < K2; ++k2) dst[(g * K2 + k2) * NR + c] = src[(g * NR + c) * K2 + k2];
  });
  return out;
}

#if defined(__AVX512BF16__)
constexpr int R = 8, NV = 3;  // 24 accumulators, 3 weight vectors, 1 broadcast

// RR rows of x (ldx apart) against one panel; y gets the first `cols` channels of each
// row. acc0: the bias for the panel's NR channels, or null. Kept out of line, as
// qgemm.cpp's tile: inlined, GCC may spill the accumulators on every k.
template <int RR>
__attribute__((noinline)) void tile(const uint16_t* x, int64_t ldx, int64_t K2, const uint16_t* w, const float* acc0,
                                    uint16_t* y, int64_t ldy, int64_t cols) {
  __m512 acc[RR][NV];
  for (int r = 0; r < RR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = acc0 ? _mm512_loadu_ps(acc0 + 16 * v) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + (k * NR + 16 * v) * 2);
    for (int r = 0; r < RR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * k, sizeof(pair));
      __m512i b = _mm512_set1_epi32(pair);
      asm("" : "+v"(b));  // one broadcast register per row, not a memory operand per product
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)b, wv[v]);
    }
  }
  for (int r = 0; r < RR; ++r) {
    uint16_t out[NR];
    uint16_t* dst = cols == NR ? y + r * ldy : out;
    for (int v = 0; v < NV; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * v), (__m256i)_mm512_cvtneps_pbh(acc[r][v]));
    if (cols < NR) std::copy_n(out, cols, y + r * ldy);
  }
}

template <int RR>
void tail(int64_t left, const uint16_t* x, int64_t ldx, int64_t K2, const uint16_t* w, const float* acc0, uint16_t* y,
          int64_t ldy, int64_t cols) {
  if constexpr (RR > 0) {
    if (left == RR)
      tile<RR>(x, ldx, K2, w, acc0, y, ldy, cols);
    else
      tail<RR - 1>(left, x, ldx, K2, w, acc0, y, ldy, cols);
  }
}
#endif

at::Tensor bgemm(const at::Tensor& x, const at::Tensor& panels, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(available(), "bgemm needs AVX512_BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "bgemm: x is [M, K] bf16, rows dense");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == NR && panels.size(3) == 2 && panels.is_contiguous() &&
                  panels.scalar_type() == at::kBFloat16, "bgemm: panels from bgemm_pack");
  const int64_t M = x.size(0), K = x.size(1), K2 = panels.size(1), G = panels.size(0);
  TORCH_CHECK(K == 2 * K2 && N > (G - 1) * NR && N <= G * NR, "bgemm: x and the panels disagree on the shape");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  std::vector<float> acc0;  // the bias per channel, in fp32, padded to whole panels; empty without one
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bgemm: bias has N values");
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    acc0.assign(G * NR, 0.f);
    std::copy_n(b.data_ptr<float>(), N, acc0.begin());
  }
  const float* b0 = acc0.empty() ? nullptr : acc0.data();
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t m1 = std::min(M, m0 + MB);
      for (int64_t g = g0; g < g1; ++g) {
        const uint16_t* w = wp + g * K2 * NR * 2;
        const int64_t cols = std::min(NR, N - g * NR);
        int64_t r = m0;
        const float* bg = b0 ? b0 + g * NR : nullptr;
        for (; r + R <= m1; r += R) tile<R>(xp + r * ldx, ldx, K2, w, bg, yp + r * N + g * NR, N, cols);
        tail<R - 1>(m1 - r, xp + r * ldx, ldx, K2, w, bg, yp + r * N + g * NR, N, cols);
      }
    }
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("bgemm_available() -> bool");
  m.def("bgemm_pack(Tensor weight) -> Tensor");
  m.def("bgemm(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("bgemm_pack", &bgemm_pack);
  m.impl("bgemm", &bgemm);
}

TORCH_LIBRARY_IMPL(pagedserve, CatchAll, m) { m.impl("bgemm_available", &available); }
