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
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// [N, K] -> [ceil(N / NR), K / KP, NR, KP]; channels past N are zeros. A step of k is four
// bytes in either dtype, so the packing moves uint32s.
at::Tensor gemm_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat),
              "gemm_pack: a 2-D bf16 or fp32 weight");
  const int64_t kp = k_step(w.scalar_type());
  TORCH_CHECK(w.size(1) % kp == 0, "gemm_pack: in_features must be even in bf16");
  const int64_t N = w.size(0), K2 = w.size(1) / kp, G = (N + NR - 1) / NR;
  const at::Tensor wc = w.contiguous();
  at::Tensor out = at::zeros({G, K2, NR, kp}, w.options());
  const auto* src = reinterpret_cast<const uint32_t*>(wc.data_ptr());
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < std::min(NR, N - g * NR); ++c)
        for (int64_t k2 = 0; k2 < K2; ++k2) dst[(g * K2 + k2) * NR + c] = src[(g * NR + c) * K2 + k2];
  });
  return out;
}

#if defined(__AVX512F__)
constexpr int R = 8, NV = 3;  // 24 accumulators, 3 weight vectors, 1 broadcast

// A dtype's step of k: the weights' load, one row's broadcast (kept in a register, not a
// memory operand per product), the products, the store.
struct F32 {
  using T = float;
  static constexpr int64_t KP = 1;  // k per step
  static __m512 splat(const float* x) {
    __m512 b = _mm512_set1_ps(*x);
    asm("" : "+v"(b));
    return b;
  }
  static __m512 load(const float* w) { return _mm512_loadu_ps(w); }
  static __m512 mul_add(__m512 acc, __m512 b, __m512 w) { return _mm512_fmadd_ps(b, w, acc); }
  static void store(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
};

#if defined(__AVX512BF16__)
struct Bf16 {
  using T = uint16_t;
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
};
#endif

// RR rows of x (ldx apart) against one panel of K2 steps; y gets the first `cols` channels
// of each row. acc0: the bias for the panel's NR channels, or null. Kept out of line, as
// qgemm.cpp's tile: inlined, GCC may spill the accumulators on every k.
template <class E, int RR>
__attribute__((noinline)) void tile(const typename E::T* x, int64_t ldx, int64_t K2, const typename E::T* w,
                                    const float* acc0, typename E::T* y, int64_t ldy, int64_t cols) {
  constexpr int64_t KP = E::KP;
  __m512 acc[RR][NV];
  for (int r = 0; r < RR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = acc0 ? _mm512_loadu_ps(acc0 + 16 * v) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    __m512 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = E::load(w + (k * NR + 16 * v) * KP);
    for (int r = 0; r < RR; ++r) {
      const __m512 b = E::splat(x + r * ldx + KP * k);
      for (int v = 0; v < NV; ++v) acc[r][v] = E::mul_add(acc[r][v], b, wv[v]);
    }
  }
  for (int r = 0; r < RR; ++r) {
    typename E::T out[NR];
    typename E::T* dst = cols == NR ? y + r * ldy : out;
    for (int v = 0; v < NV; ++v) E::store(dst + 16 * v, acc[r][v]);
    if (cols < NR) std::copy_n(out, cols, y + r * ldy);
  }
}

template <class E, int RR>
void tail(int64_t left, const typename E::T* x, int64_t ldx, int64_t K2, const typename E::T* w, const float* acc0,
          typename E::T* y, int64_t ldy, int64_t cols) {
  if constexpr (RR > 0) {
    if (left == RR)
      tile<E, RR>(x, ldx, K2, w, acc0, y, ldy, cols);
    else
      tail<E, RR - 1>(left, x, ldx, K2, w, acc0, y, ldy, cols);
  }
}

template <class E>
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
        const T* w = wp + g * panel;
        const int64_t cols = std::min(NR, N - g * NR);
        const float* bg = b0 ? b0 + g * NR : nullptr;
        int64_t r = m0;
        for (; r + R <= m1; r += R) tile<E, R>(xp + r * ldx, ldx, K2, w, bg, yp + r * N + g * NR, N, cols);
        tail<E, R - 1>(m1 - r, xp + r * ldx, ldx, K2, w, bg, yp + r * N + g * NR, N, cols);
      }
    }
  });
}
#endif

at::Tensor gemm(const at::Tensor& x, const at::Tensor& panels, int64_t N, const c10::optional<at::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "gemm: x is bf16 or fp32");
  TORCH_CHECK(gemm_available(dtype), "gemm needs AVX-512 (and AVX512_BF16 for bf16)");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "gemm: x is [M, K], rows dense");
  const int64_t kp = k_step(dtype);
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == NR && panels.size(3) == kp && panels.is_contiguous() &&
                  panels.scalar_type() == dtype, "gemm: panels from gemm_pack, in x's dtype");
  const int64_t M = x.size(0), K = x.size(1), K2 = panels.size(1), G = panels.size(0);
  TORCH_CHECK(K == kp * K2 && N > (G - 1) * NR && N <= G * NR, "gemm: x and the panels disagree on the shape");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  std::vector<float> acc0;  // the bias per channel, in fp32, padded to whole panels; empty without one
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "gemm: bias has N values");
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    acc0.assign(G * NR, 0.f);
    std::copy_n(b.data_ptr<float>(), N, acc0.begin());
  }
  const float* b0 = acc0.empty() ? nullptr : acc0.data();
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) run<Bf16>(x, panels, N, b0, y);
#endif
#if defined(__AVX512F__)
  if (dtype == at::kFloat) run<F32>(x, panels, N, b0, y);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("gemm_available(ScalarType dtype) -> bool");
  m.def("gemm_pack(Tensor weight) -> Tensor");
  m.def("gemm(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("gemm_pack", &gemm_pack);
  m.impl("gemm", &gemm);
}

TORCH_LIBRARY_IMPL(pagedserve, CatchAll, m) { m.impl("gemm_available", &gemm_available); }
