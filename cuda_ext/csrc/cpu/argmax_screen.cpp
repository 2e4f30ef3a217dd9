// The screened argmax: an fp32 LM head's greedy tokens without its logits, exactly, at the cost of a bf16
// GEMM (vdpbf16ps: about half the fp32 one's here). The bf16 pass estimates every logit; a proven bound on
// each estimate's distance to the fp32 logit,
//   B = x_width |w_c|_2 + slack_c,  x_width = 2 (2^-7 + 2^-16 + 2K 2^-24) |x|_2,
//   slack_c = 8K 2^-126 (1 + |w_c|_2) + 2^-20 |bias_c|
// (bf16 rounding of x and w: 2^-8 relative each; fp32 accumulation in either pass: K 2^-24; flushed
// denormals; the bias add; Cauchy-Schwarz bounds sum |x_k w_k| by the norms; a factor 2 to spare), rules
// out every column whose upper bound e + B is below another's lower bound e' - B'. The few left are
// recomputed with the fp32 GEMM's own fma chain, so the answer is skinny_linear_argmax's, bit for bit,
// first maximum on ties included.
#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "../ops.h"
#include "parallel.h"
#include "skinny_tile.h"

namespace pagedserve {
namespace {

using namespace skinny;

#ifdef PAGEDSERVE_SKINNY_BF16
struct Screened {
  float upper;
  int64_t column;
};

// Per row: the running floor (the largest lower bound so far) and the columns whose upper bound reached it.
class RowScreen {
 public:
  explicit RowScreen(int64_t rows) : floor_(rows, -std::numeric_limits<float>::infinity()), kept_(rows) {}

  // Row r's estimates +- their half-widths at columns [col0, col0 + cols), cols <= kPanel.
  void update(int64_t r, const float* estimate, const float* width, int64_t col0, int64_t cols) {
    float upper[kPanel];
    __m512 low = _mm512_set1_ps(floor_[r]);
    int64_t c = 0;
    for (; c + kW <= cols; c += kW) {
      const __m512 e = _mm512_loadu_ps(estimate + c), w = _mm512_loadu_ps(width + c);
      low = _mm512_max_ps(low, _mm512_sub_ps(e, w));
      _mm512_storeu_ps(upper + c, _mm512_add_ps(e, w));
    }
    float floor = _mm512_reduce_max_ps(low);
    for (; c < cols; ++c) floor = std::max(floor, estimate[c] - width[c]), upper[c] = estimate[c] + width[c];
    floor_[r] = floor;
    // A column below the running floor is below the final one too; most are, so the test is vectorized.
    const __m512 bar = _mm512_set1_ps(floor);
    for (int64_t c0 = 0; c0 < cols; c0 += kW) {
      const int64_t n = std::min(kW, cols - c0);
      auto mask = _mm512_mask_cmp_ps_mask(static_cast<__mmask16>((1u << n) - 1), _mm512_loadu_ps(upper + c0), bar,
                                          _CMP_GE_OQ);
      for (; mask; mask &= mask - 1) {
        const int64_t col = c0 + __builtin_ctz(mask);
        kept_[r].push_back({upper[col], col0 + col});
      }
    }
  }

  float floor(int64_t r) const { return floor_[r]; }
  const std::vector<Screened>& kept(int64_t r) const { return kept_[r]; }

 private:
  std::vector<float> floor_;
  std::vector<std::vector<Screened>> kept_;
};

// One call's inputs: x in bf16 for the pass, the packed bf16 weight, the bound's terms.
struct Pass {
  const BFloat16* x;  // [m, k_len]
  const BFloat16* packed;  // pack_linear_weight's panels
  int64_t panel_numel, k_len, m, out_features;
  const float *norms, *slack, *bias;  // per column (bias: or nullptr)
  std::vector<float> x_width;  // per row
};

// Panels [begin, end) for every row: the bf16 tiles, plus the bias, are the estimates; B their half-widths.
void screen_panels(const Pass& in, int64_t begin, int64_t end, RowScreen& screen) {
  float sums[kRows * kPanel], width[kPanel];
  for (int64_t p = begin; p < end; ++p) {
    const int64_t col0 = p * kPanel, cols = std::min(kPanel, in.out_features - col0);
    for (int64_t r0 = 0; r0 < in.m; r0 += kRows) {
      const int64_t rows = std::min(kRows, in.m - r0);
      tile_rows<Bf16Step>(rows, in.x + r0 * in.k_len, in.k_len, in.packed + p * in.panel_numel, in.k_len, sums);
      for (int64_t r = 0; r < rows; ++r) {
        float* estimate = sums + r * kPanel;
        if (in.bias != nullptr)
          at::vec::map2([](Vec a, Vec b) { return a + b; }, estimate, estimate, in.bias + col0, cols);
        const Vec xw(in.x_width[r0 + r]);
        at::vec::map2([xw](Vec n, Vec s) { return at::vec::fmadd(xw, n, s); }, width, in.norms + col0,
                      in.slack + col0, cols);
        screen.update(r0 + r, estimate, width, col0, cols);
      }
    }
  }
}

// Every thread's screens of its panels.
std::vector<RowScreen> screen_all(const Pass& in, int64_t panels) {
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(in.m * in.panel_numel, 1));
  std::vector<std::optional<RowScreen>> chunks(panels);
  parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    screen_panels(in, begin, end, chunks[begin].emplace(in.m));
  });
  std::vector<RowScreen> screens;
  for (auto& chunk : chunks)
    if (chunk) screens.push_back(std::move(*chunk));
  return screens;
}

// The fp32 GEMM's logit of one column: its fma chain (one lane, from k = 0), then the bias.
float exact_logit(const float* x, const float* w, const float* bias, int64_t k_len, int64_t column) {
  float acc = 0.f;
  for (int64_t k = 0; k < k_len; ++k) acc = std::fma(x[k], w[k], acc);
  return bias == nullptr ? acc : acc + bias[column];
}

// Row r's argmax among the columns that reach the final floor: their exact logits, the first maximum.
int64_t best_survivor(const std::vector<RowScreen>& screens, int64_t r, const float* x, const float* weight,
                      const float* bias, int64_t k_len) {
  float floor = -std::numeric_limits<float>::infinity();
  for (const auto& s : screens) floor = std::max(floor, s.floor(r));
  std::pair<float, int64_t> best{0.f, -1};
  for (const auto& s : screens)
    for (const Screened& c : s.kept(r)) {
      if (c.upper < floor) continue;
      const float a = exact_logit(x, weight + c.column * k_len, bias, k_len, c.column);
      if (best.second < 0 || a > best.first || (a == best.first && c.column < best.second)) best = {a, c.column};
    }
  return best.second;
}

// Rows whose bound could overflow (non-finite or huge values) are left to the plain argmax.
constexpr double kHuge = 1e30;

// |v|_2 in double, rounded up by a relative 1e-6 so that rounding never shrinks a bound built on it.
double norm_up(const float* v, int64_t n) {
  double sq = 0;
  for (int64_t k = 0; k < n; ++k) sq += double(v[k]) * v[k];
  return std::sqrt(sq) * (1 + 1e-6);
}

std::optional<at::Tensor> screened_argmax(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& screen,
                                          const at::Tensor& bounds, const float* bias) {
  const int64_t m = x.size(0), k_len = x.size(1), n = weight.size(0);
  const float *xp = x.data_ptr<float>(), *norms = bounds.data_ptr<float>();
  const double rel = 2.0 * (0x1p-7 + 0x1p-16 + 2.0 * k_len * 0x1p-24), w_max = *std::max_element(norms, norms + n);
  const at::Tensor xb = x.to(at::kBFloat16);
  Pass in{xb.data_ptr<BFloat16>(), screen.data_ptr<BFloat16>(), screen.size(1) * screen.size(2), k_len, m, n,
          norms, norms + n, bias, std::vector<float>(m)};
  for (int64_t r = 0; r < m; ++r) {
    const double width = rel * norm_up(xp + r * k_len, k_len);
    if (!std::isfinite(width) || width * w_max > kHuge) return std::nullopt;
    in.x_width[r] = static_cast<float>(width);
  }
  const auto screens = screen_all(in, screen.size(0));
  at::Tensor idx = at::empty({m}, x.options().dtype(at::kLong));
  for (int64_t r = 0; r < m; ++r)
    idx.data_ptr<int64_t>()[r] = best_survivor(screens, r, xp + r * k_len, weight.data_ptr<float>(), bias, k_len);
  return idx;
}

// bf16 panels (pack_linear_weight of the bf16 weight) and the bounds rows (|w|_2 rounded up, slack).
std::tuple<at::Tensor, at::Tensor> pack_bf16(const at::Tensor& weight, const float* bias) {
  const int64_t n = weight.size(0), k_len = weight.size(1);
  at::Tensor bounds = at::empty({2, n}, weight.options());
  float *norms = bounds.data_ptr<float>(), *slack = norms + n;
  const float* wp = weight.data_ptr<float>();
  for (int64_t c = 0; c < n; ++c) {
    const double norm = norm_up(wp + c * k_len, k_len);
    const double b = bias == nullptr ? 0.0 : std::fabs(double(bias[c]));
    norms[c] = static_cast<float>(norm);
    slack[c] = static_cast<float>((8.0 * k_len * 0x1p-126 * (1 + norm) + std::ldexp(b, -20)) * (1 + 1e-6));
  }
  return {pack_linear_weight_cpu(weight.to(at::kBFloat16)), bounds};
}
#endif

void check_bias(const c10::optional<at::Tensor>& bias, const at::Tensor& weight) {
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous() &&
                    bias->scalar_type() == weight.scalar_type(),
                "argmax screen: bias must be contiguous ", weight.scalar_type(), " [", weight.size(0), "]");
}

}  // namespace

bool argmax_screen_supports_cpu(at::ScalarType dtype) {
  if (dtype == at::kBFloat16) return argmax_screen_int8_supports_cpu();  // argmax_screen_int8.cpp
#ifdef PAGEDSERVE_SKINNY_BF16
  return dtype == at::kFloat;
#else
  return false;
#endif
}

std::tuple<at::Tensor, at::Tensor> pack_argmax_screen_cpu(const at::Tensor& weight,
                                                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && argmax_screen_supports_cpu(weight.scalar_type()),
              "pack_argmax_screen: an fp32 (AVX512-BF16 builds) or bf16 (AVX512-BF16 + VNNI, no AMX) "
              "[out_features, in_features] weight, got ", weight.scalar_type(), " ", weight.sizes());
  check_bias(bias, weight);
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(at::isfinite(weight).all().item<bool>() && (!has_bias || at::isfinite(*bias).all().item<bool>()),
              "pack_argmax_screen: the weight and bias must be finite");
  if (weight.scalar_type() == at::kBFloat16) return pack_argmax_screen_int8_cpu(weight.contiguous());
#ifdef PAGEDSERVE_SKINNY_BF16
  return pack_bf16(weight.contiguous(), has_bias ? bias->data_ptr<float>() : nullptr);
#else
  TORCH_CHECK(false, "pack_argmax_screen: not in this build");
#endif
}

// Rows up to which the bf16 layer's int8 screen beats its fused argmax. The screen streams half the bytes but
// runs vpdpbusd, on Zen 5 ~171 GMAC/s a core against vdpbf16ps's ~231: Qwen2-0.5B's LM head (151,936 x 896,
// 2 threads) took 3.1-4.6 against 5.3-7.3 ms at 1 row, 4.5 against 5.8 at 4, 7.1 against 6.7 at 8 and 14
// against 9.5 at 16.
constexpr int64_t kInt8ScreenMaxRows = 4;

// A bf16 layer's screen: ``weight`` is the layer's own packed panels (pack_linear_weight), what the survivors
// are recomputed from; the answer is skinny_linear_argmax's.
at::Tensor screened_bf16(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& screen,
                         const at::Tensor& bounds, const c10::optional<at::Tensor>& bias) {
  const int64_t n = bounds.size(-1);
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(1) == (x.size(1) + 1) / 2 && packed.size(0) == (n + kPanel - 1) / kPanel,
              "skinny_argmax_screened: bf16 x [rows, in_features] and the layer's packed panels, got ", x.sizes(),
              " and ", packed.sizes());
  TORCH_CHECK(screen.dim() == 3 && screen.scalar_type() == at::kChar && screen.size(0) == packed.size(0) &&
                  screen.size(1) == (x.size(1) + 3) / 4 && bounds.dim() == 2 && bounds.scalar_type() == at::kFloat,
              "skinny_argmax_screened: screen and bounds must be pack_argmax_screen's of a bf16 weight");
  TORCH_CHECK(!bias.has_value() || !bias->defined() ||
                  (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kBFloat16),
              "skinny_argmax_screened: bias must be bf16 [", n, "]");
  if (x.size(0) == 0) return at::empty({0}, x.options().dtype(at::kLong));
  const at::Tensor xc = x.contiguous();
  std::optional<at::Tensor> bias_f;
  if (bias.has_value() && bias->defined()) bias_f = bias->to(at::kFloat).contiguous();
  const float* b = bias_f ? bias_f->data_ptr<float>() : nullptr;
  if (x.size(0) <= kInt8ScreenMaxRows)
    if (auto idx = skinny_argmax_screened_int8_cpu(xc, packed, screen, bounds, b)) return *idx;
  return std::get<1>(skinny_linear_argmax_cpu(xc, packed, bias, n));
}

at::Tensor skinny_argmax_screened_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& screen,
                                      const at::Tensor& bounds, const c10::optional<at::Tensor>& bias) {
  if (x.scalar_type() == at::kBFloat16) return screened_bf16(x, weight, screen, bounds, bias);
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.is_contiguous() && x.scalar_type() == at::kFloat &&
                  dtype == at::kFloat && x.size(1) == weight.size(1),
              "skinny_argmax_screened: fp32 x [rows, in_features] and a contiguous fp32 weight [out, in_features], "
              "got ", x.scalar_type(), " ", x.sizes(), " and ", dtype, " ", weight.sizes());
  check_bias(bias, weight);
  const int64_t n = weight.size(0), panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(bounds.dim() == 2 && bounds.size(0) == 2 && bounds.size(1) == n && bounds.is_contiguous() &&
                  bounds.scalar_type() == at::kFloat,
              "skinny_argmax_screened: bounds must be pack_argmax_screen's [2, ", n, "]");
  TORCH_CHECK(screen.dim() == 3 && screen.is_contiguous() && screen.size(0) == panels &&
                  screen.size(1) == (x.size(1) + 1) / 2 && screen.size(2) == 2 * kPanel &&
                  screen.scalar_type() == at::kBFloat16,
              "skinny_argmax_screened: screen must be pack_argmax_screen's, got ", screen.scalar_type(), " ",
              screen.sizes());
  if (x.size(0) == 0) return at::empty({0}, x.options().dtype(at::kLong));
#ifdef PAGEDSERVE_SKINNY_BF16
  const float* b = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  if (auto idx = screened_argmax(x.contiguous(), weight, screen, bounds, b)) return *idx;
#endif
  return row_argmax_cpu(at::linear(x, weight, bias));
}

}  // namespace pagedserve
