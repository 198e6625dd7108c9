// Qwen3.5's and Qwen3-Next's linear-attention layers for a batch of sequences, in place on
// their state slots: the causal convolution over the last k inputs (conv), and the gated
// delta rule (delta_rule), each over every sequence's new tokens. Per sequence
// and value head the state is a dk x dv fp32 matrix (64 KB at 128 x 128): eager PyTorch
// reads and writes it five or six times a decode step besides gathering it out of its slot
// and scattering it back; here it is read once from memory and written once, its passes
// in between running from L2. The torch references are kernels/reference.py's conv and
// delta_rule.
#include <torch/library.h>
#include "aten.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec.h"

namespace {

using pagedserve::load_f;
using pagedserve::store_f;

template <typename T>
float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// state [S, k - 1, C] (each sequence's last k - 1 inputs, oldest first, channels
// contiguous); slots int64 [b]; fresh bool [b]: no earlier inputs (zeros); starts int64
// [b + 1]: sequence i's new inputs are rows starts[i] .. starts[i + 1] of x [n, C]; weight
// [k, C] (the checkpoint's [C, 1, k], transposed). Each output is the k-tap dot product
// over the inputs up to its own, rounded to the dtype (as a conv1d in that dtype gives it),
// then, with `silu` (Qwen3.5's; LFM2's has none), SiLU of it rounded again; the state then
// holds the sequence's last k - 1 inputs.
at::Tensor conv(at::Tensor& state, const at::Tensor& slots, const at::Tensor& fresh, const at::Tensor& starts,
                const at::Tensor& x, const at::Tensor& weight, bool silu) {
  TORCH_CHECK(state.dim() == 3 && state.is_contiguous() && x.is_contiguous() && weight.is_contiguous(),
              "conv: contiguous state [slots, k - 1, C], x [n, C] and weight [k, C]");
  const int64_t S = state.size(0), K = state.size(1) + 1, C = state.size(2), b = slots.numel(), n = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == C && weight.size(0) == K && weight.size(1) == C,
              "conv: x [n, C] and weight [k, C] must match the state");
  TORCH_CHECK(x.scalar_type() == state.scalar_type() && weight.scalar_type() == state.scalar_type(),
              "conv: one dtype for state, x and weight");
  TORCH_CHECK(slots.scalar_type() == at::kLong && fresh.scalar_type() == at::kBool && fresh.numel() == b &&
              starts.scalar_type() == at::kLong && starts.numel() == b + 1,
              "conv: slots int64 [b], fresh bool [b] and starts int64 [b + 1]");
  auto sl = slots.contiguous();
  auto fr = fresh.contiguous();
  auto ts = starts.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const bool* fp = fr.data_ptr<bool>();
  const int64_t* tp = ts.data_ptr<int64_t>();
  TORCH_CHECK(tp[0] == 0 && tp[b] == n, "conv: starts must run from 0 to the row count");
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < S, "conv: slot out of range");
    TORCH_CHECK(tp[i] <= tp[i + 1], "conv: starts must not decrease");
  }
  auto out = at::empty_like(x);
  constexpr int64_t kSpan = 512;  // channels a task takes
  const int64_t spans = (C + kSpan - 1) / kSpan;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "conv", [&] {
    scalar_t* st = state.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, b * spans, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(kSpan);
      float* a = acc.data();
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / spans, lo = (task % spans) * kSpan, m = std::min(kSpan, C - lo);
        const int64_t first = tp[i], last = tp[i + 1];
        scalar_t* s = st + sp[i] * (K - 1) * C + lo;
        if (fp[i]) {
          for (int64_t j = 0; j < K - 1; ++j) std::fill(s + j * C, s + j * C + m, static_cast<scalar_t>(0.f));
        }
        // input p of this sequence (p < 0: the state's row k - 1 + p)
        auto input = [&](int64_t p) -> const scalar_t* {
          return p < 0 ? s + (K - 1 + p) * C : xp + (first + p) * C + lo;
        };
        for (int64_t t = 0; t < last - first; ++t) {
          _Pragma("omp simd") for (int64_t c = 0; c < m; ++c) a[c] = 0.f;
          for (int64_t j = 0; j < K; ++j) {
            const scalar_t* in = input(t - (K - 1) + j);
            const scalar_t* wj = wp + j * C + lo;
            _Pragma("omp simd") for (int64_t c = 0; c < m; ++c) a[c] += load_f(wj, c) * load_f(in, c);
          }
          scalar_t* o = op + (first + t) * C + lo;
          _Pragma("omp simd") for (int64_t c = 0; c < m; ++c) {
            const float y = rounded<scalar_t>(a[c]);
            store_f(o, c, silu ? y / (1.f + pagedserve::fast_exp(-y)) : y);
          }
        }
        // keep the last k - 1 inputs; rows move towards the front, so each is read before it is overwritten
        const int64_t count = last - first;
        for (int64_t r = 0; r < K - 1; ++r) {
          const scalar_t* src = input(count - (K - 1) + r);
          if (src != s + r * C) std::copy(src, src + m, s + r * C);
        }
      }
    });
  });
  return out;
}

// The rest of a linear-attention layer after its convolution, for every sequence's new
// tokens, as transformers computes it: from each token's convolved q, k, v (x [n, C] in
// the model's dtype T, C = 2 Hk dk + H dv, value head h reading key head h / (H / Hk)), q
// and k L2-normed in fp32 (q then scaled by dk^-1/2); beta = sigmoid(b) rounded to T; the
// decay exp(g), g = -exp(A_log) softplus(a + dt_bias) in fp32; then per token in order
// S <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q on state fp32 [S, H, dk,
// dv] (slots int64 [b], distinct; fresh bool [b]: from zeros; sequence i's tokens rows
// starts[i] .. starts[i + 1]); and each head's o, rounded to T, through the gated RMSNorm:
// T(T(weight) * T(o / rms(o))) * silu(z) rounded to T. One task per sequence and head
// keeps its state in L2 across the tokens. Returns [n, H dv] in T.
at::Tensor gated_delta_rule(at::Tensor& state, const at::Tensor& slots, const at::Tensor& fresh,
                            const at::Tensor& starts, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                            const at::Tensor& z, const at::Tensor& A_log, const at::Tensor& dt_bias,
                            const at::Tensor& norm_weight, int64_t key_heads, double eps) {
  TORCH_CHECK(state.dim() == 4 && state.scalar_type() == at::kFloat && state.is_contiguous(),
              "gated_delta_rule: state must be contiguous fp32 [slots, heads, dk, dv]");
  const int64_t S = state.size(0), H = state.size(1), dk = state.size(2), dv = state.size(3);
  const int64_t nb = slots.numel(), n = x.size(0);
  TORCH_CHECK(key_heads >= 1 && H % key_heads == 0, "gated_delta_rule: value heads must be a multiple of key heads");
  const int64_t C = 2 * key_heads * dk + H * dv, per = H / key_heads;
  TORCH_CHECK(slots.scalar_type() == at::kLong && fresh.scalar_type() == at::kBool && fresh.numel() == nb &&
              starts.scalar_type() == at::kLong && starts.numel() == nb + 1,
              "gated_delta_rule: slots int64 [b], fresh bool [b] and starts int64 [b + 1]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == C && x.is_contiguous(), "gated_delta_rule: x must be contiguous [n, C]");
  for (const at::Tensor* t : {&a, &b}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->size(1) == H && t->stride(1) == 1,
                "gated_delta_rule: a and b must be [n, heads] with unit column stride");
  }
  TORCH_CHECK(z.dim() == 2 && z.size(0) == n && z.size(1) == H * dv && z.stride(1) == 1,
              "gated_delta_rule: z must be [n, heads * dv] with unit column stride");
  TORCH_CHECK(A_log.numel() == H && dt_bias.numel() == H && norm_weight.numel() == dv,
              "gated_delta_rule: A_log and dt_bias [heads], the norm's weight [dv]");
  for (const at::Tensor* t : {&a, &b, &z, &A_log, &dt_bias, &norm_weight}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "gated_delta_rule: one dtype for x, a, b, z and the weights");
  }
  auto sl = slots.contiguous();
  auto fr = fresh.contiguous();
  auto ts = starts.contiguous();
  auto al = A_log.contiguous();
  auto db = dt_bias.contiguous();
  auto nw = norm_weight.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const bool* fp = fr.data_ptr<bool>();
  const int64_t* tp = ts.data_ptr<int64_t>();
  TORCH_CHECK(tp[0] == 0 && tp[nb] == n, "gated_delta_rule: starts must run from 0 to the token count");
  for (int64_t i = 0; i < nb; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < S, "gated_delta_rule: slot out of range");
    TORCH_CHECK(tp[i] <= tp[i + 1], "gated_delta_rule: starts must not decrease");
  }
  auto out = at::empty({n, H * dv}, x.options());
  const int64_t as = a.stride(0), bs = b.stride(0), zs = z.stride(0);
  const float qscale = 1.f / std::sqrt(static_cast<float>(dk));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gated_delta_rule", [&] {
    using T = scalar_t;
    float* st = state.data_ptr<float>();
    const T *xp = x.data_ptr<T>(), *ap = a.data_ptr<T>(), *bp = b.data_ptr<T>(), *zp = z.data_ptr<T>();
    const T *alp = al.data_ptr<T>(), *dbp = db.data_ptr<T>(), *wp = nw.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, nb * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(2 * dk + 3 * dv);
      float *q = buf.data(), *k = q + dk, *v = k + dk, *dl = v + dv, *o = dl + dv;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / H, h = task % H, kh = h / per;
        float* s = st + (sp[i] * H + h) * dk * dv;
        if (fp[i]) std::fill(s, s + dk * dv, 0.f);
        const float A = -std::exp(load_f(alp, h)), bias = load_f(dbp, h);
        for (int64_t t = tp[i]; t < tp[i + 1]; ++t) {
          const T* row = xp + t * C;
          float qq = 0.f, kk = 0.f;
          _Pragma("omp simd reduction(+ : qq, kk)") for (int64_t r = 0; r < dk; ++r) {
            q[r] = load_f(row, kh * dk + r);
            k[r] = load_f(row, key_heads * dk + kh * dk + r);
            qq += q[r] * q[r];
            kk += k[r] * k[r];
          }
          const float qn = 1.f / std::sqrt(qq + 1e-6f), kn = 1.f / std::sqrt(kk + 1e-6f);
          for (int64_t r = 0; r < dk; ++r) {
            q[r] = (q[r] * qn) * qscale;
            k[r] = k[r] * kn;
          }
          _Pragma("omp simd") for (int64_t j = 0; j < dv; ++j) v[j] = load_f(row, 2 * key_heads * dk + h * dv + j);
          const float bx = load_f(bp + t * bs, h);
          const float bt = rounded<T>(1.f / (1.f + std::exp(-bx)));
          const float ax = load_f(ap + t * as, h) + bias;
          const float softplus = ax > 20.f ? ax : std::log1p(std::exp(ax));
          const float decay = std::exp(A * softplus);
          // what the decayed state predicts for k: sum_r k_r decay S_r
          std::fill(dl, dl + dv, 0.f);
          for (int64_t r = 0; r < dk; ++r) {
            const float kr = k[r];
            const float* srow = s + r * dv;
            _Pragma("omp simd") for (int64_t j = 0; j < dv; ++j) dl[j] += (srow[j] * decay) * kr;
          }
          _Pragma("omp simd") for (int64_t j = 0; j < dv; ++j) dl[j] = (v[j] - dl[j]) * bt;
          std::fill(o, o + dv, 0.f);
          for (int64_t r = 0; r < dk; ++r) {
            const float kr = k[r], qr = q[r];
            float* srow = s + r * dv;
            _Pragma("omp simd") for (int64_t j = 0; j < dv; ++j) {
              const float y = srow[j] * decay + kr * dl[j];
              srow[j] = y;
              o[j] += y * qr;
            }
          }
          // the gated RMSNorm of this head's output
          float ss = 0.f;
          _Pragma("omp simd reduction(+ : ss)") for (int64_t j = 0; j < dv; ++j) {
            o[j] = rounded<T>(o[j]);
            ss += o[j] * o[j];
          }
          const float inv = 1.f / std::sqrt(ss / static_cast<float>(dv) + static_cast<float>(eps));
          const T* zt = zp + t * zs + h * dv;
          T* ot = op + t * H * dv + h * dv;
          _Pragma("omp simd") for (int64_t j = 0; j < dv; ++j) {
            const float normed = rounded<T>(load_f(wp, j) * rounded<T>(o[j] * inv));
            const float g = load_f(zt, j);
            store_f(ot, j, normed * (g / (1.f + pagedserve::fast_exp(-g))));
          }
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("conv(Tensor(a!) state, Tensor slots, Tensor fresh, Tensor starts, Tensor x, Tensor weight, bool silu) "
        "-> Tensor");
  m.def("gated_delta_rule(Tensor(a!) state, Tensor slots, Tensor fresh, Tensor starts, Tensor x, Tensor a, "
        "Tensor b, Tensor z, Tensor A_log, Tensor dt_bias, Tensor norm_weight, int key_heads, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("conv", &conv);
  m.impl("gated_delta_rule", &gated_delta_rule);
}
