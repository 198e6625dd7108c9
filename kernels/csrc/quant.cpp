// GEMMs on quantized weights, for the CPU: y[M, N] = x[M, K] . W[N, K]^T with W kept as
// GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, Q4_K, Q5_K, Q6_K) or as int8 rows with
// one fp32 scale each. Activations stay fp32 and so do the sums; the weights' values are
// exactly the blocks' (quant_a8.cpp has the few-rows kernels again with activations
// rounded to int8).
//
// - Few rows (decode) with a 32-block type or int8 rows, AVX2 or AVX-512: the blocks
//   stream through registers, panel of four output channels by panel, each row's sums
//   scaled after the block (one row) or the block expanded once for a group of rows;
//   past one group, 4- and 5-bit panels keep their expanded weights in L1 for the other
//   rows. The K-quants (quant_k.cpp) turn each sub-block's quants into floats in
//   registers, as the rest do.
// - Otherwise (prefill, large batches, the portable build): qgemm.cpp's many-rows kernel.
#include <torch/library.h>
#include "aten.h"
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#include "qblocks.h"

namespace pagedserve {
namespace {

using namespace quant;  // NOLINT: this file is the formats' few-rows kernel

// -- few rows: dequantize in registers, scales after the block sums ------------------------
// For a decode step every weight is used by one to four rows, so the cost is reading and
// expanding the blocks. Each block's sum of q * x is taken on the raw integers (as floats),
// then scaled once: y += d * sum(q x) + m * sum(x), with sum(x) per block computed once
// per row for every output channel. The values are the blocks' exactly; only the order
// of the fp32 additions differs from the dequantized product.
#ifdef PAGEDSERVE_AVX2
// AVX-512's 16-float vectors take half the conversions per block.
#if defined(__AVX512F__)
inline vf from_i8(const uint8_t* p) {  // 16 signed bytes
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf from_u8(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
// The 32 values of one block's quants, QT a 32-block type, as 32 / VL vectors: Q4_0's and
// Q5_0's less 8 and 16 (CENTRED), MXFP4's doubled E2M1 values.
template <int64_t QT>
inline void block_q(const uint8_t* b, vf* q) {
  if constexpr (QT == Q8_0 || QT == INT8_ROWS) {
    const uint8_t* p = b + (QT == Q8_0 ? 2 : 0);
    q[0] = from_i8(p), q[1] = from_i8(p + 16);
  } else if constexpr (QT == Q5_0 || QT == Q5_1) {  // the 32 quants as bytes, then widened
    const int64_t at = QT == Q5_1 ? 4 : 2;
    __m256i v = q5_bytes32(b + at + 4, load_u32(b + at));
    if constexpr (QT == Q5_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(16));
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    if constexpr (QT == Q5_0)
      q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
    else
      q[0] = from_u8(lo), q[1] = from_u8(hi);
  } else {  // a nibble indexes a table of its value: permutes read 4 index bits
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (QT == Q4_1 ? 4 : QT == MXFP4 ? 1 : 2)));
    const __m512i v = _mm512_cvtepu8_epi32(raw);
    const vf table = QT == Q4_1    ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                     : QT == MXFP4 ? _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
                                   : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    q[0] = _mm512_permutexvar_ps(v, table), q[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
  }
}
constexpr bool CENTRED = true;  // block_q returns Q4_0's and Q5_0's quants less 8 and 16
#else
inline vf from_i8(const uint8_t* p) {  // 8 signed bytes
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// The 32 quants as four 8-float vectors (qblocks.h bytes32_floats): Q4_0's and Q5_0's as
// stored (0-15, 0-31), their offsets applied by the caller.
template <int64_t QT>
inline void block_q(const uint8_t* b, vf* q) {
  if constexpr (QT == Q8_0 || QT == INT8_ROWS) {
    const uint8_t* p = b + (QT == Q8_0 ? 2 : 0);
    for (int i = 0; i < 4; ++i) q[i] = from_i8(p + 8 * i);
  } else if constexpr (QT == Q5_0 || QT == Q5_1) {
    const int64_t at = QT == Q5_1 ? 4 : 2;
    bytes32_floats(q5_bytes32(b + at + 4, load_u32(b + at)), false, q);
  } else if constexpr (QT == MXFP4) {
    bytes32_floats(mxfp4_bytes32(b + 1), true, q);
  } else {
    bytes32_floats(nibbles32(b + (QT == Q4_1 ? 4 : 2)), false, q);
  }
}
constexpr bool CENTRED = false;
#endif
constexpr int NV = 32 / VL;  // vectors per 32 weights

// A block's scale d (MXFP4's 2^(e - 128) for its doubled values), and its offset m, the
// value of a zero quant: Q4_1's and Q5_1's stored m, Q4_0's -8d and Q5_0's -16d where
// block_q does not centre them.
template <int64_t QT>
inline float block_d(const uint8_t* b) {
  return QT == MXFP4 ? e8m0_half(b[0]) : half_to_float(load_u16(b));
}
template <int64_t QT>
inline float block_m(const uint8_t* b, float d) {
  return QT == Q4_1 || QT == Q5_1 ? half_to_float(load_u16(b + 2)) : QT == Q5_0 ? -16.f * d : -8.f * d;
}

// R rows against PANEL output channels, QT a 32-block type or int8 rows (taken 32
// weights at a time, its one scale per row applied at the end). The type is a template
// argument so that each inner loop has no branch and the signed types no offset term.
template <int64_t QT, int R>
void few_rows(const float* x, const float* xsum, int64_t K, const uint8_t* w, int64_t rb, const float* scales,
              float* y, int64_t ldy, int64_t cols, float* keep = nullptr) {
  constexpr bool has_m = QT == Q4_1 || QT == Q5_1 || ((QT == Q4_0 || QT == Q5_0) && !CENTRED);
  constexpr int64_t bytes = QT == INT8_ROWS ? 32 : block_bytes(QT);
  const int64_t nb = K / 32;
  vf acc[R][PANEL];
  float macc[R][PANEL];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < PANEL; ++c) acc[r][c] = vzero(), macc[r][c] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    vf xv[R][NV];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NV; ++i) xv[r][i] = vload(x + r * K + 32 * b + VL * i);
    for (int c = 0; c < PANEL; ++c) {
      if (c >= cols) break;
      const uint8_t* blk = w + c * rb + b * bytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH), _MM_HINT_T0);
      vf q[NV];
      block_q<QT>(blk, q);
      if constexpr (QT == INT8_ROWS) {
        for (int r = 0; r < R; ++r)
          for (int i = 0; i < NV; ++i) acc[r][c] = vfma(q[i], xv[r][i], acc[r][c]);
      } else if constexpr (R >= 2) {
        // Several rows share each block: expand it to its weights once (q * d + m, the
        // dequantized values) and give every row plain FMAs, no per-row scaling.
        const float d = block_d<QT>(blk);
        const vf vd = vset(d);
        vf wv[NV];
        if constexpr (has_m) {
          const vf vm = vset(block_m<QT>(blk, d));
          for (int i = 0; i < NV; ++i) wv[i] = vadd(vmul(q[i], vd), vm);
        } else {
          for (int i = 0; i < NV; ++i) wv[i] = vmul(q[i], vd);
        }
        for (int r = 0; r < R; ++r)
          for (int i = 0; i < NV; ++i) acc[r][c] = vfma(wv[i], xv[r][i], acc[r][c]);
        if (keep != nullptr)  // the panel's weights for the next rows (from_kept)
          for (int i = 0; i < NV; ++i) vstore(keep + c * K + 32 * b + VL * i, wv[i]);
      } else {
        const float d = block_d<QT>(blk);
        const vf vd = vset(d);
        for (int r = 0; r < R; ++r) {
          vf s = vmul(q[0], xv[r][0]);
          for (int i = 1; i < NV; ++i) s = vfma(q[i], xv[r][i], s);
          acc[r][c] = vfma(s, vd, acc[r][c]);
        }
        if constexpr (has_m) {  // one row: scale the block sum, add the offset times the x sum
          const float m = block_m<QT>(blk, d);
          for (int r = 0; r < R; ++r) macc[r][c] += m * xsum[r * nb + b];
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < cols; ++c)
      y[r * ldy + c] = QT == INT8_ROWS ? vsum(acc[r][c]) * scales[c] : vsum(acc[r][c]) + macc[r][c];
}

// R rows against a panel's weights that few_rows kept in fp32 (in L1): the rows after a
// panel's first group reuse them instead of expanding the blocks again.
template <int R>
void from_kept(const float* x, int64_t K, const float* kept, float* y, int64_t ldy, int64_t cols) {
  vf acc[R][PANEL];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < PANEL; ++c) acc[r][c] = vzero();
  for (int64_t k = 0; k < K; k += VL) {
    vf xv[R];
    for (int r = 0; r < R; ++r) xv[r] = vload(x + r * K + k);
    for (int c = 0; c < PANEL; ++c) {
      const vf wv = vload(kept + c * K + k);
      for (int r = 0; r < R; ++r) acc[r][c] = vfma(wv, xv[r], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < cols; ++c) y[r * ldy + c] = vsum(acc[r][c]);
}

template <int64_t QT>
void few_rows_all(const float* xp, const float* xsum, int64_t M, int64_t N, int64_t K, const uint8_t* wp,
                  int64_t rb, const float* sp, float* yp) {
  const int64_t nb = K / 32, panels = (N + PANEL - 1) / PANEL;
  constexpr int G = VL == 16 ? 4 : 2;  // rows in a group: 32 vector registers hold four, 16 two
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    // Past one group of rows, the first group keeps the panel's expanded weights and the
    // other rows read them back (int8 rows expand in one conversion: they stream again).
    std::vector<float> kept(M > G && QT != Q8_0 && QT != INT8_ROWS ? PANEL * K : 0);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * PANEL, cols = std::min(PANEL, N - n0);
      const float* s = sp ? sp + n0 : nullptr;
      const uint8_t* wpan = wp + n0 * rb;
      float* ypan = yp + n0;
      int64_t r = 0;
      if (!kept.empty()) {
        few_rows<QT, G>(xp, xsum, K, wpan, rb, s, ypan, N, cols, kept.data());
        for (r = G; r + G <= M; r += G) from_kept<G>(xp + r * K, K, kept.data(), ypan + r * N, N, cols);
        for (; r < M; ++r) from_kept<1>(xp + r * K, K, kept.data(), ypan + r * N, N, cols);
        continue;
      }
#if defined(__AVX512F__)
      for (; r + 4 <= M; r += 4)
        few_rows<QT, 4>(xp + r * K, xsum + r * nb, K, wpan, rb, s, ypan + r * N, N, cols);
#endif
      for (; r + 2 <= M; r += 2)
        few_rows<QT, 2>(xp + r * K, xsum + r * nb, K, wpan, rb, s, ypan + r * N, N, cols);
      for (; r < M; ++r)
        few_rows<QT, 1>(xp + r * K, xsum + r * nb, K, wpan, rb, s, ypan + r * N, N, cols);
    }
  });
}

#endif

// The types and shapes the block-streaming kernel takes.
bool few_rows_fit(int64_t qtype, int64_t K) {
#ifdef PAGEDSERVE_AVX2
  return (qtype != INT8_ROWS && block_bytes(qtype) > 0) || (qtype == INT8_ROWS && K % 32 == 0);
#else
  return false;
#endif
}

// The most rows the block-streaming kernel takes, by type: past them qgemm.cpp's kernel,
// which expands each weight once for all rows, is faster (scripts/bench_quant.py on the
// embedded model's shapes, benchmarks/RESULTS.md). int8 rows expand in one conversion, so
// streaming them again per group of rows stays cheap the longest.
constexpr int64_t KQ_ROWS = 4;  // the K-quants expand each superblock again per pair of rows

// With int8 activations (quant_a8.cpp) on AVX-512, up to this many rows stream: there
// the integer kernel beat the many-rows one at 4 to 32 rows for every type (0.12-0.72x
// its time; scripts/bench_quant.py --a8 --both, benchmarks/LOG.md, session 30). AVX2 builds keep the fp32
// kernel's limits below, not measured for int8 activations.
constexpr int64_t A8_ROWS = 32;

bool few_rows_kernel(int64_t qtype, int64_t M, int64_t K, bool int8_activations) {
  if (!few_rows_fit(qtype, K)) return false;
#if defined(__AVX512F__)
  if (int8_activations) return M <= A8_ROWS;
#endif
#if defined(__AVX512F__)
  constexpr int64_t q4 = 16, q8 = 24, i8 = 64;  // four rows a group
#else
  constexpr int64_t q4 = 8, q8 = 8, i8 = 16;  // two rows a group (AVX2 build, measured on Zen 4 without AVX-512)
#endif
  switch (qtype) {
    case Q4_0:
    case Q4_1:
    case Q5_0:  // expanded as Q4's are (not measured apart)
    case Q5_1:
    case MXFP4: return M <= q4;
    case Q8_0: return M <= q8;
    case INT8_ROWS: return M <= i8;
    case Q4_K:
    case Q5_K:
    case Q6_K: return M <= KQ_ROWS;
  }
  return false;
}

// Whether bf16 rows take the AMX tiles (many_rows_bf16) under `kernel`: where the CPU has
// them, every count the few-rows kernel would not take, and past 16 rows even those it
// would: there a group's dequantization once per call costs less than the few-rows
// kernel's work per row (a Q4_K 12,288 x 2,048 at 32 rows: 4.9 ms on the tiles, 7.8 with
// int8 activations; level at 16; LOG, session 44).
constexpr int64_t kBf16FewRows = 16;
bool bf16_tiles(int64_t qtype, int64_t M, int64_t K, int64_t kernel, bool int8_activations) {
  if (kernel == 1 || !many_rows_tiles(K)) return false;
  return kernel == 2 || M > kBf16FewRows || !few_rows_kernel(qtype, M, K, int8_activations);
}

// kernel: 0 picks by row count, 1 forces the few-rows kernel, 2 the many-rows one (tests
// and bench_quant.py check each on every row count). int8_activations: the few-rows
// kernel rounds x to int8 per 32 values (quant_a8.cpp); the many-rows one ignores it.
at::Tensor qlinear(const at::Tensor& x_in, const at::Tensor& w, const c10::optional<at::Tensor>& scales,
                   int64_t qtype, int64_t K, int64_t kernel, bool int8_activations) {
  check_weights(w, qtype, K);
  TORCH_CHECK(kernel >= 0 && kernel <= 2, "kernel must be 0 (by rows), 1 (few rows) or 2 (many rows)");
  TORCH_CHECK(kernel != 1 || few_rows_fit(qtype, K), "the few-rows kernel needs AVX2, and int8 rows need K a "
              "multiple of 32");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K &&
              (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "x must be fp32 or bf16 [M, ", K, "]");
  TORCH_CHECK(qtype != INT8_ROWS || (scales.has_value() && scales->numel() == w.size(0)),
              "int8 rows need one fp32 scale per row");
  if (x_in.scalar_type() == at::kBFloat16) {
    // A bf16 model's rows: many on the AMX tiles where the CPU has them (the weights
    // rounded to bf16, as a bf16 model dequantized from the file holds them); otherwise
    // in fp32, exactly, and rounded once on the way out.
    const int64_t M = x_in.size(0);
    if (!bf16_tiles(qtype, M, K, kernel, int8_activations))
      return qlinear(x_in.to(at::kFloat), w, scales, qtype, K, kernel, int8_activations).to(at::kBFloat16);
    const at::Tensor x = x_in.contiguous();
    at::Tensor y = at::empty({M, w.size(0)}, x.options());
    if (M == 0 || w.size(0) == 0) return y;
    many_rows_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, w.size(0), K,
                   static_cast<const uint8_t*>(w.data_ptr()), qtype,
                   qtype == INT8_ROWS ? scales->data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()));
    return y;
  }
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), N = w.size(0), rb = w.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const float* sp = qtype == INT8_ROWS ? scales->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
#ifdef PAGEDSERVE_AVX2
  if (kernel == 1 || (kernel == 0 && few_rows_kernel(qtype, M, K, int8_activations))) {
    if (int8_activations) {
      few_rows_a8(xp, M, N, K, wp, rb, qtype, sp, yp);
      return y;
    }
    const int64_t nb = K / 32;
    std::vector<float> xsum(M * nb);  // each row's sum over each 32 weights
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        float s = 0.f;
        for (int i = 0; i < 32; ++i) s += xp[r * K + 32 * b + i];
        xsum[r * nb + b] = s;
      }
    switch (qtype) {
      case Q4_K:
      case Q5_K:
      case Q6_K: few_rows_k(xp, xsum.data(), M, N, K, wp, rb, qtype, yp); break;
      case Q8_0: few_rows_all<Q8_0>(xp, xsum.data(), M, N, K, wp, rb, sp, yp); break;
      case Q4_0: few_rows_all<Q4_0>(xp, xsum.data(), M, N, K, wp, rb, sp, yp); break;
      case Q4_1: few_rows_all<Q4_1>(xp, xsum.data(), M, N, K, wp, rb, sp, yp); break;
      case Q5_0: few_rows_all<Q5_0>(xp, xsum.data(), M, N, K, wp, rb, sp, yp); break;
      case Q5_1: few_rows_all<Q5_1>(xp, xsum.data(), M, N, K, wp, rb, sp, yp); break;
      case MXFP4: few_rows_all<MXFP4>(xp, xsum.data(), M, N, K, wp, rb, sp, yp); break;
      default: few_rows_all<INT8_ROWS>(xp, xsum.data(), M, N, K, wp, rb, sp, yp); break;
    }
    return y;
  }
#endif
  many_rows(xp, M, N, K, wp, qtype, sp, yp);
  return y;
}

// Rows `ids` of a quantized matrix as fp32 [len(ids), K]: an embedding lookup.
at::Tensor dequant_rows(const at::Tensor& w, const c10::optional<at::Tensor>& scales, const at::Tensor& ids,
                        int64_t qtype, int64_t K) {
  check_weights(w, qtype, K);
  const at::Tensor idx = ids.to(at::kLong).contiguous();
  const int64_t n = idx.numel(), rows = w.size(0), rb = w.size(1);
  at::Tensor out = at::empty({n, K}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "row id ", ip[i], " out of range");
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const float* sp = qtype == INT8_ROWS ? scales->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) dequant_row(wp + ip[i] * rb, qtype, K, sp ? sp[ip[i]] : 1.f, op + i * K);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("qlinear(Tensor x, Tensor w, Tensor? scales, int qtype, int K, int kernel=0, bool int8_activations=False) "
        "-> Tensor");
  m.def("dequant_rows(Tensor w, Tensor? scales, Tensor ids, int qtype, int K) -> Tensor");
  m.def("few_rows_fit(int qtype, int K) -> bool");
  m.def("bf16_tiles(int qtype, int M, int K, int kernel, bool int8_activations) -> bool");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("qlinear", &qlinear);
  m.impl("dequant_rows", &dequant_rows);
}

TORCH_LIBRARY_IMPL(pagedserve, CatchAll, m) {
  m.impl("few_rows_fit", &few_rows_fit);
  m.impl("bf16_tiles", &bf16_tiles);
}

}  // namespace pagedserve