// AMX bf16 blocks for the skinny GEMM (skinny_gemm.cpp), on CPUs with AMX tiles (builds for such a CPU only).
//
// One block is out[0:16, 0:kPanel] = x[0:16, :] @ panel, the panel as pack_linear_weight lays it out for
// vdpbf16ps ([K / 2, kPanel, 2]): a B tile is 16 k-pair rows x 16 columns of it, read in place with a row
// stride of one k-pair row, so the same packed weight serves both kernels. The four C tiles (16 x 16 fp32
// each) hold the block; A is 16 rows x 32 k of x. At decode sizes a step is bound by the weights' stream
// from memory, and AMX's arithmetic (16 rows a tile instruction) keeps that bound up to 16 rows where the
// vdpbf16ps tiles (6 rows, 4 of them per panel at 16 rows) fall behind it.
#pragma once

#include "skinny_tile.h"

#if defined(PAGEDSERVE_SKINNY_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDSERVE_SKINNY_AMX 1

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

namespace pagedserve::skinny {

inline constexpr int64_t kAmxRows = 16;   // rows of x per block (an A tile's rows)
inline constexpr int64_t kAmxDepth = 32;  // k per tile product (an A tile row: 64 bytes of bf16)
inline constexpr int64_t kAmxCols = 16;   // output columns per C tile
// The weights one k step (4 KB of a panel) ahead go to L1 by hand: tile loads alone left the stream ~7%
// short of it at 8-16 rows (Qwen2-0.5B's GEMM 54-55 -> 50-52 ms a step; 8 KB ahead 52, 16 KB 53-54). Past
// a panel's end the next panel follows in memory; a prefetch past the weights' end is harmless.
inline constexpr int64_t kPrefetchK = kAmxDepth;
static_assert(kPanel == 4 * kAmxCols, "a panel is four C tiles wide");

// Linux hands a process the tile state only on request (arch_prctl, once; oneDNN may have asked already).
inline bool amx_usable() {
  static const bool usable = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

// The tile registers of one thread while it runs blocks: C in tiles 0-3, A in 4, B in 5-7, all 16 x 64 bytes.
class AmxTiles {
 public:
  AmxTiles() {
    alignas(64) uint8_t config[64] = {};
    config[0] = 1;  // palette 1
    for (int t = 0; t < 8; ++t) {
      config[16 + 2 * t] = 64;  // bytes per row
      config[48 + t] = 16;      // rows
    }
    // GCC 12 does not see ldtilecfg read the config: without this barrier it dropped the stores above (an
    // invalid config: SIGSEGV).
    asm volatile("" : : "r"(config) : "memory");
    _tile_loadconfig(config);
  }
  ~AmxTiles() { _tile_release(); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};

// out[0:16, 0:kPanel] (row stride kPanel) = x[0:16, 0:k_len] @ panel for 16 rows of x, ldx elements apart;
// the k beyond the last whole 32 go through the vdpbf16ps tile, for the first ``rows`` rows only.
inline void amx_block(const BFloat16* x, int64_t ldx, int64_t rows, const BFloat16* panel, int64_t k_len,
                      float* out) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t k_whole = k_len - k_len % kAmxDepth, b_stride = 2 * kPanel * sizeof(BFloat16);
  for (int64_t k = 0; k < k_whole; k += kAmxDepth) {
    const BFloat16* b = panel + k * kPanel;  // k-pair row k / 2
    for (int64_t line = 0; line < kAmxDepth * kPanel; line += 64 / sizeof(BFloat16))
      _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchK * kPanel + line), _MM_HINT_T0);
    _tile_loadd(4, x + k, ldx * sizeof(BFloat16));
    _tile_loadd(5, b, b_stride);
    _tile_loadd(6, b + 2 * kAmxCols, b_stride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(7, b + 4 * kAmxCols, b_stride);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 6 * kAmxCols, b_stride);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 4, 5);
  }
  const int64_t out_stride = kPanel * sizeof(float);
  _tile_stored(0, out, out_stride);
  _tile_stored(1, out + kAmxCols, out_stride);
  _tile_stored(2, out + 2 * kAmxCols, out_stride);
  _tile_stored(3, out + 3 * kAmxCols, out_stride);
  if (k_whole == k_len) return;
  float tail[kAmxRows * kPanel];
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t n = std::min(kRows, rows - r0);
    tile_rows<Bf16Step>(n, x + r0 * ldx + k_whole, ldx, panel + k_whole * kPanel, k_len - k_whole, tail + r0 * kPanel);
  }
  for (int64_t i = 0; i < rows * kPanel; i += kW) (Vec::loadu(out + i) + Vec::loadu(tail + i)).store(out + i);
}

}  // namespace pagedserve::skinny

#endif
