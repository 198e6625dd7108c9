// Paged attention on the CPU: one call per layer for every sequence of the step, decode
// and chunked prefill alike. K/V are read in place through the block table (no gather
// copy), each KV block is converted to fp32 once and shared by every query row of the
// work item (all query heads of a KV head, for a chunk of query tokens), and softmax is
// online with fp32 accumulation. Work items are (sequence, KV head, query chunk, KV
// split); splits of long contexts keep both cores busy when the batch is small, and
// are merged with their log-sum-exp weights at the end. Head dims 64 and 128 take the
// AVX-512 path of attn512.h where the CPU has it, and prefill chunks its tiled paths
// (prefill512.h in bf16, prefill_f32.h in fp32), or on a CPU with AMX the tiles for bf16
// (prefill_amx.h). A sliding window (query p sees keys (p - window, p]) and tanh
// soft-capping of the scores take the AMX tiles where they run and otherwise the portable
// path, both of which bound every row's keys from below as well as above; decode items
// simply start at the window's first key. Attention sinks (gpt-oss: a learned logit per head that joins every
// softmax and carries no value) enter in the final merge, so every path takes them.
#include <torch/library.h>
#include "aten.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "vec.h"
#if defined(__AVX512F__)
#include "attn512.h"
#endif
#include "prefill512.h"
#include "prefill_amx.h"
#include "prefill_f32.h"

namespace {

using pagedserve::fast_exp;

constexpr int kMaxDim = 256;
constexpr int kQChunk = 16;     // query tokens per work item
constexpr int kTiledQChunk = 64;  // query tokens per prefill work item on a tiled path
constexpr int kAmxQChunk = 128;  // and on the AMX tiles
// The fewest keys a split of a long context takes. At 64, a lone decode over 190 keys
// split 64/64/62 and one thread took two of the three: 49-50 us a layer (Qwen3-0.6B's 8
// KV heads, fp32, two threads) against 45 at 32, where it splits into six; other lengths
// unchanged (scripts/bench_cpu_attention.py --decode-one; LOG, session 32).
constexpr int kMinSplit = 32;
constexpr int kTiledRows = 16;  // query rows of a KV head from which a tiled path's repacking pays

struct Item {
  int seq, q0, q1, kv0, kv1, part;
};

// Four independent 8-lane partial sums: one accumulator would chain every FMA on the
// previous one and run at FMA latency instead of throughput.
inline float dot(const float* a, const float* b, int D) {
  float acc[4][8] = {};
  int d = 0;
  for (; d + 32 <= D; d += 32)
    for (int k = 0; k < 4; ++k)
#pragma omp simd
      for (int i = 0; i < 8; ++i) acc[k][i] += a[d + 8 * k + i] * b[d + 8 * k + i];
  float s = 0.f;
  for (; d < D; ++d) s += a[d] * b[d];
  for (int i = 0; i < 8; ++i) s += (acc[0][i] + acc[1][i]) + (acc[2][i] + acc[3][i]);
  return s;
}

// A cache row in fp32: the row itself when the cache is fp32, else converted into buf.
template <typename scalar_t>
inline const float* row_f32(const scalar_t* src, float* buf, int n) {
  if constexpr (std::is_same<scalar_t, float>::value) {
    return src;
  } else {
#pragma omp simd
    for (int d = 0; d < n; ++d) buf[d] = pagedserve::load_f(src, d);
    return buf;
  }
}

#ifdef PAGEDSERVE_AVX2
// Dot products waiting for their horizontal sums, reduced eight at a time (hsum8).
struct Partials {
  __m256 v[8];
  float* dst[8];
  int n = 0;
  void push(__m256 x, float* d) {
    v[n] = x;
    dst[n] = d;
    if (++n == 8) flush();
  }
  void flush() {
    if (n == 0) return;
    for (int i = n; i < 8; ++i) v[i] = _mm256_setzero_ps();
    alignas(32) float out[8];
    _mm256_store_ps(out, pagedserve::hsum8(v));
    for (int i = 0; i < n; ++i) *dst[i] = out[i];
    n = 0;
  }
};

// Eight bf16 values widened to fp32 in registers: a bf16 is the top half of its fp32.
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// J query rows (row stride D) against one key row, read in the cache's dtype (fp32 or
// bf16, widened in registers): each key vector is loaded once for all J rows. out[j]
// receives row j's score.
template <int J, typename K>
inline void dot_rows(const float* q, const K* kr, int D, float* out, int out_stride, Partials& acc) {
  __m256 a[J];
  for (int j = 0; j < J; ++j) a[j] = _mm256_setzero_ps();
  for (int d = 0; d < D; d += 8) {
    const __m256 kv = load8(kr + d);
    for (int j = 0; j < J; ++j) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * D + d), kv, a[j]);
  }
  for (int j = 0; j < J; ++j) acc.push(a[j], out + j * out_stride);
}

// dot_rows for any number of rows, four at a time.
template <typename K>
inline void dot_rows_any(int G, const float* q, const K* kr, int D, float* out, int out_stride, Partials& acc) {
  for (int j = 0; j < G; j += 4) {
    const float* qj = q + j * D;
    float* oj = out + j * out_stride;
    switch (std::min(4, G - j)) {
      case 1: dot_rows<1>(qj, kr, D, oj, out_stride, acc); break;
      case 2: dot_rows<2>(qj, kr, D, oj, out_stride, acc); break;
      case 3: dot_rows<3>(qj, kr, D, oj, out_stride, acc); break;
      default: dot_rows<4>(qj, kr, D, oj, out_stride, acc);
    }
  }
}

// acc[j] += sum over t < n of p[j * BS + t] * v[t] for J rows, 16 columns at a time, so
// the J x 16 accumulators stay in registers for the whole block; v in the cache's dtype.
template <int J, typename V>
inline void pv_rows(const float* p, int BS, const V* v, int64_t vs, int n, int D, float* acc) {
  for (int d = 0; d < D; d += 16) {
    __m256 a[J][2];
    for (int j = 0; j < J; ++j) {
      a[j][0] = _mm256_loadu_ps(acc + j * D + d);
      a[j][1] = _mm256_loadu_ps(acc + j * D + d + 8);
    }
    for (int t = 0; t < n; ++t) {
      const __m256 v0 = load8(v + t * vs + d), v1 = load8(v + t * vs + d + 8);
      for (int j = 0; j < J; ++j) {
        const __m256 pb = _mm256_broadcast_ss(p + j * BS + t);
        a[j][0] = _mm256_fmadd_ps(pb, v0, a[j][0]);
        a[j][1] = _mm256_fmadd_ps(pb, v1, a[j][1]);
      }
    }
    for (int j = 0; j < J; ++j) {
      _mm256_storeu_ps(acc + j * D + d, a[j][0]);
      _mm256_storeu_ps(acc + j * D + d + 8, a[j][1]);
    }
  }
}

// pv_rows for any number of rows, four at a time.
template <typename V>
inline void pv_rows_any(int G, const float* p, int BS, const V* v, int64_t vs, int n, int D, float* acc) {
  for (int j = 0; j < G; j += 4) {
    const float* pj = p + j * BS;
    float* aj = acc + j * D;
    switch (std::min(4, G - j)) {
      case 1: pv_rows<1>(pj, BS, v, vs, n, D, aj); break;
      case 2: pv_rows<2>(pj, BS, v, vs, n, D, aj); break;
      case 3: pv_rows<3>(pj, BS, v, vs, n, D, aj); break;
      default: pv_rows<4>(pj, BS, v, vs, n, D, aj);
    }
  }
}
#endif

// One work item: rows = query tokens [q0, q1) x all H query heads (row i * H + h),
// keys [kv0, kv1). Each block is streamed once, token by token across all KV heads,
// so the reads are sequential; every query head of a KV head reuses the row in L1.
// Writes the unnormalised acc, the running max m and the sum l per row.
template <typename scalar_t, int BS>
void attend(const Item& it, const scalar_t* q, const scalar_t* kc, const scalar_t* vc,
            const int32_t* table, int seq_len, int q_start, int q_len, int H, int Hkv, int D,
            float scale, bool tiled, bool amx, int window, float softcap, float* acc, float* m, float* l) {
  const int G = H / Hkv;
  const bool plain = window <= 0 && softcap <= 0.f;  // the specialised paths know neither
  const int nq = it.q1 - it.q0;
  const int R = nq * H;
  const scalar_t* q0 = q + static_cast<int64_t>(q_start + it.q0) * H * D;
#if defined(PAGEDSERVE_AMX)
  if constexpr (std::is_same<scalar_t, c10::BFloat16>::value) {
    if (amx && nq * G >= kTiledRows) {
      pagedserve::amx::TileScope hold(true);
      (D == 64 ? pagedserve::prefill_amx::attend<4, BS> : pagedserve::prefill_amx::attend<8, BS>)(
          q0, scale, kc, vc, table, it.kv0, it.kv1, nq, seq_len - q_len + it.q0, H, Hkv, window, softcap, acc, m, l);
      return;
    }
  }
#endif
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<scalar_t, c10::BFloat16>::value) {
    if (plain && tiled && nq * G >= kTiledRows) {
      (D == 64 ? pagedserve::prefill512::attend<4, BS> : pagedserve::prefill512::attend<8, BS>)(
          q0, scale, kc, vc, table, it.kv0, it.kv1, nq, seq_len - q_len + it.q0, H, Hkv, acc, m, l);
      return;
    }
  }
#endif
  std::vector<float> qf(static_cast<size_t>(R) * D);  // query rows in fp32, pre-scaled
  for (int64_t x = 0; x < static_cast<int64_t>(R) * D; ++x) qf[x] = pagedserve::load_f(q0, x) * scale;
#if defined(__AVX512F__)
  if constexpr (std::is_same<scalar_t, float>::value) {
    if (plain && tiled && nq * G >= kTiledRows) {  // writes acc, m and l whole
      (D == 64 ? pagedserve::prefill_f32::attend<4, BS> : pagedserve::prefill_f32::attend<8, BS>)(
          qf.data(), kc, vc, table, it.kv0, it.kv1, nq, seq_len - q_len + it.q0, H, Hkv, acc, m, l);
      return;
    }
  }
#endif
  for (int r = 0; r < R; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  std::fill(acc, acc + static_cast<int64_t>(R) * D, 0.f);
#if defined(__AVX512F__)
  if constexpr (!std::is_same<scalar_t, double>::value) {
    if (plain && G <= pagedserve::attn512::kMaxG && (D == 64 || D == 128)) {
      (D == 64 ? pagedserve::attn512::attend<scalar_t, 4, BS> : pagedserve::attn512::attend<scalar_t, 8, BS>)(
          qf.data(), q0, scale, kc, vc, table, it.kv0, it.kv1, nq, seq_len - q_len + it.q0, H, Hkv, acc, m, l);
      return;
    }
  }
#endif

  std::vector<float> s(static_cast<size_t>(R) * BS);  // this block's scores, then probabilities
  alignas(64) float buf[kMaxDim];
#ifdef PAGEDSERVE_AVX2
  const bool simd = D % 16 == 0;
  std::vector<float> vblk(std::is_same<scalar_t, at::Half>::value ? static_cast<size_t>(BS) * D : 0);  // fp16 V rows
#else
  const bool simd = false;
#endif
  std::vector<float> kt(nq > 1 ? static_cast<size_t>(D) * BS : 0);  // one head's K block, [D][BS]
  const int64_t tok_stride = static_cast<int64_t>(Hkv) * D;
  const int64_t blk_stride = tok_stride * BS;
  const int first_pos = seq_len - q_len + it.q0;  // causal: query token i sits at first_pos + i
  const scalar_t* nk = nullptr;
  const scalar_t* nv = nullptr;

  for (int kv = it.kv0; kv < it.kv1;) {
    const int blk = kv / BS, off = kv % BS;
    const int n = std::min(BS - off, it.kv1 - kv);
    const scalar_t* kb = kc + table[blk] * blk_stride + off * tok_stride;
    const scalar_t* vb = vc + table[blk] * blk_stride + off * tok_stride;
    const int64_t row_bytes = tok_stride * static_cast<int64_t>(sizeof(scalar_t));
    if (kv + n < it.kv1) {  // the next block, one row per key of this one, as we go
      nk = kc + table[blk + 1] * blk_stride;
      nv = vc + table[blk + 1] * blk_stride;
    } else {
      nk = nv = nullptr;
    }
    // Scores: s[r][t] for every row and key of the block (masked keys never read later).
    if (nq == 1 && simd) {  // decode: each key row loaded once for its G query heads
#ifdef PAGEDSERVE_AVX2
      Partials parts;
      for (int t = 0; t < n; ++t) {
        if (nk != nullptr) {
          pagedserve::prefetch(nk + t * tok_stride, row_bytes);
          pagedserve::prefetch(nv + t * tok_stride, row_bytes);
        }
        for (int g = 0; g < Hkv; ++g) {
          const scalar_t* kr = kb + t * tok_stride + g * D;
          float* out = s.data() + g * G * BS + t;
          if constexpr (std::is_same<scalar_t, float>::value || std::is_same<scalar_t, c10::BFloat16>::value)
            dot_rows_any(G, qf.data() + static_cast<int64_t>(g) * G * D, kr, D, out, BS, parts);
          else
            dot_rows_any(G, qf.data() + static_cast<int64_t>(g) * G * D, row_f32(kr, buf, D), D, out, BS, parts);
        }
      }
      parts.flush();
#endif
    } else if (nq == 1) {  // decode, portable: a dot per (key, query head)
      for (int t = 0; t < n; ++t)
        for (int g = 0; g < Hkv; ++g) {
          const float* kr = row_f32(kb + t * tok_stride + g * D, buf, D);
          for (int j = 0; j < G; ++j) {
            const int r = g * G + j;
            s[r * BS + t] = dot(qf.data() + static_cast<int64_t>(r) * D, kr, D);
          }
        }
    } else {  // prefill: K transposed per head, then 4 query rows x BS keys at a time
      for (int g = 0; g < Hkv; ++g) {
        for (int t = 0; t < BS; ++t) {
          if (t < n) {
            const scalar_t* kr = kb + t * tok_stride + g * D;
            for (int d = 0; d < D; ++d) kt[static_cast<size_t>(d) * BS + t] = pagedserve::load_f(kr, d);
          } else {
            for (int d = 0; d < D; ++d) kt[static_cast<size_t>(d) * BS + t] = 0.f;
          }
        }
        const int rows_g = nq * G;  // row k of this head: token k / G, head g * G + k % G
        for (int k0 = 0; k0 < rows_g; k0 += 4) {
          const int kn = std::min(4, rows_g - k0);
          const float* qr[4];
          int rr[4];
          for (int k = 0; k < 4; ++k) {
            const int kk = k0 + std::min(k, kn - 1);
            rr[k] = (kk / G) * H + g * G + kk % G;
            qr[k] = qf.data() + static_cast<int64_t>(rr[k]) * D;
          }
          float s4[4][BS] = {};
          for (int d = 0; d < D; ++d) {
            const float* kd = kt.data() + d * BS;
            for (int k = 0; k < 4; ++k) {
              const float qd = qr[k][d];
#pragma omp simd
              for (int t = 0; t < BS; ++t) s4[k][t] += qd * kd[t];
            }
          }
          for (int k = 0; k < kn; ++k) std::copy(s4[k], s4[k] + BS, s.data() + rr[k] * BS);
        }
      }
    }
    // Online softmax per row: rescale only when the running max grows.
    for (int i = 0; i < nq; ++i) {
      const int visible = std::max(0, std::min(n, first_pos + i - kv + 1));
      // Keys before `start` are outside this query's window.
      const int start = window > 0 ? std::min(visible, std::max(0, first_pos + i - window + 1 - kv)) : 0;
      for (int h = 0; h < H; ++h) {
        const int r = i * H + h;
        float* sr = s.data() + r * BS;
        if (visible == start) {  // a block wholly after this query, or before its window
          std::fill(sr, sr + BS, 0.f);
          continue;
        }
        if (softcap > 0.f)
          for (int t = start; t < visible; ++t) sr[t] = softcap * std::tanh(sr[t] / softcap);
        float mx = m[r];
        for (int t = start; t < visible; ++t) mx = std::max(mx, sr[t]);
        if (mx > m[r]) {
          const float c = fast_exp(m[r] - mx);
          l[r] *= c;
          float* ar = acc + static_cast<int64_t>(r) * D;
#pragma omp simd
          for (int d = 0; d < D; ++d) ar[d] *= c;
          m[r] = mx;
        }
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < BS; ++t) {
          const float p = t >= start && t < visible ? fast_exp(sr[t] - mx) : 0.f;
          sr[t] = p;
          sum += p;
        }
        l[r] += sum;
      }
    }
    // acc += P V, again streaming the block's V rows once.
#ifdef PAGEDSERVE_AVX2
    if (simd) {
      for (int g = 0; g < Hkv; ++g) {
        const scalar_t* vg = vb + g * D;
        auto accumulate = [&](const auto* vrows, int64_t vs) {
          for (int i = 0; i < nq; ++i) {
            const int visible = std::max(0, std::min(n, first_pos + i - kv + 1));
            if (visible == 0) continue;
            const int r0 = i * H + g * G;
            pv_rows_any(G, s.data() + r0 * BS, BS, vrows, vs, visible, D, acc + static_cast<int64_t>(r0) * D);
          }
        };
        if constexpr (std::is_same<scalar_t, float>::value || std::is_same<scalar_t, c10::BFloat16>::value) {
          accumulate(vg, tok_stride);  // widened in registers
        } else {  // one conversion of this head's block, shared by every query row
          for (int t = 0; t < n; ++t) row_f32(vg + t * tok_stride, vblk.data() + t * D, D);
          accumulate(vblk.data(), static_cast<int64_t>(D));
        }
      }
      kv += n;
      continue;
    }
#endif
    for (int t = 0; t < n; ++t)
      for (int g = 0; g < Hkv; ++g) {
        const float* vr = row_f32(vb + t * tok_stride + g * D, buf, D);
        for (int i = 0; i < nq; ++i)
          for (int j = 0; j < G; ++j) {
            const int r = i * H + g * G + j;
            const float p = s[r * BS + t];
            if (p == 0.f) continue;
            float* ar = acc + static_cast<int64_t>(r) * D;
#pragma omp simd
            for (int d = 0; d < D; ++d) ar[d] += p * vr[d];
          }
      }
    kv += n;
  }
}

template <typename scalar_t>
void run(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& tables,
         const at::Tensor& qsl, const at::Tensor& lens, double scale, int window, float softcap,
         const float* sinks, at::Tensor& out) {
  const int S = lens.size(0), H = q.size(1), D = q.size(2);
  const int BS = kc.size(1), Hkv = kc.size(2);
  const int64_t width = tables.size(1);
  const int32_t* qs = qsl.data_ptr<int32_t>();
  const int32_t* ls = lens.data_ptr<int32_t>();

  // Work items; long contexts are split so that small batches still fill every thread.
  const int threads = at::get_num_threads();
  int64_t base_items = 0;
  int max_len = 0;
  // Whether prefill takes a tiled path: prefill512.h for bf16 caches with AVX512_BF16,
  // prefill_f32.h for fp32 ones with AVX-512; head dims 64 and 128, under 2^31 elements
  // (bf16 pairs) for their gathers' int32 offsets. Their items take longer chunks: each
  // repacks its keys once.
  bool tiled = false;
#if defined(__AVX512BF16__)
  tiled = std::is_same<scalar_t, c10::BFloat16>::value && (D == 64 || D == 128) && kc.numel() / 2 < (int64_t{1} << 31);
#endif
#if defined(__AVX512F__)
  tiled = tiled || (std::is_same<scalar_t, float>::value && (D == 64 || D == 128) && kc.numel() < (int64_t{1} << 31));
#endif
  // The AMX tiles (prefill_amx.h) take bf16 prefill with windows and soft-capping too.
  bool amx = false;
#if defined(PAGEDSERVE_AMX)
  amx = std::is_same<scalar_t, c10::BFloat16>::value && (D == 64 || D == 128) &&
        kc.numel() / 2 < (int64_t{1} << 31) && pagedserve::amx::enabled();
#endif
  if ((window > 0 || softcap > 0.f) && !amx) tiled = false;
  const int chunk = amx ? kAmxQChunk : tiled ? kTiledQChunk : kQChunk;
  for (int i = 0; i < S; ++i) {
    base_items += (qs[i + 1] - qs[i] + chunk - 1) / chunk;
    max_len = std::max(max_len, ls[i]);
  }
  int split_len = std::numeric_limits<int>::max();
  if (base_items < 4 * threads && max_len > 64) {
    const int64_t want = (4 * threads + base_items - 1) / std::max<int64_t>(base_items, 1);
    split_len = std::max(kMinSplit, static_cast<int>((max_len + want - 1) / want));
    split_len = (split_len + BS - 1) / BS * BS;  // whole blocks
  }
  std::vector<Item> items;
  for (int i = 0; i < S; ++i) {
    const int nq = qs[i + 1] - qs[i];
    for (int q0 = 0; q0 < nq; q0 += chunk) {
      const int q1 = std::min(nq, q0 + chunk);
      const int kv_end = ls[i] - nq + q1;  // the chunk's last query sees keys [kv_lo, kv_end)
      // Under a window the chunk's first query sees nothing before kv_lo, and no later one does.
      const int kv_lo = window > 0 ? std::max(0, ls[i] - nq + q0 - window + 1) : 0;
      const int parts = 1 + (kv_end - kv_lo - 1) / split_len;  // kv_end > kv_lo: a query sees itself
      for (int p = 0; p < parts; ++p)
        items.push_back({i, q0, q1, kv_lo + p * split_len,  // 64-bit: split_len may be INT_MAX
                         static_cast<int>(std::min<int64_t>(kv_end, kv_lo + int64_t{p + 1} * split_len)), p});
    }
  }
  // Each item's rows start at row0[w]; attend() initialises its own, so no zero fill.
  const int64_t n_items = items.size();
  std::vector<int64_t> row0(n_items + 1, 0);
  for (int64_t w = 0; w < n_items; ++w) row0[w + 1] = row0[w] + static_cast<int64_t>(items[w].q1 - items[w].q0) * H;
  const int64_t total_rows = row0[n_items];
  std::unique_ptr<float[]> acc(new float[total_rows * D]), m(new float[total_rows]), l(new float[total_rows]);

  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = kc.data_ptr<scalar_t>();
  const scalar_t* vp = vc.data_ptr<scalar_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  // Each thread takes a contiguous run of items of equal total cost, not of equal count:
  // a long prompt's chunks cost more the later they sit, and an even split by count left
  // one thread three quarters of the work. (Claiming items one by one from a shared
  // counter balanced as well but made decode 15% slower: interleaved, neighbouring items'
  // running max and sum rows share cache lines across the threads.)
  std::vector<double> upto(n_items + 1, 0.0);
  for (int64_t w = 0; w < n_items; ++w)
    upto[w + 1] = upto[w] + static_cast<double>(items[w].q1 - items[w].q0 + 1) * (items[w].kv1 - items[w].kv0);
  auto cut = [&](int64_t t) {  // the first item of thread t's run
    if (t >= threads) return n_items;
    return static_cast<int64_t>(std::lower_bound(upto.begin(), upto.end(), upto[n_items] * t / threads) -
                                upto.begin());
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    auto fn = BS == 8 ? attend<scalar_t, 8> : BS == 16 ? attend<scalar_t, 16> : attend<scalar_t, 32>;
    for (int64_t w = cut(t0); w < cut(t1); ++w) {
      const Item& it = items[w];
      fn(it, qp, kp, vp, tp + it.seq * width, ls[it.seq], qs[it.seq], qs[it.seq + 1] - qs[it.seq], H, Hkv,
         D, static_cast<float>(scale), tiled, amx, window, softcap, acc.get() + row0[w] * D, m.get() + row0[w], l.get() + row0[w]);
    }
  });

  // Merge each (seq, chunk)'s splits with their log-sum-exp weights; normalise; write.
  // A head's sink (gpt-oss) is one more split: running max the sink logit, sum 1, no value.
  std::vector<int64_t> groups;
  for (int64_t w = 0; w < n_items; ++w)
    if (items[w].part == 0) groups.push_back(w);
  groups.push_back(n_items);
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, static_cast<int64_t>(groups.size()) - 1, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(D);
    for (int64_t gi = begin; gi < end; ++gi) {
      const int64_t w = groups[gi], e = groups[gi + 1];
      const Item& it = items[w];
      const int R = (it.q1 - it.q0) * H;
      scalar_t* dst0 = op + static_cast<int64_t>(qs[it.seq] + it.q0) * H * D;
      for (int r = 0; r < R; ++r) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t x = w; x < e; ++x)
          if (l[row0[x] + r] > 0.f) mx = std::max(mx, m[row0[x] + r]);
        const float sink = sinks ? sinks[r % H] : 0.f;
        if (sinks) mx = std::max(mx, sink);
        float denom = sinks ? fast_exp(sink - mx) : 0.f;
        std::fill(row.begin(), row.end(), 0.f);
        for (int64_t x = w; x < e; ++x) {
          if (l[row0[x] + r] == 0.f) continue;
          const float c = e - w == 1 && !sinks ? 1.f : fast_exp(m[row0[x] + r] - mx);
          denom += l[row0[x] + r] * c;
          const float* a = acc.get() + (row0[x] + r) * D;
          for (int d = 0; d < D; ++d) row[d] += a[d] * c;
        }
        const float inv = denom > 0.f ? 1.f / denom : 0.f;
        scalar_t* dst = dst0 + static_cast<int64_t>(r) * D;
        _Pragma("omp simd") for (int d = 0; d < D; ++d) pagedserve::store_f(dst, d, row[d] * inv);
      }
    }
  });
}

// What comes from Python, checked before any of it becomes a pointer offset: the kernel
// reads K/V through these, and one bad entry would read another sequence's cache, or past
// the pool. One pass over the sequences and the blocks they read: a few microseconds a
// layer at 64 sequences of 2,048 tokens.
void check_layout(int64_t tokens, int64_t num_blocks, int64_t bs, const at::Tensor& tables, const at::Tensor& qsl,
                  const at::Tensor& lens) {
  TORCH_CHECK(tables.dim() == 2 && qsl.dim() == 1 && lens.dim() == 1, "block_tables [S, W], query_start_loc "
              "[S + 1], seq_lens [S]");
  const int64_t S = lens.size(0), width = tables.size(1);
  TORCH_CHECK(qsl.size(0) == S + 1 && tables.size(0) >= S, "query_start_loc and block_tables must cover seq_lens");
  const int32_t* qs = qsl.data_ptr<int32_t>();
  const int32_t* ls = lens.data_ptr<int32_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  TORCH_CHECK(qs[0] == 0 && qs[S] == tokens, "query_start_loc must run from 0 to the query's ", tokens, " tokens");
  for (int64_t i = 0; i < S; ++i) {
    const int64_t nq = static_cast<int64_t>(qs[i + 1]) - qs[i];
    TORCH_CHECK(nq >= 0 && nq <= ls[i] && ls[i] <= width * bs, "sequence ", i, ": ", nq, " new tokens, length ",
                ls[i], ", ", width, " blocks of ", bs, " in its table");
    if (nq == 0) continue;  // not read
    for (int64_t b = 0, used = (ls[i] + bs - 1) / bs; b < used; ++b)
      TORCH_CHECK(tp[i * width + b] >= 0 && tp[i * width + b] < num_blocks, "sequence ", i, ": block ",
                  tp[i * width + b], " is outside the pool of ", num_blocks);
  }
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                           const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4, "query [T, H, D], caches [blocks, block, Hkv, D]");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt, "block_tables, query_start_loc and seq_lens are int32");
  const int64_t bs = k_cache.size(1);
  TORCH_CHECK((bs == 8 || bs == 16 || bs == 32) && query.size(2) <= kMaxDim,
              "block size 8, 16 or 32 and head_dim <= 256");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(window >= 0 && window < (int64_t{1} << 30) && softcap >= 0.0, "window >= 0, softcap >= 0");
  auto q = query.contiguous();
  auto tables = block_tables.contiguous();
  auto qsl = query_start_loc.contiguous();
  auto lens = seq_lens.contiguous();
  check_layout(q.size(0), k_cache.size(0), bs, tables, qsl, lens);
  at::Tensor sink_values;  // fp32 [H], one logit per query head
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == query.size(1), "sinks must be [query heads]");
    sink_values = sinks->to(at::kFloat).contiguous();
  }
  const float* sink_ptr = sinks.has_value() ? sink_values.data_ptr<float>() : nullptr;
  auto out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    run<scalar_t>(q, k_cache, v_cache, tables, qsl, lens, scale, static_cast<int>(window),
                  static_cast<float>(softcap), sink_ptr, out);
  });
  return out;
}

// Each new token's key and value rows into their cache slots; a negative slot (a
// padding row) is skipped. One call per layer where the torch path takes about ten ops.
void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "key/value [T, Hkv, D], caches [blocks, block, Hkv, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3), "key rows must match the cache's");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                  slot_mapping.scalar_type() == at::kLong, "slot_mapping is int64 [T]");
  const int64_t n = key.size(0), slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  const at::Tensor k = key.to(k_cache.scalar_type()), v = value.to(v_cache.scalar_type());
  const at::Tensor sm = slot_mapping.contiguous();
  const int64_t* sp = sm.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(sp[t] < slots, "slot ", sp[t], " is outside the cache");
  const int64_t es = k_cache.element_size();
  auto* kd = static_cast<char*>(k_cache.data_ptr());
  auto* vd = static_cast<char*>(v_cache.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  // key and value are often strided views of the fused qkv output: rows of [Hkv, D] with
  // contiguous heads are copied whole, anything else element-wise through torch.
  const bool rows_dense = k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2);
  if (!rows_dense) {
    for (int64_t t = 0; t < n; ++t)
      if (sp[t] >= 0) {
        const int64_t b = sp[t] / k_cache.size(1), o = sp[t] % k_cache.size(1);
        k_cache[b][o].copy_(k[t]);
        v_cache[b][o].copy_(v[t]);
      }
    return;
  }
  // A prompt's rows in parallel: one thread took 9 ms a layer at 4,096 tokens of
  // Qwen3-0.6B (16 MB of K and V), level with its rotary pass.
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (sp[t] < 0) continue;
      std::memcpy(kd + sp[t] * row * es, ks + t * k.stride(0) * es, row * es);
      std::memcpy(vd + sp[t] * row * es, vs + t * v.stride(0) * es, row * es);
    }
  });
}

}  // namespace

TORCH_LIBRARY(pagedserve, m) {
  m.def("paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, int window=0, float softcap=0.0, "
        "Tensor? sinks=None) -> Tensor");
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("store_kv", &store_kv);
}
