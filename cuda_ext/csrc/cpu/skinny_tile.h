// The skinny GEMM's register tiles (skinny_gemm.cpp, argmax_screen*.cpp): out[r, 0:kPanel] = sum_k x[r, k] *
// panel[k, 0:kPanel] for up to kRows rows, the panel packed by pack_linear_weight. One "step" struct per
// element type: fp32 (FMA), int8 weights widened to fp32 (FMA), bf16 (vdpbf16ps, AVX512-BF16 builds) and bytes
// (vpdpbusd).
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
#define PAGEDSERVE_SKINNY_BF16 1
#endif

namespace pagedserve::skinny {

using Vec = at::vec::Vectorized<float>;
using c10::BFloat16;
inline constexpr int64_t kW = Vec::size();
// Register budget: AVX-512 has 32 vector registers (6 x 4 accumulators + 4 weights + 1
// broadcast), AVX2 has 16 (4 x 2 + 2 + 1).
inline constexpr int64_t kPanelVecs = kW == 16 ? 4 : 2;
inline constexpr int64_t kPanel = kPanelVecs * kW;  // output columns per packed panel
inline constexpr int64_t kRows = kW == 16 ? 6 : 4;  // rows of x per register tile
inline constexpr int64_t kMinWorkPerThread = 1 << 20;  // multiply-adds (~12 us of fp32 AVX-512) worth a thread

// One element type's k step of the micro-kernel: the panel's kPanelVecs weight
// operands, x's broadcast operand and the multiply-add into an fp32 accumulator. T: x's element type, W: the
// panel's.
struct F32Step {
  using T = float;
  using W = float;
  static constexpr int64_t kTileRows = kRows;  // rows of x per register tile
  using Acc = Vec;
  using Operand = Vec;
  static constexpr int64_t kDepth = 1;  // k values per step
  static Acc zero() { return Vec(0.f); }
  static Acc load(const float* src) { return Vec::loadu(src); }
  static Operand weights(const W* panel, int64_t k, int64_t v) { return Vec::loadu(panel + k * kPanel + v * kW); }
  static Operand broadcast(const T* row, int64_t k) { return Vec(row[k]); }
  static Operand broadcast_last(const T* row, int64_t k) { return broadcast(row, k); }
  static Acc madd(Acc acc, Operand a, Operand w) { return at::vec::fmadd(a, w, acc); }
  static void store(float* out, Acc acc) { acc.store(out); }
};

// kW int8 weights widened to fp32 (exact).
inline Vec widen_int8(const int8_t* src) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
#else
  float wide[kW];
  for (int64_t i = 0; i < kW; ++i) wide[i] = src[i];
  return Vec::loadu(wide);
#endif
}

// int8 weights, fp32 x (skinny_linear_w8): the panel is [K, kPanel] int8, a quarter of the fp32 panel's bytes
// (the decode GEMM streams its weights from memory), widened in registers; the per-column scale multiplies
// the sums once, when they are stored.
struct W8Step : F32Step {
  using W = int8_t;
  static Operand weights(const W* panel, int64_t k, int64_t v) { return widen_int8(panel + k * kPanel + v * kW); }
};

#ifdef PAGEDSERVE_SKINNY_BF16
struct Bf16Step {
  using T = BFloat16;
  using W = BFloat16;
  static constexpr int64_t kTileRows = kRows;
  using Acc = __m512;
  using Operand = __m512bh;
  static constexpr int64_t kDepth = 2;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc load(const float* src) { return _mm512_loadu_ps(src); }
  static Operand weights(const W* panel, int64_t k, int64_t v) {
    return (__m512bh)_mm512_loadu_si512(panel + (k / 2 * kPanel + v * kW) * 2);
  }
  // x[r, k], x[r, k + 1] as one 32-bit lane: one load-and-broadcast (K is even in practice).
  static Operand broadcast(const T* row, int64_t k) {
    int32_t pair;
    std::memcpy(&pair, row + k, sizeof(pair));
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  // The last k of an odd K: the pair ends in zero.
  static Operand broadcast_last(const T* row, int64_t k) { return (__m512bh)_mm512_set1_epi32(row[k].x); }
  static Acc madd(Acc acc, Operand a, Operand w) { return _mm512_dpbf16_ps(acc, a, w); }
  static void store(float* out, Acc acc) { _mm512_storeu_ps(out, acc); }
};
#endif

#if defined(PAGEDSERVE_SKINNY_BF16) && defined(__AVX512VNNI__)
#define PAGEDSERVE_SKINNY_INT8 1
// bytes (vpdpbusd, AVX512-VNNI; the bf16 LM head's int8 screen, argmax_screen_int8.cpp): 4 k per 32-bit lane,
// x unsigned (broadcast), the panel signed; fp32 scratch holds the integer sums (rounded past 2^24, which the
// screen's bound allows for).
struct I8Step {
  using T = uint8_t;
  using W = T;  // the panel's signed bytes, as argmax_screen_int8.cpp stores them
  // 5 and 6-row tiles ran at half the speed per row of 4-row ones (Zen 5, 1-13 rows): the broadcasts spill.
  static constexpr int64_t kTileRows = 4;
  using Acc = __m512i;
  using Operand = __m512i;
  static constexpr int64_t kDepth = 4;
  static Acc zero() { return _mm512_setzero_si512(); }
  static Acc load(const float* src) { return _mm512_cvtps_epi32(_mm512_loadu_ps(src)); }
  static Operand weights(const W* panel, int64_t k, int64_t v) {
    return _mm512_loadu_si512(panel + (k / 4 * kPanel + v * kW) * 4);
  }
  static Operand broadcast(const T* row, int64_t k) {
    int32_t quad;
    std::memcpy(&quad, row + k, sizeof(quad));
    return _mm512_set1_epi32(quad);
  }
  static Operand broadcast_last(const T* row, int64_t k) { return broadcast(row, k); }  // rows are padded to 4
  static Acc madd(Acc acc, Operand a, Operand w) { return _mm512_dpbusd_epi32(acc, a, w); }
  static void store(float* out, Acc acc) { _mm512_storeu_ps(out, _mm512_cvtepi32_ps(acc)); }
};
#endif

// Bytes of a panel per k step.
template <typename S>
inline constexpr int64_t kDepthBytes = S::kDepth * kPanel * int64_t{sizeof(typename S::W)};

// Weights fetched by hand ahead of their use: ``lines`` cache lines per k step, from ``next`` on.
struct Prefetch {
  const char* next = nullptr;
  int64_t lines = 0;
};

// acc[r] += x[r, k:k + kDepth] * panel[k:k + kDepth, 0:kPanel] for R rows (kLast: the last k of an odd K).
template <typename S, int64_t R, bool kLast = false>
inline void k_step(typename S::Acc (&acc)[R][kPanelVecs], const typename S::T* x, int64_t ldx,
                   const typename S::W* panel, int64_t k, Prefetch& ahead) {
  for (int64_t i = 0; i < ahead.lines; ++i, ahead.next += 64) _mm_prefetch(ahead.next, _MM_HINT_T0);
  typename S::Operand w[kPanelVecs];
#pragma GCC unroll 4
  for (int64_t v = 0; v < kPanelVecs; ++v) w[v] = S::weights(panel, k, v);
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) {
    const typename S::Operand a = kLast ? S::broadcast_last(x + r * ldx, k) : S::broadcast(x + r * ldx, k);
#pragma GCC unroll 4
    for (int64_t v = 0; v < kPanelVecs; ++v) acc[r][v] = S::madd(acc[r][v], a, w[v]);
  }
}

// out[r, 0:kPanel] (+)= sum_k x[r, k] * panel[k, 0:kPanel] for R rows (out: [R, kPanel]; ``accumulate``: add
// to what out holds). ``ahead``: see Prefetch.
template <typename S, int64_t R>
void tile(const typename S::T* x, int64_t ldx, const typename S::W* panel, int64_t k_len, float* out,
          bool accumulate, Prefetch& ahead) {
  typename S::Acc acc[R][kPanelVecs];
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int64_t v = 0; v < kPanelVecs; ++v) acc[r][v] = accumulate ? S::load(out + r * kPanel + v * kW) : S::zero();
  const int64_t k_whole = k_len - k_len % S::kDepth;
  for (int64_t k = 0; k < k_whole; k += S::kDepth) k_step<S, R>(acc, x, ldx, panel, k, ahead);
  if (k_whole < k_len) k_step<S, R, true>(acc, x, ldx, panel, k_whole, ahead);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < kPanelVecs; ++v) S::store(out + r * kPanel + v * kW, acc[r][v]);
}

template <typename S>
void tile_rows(int64_t rows, const typename S::T* x, int64_t ldx, const typename S::W* panel, int64_t k_len,
               float* out) {
  Prefetch none;
  tile_rows<S>(rows, x, ldx, panel, k_len, out, false, none);
}

template <typename S>
void tile_rows(int64_t rows, const typename S::T* x, int64_t ldx, const typename S::W* panel, int64_t k_len,
               float* out, bool accumulate, Prefetch& ahead) {
  switch (rows) {
    case 1: return tile<S, 1>(x, ldx, panel, k_len, out, accumulate, ahead);
    case 2: return tile<S, 2>(x, ldx, panel, k_len, out, accumulate, ahead);
    case 3: return tile<S, 3>(x, ldx, panel, k_len, out, accumulate, ahead);
    case 4: return tile<S, 4>(x, ldx, panel, k_len, out, accumulate, ahead);
    case 5: return tile<S, 5>(x, ldx, panel, k_len, out, accumulate, ahead);
    default: return tile<S, S::kTileRows>(x, ldx, panel, k_len, out, accumulate, ahead);
  }
}

// Rows past one register tile share the panel chunk by chunk: the row blocks take turns on a chunk (the
// first reads it from memory, the others from L1) while each fetches its share of the next chunk by hand,
// so the weights stream on while every block computes. Whole-panel passes, one block after another, left
// memory idle in all but the first: Qwen2-0.5B's GEMM at 8-16 rows took 15% longer (Zen 5).
inline constexpr int64_t kChunkBytes = 8 << 10;
inline constexpr int64_t kGroupRows = 8 * kRows;  // rows sharing the chunks (their sums fill run_panel's scratch)

// tile_group of int8 panels past one register tile of rows: each chunk is widened to fp32 once, into L1, for
// the fp32 tiles of every row block (widening it in each block's tiles made 16 rows slower than fp32 weights).
inline void widened_group(int64_t rows, const float* x, int64_t ldx, const int8_t* panel, int64_t k_len,
                          float* out) {
  constexpr int64_t chunk = kChunkBytes / (kPanel * int64_t{sizeof(float)});
  alignas(64) float wide[chunk * kPanel];
  Prefetch none;
  for (int64_t k0 = 0; k0 < k_len; k0 += chunk) {
    const int64_t n = std::min(chunk, k_len - k0);
    for (int64_t k = 0; k < n; ++k)
      for (int64_t v = 0; v < kPanelVecs; ++v)
        W8Step::weights(panel + k0 * kPanel, k, v).store(wide + k * kPanel + v * kW);
    for (int64_t r0 = 0; r0 < rows; r0 += kRows)
      tile_rows<F32Step>(std::min(kRows, rows - r0), x + r0 * ldx + k0, ldx, wide, n, out + r0 * kPanel, k0 > 0,
                         none);
  }
}

// out[0:rows, 0:kPanel] = x[0:rows, 0:k_len] @ panel through the register tiles, rows <= kGroupRows.
template <typename S, typename T = typename S::T, typename W = typename S::W>
void tile_group(int64_t rows, const T* x, int64_t ldx, const W* panel, int64_t k_len, float* out) {
  if constexpr (std::is_same_v<S, W8Step>)
    if (rows > kRows) return widened_group(rows, x, ldx, panel, k_len, out);
  constexpr int64_t chunk = kChunkBytes / kDepthBytes<S> * S::kDepth, lines = kDepthBytes<S> / 64;
  constexpr int64_t height = S::kTileRows;
  const int64_t blocks = (rows + height - 1) / height;
  for (int64_t k0 = 0; k0 < k_len; k0 += chunk) {
    // Past a panel's end the thread's next panel follows in memory; a prefetch past the weights is harmless.
    Prefetch ahead{reinterpret_cast<const char*>(panel + k0 * kPanel) + kChunkBytes, (lines + blocks - 1) / blocks};
    for (int64_t r0 = 0; r0 < rows; r0 += height)
      tile_rows<S>(std::min(height, rows - r0), x + r0 * ldx + k0, ldx, panel + k0 * kPanel,
                   std::min(chunk, k_len - k0), out + r0 * kPanel, k0 > 0, ahead);
  }
}

}  // namespace pagedserve::skinny
