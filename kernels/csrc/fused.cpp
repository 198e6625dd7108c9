// Fused elementwise ops for the dense layers on the CPU: each is one pass over memory
// where eager PyTorch makes three to five. Math is in fp32 with one rounding at the
// end, in the same order as transformers' Llama (residual add in the model dtype,
// RMSNorm statistics in fp32, the weight applied after rounding back).
#include <torch/library.h>
#include "aten.h"
#include <ATen/Parallel.h>

#include <pthread.h>
#include <sched.h>

#include <cmath>
#include <vector>
#include <tuple>

#include "vec.h"

namespace {

using pagedserve::load_f;
using pagedserve::round_f;
using pagedserve::store_f;

// residual = x + residual (in the model dtype), out = weight * rmsnorm(residual). The
// AVX-512 loops do the scalar ones' arithmetic sixteen lanes at a time (the compiler had
// left the bf16 loops scalar); the scalar loops finish each row's tail. W is the weight's
// type: T (Llama: the normalised x rounded, then weighted) or float (Gemma, gpt-oss: the
// fp32 weight applied first, one rounding after).
template <typename T, typename W>
void add_rms_norm_row(const T* x, T* h, const W* w, T* o, int64_t n, float eps, bool add) {
  constexpr bool late = std::is_same<W, float>::value && !std::is_same<T, float>::value;
  int64_t i0 = 0;
  float ss = 0.f;
#if defined(__AVX512F__)
  __m512 ssv = _mm512_setzero_ps();
  if constexpr (pagedserve::kLanes16<T>) for (; i0 + 16 <= n; i0 += 16) {
    __m512 v = pagedserve::load16(h + i0);
    if (add) {
      v = pagedserve::round16<T>(_mm512_add_ps(v, pagedserve::load16(x + i0)));
      pagedserve::store16(h + i0, v);
    }
    ssv = _mm512_fmadd_ps(v, v, ssv);
  }
  ss = _mm512_reduce_add_ps(ssv);
#endif
  if (add) {
#pragma omp simd
    for (int64_t i = i0; i < n; ++i) store_f(h, i, load_f(h, i) + load_f(x, i));
  }
#pragma omp simd reduction(+ : ss)
  for (int64_t i = i0; i < n; ++i) ss += load_f(h, i) * load_f(h, i);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 invv = _mm512_set1_ps(inv);
  if constexpr (pagedserve::kLanes16<T>) for (; i + 16 <= n; i += 16) {
    const __m512 normed = _mm512_mul_ps(pagedserve::load16(h + i), invv);
    pagedserve::store16(o + i, late ? _mm512_mul_ps(normed, pagedserve::load16(w + i))
                                    : _mm512_mul_ps(pagedserve::load16(w + i), pagedserve::round16<T>(normed)));
  }
#endif
  if constexpr (late) {
#pragma omp simd
    for (int64_t j = i; j < n; ++j) store_f(o, j, load_f(h, j) * inv * w[j]);
  } else {
#pragma omp simd
    for (int64_t j = i; j < n; ++j) store_f(o, j, load_f(w, j) * round_f<T>(load_f(h, j) * inv));
  }
}

template <typename T, typename W>
void add_rms_norm_impl(const T* x, T* res, const W* w, T* out, int64_t rows, int64_t n, float eps, bool add) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) add_rms_norm_row(x + r * n, res + r * n, w, out + r * n, n, eps, add);
  });
}

// Returns weight * rmsnorm(residual + x) and updates residual in place; x may be undefined
// (then residual is only normalised, for the first layer). An fp32 weight with a bf16 or
// fp16 residual multiplies before the rounding (Gemma's and gpt-oss's order).
at::Tensor add_rms_norm(const c10::optional<at::Tensor>& x, at::Tensor residual, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(residual.is_contiguous() && weight.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(weight.scalar_type() == residual.scalar_type() || weight.scalar_type() == at::kFloat,
              "the weight is the residual's dtype or fp32");
  const int64_t n = residual.size(-1), rows = residual.numel() / n;
  auto out = at::empty_like(residual);
  const bool add = x.has_value() && x->defined();
  at::Tensor xc = add ? x->contiguous() : residual;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm", [&] {
    if (weight.scalar_type() == at::kFloat)
      add_rms_norm_impl<scalar_t, float>(xc.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                                         weight.data_ptr<float>(), out.data_ptr<scalar_t>(), rows, n,
                                         static_cast<float>(eps), add);
    else
      add_rms_norm_impl<scalar_t, scalar_t>(xc.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                                            weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, n,
                                            static_cast<float>(eps), add);
  });
  return out;
}

// One row of silu(gate) * up, out of the dispatch macro so the loop is a plain one; the
// AVX-512 loop (exp16 is fast_exp's vector form) where the compiler had left bf16 scalar:
// 2.9 ms for 2,048 x 1,536, the largest elementwise cost of a prefill step.
template <typename T>
void silu_mul_row(const T* g, const T* u, T* dst, int64_t n) {
  int64_t i0 = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f);
  if constexpr (pagedserve::kLanes16<T>) for (; i0 + 16 <= n; i0 += 16) {
    const __m512 gf = pagedserve::load16(g + i0);
    const __m512 e = pagedserve::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gf));
    const __m512 act = pagedserve::round16<T>(_mm512_div_ps(gf, _mm512_add_ps(one, e)));
    pagedserve::store16(dst + i0, _mm512_mul_ps(act, pagedserve::load16(u + i0)));
  }
#endif
#pragma omp simd
  for (int64_t i = i0; i < n; ++i) {
    const float gf = load_f(g, i);
    const float act = round_f<T>(gf / (1.f + pagedserve::fast_exp(-gf)));
    store_f(dst, i, act * load_f(u, i));
  }
}

// silu(gate) * up for gate_up = [gate | up] along the last dimension.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  auto gu = gate_up.contiguous();
  const int64_t n = gu.size(-1) / 2, rows = gu.numel() / (2 * n);
  auto sizes = gu.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "silu_mul", [&] {
    const scalar_t* in = gu.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        silu_mul_row(in + r * 2 * n, in + r * 2 * n + n, o + r * n, n);
      }
    });
  });
  return out;
}

// Rotary embedding (rotate-half, as Llama) of the q and k parts of a fused qkv
// projection, written out contiguous: one pass where eager torch makes four per tensor.
// With `norm` (fp32 [H + Hkv, D], each head's weight: Qwen3's and Gemma 3's q/k norms),
// each head is first RMS-normed in fp32, times its weight, and rounded once to the model
// dtype, as the eager form did in seven operations a layer.
std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                           int64_t H, int64_t Hkv, int64_t D, const c10::optional<at::Tensor>& norm,
                                           double eps) {
  // Partial rotary (cos/sin narrower than a head): the first `rot` dims of each head turn
  // in pairs (i, i + rot / 2), the rest pass through.
  TORCH_CHECK(qkv.dim() == 2 && cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous(),
              "qkv [n, (H + 2 Hkv) D], cos/sin [n, rot] contiguous");
  const int64_t n = qkv.size(0), rot = cos.size(1), half = rot / 2;
  TORCH_CHECK(rot <= D && rot % 2 == 0 && qkv.size(1) >= (H + Hkv) * D && qkv.stride(1) == 1,
              "rotary dims must be even and at most head_dim, qkv rows dense");
  const bool normed = norm.has_value() && norm->defined();
  TORCH_CHECK(!normed || (norm->scalar_type() == at::kFloat && norm->is_contiguous() && norm->numel() == (H + Hkv) * D),
              "norm must be fp32 [H + Hkv, D]");
  TORCH_CHECK(!normed || D <= 1024, "a normed head_dim is at most 1024 (the per-head buffer)");
  const float* nw = normed ? norm->data_ptr<float>() : nullptr;
  const float feps = static_cast<float>(eps);
  auto q = at::empty({n, H, D}, qkv.options());
  auto k = at::empty({n, Hkv, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_qk", [&] {
    const scalar_t* in = qkv.data_ptr<scalar_t>();
    const int64_t row = qkv.stride(0);
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* qo = q.data_ptr<scalar_t>();
    scalar_t* ko = k.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cp + t * rot;
        const scalar_t* s = sp + t * rot;
        for (int64_t h = 0; h < H + Hkv; ++h) {
          const scalar_t* x = in + t * row + h * D;
          scalar_t* o = h < H ? qo + (t * H + h) * D : ko + (t * Hkv + h - H) * D;
          if (nw != nullptr) {  // the head normed into a float row, then turned from it
            float buf[1024];
            float ss = 0.f;
            _Pragma("omp simd reduction(+ : ss)") for (int64_t i = 0; i < D; ++i) {
              buf[i] = load_f(x, i);
              ss += buf[i] * buf[i];
            }
            const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + feps);
            const float* w = nw + h * D;
            _Pragma("omp simd") for (int64_t i = 0; i < D; ++i) buf[i] = round_f<scalar_t>(buf[i] * inv * w[i]);
            _Pragma("omp simd") for (int64_t i = 0; i < half; ++i) {
              const float a = buf[i], b = buf[i + half];
              store_f(o, i, a * load_f(c, i) - b * load_f(s, i));
              store_f(o, i + half, b * load_f(c, i + half) + a * load_f(s, i + half));
            }
            for (int64_t i = rot; i < D; ++i) store_f(o, i, buf[i]);
            continue;
          }
          _Pragma("omp simd") for (int64_t i = 0; i < half; ++i) {
            const float a = load_f(x, i), b = load_f(x, i + half);
            store_f(o, i, a * load_f(c, i) - b * load_f(s, i));
            store_f(o, i + half, b * load_f(c, i + half) + a * load_f(s, i + half));
          }
          for (int64_t i = rot; i < D; ++i) o[i] = x[i];
        }
      }
    });
  });
  return {q, k};
}

// Pin each of torch's intra-op threads to one core of `cores`, as vLLM's CPU backend does:
// threads that migrate between cores lose their caches and make step times jitter.
int64_t bind_threads(const at::Tensor& cores) {
  auto c = cores.to(at::kLong).contiguous();
  const int64_t k = c.numel();
  if (k == 0) return 0;
  const int64_t* cp = c.data_ptr<int64_t>();
  const int64_t n = at::get_num_threads();
  std::vector<int> ok(n, 0);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    const int t = at::get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cp[t % k]), &set);
    ok[t % n] = pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
  });
  int64_t bound = 0;
  for (int v : ok) bound += v;
  return bound;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("add_rms_norm(Tensor? x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("bind_threads(Tensor cores) -> int");
  m.def("rope_qk(Tensor qkv, Tensor cos, Tensor sin, int H, int Hkv, int D, Tensor? norm=None, float eps=0.0) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("bind_threads", &bind_threads);
  m.impl("rope_qk", &rope_qk);
}
