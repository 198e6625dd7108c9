// The AMX tiles' common ground: the permission and configuration, a thread's hold on them,
// and one 16-row pass over a panel of 48 channels in bf16 pairs. gemm.cpp's dense panels
// (amx_gemm.h) and qgemm.cpp's blocks dequantized into such a panel both run on it.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEDSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace pagedserve {
namespace amx {

constexpr int64_t kNR = 48;         // channels per panel: three C tiles of 16
constexpr int64_t kAhead = 16384;   // bytes a panel pass fetches ahead of its loads

// PAGEDSERVE_GEMM_TILES=0 keeps the AVX-512 paths (benchmarks/LOG.md, session 42, compares them).
inline bool enabled() {
  static const bool ok = [] {
    const char* env = std::getenv("PAGEDSERVE_GEMM_TILES");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // Linux: ask for the tile state once
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr TileConfig tile_config() {  // eight tiles of 16 rows of 64 bytes
  TileConfig c{};
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  return c;
}

// A constant in memory: built on the stack in a caller GCC 12 inlined it into, the
// configuration made ldtilecfg fault (SIGSEGV) as if it held garbage.
alignas(64) inline constexpr TileConfig kTileConfig = tile_config();

// A thread's hold on the tiles for one parallel chunk: their configuration loaded on
// entry (tiles 0-2: C; 3: A; 4-6: B), released on exit.
struct TileScope {
  explicit TileScope(bool on) : on(on) {
    if (on) _tile_loadconfig(&kTileConfig);
  }
  ~TileScope() {
    if (on) _tile_release();
  }
  bool on;
};

// 16 rows of bf16 x (ldx apart) against one panel of K2 steps of k pairs (a multiple of
// 16; [K2][kNR][2], each pair of k side by side per channel: the B tile's layout), into
// acc [16][kNR] fp32, which holds each channel's bias (or zeros) on entry.
inline void panel_pass(const uint16_t* x, int64_t ldx, int64_t K2, const uint16_t* w, float* acc) {
  constexpr int64_t wstride = kNR * 2 * sizeof(uint16_t), cstride = kNR * sizeof(float);
  _tile_loadd(0, acc, cstride);
  _tile_loadd(1, acc + 16, cstride);
  _tile_loadd(2, acc + 32, cstride);
  for (int64_t k = 0; k < K2; k += 16) {
    const uint16_t* wk = w + k * kNR * 2;
    _mm_prefetch(reinterpret_cast<const char*>(wk) + kAhead, _MM_HINT_T0);
    _tile_loadd(3, x + 2 * k, ldx * sizeof(uint16_t));
    _tile_loadd(4, wk, wstride);
    _tile_loadd(5, wk + 32, wstride);
    _tile_loadd(6, wk + 64, wstride);
    _tile_dpbf16ps(0, 3, 4);
    _tile_dpbf16ps(1, 3, 5);
    _tile_dpbf16ps(2, 3, 6);
  }
  _tile_stored(0, acc, cstride);
  _tile_stored(1, acc + 16, cstride);
  _tile_stored(2, acc + 32, cstride);
}

}  // namespace amx
}  // namespace pagedserve
#endif
