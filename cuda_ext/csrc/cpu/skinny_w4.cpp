// CPU skinny GEMM for 4-bit weights (engine/int4.py's form): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), with
// W[n, k] = (code[n, k] - zero[n, g]) * scale[n, g] over groups g of G input columns, M small (decode).
//
// Batch-1 decode streams the weights from memory, so the panel holds half a byte per weight: per panel of
// kP = 64 output columns, per 4 input columns k..k+3 ("quad"), 128 bytes: column c's byte 2c + t holds
// code[k + t] in its low nibble and code[k + 2 + t] in its high one (t = 0, 1). One 256-bit load widened to 32
// 16-bit lanes, masked and shifted, gives two vectors whose 32-bit lanes are column c's code pairs (k, k + 1)
// and (k + 2, k + 3); a 16-entry table lookup (vpermw) turns each code into its bf16 value, exact. Then
//  - bf16 x (AVX512-BF16): vdpbf16ps multiplies the broadcast pair x[k], x[k + 1] by the pair and adds both
//    products to an fp32 accumulator (exact products: 8-bit by 4-bit significands);
//  - fp32 x: the pair split into two fp32 vectors (shift / mask), two FMAs.
// The dequantization is fused per group: the group's sums of x * code are scaled once per column and the
// zero's share, zero * scale * sum_k x[k], taken off (the sums of x per row and group are computed first).
// Threads split the panels, as skinny_gemm.cpp does.
#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../ops.h"
#include "parallel.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDSERVE_SKINNY_W4 1
#endif

namespace pagedserve {

bool skinny_linear_w4_supports_cpu() {
#ifdef PAGEDSERVE_SKINNY_W4
  return true;
#else
  return false;
#endif
}

namespace {

constexpr int64_t kP = 64;          // output columns per panel
constexpr int64_t kQuadBytes = kP * 2;  // a panel's bytes per 4 input columns
constexpr int64_t kMaxRows = 4;      // rows of x per register tile
// Packed bytes (times rows) a chunk of panels should hold: small enough that at one row both threads get chunks
// before the first finishes (the packed layer reads 4x fewer bytes per multiply-add than bf16, so a grain sized
// in multiply-adds, as skinny_gemm.cpp's, left a 4.4 MB gate_up projection to one thread).
constexpr int64_t kMinChunkBytes = 1 << 16;

void check_w4(const at::Tensor& codes, int64_t groups) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "pack_linear_weight_w4: codes must be uint8 "
              "[out, in], got ", codes.scalar_type(), " ", codes.sizes());
  TORCH_CHECK(groups > 0 && codes.size(1) % groups == 0 && (codes.size(1) / groups) % 4 == 0,
              "pack_linear_weight_w4: ", groups, " groups must split ", codes.size(1), " input columns into runs of "
              "a multiple of 4");
}

}  // namespace

// (packed uint8 [panels, K / 4, 128], scale fp32 [panels, groups, 64], zero * scale fp32 [panels, groups, 64]);
// zero None: symmetric (8). Padding columns get scale 0.
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_linear_weight_w4_cpu(const at::Tensor& codes_in,
                                                                         const at::Tensor& scale_in,
                                                                         const c10::optional<at::Tensor>& zero_in) {
  const int64_t n = codes_in.size(0), k = codes_in.size(1), groups = scale_in.size(1);
  check_w4(codes_in, groups);
  TORCH_CHECK(scale_in.dim() == 2 && scale_in.size(0) == n, "pack_linear_weight_w4: scale must be [out, groups]");
  const at::Tensor codes = codes_in.contiguous(), scale = scale_in.to(at::kFloat).contiguous();
  const at::Tensor zero = zero_in.has_value() && zero_in->defined() ? zero_in->to(at::kFloat).contiguous()
                                                                    : at::full({n, groups}, 8.f, scale.options());
  const int64_t panels = (n + kP - 1) / kP;
  at::Tensor packed = at::zeros({panels, k / 4, kQuadBytes}, codes.options());
  at::Tensor scales = at::zeros({panels, groups, kP}, scale.options()), offsets = at::zeros_like(scales);
  const uint8_t* src = codes.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  for (int64_t col = 0; col < n; ++col) {
    const int64_t p = col / kP, c = col % kP;
    for (int64_t q = 0; q < k / 4; ++q)
      for (int64_t t = 0; t < 2; ++t) {
        const uint8_t* in = src + col * k + 4 * q + t;
        dst[(p * (k / 4) + q) * kQuadBytes + 2 * c + t] = static_cast<uint8_t>((in[0] & 0xF) | (in[2] & 0xF) << 4);
      }
    for (int64_t g = 0; g < groups; ++g) {
      const float s = scale.data_ptr<float>()[col * groups + g];
      scales.data_ptr<float>()[(p * groups + g) * kP + c] = s;
      offsets.data_ptr<float>()[(p * groups + g) * kP + c] = s * zero.data_ptr<float>()[col * groups + g];
    }
  }
  return {packed, scales, offsets};
}

#ifdef PAGEDSERVE_SKINNY_W4
namespace {

using c10::BFloat16;

// Code n -> bf16(n), in vpermw's 32-lane table (lanes 16..31 unused).
inline __m512i code_table() {
  alignas(64) uint16_t lanes[32] = {};
  for (int n = 0; n < 16; ++n) lanes[n] = c10::BFloat16(static_cast<float>(n)).x;
  return _mm512_load_si512(lanes);
}

// 16 columns' codes of one quad: the bf16 pairs (k, k + 1) and (k + 2, k + 3).
inline void expand(const uint8_t* src, __m512i table, __m512i& lo, __m512i& hi) {
  const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  lo = _mm512_permutexvar_epi16(_mm512_and_si512(words, _mm512_set1_epi16(0xF)), table);
  hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
}

#if defined(__AVX512BF16__)
struct Bf16Rows {
  using T = BFloat16;
  static __m512i pair(const T* row, int64_t k) {
    int32_t p;
    std::memcpy(&p, row + k, sizeof(p));
    return _mm512_set1_epi32(p);
  }
  static __m512 madd(__m512 acc, const T* row, int64_t k, __m512i lo, __m512i hi) {
    acc = _mm512_dpbf16_ps(acc, (__m512bh)pair(row, k), (__m512bh)lo);
    return _mm512_dpbf16_ps(acc, (__m512bh)pair(row, k + 2), (__m512bh)hi);
  }
};
#endif

struct F32Rows {
  using T = float;
  static __m512 madd(__m512 acc, const T* row, int64_t k, __m512i lo, __m512i hi) {
    const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    acc = _mm512_fmadd_ps(_mm512_set1_ps(row[k]), _mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)), acc);
    acc = _mm512_fmadd_ps(_mm512_set1_ps(row[k + 1]), _mm512_castsi512_ps(_mm512_and_si512(lo, high)), acc);
    acc = _mm512_fmadd_ps(_mm512_set1_ps(row[k + 2]), _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)), acc);
    return _mm512_fmadd_ps(_mm512_set1_ps(row[k + 3]), _mm512_castsi512_ps(_mm512_and_si512(hi, high)), acc);
  }
};

// out[r, 0:64] = sum over groups of scale * (x[r] . codes) - zero * scale * xsum[r, g], for R rows of x.
template <typename S, int64_t R>
void panel_rows(const typename S::T* x, int64_t ldx, const float* xsum, int64_t groups, const uint8_t* panel,
                const float* scale, const float* offset, int64_t group_len, float (*out)[kP]) {
  const __m512i table = code_table();
  __m512 total[R][4];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < 4; ++v) total[r][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[R][4];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t k = g * group_len; k < (g + 1) * group_len; k += 4) {
      const uint8_t* quad = panel + k / 4 * kQuadBytes;
      _mm_prefetch(reinterpret_cast<const char*>(quad + 8 * kQuadBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(quad + 8 * kQuadBytes + 64), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int64_t v = 0; v < 4; ++v) {
        __m512i lo, hi;
        expand(quad + v * 32, table, lo, hi);
#pragma GCC unroll 4
        for (int64_t r = 0; r < R; ++r) acc[r][v] = S::madd(acc[r][v], x + r * ldx, k, lo, hi);
      }
    }
    for (int64_t v = 0; v < 4; ++v) {
      const __m512 s = _mm512_loadu_ps(scale + g * kP + v * 16), o = _mm512_loadu_ps(offset + g * kP + v * 16);
      for (int64_t r = 0; r < R; ++r)
        total[r][v] = _mm512_fnmadd_ps(o, _mm512_set1_ps(xsum[r * groups + g]), _mm512_fmadd_ps(s, acc[r][v], total[r][v]));
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < 4; ++v) _mm512_storeu_ps(out[r] + v * 16, total[r][v]);
}

template <typename S>
void rows_tile(int64_t rows, const typename S::T* x, int64_t ldx, const float* xsum, int64_t groups,
               const uint8_t* panel, const float* scale, const float* offset, int64_t group_len, float (*out)[kP]) {
  switch (rows) {
    case 1: return panel_rows<S, 1>(x, ldx, xsum, groups, panel, scale, offset, group_len, out);
    case 2: return panel_rows<S, 2>(x, ldx, xsum, groups, panel, scale, offset, group_len, out);
    case 3: return panel_rows<S, 3>(x, ldx, xsum, groups, panel, scale, offset, group_len, out);
    default: return panel_rows<S, 4>(x, ldx, xsum, groups, panel, scale, offset, group_len, out);
  }
}

// Each row's sum over each group of its x values (fp32), [rows, groups].
template <typename T>
std::vector<float> group_sums(const T* x, int64_t rows, int64_t ldx, int64_t groups, int64_t group_len) {
  std::vector<float> sums(rows * groups, 0.f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < groups * group_len; ++k) sums[r * groups + k / group_len] += static_cast<float>(x[r * ldx + k]);
  return sums;
}

template <typename S, typename O>
void run_w4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& offsets,
            const float* bias, at::Tensor& y) {
  using T = typename S::T;
  const int64_t m = x.size(0), k = x.size(1), groups = scales.size(1), group_len = k / groups;
  const int64_t panels = packed.size(0), n = y.size(1), ldx = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const std::vector<float> xsum = group_sums(xp, m, ldx, groups, group_len);
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  const int64_t grain = std::max<int64_t>(1, kMinChunkBytes / std::max<int64_t>(m * (k / 4) * kQuadBytes, 1));
  parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    float out[kMaxRows][kP];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t col0 = p * kP, cols = std::min(kP, n - col0);
      for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
        const int64_t rows = std::min(kMaxRows, m - r0);
        rows_tile<S>(rows, xp + r0 * ldx, ldx, xsum.data() + r0 * groups, groups, pk + p * (k / 4) * kQuadBytes,
                     scales.data_ptr<float>() + p * groups * kP, offsets.data_ptr<float>() + p * groups * kP,
                     group_len, out);
        for (int64_t r = 0; r < rows; ++r) {
          if (bias != nullptr) at::vec::map2([](auto a, auto b) { return a + b; }, out[r], out[r], bias + col0, cols);
          at::vec::convert(out[r], y.data_ptr<O>() + (r0 + r) * y.stride(0) + col0, cols);
        }
      }
    }
  });
}

}  // namespace
#endif

// y = x @ W.T + bias for the 4-bit layer packed by pack_linear_weight_w4; x fp32 or bf16 (bf16 needs
// AVX512-BF16), y in x's dtype; bias in x's dtype.
at::Tensor skinny_linear_w4_cpu(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales,
                                const at::Tensor& offsets, const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(skinny_linear_w4_supports_cpu(), "skinny_linear_w4: this build has no AVX-512 (skinny_linear_w4_supports)");
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "skinny_linear_w4: x must be fp32 or bf16 [rows, in], got ", x_in.scalar_type(), " ", x_in.sizes());
  const int64_t panels = (out_features + kP - 1) / kP;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(0) == panels &&
                  packed.size(1) * 4 == x_in.size(1) && packed.size(2) == kQuadBytes && packed.is_contiguous(),
              "skinny_linear_w4: packed weight ", packed.sizes(), " does not fit x ", x_in.sizes(), " and out_features ",
              out_features, " (pack_linear_weight_w4)");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == panels && scales.size(2) == kP && offsets.sizes() == scales.sizes()
                  && scales.scalar_type() == at::kFloat && offsets.scalar_type() == at::kFloat,
              "skinny_linear_w4: scales and offsets must be fp32 [", panels, ", groups, ", kP, "]");
  at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) bias_f = bias->to(at::kFloat).contiguous();
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
#ifdef PAGEDSERVE_SKINNY_W4
  if (x.scalar_type() == at::kFloat) {
    run_w4<F32Rows, float>(x, packed, scales, offsets, b, y);
  } else {
#if defined(__AVX512BF16__)
    run_w4<Bf16Rows, BFloat16>(x, packed, scales, offsets, b, y);
#else
    at::Tensor wide = x.to(at::kFloat), y32 = at::empty({x.size(0), out_features}, wide.options());
    run_w4<F32Rows, float>(wide, packed, scales, offsets, b, y32);
    y.copy_(y32);
#endif
  }
#endif
  return y;
}

}  // namespace pagedserve
