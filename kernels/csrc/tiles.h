// The query rows of one KV head in a prefill work item, four at a time: the walk shared
// by the tiled prefill kernels (prefill_f32.h, prefill512.h), whatever their element type.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace pagedserve {

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
