// The screened argmax of a bf16 LM head: its greedy tokens without its logits, exactly, streaming an int8
// copy of the weight (half the bf16 bytes) through vpdpbusd. Each column c gets a scale s_c = max|w_c| / 127
// and int8 values q_c; each row r of x a scale t_r = max|x_r| / 127 and int8 values (offset by 128, since
// vpdpbusd multiplies unsigned by signed bytes; sum_k q_ck is subtracted back). The estimate
// e = t_r s_c sum_k xq_k q_ck (+ bias) is within
//   W = |x - x^|_2 |w_c|_2 + |x^|_2 |w_c - w^_c|_2       (quantization; Cauchy-Schwarz)
//     + 2K 2^-24 |x|_2 |w_c|_2 + 8K 2^-126 (1 + |w_c|_2)  (the bf16 GEMM's fp32 sums, flushed denormals)
//     + t_r s_c 255 127 K 2^-19                          (fp32 rounding of the integer sums and estimate)
//     + 2^-22 (|e| + W)                                  (the bias adds), all rounded up,
// of the fp32 logit the bf16 GEMM computes, so the bf16 logit it rounds to lies in
// [bf16(e - W), bf16(e + W)] (rounding is monotone). A column whose upper end is below some column's lower
// end is not the argmax; the few left are recomputed with the bf16 GEMM's own tiles on their panels, so the
// answer is skinny_linear_argmax's bit for bit, first maximum on ties included. Not on AMX CPUs, whose bf16
// GEMM sums in another order.
#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "../ops.h"
#include "parallel.h"
#include "skinny_amx.h"
#include "skinny_tile.h"

namespace pagedserve {
namespace {

using namespace skinny;

#ifdef PAGEDSERVE_SKINNY_INT8
constexpr double kUp = 1 + 1e-6;  // rounds a bound computed in double up past its float rounding
constexpr double kHuge = 1e30;    // rows whose bound could overflow are left to the plain fused argmax

int64_t padded_k(int64_t k_len) { return (k_len + 3) / 4 * 4; }

// Bounds rows: s_c, |w_c|_2, |w_c - w^_c|_2, sum_k q_ck, the fp32 estimate's and the flush slack terms.
enum Bound { kScale, kNorm, kResidual, kColSum, kArith, kSlack, kBoundRows };

// max_k |v_k|, NaN when a v_k is (std::max would skip it).
float max_abs(const BFloat16* v, int64_t n) {
  float m = 0.f;
  for (int64_t k = 0; k < n; ++k) {
    const float a = std::fabs(float(v[k]));
    if (std::isnan(a)) return a;
    m = std::max(m, a);
  }
  return m;
}

// The int8 step of a vector whose largest magnitude is ``top`` (1 for an all-zero vector).
float int8_scale(float top) { return top > 0.f ? top / 127.f : 1.f; }

int to_int8(double v, float scale) { return static_cast<int>(std::clamp(std::nearbyint(v / scale), -127.0, 127.0)); }

// One column into the int8 panels ([panels, K4 / 4, kPanel, 4]) and its bounds.
void pack_column(const BFloat16* w, int64_t k_len, int64_t c, int8_t* screen, int64_t panel_numel, float* bounds,
                 int64_t n) {
  const float scale = int8_scale(max_abs(w, k_len));
  int8_t* out = screen + c / kPanel * panel_numel + c % kPanel * 4;
  double norm = 0, residual = 0;
  int64_t sum = 0;
  for (int64_t k = 0; k < k_len; ++k) {
    const double v = float(w[k]);
    const int q = to_int8(v, scale);
    out[k / 4 * kPanel * 4 + k % 4] = static_cast<int8_t>(q);
    norm += v * v, residual += (v - double(scale) * q) * (v - double(scale) * q), sum += q;
  }
  bounds[kScale * n + c] = scale;
  bounds[kNorm * n + c] = static_cast<float>(std::sqrt(norm) * kUp);
  bounds[kResidual * n + c] = static_cast<float>(std::sqrt(residual) * kUp);
  bounds[kColSum * n + c] = static_cast<float>(sum);  // |sum| <= 127 K: exact
  bounds[kArith * n + c] = static_cast<float>(double(scale) * 255 * 127 * k_len * 0x1p-19 * kUp);
  bounds[kSlack * n + c] = static_cast<float>(8.0 * k_len * 0x1p-126 * (1 + std::sqrt(norm)) * kUp);
}

// One row of x: its bytes (offset by 128, zero-padded to K4) and the terms of its bound.
struct RowTerms {
  float scale, quant_err, quant_norm, norm;  // t_r, |x - x^|_2, |x^|_2, |x|_2 (rounded up)
};

std::optional<RowTerms> quantize_row(const BFloat16* x, int64_t k_len, uint8_t* out) {
  const float top = max_abs(x, k_len);
  if (!std::isfinite(top) || top > 1e18f) return std::nullopt;  // NaN, inf, or norms past float range
  const float scale = int8_scale(top);
  double err = 0, qnorm = 0, norm = 0;
  for (int64_t k = 0; k < k_len; ++k) {
    const double v = float(x[k]);
    const int q = to_int8(v, scale);
    out[k] = static_cast<uint8_t>(q + 128);
    const double xh = double(scale) * q;
    err += (v - xh) * (v - xh), qnorm += xh * xh, norm += v * v;
  }
  std::fill(out + k_len, out + padded_k(k_len), uint8_t{128});
  return RowTerms{scale, float(std::sqrt(err) * kUp), float(std::sqrt(qnorm) * kUp), float(std::sqrt(norm) * kUp)};
}

__m512 round_bf16(__m512 v) {  // to the nearest bf16 (ties to even), widened back
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

struct Screen {
  const uint8_t* xq;  // [m, K4]
  const int8_t* panels;
  const float *bounds, *bias;  // bias: or nullptr
  const std::vector<RowTerms>& rows;
  int64_t m, k4, k_len, n, panel_numel;
};

// One thread's screen of its panels, per row: the running floor (the largest lower end so far) and the
// columns whose upper end reached it then, in column order (the final floor rules out most of them).
struct Kept {
  std::vector<float> floor;
  std::vector<std::vector<std::pair<float, int64_t>>> columns;  // (upper end, column)
  explicit Kept(int64_t rows) : floor(rows, -std::numeric_limits<float>::infinity()), columns(rows) {}
};

// Panels [begin, end) for every row.
Kept screen_panels(const Screen& s, int64_t begin, int64_t end) {
  Kept kept(s.m);
  float dots[kGroupRows * kPanel], upper[kPanel];
  const float gamma = static_cast<float>(2.0 * s.k_len * 0x1p-24 * kUp);
  for (int64_t p = begin; p < end; ++p) {
    const uint8_t* panel = reinterpret_cast<const uint8_t*>(s.panels + p * s.panel_numel);
    for (int64_t r0 = 0; r0 < s.m; r0 += kGroupRows) {
      const int64_t rows = std::min(kGroupRows, s.m - r0);
      tile_group<I8Step>(rows, s.xq + r0 * s.k4, s.k4, panel, s.k4, dots);
      for (int64_t r = 0; r < rows; ++r) {
        const RowTerms& t = s.rows[r0 + r];
        __m512 low = _mm512_set1_ps(kept.floor[r0 + r]);
        for (int64_t v = 0; v < kPanelVecs; ++v) {
          const int64_t c0 = p * kPanel + v * kW;
          const __mmask16 live = c0 >= s.n ? 0 : static_cast<__mmask16>((1u << std::min<int64_t>(kW, s.n - c0)) - 1);
          auto col = [&](Bound b) { return _mm512_maskz_loadu_ps(live, s.bounds + b * s.n + c0); };
          const __m512 ints = _mm512_sub_ps(_mm512_loadu_ps(dots + r * kPanel + v * kW),
                                            _mm512_mul_ps(_mm512_set1_ps(128.f), col(kColSum)));
          __m512 est = _mm512_mul_ps(ints, _mm512_mul_ps(_mm512_set1_ps(t.scale), col(kScale)));
          if (s.bias != nullptr) est = _mm512_add_ps(est, _mm512_maskz_loadu_ps(live, s.bias + c0));
          __m512 w = _mm512_fmadd_ps(_mm512_set1_ps(t.quant_err + gamma * t.norm), col(kNorm), col(kSlack));
          w = _mm512_fmadd_ps(_mm512_set1_ps(t.quant_norm), col(kResidual), w);
          w = _mm512_fmadd_ps(_mm512_set1_ps(t.scale), col(kArith), w);
          w = _mm512_fmadd_ps(_mm512_add_ps(_mm512_abs_ps(est), w), _mm512_set1_ps(0x1p-21f), w);
          low = _mm512_mask_max_ps(low, live, low, round_bf16(_mm512_sub_ps(est, w)));
          _mm512_storeu_ps(upper + v * kW,
                           _mm512_mask_blend_ps(live, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                                round_bf16(_mm512_add_ps(est, w))));
        }
        const float floor = kept.floor[r0 + r] = _mm512_reduce_max_ps(low);
        // A column below the running floor is below the final one too; most are, so the test is vectorized.
        for (int64_t v = 0; v < kPanelVecs; ++v)
          for (__mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(upper + v * kW), _mm512_set1_ps(floor), _CMP_GE_OQ);
               m; m &= m - 1) {
            const int64_t lane = v * kW + __builtin_ctz(m);
            kept.columns[r0 + r].push_back({upper[lane], p * kPanel + lane});
          }
      }
    }
  }
  return kept;
}

// Row r's argmax among the columns whose upper end reaches the final floor: their panels through the bf16
// GEMM's own tile (the same sums, in the same order), bias added, rounded to bf16; the first maximum.
int64_t best_survivor(const std::vector<Kept>& screens, int64_t r, const BFloat16* x, const BFloat16* packed,
                      int64_t panel_numel, int64_t k_len, const float* bias) {
  float floor = -std::numeric_limits<float>::infinity();
  for (const Kept& k : screens) floor = std::max(floor, k.floor[r]);
  std::pair<float, int64_t> best{0.f, -1};
  float logits[kPanel];
  int64_t computed = -1;
  for (const Kept& k : screens)  // in panel order, each in column order
    for (const auto& [upper, c] : k.columns[r]) {
      if (upper < floor) continue;
      if (c / kPanel != computed) {
        computed = c / kPanel;
        tile_rows<Bf16Step>(1, x, k_len, packed + computed * panel_numel, k_len, logits);
      }
      const float v = static_cast<float>(BFloat16(logits[c % kPanel] + (bias == nullptr ? 0.f : bias[c])));
      if (best.second < 0 || v > best.first) best = {v, c};
    }
  return best.second;
}

std::optional<at::Tensor> screened_argmax(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& screen,
                                          const at::Tensor& bounds, const float* bias) {
  const int64_t m = x.size(0), k_len = x.size(1), n = bounds.size(1), k4 = padded_k(k_len);
  const int64_t panels = screen.size(0);
  const float* norms = bounds.data_ptr<float>() + kNorm * n;
  const double w_max = *std::max_element(norms, norms + n);
  std::vector<uint8_t> xq(m * k4);
  std::vector<RowTerms> rows;
  for (int64_t r = 0; r < m; ++r) {
    auto t = quantize_row(x.data_ptr<BFloat16>() + r * k_len, k_len, xq.data() + r * k4);
    if (!t || double(t->norm) * w_max > kHuge) return std::nullopt;
    rows.push_back(*t);
  }
  Screen s{xq.data(), screen.data_ptr<int8_t>(), bounds.data_ptr<float>(), bias, rows, m, k4, k_len,
           n, screen.size(1) * screen.size(2)};
  std::vector<std::optional<Kept>> chunks(panels);
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(m * s.panel_numel, 1));
  parallel_for(0, panels, grain,
               [&](int64_t begin, int64_t end) { chunks[begin].emplace(screen_panels(s, begin, end)); });
  std::vector<Kept> screens;
  for (auto& chunk : chunks)
    if (chunk) screens.push_back(std::move(*chunk));
  at::Tensor idx = at::empty({m}, x.options().dtype(at::kLong));
  const int64_t bf16_panel_numel = packed.size(1) * packed.size(2);
  for (int64_t r = 0; r < m; ++r)
    idx.data_ptr<int64_t>()[r] = best_survivor(screens, r, x.data_ptr<BFloat16>() + r * k_len,
                                               packed.data_ptr<BFloat16>(), bf16_panel_numel, k_len, bias);
  return idx;
}
#endif

}  // namespace

bool argmax_screen_int8_supports_cpu() {
#ifdef PAGEDSERVE_SKINNY_INT8
#ifdef PAGEDSERVE_SKINNY_AMX
  return !amx_usable();
#else
  return true;
#endif
#else
  return false;
#endif
}

std::tuple<at::Tensor, at::Tensor> pack_argmax_screen_int8_cpu(const at::Tensor& weight) {
#ifdef PAGEDSERVE_SKINNY_INT8
  const int64_t n = weight.size(0), k_len = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor screen = at::zeros({panels, padded_k(k_len) / 4, kPanel * 4}, weight.options().dtype(at::kChar));
  at::Tensor bounds = at::empty({kBoundRows, n}, weight.options().dtype(at::kFloat));
  const int64_t panel_numel = screen.size(1) * screen.size(2);
  parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      pack_column(weight.data_ptr<BFloat16>() + c * k_len, k_len, c, screen.data_ptr<int8_t>(), panel_numel,
                  bounds.data_ptr<float>(), n);
  });
  return {screen, bounds};
#else
  TORCH_CHECK(false, "pack_argmax_screen: bf16 needs a build for an AVX512-BF16 + VNNI CPU");
#endif
}

std::optional<at::Tensor> skinny_argmax_screened_int8_cpu(const at::Tensor& x, const at::Tensor& packed,
                                                          const at::Tensor& screen, const at::Tensor& bounds,
                                                          const float* bias) {
#ifdef PAGEDSERVE_SKINNY_INT8
  if (!argmax_screen_int8_supports_cpu()) return std::nullopt;
  return screened_argmax(x, packed, screen, bounds, bias);
#else
  return std::nullopt;
#endif
}

}  // namespace pagedserve
