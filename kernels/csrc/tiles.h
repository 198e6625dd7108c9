// What the tiled prefill kernels (prefill_f32.h, prefill512.h) share whatever their
// element type: the walk over a KV head's query rows, four at a time, and a row's online
// softmax over a group of sixteen scores.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "vec.h"

namespace pagedserve {

#if defined(__AVX512F__)
// One row's step of the online softmax: x holds a group's sixteen scores, -inf outside
// `valid`. The running max mx moves only when a score passes it (always on a row's first
// group); otherwise the reduction, the scalar exp and the rescaling are skipped. When it
// moves, c becomes the factor for the row's earlier sums, the lane sums lv are rescaled
// by it and `rescale` is set; c is left as it was otherwise. The group's probabilities
// are added to lv and returned, zero outside `valid`.
inline __m512 softmax_group(__m512 x, __mmask16 valid, float& mx, float& c, float* lv, bool& rescale) {
  if (_mm512_cmp_ps_mask(x, _mm512_set1_ps(mx), _CMP_GT_OQ)) {
    const float mnew = _mm512_reduce_max_ps(x);
    c = fast_exp(mx - mnew);  // ~0 on the first group (-inf clamps)
    mx = mnew;
    rescale = true;
    _mm512_store_ps(lv, _mm512_mul_ps(_mm512_load_ps(lv), _mm512_set1_ps(c)));
  }
  const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(x, _mm512_set1_ps(mx))));
  _mm512_store_ps(lv, _mm512_add_ps(_mm512_load_ps(lv), e));
  return e;
}
#endif

// Row k of KV head g is query token k / G (position first_pos + k / G) and query head
// g * G + k % G, so a tile's rows share the head's packed keys. q holds the item's
// query rows (row i * H + h, q_stride elements of T each); acc (D floats a row), m and
// l its outputs.
// Calls tile(std::integral_constant<int, n>, qr, pos, acc, m, l) for each tile of
// n = 1..4 rows, so that the kernel's row count is a template argument.
template <typename T, typename Tile>
inline void row_tiles(const T* q, int q_stride, int D, int nq, int first_pos, int H, int Hkv, int g, float* acc,
                      float* m, float* l, Tile&& tile) {
  constexpr int RT = 4;
  const int G = H / Hkv, rows_g = nq * G;
  for (int r0 = 0; r0 < rows_g; r0 += RT) {
    const int nr = std::min(RT, rows_g - r0);
    const T* qr[RT];
    int pos[RT];
    float *ar[RT], *mr[RT], *lr[RT];
    for (int j = 0; j < nr; ++j) {
      const int i = (r0 + j) / G, row = i * H + g * G + (r0 + j) % G;
      qr[j] = q + static_cast<int64_t>(row) * q_stride;
      pos[j] = first_pos + i;
      ar[j] = acc + static_cast<int64_t>(row) * D;
      mr[j] = m + row;
      lr[j] = l + row;
    }
    switch (nr) {
      case 1: tile(std::integral_constant<int, 1>{}, qr, pos, ar, mr, lr); break;
      case 2: tile(std::integral_constant<int, 2>{}, qr, pos, ar, mr, lr); break;
      case 3: tile(std::integral_constant<int, 3>{}, qr, pos, ar, mr, lr); break;
      default: tile(std::integral_constant<int, 4>{}, qr, pos, ar, mr, lr);
    }
  }
}

}  // namespace pagedserve
