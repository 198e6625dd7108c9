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
// [k, C] (the checkpoint's [C, 1, k], transposed). Each output is SiLU of the k-tap dot
// product over the inputs up to its own, rounded to the dtype (as a conv1d in that dtype
// gives it), rounded again; the state then holds the sequence's last k - 1 inputs.
at::Tensor conv(at::Tensor& state, const at::Tensor& slots, const at::Tensor& fresh, const at::Tensor& starts,
                const at::Tensor& x, const at::Tensor& weight) {
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
        auto input = [&](int64_t p) -> const scalar_t* { return p < 0 ? s + (K - 1 + p) * C : xp + (first + p) * C + lo; };
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
            store_f(o, c, y / (1.f + pagedserve::fast_exp(-y)));
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

// state fp32 [S, H, dk, dv]; slots int64 [b] (distinct); fresh bool [b]: start that
// sequence from zeros; starts int64 [b + 1]: sequence i's tokens are rows starts[i] ..
// starts[i + 1] of q, k fp32 [n, H, dk] (normed, q scaled), v fp32 [n, H, dv], g and beta
// fp32 [n, H]. For each token in order: S <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T;
// o = S^T q. One task per sequence and head keeps its state in L2 across the tokens, so a
// prompt costs two passes over 64 KB a token and head, with no chunked solve. Returns o
// fp32 [n, H, dv].
at::Tensor delta_rule(at::Tensor& state, const at::Tensor& slots, const at::Tensor& fresh, const at::Tensor& starts,
                      const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta) {
  TORCH_CHECK(state.dim() == 4 && state.scalar_type() == at::kFloat && state.is_contiguous(),
              "delta_rule: state must be contiguous fp32 [slots, heads, dk, dv]");
  const int64_t S = state.size(0), H = state.size(1), dk = state.size(2), dv = state.size(3);
  const int64_t b = slots.numel(), n = q.size(0);
  TORCH_CHECK(slots.scalar_type() == at::kLong && fresh.scalar_type() == at::kBool && fresh.numel() == b &&
              starts.scalar_type() == at::kLong && starts.numel() == b + 1,
              "delta_rule: slots int64 [b], fresh bool [b] and starts int64 [b + 1]");
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->size(0) == n && t->size(1) == H,
                "delta_rule: q, k, v, g and beta must be contiguous fp32 with [tokens, heads] leading");
  }
  TORCH_CHECK(q.size(2) == dk && k.size(2) == dk && v.size(2) == dv && g.dim() == 2 && beta.dim() == 2,
              "delta_rule: q and k [n, heads, dk], v [n, heads, dv], g and beta [n, heads]");
  auto sl = slots.contiguous();
  auto fr = fresh.contiguous();
  auto st_ = starts.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const bool* fp = fr.data_ptr<bool>();
  const int64_t* tp = st_.data_ptr<int64_t>();
  TORCH_CHECK(tp[0] == 0 && tp[b] == n, "delta_rule: starts must run from 0 to the token count");
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < S, "delta_rule: slot out of range");
    TORCH_CHECK(tp[i] <= tp[i + 1], "delta_rule: starts must not decrease");
  }
  auto out = at::empty({n, H, dv}, q.options());
  float* st = state.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, b * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> delta(dv);
    float* dl = delta.data();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / H, h = task % H;
      float* s = st + (sp[i] * H + h) * dk * dv;
      if (fp[i]) std::fill(s, s + dk * dv, 0.f);
      for (int64_t t = tp[i]; t < tp[i + 1]; ++t) {
        const int64_t w = t * H + h;
        const float* kw = kp + w * dk;
        const float* qw = qp + w * dk;
        const float* vw = vp + w * dv;
        float* ow = op + w * dv;
        const float decay = std::exp(gp[w]), bt = bp[w];
        // what the decayed state predicts for k: sum_r k_r decay S_r
        std::fill(dl, dl + dv, 0.f);
        for (int64_t r = 0; r < dk; ++r) {
          const float kr = kw[r];
          const float* row = s + r * dv;
          _Pragma("omp simd") for (int64_t j = 0; j < dv; ++j) dl[j] += (row[j] * decay) * kr;
        }
        _Pragma("omp simd") for (int64_t j = 0; j < dv; ++j) dl[j] = (vw[j] - dl[j]) * bt;
        std::fill(ow, ow + dv, 0.f);
        for (int64_t r = 0; r < dk; ++r) {
          const float kr = kw[r], qr = qw[r];
          float* row = s + r * dv;
          _Pragma("omp simd") for (int64_t j = 0; j < dv; ++j) {
            const float x = row[j] * decay + kr * dl[j];
            row[j] = x;
            ow[j] += x * qr;
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("conv(Tensor(a!) state, Tensor slots, Tensor fresh, Tensor starts, Tensor x, Tensor weight) -> Tensor");
  m.def("delta_rule(Tensor(a!) state, Tensor slots, Tensor fresh, Tensor starts, Tensor q, Tensor k, Tensor v, "
        "Tensor g, Tensor beta) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("conv", &conv);
  m.impl("delta_rule", &delta_rule);
}
