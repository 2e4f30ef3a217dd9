// CPU "skinny" GEMM for decode-sized batches: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M small.
//
// MKL's sgemm is slow at a few rows (it packs x and W on every call). Here W is
// packed once, at load, into panels of kPanel output columns, each a dense
// [K, kPanel] run, so a panel streams from memory once and then serves every row
// block of x from cache. The micro-kernel keeps a [kRows, kPanel] fp32 accumulator
// tile in registers: per k, kPanel / kW weight vectors times kRows broadcasts of x,
// one FMA each. Threads split the panels (the output dimension).
//
// skinny_linear_argmax also returns each row's argmax (the LM head's greedy token), taken from each
// output tile while it is in L1: a separate pass over [64, 32000] logits reads them back from L3 (~0.35 ms).
// Its logits are fp32: for bf16 layers, the bf16-rounded values widened (what the model's bf16 logits
// give after .float(), without a second pass over [rows, vocab] to convert them).
//
// bf16 (builds for AVX512-BF16 CPUs only): a panel is [ceil(K / 2), kPanel, 2], k
// pairs interleaved for vdpbf16ps, which multiplies a broadcast pair of x by a
// pair of weights per lane and adds both products to the fp32 accumulator.
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../ops.h"
#include "parallel.h"

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define PAGEDSERVE_SKINNY_BF16 1
#endif

namespace pagedserve {
namespace {

using Vec = at::vec::Vectorized<float>;
using c10::BFloat16;
constexpr int64_t kW = Vec::size();
// Register budget: AVX-512 has 32 vector registers (6 x 4 accumulators + 4 weights + 1
// broadcast), AVX2 has 16 (4 x 2 + 2 + 1).
constexpr int64_t kPanelVecs = kW == 16 ? 4 : 2;
constexpr int64_t kPanel = kPanelVecs * kW;  // output columns per packed panel
constexpr int64_t kRows = kW == 16 ? 6 : 4;  // rows of x per register tile
constexpr int64_t kMinWorkPerThread = 1 << 20;  // multiply-adds (~12 us of fp32 AVX-512) worth a thread

// One element type's k step of the micro-kernel: the panel's kPanelVecs weight
// operands, x's broadcast operand and the multiply-add into an fp32 accumulator.
struct F32Step {
  using T = float;
  using Acc = Vec;
  using Operand = Vec;
  static constexpr int64_t kDepth = 1;  // k values per step
  static Acc zero() { return Vec(0.f); }
  static Operand weights(const T* panel, int64_t k, int64_t v) { return Vec::loadu(panel + k * kPanel + v * kW); }
  static Operand broadcast(const T* row, int64_t k) { return Vec(row[k]); }
  static Operand broadcast_last(const T* row, int64_t k) { return broadcast(row, k); }
  static Acc madd(Acc acc, Operand a, Operand w) { return at::vec::fmadd(a, w, acc); }
  static void store(float* out, Acc acc) { acc.store(out); }
};

#ifdef PAGEDSERVE_SKINNY_BF16
struct Bf16Step {
  using T = BFloat16;
  using Acc = __m512;
  using Operand = __m512bh;
  static constexpr int64_t kDepth = 2;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Operand weights(const T* panel, int64_t k, int64_t v) {
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

// acc[r] += x[r, k:k + kDepth] * panel[k:k + kDepth, 0:kPanel] for R rows (kLast: the last k of an odd K).
template <typename S, int64_t R, bool kLast = false>
inline void k_step(typename S::Acc (&acc)[R][kPanelVecs], const typename S::T* x, int64_t ldx,
                   const typename S::T* panel, int64_t k) {
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

// out[r, 0:kPanel] = sum_k x[r, k] * panel[k, 0:kPanel] for R rows (out: [R, kPanel]).
template <typename S, int64_t R>
void tile(const typename S::T* x, int64_t ldx, const typename S::T* panel, int64_t k_len, float* out) {
  typename S::Acc acc[R][kPanelVecs];
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int64_t v = 0; v < kPanelVecs; ++v) acc[r][v] = S::zero();
  const int64_t k_whole = k_len - k_len % S::kDepth;
  for (int64_t k = 0; k < k_whole; k += S::kDepth) k_step<S, R>(acc, x, ldx, panel, k);
  if (k_whole < k_len) k_step<S, R, true>(acc, x, ldx, panel, k_whole);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < kPanelVecs; ++v) S::store(out + r * kPanel + v * kW, acc[r][v]);
}

template <typename S>
void tile_rows(int64_t rows, const typename S::T* x, int64_t ldx, const typename S::T* panel, int64_t k_len,
               float* out) {
  switch (rows) {
    case 1: return tile<S, 1>(x, ldx, panel, k_len, out);
    case 2: return tile<S, 2>(x, ldx, panel, k_len, out);
    case 3: return tile<S, 3>(x, ldx, panel, k_len, out);
    case 4: return tile<S, 4>(x, ldx, panel, k_len, out);
    case 5: return tile<S, 5>(x, ldx, panel, k_len, out);
    default: return tile<S, kRows>(x, ldx, panel, k_len, out);
  }
}

// dst[0:cols] = src + bias (src is scratch: the bias is added in place), rounded once to the layer's dtype R
// and stored as O: R itself, or fp32 holding the R value (the LM head's logits).
template <typename R, typename O>
void store_row(float* src, const float* bias, int64_t cols, O* dst) {
  if (bias != nullptr) at::vec::map2([](Vec a, Vec b) { return a + b; }, src, src, bias, cols);
  if constexpr (std::is_same_v<R, float>) {
    std::memcpy(dst, src, cols * sizeof(float));
  } else if constexpr (std::is_same_v<O, R>) {
    at::vec::convert(src, dst, cols);
  } else {
    R rounded[kPanel];
    at::vec::convert(src, rounded, cols);
    at::vec::convert(rounded, dst, cols);
  }
}

// The fused argmax: per row, a running lane-wise maximum over the columns one thread computes. Lane l
// sees its columns in increasing order, so a strict > keeps the first maximum; the column is kept as a
// float (exact below 2^24). NaNs only show in a NaN-propagating maximum kept beside it: such rows (and
// rows of -inf) are redone by row_argmax, whose rule (the first NaN wins) costs more to follow here.
class RowBest {
 public:
  using Result = std::vector<std::pair<float, int64_t>>;  // per row (max, column); column -1: redo the row

  explicit RowBest(int64_t rows)
      : value_(rows * kW, -std::numeric_limits<float>::infinity()), column_(rows * kW, -1.f), top_(rows * kW, 0.f) {
    for (int64_t v = 0; v < kPanelVecs; ++v) lanes_[v] = Vec::arange(static_cast<float>(v * kW), 1.f);
  }

  // Row r's values at columns [col0, col0 + cols), cols <= kPanel.
  void update(int64_t r, const float* src, int64_t col0, int64_t cols) {
    float *value = value_.data() + r * kW, *column = column_.data() + r * kW, *top = top_.data() + r * kW;
    if (cols < kPanel) {  // the last, partial panel: its padding columns must not count
      for (int64_t c = 0; c < cols; ++c) {
        if (src[c] > value[c % kW]) value[c % kW] = src[c], column[c % kW] = static_cast<float>(col0 + c);
        if (std::isnan(src[c])) top[c % kW] = src[c];
      }
      return;
    }
    const Vec base(static_cast<float>(col0));
    Vec best = Vec::loadu(value), at = Vec::loadu(column), nan_max = Vec::loadu(top);
    for (int64_t v = 0; v < kPanelVecs; ++v) {
      const Vec x = Vec::loadu(src + v * kW), greater = x > best;
      best = Vec::blendv(best, x, greater);
      at = Vec::blendv(at, base + lanes_[v], greater);
      nan_max = at::vec::maximum(nan_max, x);
    }
    best.store(value), at.store(column), nan_max.store(top);
  }

  Result result() const {
    const int64_t rows = static_cast<int64_t>(value_.size()) / kW;
    Result out(rows, {0.f, -1});
    for (int64_t r = 0; r < rows; ++r) {
      const float *value = value_.data() + r * kW, *column = column_.data() + r * kW, *top = top_.data() + r * kW;
      if (std::any_of(top, top + kW, [](float f) { return std::isnan(f); })) continue;
      for (int64_t l = 0; l < kW; ++l) {
        const auto c = static_cast<int64_t>(column[l]);
        if (c >= 0 && (out[r].second < 0 || value[l] > out[r].first || (value[l] == out[r].first && c < out[r].second)))
          out[r] = {value[l], c};
      }
    }
    return out;
  }

 private:
  std::vector<float> value_, column_, top_;  // [rows, kW] each
  Vec lanes_[kPanelVecs];  // a panel's column offsets, lane by lane
};

// With ``best``, each output row's columns also go into its running argmax (fp32 output only).
template <typename S, typename O, typename T = typename S::T>
void run_panel(const at::Tensor& x, const T* panel, const T* bias, int64_t p, int64_t cols, at::Tensor& y,
               RowBest* best) {
  const int64_t m = x.size(0), k_len = x.size(1), ldx = x.stride(0), ldy = y.stride(0);
  const T* xp = x.data_ptr<T>();
  O* yp = y.data_ptr<O>() + p * kPanel;
  float tmp[kRows * kPanel], bias_f[kPanel];
  if (bias != nullptr) at::vec::convert(bias + p * kPanel, bias_f, cols);
  for (int64_t r0 = 0; r0 < m; r0 += kRows) {
    const int64_t rows = std::min(kRows, m - r0);
    tile_rows<S>(rows, xp + r0 * ldx, ldx, panel, k_len, tmp);
    for (int64_t r = 0; r < rows; ++r) {
      O* out = yp + (r0 + r) * ldy;
      store_row<T>(tmp + r * kPanel, bias == nullptr ? nullptr : bias_f, cols, out);
      if constexpr (std::is_same_v<O, float>)
        if (best != nullptr) best->update(r0 + r, out, p * kPanel, cols);
    }
  }
}

// With ``chunks`` (one entry per panel), the thread that computes panels [begin, end) leaves its rows'
// argmax in chunks[begin].
template <typename S, typename O = typename S::T, typename T = typename S::T>
void run(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor& y,
         std::vector<RowBest::Result>* chunks = nullptr) {
  const int64_t out_features = y.size(1), panels = packed.size(0),
                panel_numel = packed.size(1) * packed.size(2);  // not packed[0].numel(): a tensor per call
  const T* b = bias.has_value() && bias->defined() ? bias->data_ptr<T>() : nullptr;
  const T* pk = packed.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(x.size(0) * panel_numel, 1));
  parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    std::optional<RowBest> best;
    if (chunks != nullptr) best.emplace(x.size(0));
    for (int64_t p = begin; p < end; ++p)
      run_panel<S, O>(x, pk + p * panel_numel, b, p, std::min(kPanel, out_features - p * kPanel), y,
                      best ? &*best : nullptr);
    if (best) (*chunks)[begin] = best->result();
  });
}

// Each row's argmax over the threads' chunks (in column order, so a strict > keeps the first maximum);
// a row some chunk flagged is redone by row_argmax.
at::Tensor combine_chunks(const std::vector<RowBest::Result>& chunks, const at::Tensor& y) {
  at::Tensor idx = at::empty({y.size(0)}, y.options().dtype(at::kLong));
  int64_t* out = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < y.size(0); ++r) {
    std::pair<float, int64_t> best{0.f, -1};
    bool redo = false;
    for (const auto& chunk : chunks) {
      if (chunk.empty()) continue;
      redo = redo || chunk[r].second < 0;
      if (!redo && (best.second < 0 || chunk[r].first > best.first)) best = chunk[r];
    }
    out[r] = redo ? row_argmax_cpu(y.narrow(0, r, 1)).item<int64_t>() : best.second;
  }
  return idx;
}

#ifdef PAGEDSERVE_SKINNY_BF16
// The screened argmax (an fp32 LM head's greedy tokens at bf16 speed, exactly). A bf16 pass gives each
// logit an estimate e whose distance to the fp32 logit is provably at most
//   B = x_width * |w_c| + slack_c,  x_width = 2 * (2^-7 + 2^-16 + 2K * 2^-24) * |x|,
//   slack_c = 8K * 2^-126 * (1 + |w_c|) + 2^-20 * |bias_c|
// (bf16 rounding of x and w: 2^-8 relative each; fp32 accumulation in either pass: K * 2^-24; flushed
// denormals: the 2^-126 terms; Cauchy-Schwarz bounds sum |x_k w_k| by |x| |w_c|; a factor 2 to spare). A
// column whose upper bound e + B is below another's lower bound e' - B' cannot be the argmax; the few
// left are recomputed in the fp32 kernel's order (one fma chain from k = 0, then the bias), so the result
// is skinny_linear_argmax's, first maximum and all.
struct Screened {
  float upper;
  int64_t column;
};

class RowScreen {
 public:
  explicit RowScreen(int64_t rows) : floor_(rows, -std::numeric_limits<float>::infinity()), kept_(rows) {}

  // Row r's estimates at columns [col0, col0 + cols) (cols <= kPanel); B = x_width * norms + slack.
  void update(int64_t r, const float* estimate, float x_width, const float* norms, const float* slack, int64_t col0,
              int64_t cols) {
    float upper[kPanel];
    float floor = floor_[r];
    if (cols < kPanel) {  // the last panel: its padding columns must not count
      for (int64_t c = 0; c < cols; ++c) {
        const float width = x_width * norms[c] + slack[c];
        floor = std::max(floor, estimate[c] - width), upper[c] = estimate[c] + width;
      }
    } else {
      __m512 low = _mm512_set1_ps(floor);
      for (int64_t v = 0; v < kPanelVecs; ++v) {
        const __m512 e = _mm512_loadu_ps(estimate + v * kW),
                     width = _mm512_fmadd_ps(_mm512_set1_ps(x_width), _mm512_loadu_ps(norms + v * kW),
                                             _mm512_loadu_ps(slack + v * kW));
        low = _mm512_max_ps(low, _mm512_sub_ps(e, width));
        _mm512_storeu_ps(upper + v * kW, _mm512_add_ps(e, width));
      }
      floor = _mm512_reduce_max_ps(low);
    }
    floor_[r] = floor;
    // A column below the running floor is below the final one too; most are, so the test is vectorized.
    for (int64_t c0 = 0; c0 < cols; c0 += kW) {
      const int64_t n = std::min(kW, cols - c0);
      auto mask = _mm512_mask_cmp_ps_mask(static_cast<__mmask16>((1u << n) - 1), _mm512_loadu_ps(upper + c0),
                                          _mm512_set1_ps(floor), _CMP_GE_OQ);
      for (; mask; mask &= mask - 1) {
        const int64_t c = c0 + __builtin_ctz(mask);
        kept_[r].push_back({upper[c], col0 + c});
      }
    }
  }

  float floor(int64_t r) const { return floor_[r]; }
  const std::vector<Screened>& kept(int64_t r) const { return kept_[r]; }

 private:
  std::vector<float> floor_;
  std::vector<std::vector<Screened>> kept_;
};

struct ScreenInputs {
  const BFloat16* x;  // [m, K], bf16
  const BFloat16* screen;  // the bf16 packed weight
  const float* norms;  // |w_c|, rounded up
  const float* slack;  // slack_c
  const float* bias;  // or nullptr
  std::vector<float> x_width;  // per row
  int64_t m, k_len, panel_numel, out_features;
};

// Panels [begin, end) screened for every row.
void screen_panels(const ScreenInputs& in, int64_t begin, int64_t end, RowScreen& screen) {
  float tmp[kRows * kPanel];
  for (int64_t p = begin; p < end; ++p) {
    const int64_t col0 = p * kPanel, cols = std::min(kPanel, in.out_features - col0);
    for (int64_t r0 = 0; r0 < in.m; r0 += kRows) {
      const int64_t rows = std::min(kRows, in.m - r0);
      tile_rows<Bf16Step>(rows, in.x + r0 * in.k_len, in.k_len, in.screen + p * in.panel_numel, in.k_len, tmp);
      for (int64_t r = 0; r < rows; ++r) {
        float* estimate = tmp + r * kPanel;
        if (in.bias != nullptr) at::vec::map2([](Vec a, Vec b) { return a + b; }, estimate, estimate, in.bias + col0, cols);
        screen.update(r0 + r, estimate, in.x_width[r0 + r], in.norms + col0, in.slack + col0, col0, cols);
      }
    }
  }
}

// The fp32 kernel's logit of one column: the same fma chain (one lane, from k = 0), then the bias.
float exact_logit(const float* x, const float* w, const float* bias, int64_t k_len, int64_t column) {
  float acc = 0.f;
  for (int64_t k = 0; k < k_len; ++k) acc = std::fma(x[k], w[k], acc);
  return bias == nullptr ? acc : acc + bias[column];
}

// Row r's argmax among the columns no thread screened out: their exact logits, the first maximum.
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

// The screened argmax of every row, or nullopt where the bound's arithmetic could overflow (huge or
// non-finite x: the plain argmax handles those, NaN rules and all).
std::optional<at::Tensor> screened_argmax(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& screen,
                                          const at::Tensor& bounds, const float* bias) {
  const int64_t m = x.size(0), k_len = x.size(1), out_features = weight.size(0);
  const float *xp = x.data_ptr<float>(), *norms = bounds.data_ptr<float>();
  const float w_max = *std::max_element(norms, norms + out_features);
  const double rel = 2.0 * (std::ldexp(1.0, -7) + std::ldexp(1.0, -16) + 2.0 * k_len * std::ldexp(1.0, -24));
  const at::Tensor xb = x.to(at::kBFloat16);
  ScreenInputs in{xb.data_ptr<BFloat16>(), screen.data_ptr<BFloat16>(), norms, norms + out_features, bias,
                  std::vector<float>(m), m, k_len, screen.size(1) * screen.size(2), out_features};
  for (int64_t r = 0; r < m; ++r) {
    double sq = 0;
    for (int64_t k = 0; k < k_len; ++k) sq += double(xp[r * k_len + k]) * xp[r * k_len + k];
    const double width = rel * std::sqrt(sq) * (1.0 + 1e-6);
    if (!std::isfinite(width) || width * w_max > 1e30) return std::nullopt;
    in.x_width[r] = static_cast<float>(width);
  }
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(m * in.panel_numel, 1));
  std::vector<std::optional<RowScreen>> chunks(screen.size(0));
  parallel_for(0, screen.size(0), grain, [&](int64_t begin, int64_t end) {
    screen_panels(in, begin, end, chunks[begin].emplace(m));
  });
  std::vector<RowScreen> screens;
  for (auto& chunk : chunks)
    if (chunk) screens.push_back(std::move(*chunk));
  at::Tensor idx = at::empty({m}, x.options().dtype(at::kLong));
  for (int64_t r = 0; r < m; ++r)
    idx.data_ptr<int64_t>()[r] = best_survivor(screens, r, xp + r * k_len, weight.data_ptr<float>(), bias, k_len);
  return idx;
}
#endif

}  // namespace

bool skinny_linear_supports_cpu(at::ScalarType dtype) {
#ifdef PAGEDSERVE_SKINNY_BF16
  if (dtype == at::kBFloat16) return true;
#endif
  return dtype == at::kFloat;
}

at::Tensor pack_linear_weight_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && skinny_linear_supports_cpu(weight.scalar_type()),
              "pack_linear_weight: weight must be [out_features, in_features] in a dtype this build supports "
              "(fp32; bf16 on AVX512-BF16 CPUs), got ", weight.scalar_type(), " ", weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  // Zero rows pad the last panel, so the kernel never branches on the column count.
  const at::Tensor padded = at::constant_pad_nd(weight, {0, 0, 0, panels * kPanel - n}, 0);
  if (weight.scalar_type() == at::kFloat) return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
  // bf16: an even K, then k pairs interleaved: [panels, K / 2, kPanel, 2] stored as [panels, K / 2, 2 * kPanel].
  const int64_t pairs = (k + 1) / 2;
  const at::Tensor even = at::constant_pad_nd(padded, {0, 2 * pairs - k}, 0);
  return even.view({panels, kPanel, pairs, 2}).permute({0, 2, 1, 3}).reshape({panels, pairs, 2 * kPanel});
}

static void check_inputs(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t out_features) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && skinny_linear_supports_cpu(dtype) && x.stride(1) == 1,
              "skinny_linear: x must be [rows, in_features] with a dense last dim, in a dtype this build supports "
              "(fp32; bf16 on AVX512-BF16 CPUs), got ", dtype, " ", x.sizes(), " strides ", x.strides());
  const int64_t panels = (out_features + kPanel - 1) / kPanel, k = x.size(1);
  const int64_t k_rows = dtype == at::kFloat ? k : (k + 1) / 2, width = dtype == at::kFloat ? kPanel : 2 * kPanel;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == dtype &&
                  packed.size(0) == panels && packed.size(1) == k_rows && packed.size(2) == width,
              "skinny_linear: packed weight ", packed.scalar_type(), " ", packed.sizes(), " does not fit x ", dtype,
              " ", x.sizes(), " and out_features ", out_features, " (expected [", panels, ", ", k_rows, ", ", width,
              "] from pack_linear_weight)");
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                    bias->scalar_type() == dtype,
                "skinny_linear: bias must be contiguous ", dtype, " [", out_features, "]");
}

at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                             int64_t out_features) {
  check_inputs(x, packed, bias, out_features);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return y;
#ifdef PAGEDSERVE_SKINNY_BF16
  if (x.scalar_type() == at::kBFloat16) {
    run<Bf16Step>(x, packed, bias, y);
    return y;
  }
#endif
  run<F32Step>(x, packed, bias, y);
  return y;
}

std::tuple<at::Tensor, at::Tensor> skinny_linear_argmax_cpu(const at::Tensor& x, const at::Tensor& packed,
                                                            const c10::optional<at::Tensor>& bias,
                                                            int64_t out_features) {
  TORCH_CHECK(out_features > 0 && out_features < (int64_t{1} << 24),
              "skinny_linear_argmax: 0 < out_features < 2^24, got ", out_features);
  check_inputs(x, packed, bias, out_features);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
  if (x.size(0) == 0) return {y, at::empty({0}, x.options().dtype(at::kLong))};
  std::vector<RowBest::Result> chunks(packed.size(0));
#ifdef PAGEDSERVE_SKINNY_BF16
  if (x.scalar_type() == at::kBFloat16) {
    run<Bf16Step, float>(x, packed, bias, y, &chunks);
    return {y, combine_chunks(chunks, y)};
  }
#endif
  run<F32Step>(x, packed, bias, y, &chunks);
  return {y, combine_chunks(chunks, y)};
}

}  // namespace pagedserve

namespace pagedserve {

std::tuple<at::Tensor, at::Tensor> pack_argmax_screen_cpu(const at::Tensor& weight,
                                                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && skinny_linear_supports_cpu(at::kBFloat16),
              "pack_argmax_screen: an fp32 [out_features, in_features] weight, on a build with the bf16 skinny "
              "GEMM (AVX512-BF16), got ", weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(at::isfinite(weight).all().item<bool>() && (!bias.has_value() || !bias->defined() ||
                                                           at::isfinite(*bias).all().item<bool>()),
              "pack_argmax_screen: the weight and bias must be finite");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k_len = w.size(1);
  const double tiny = 8.0 * k_len * std::ldexp(1.0, -126);
  at::Tensor bounds = at::empty({2, n}, w.options());
  float *norms = bounds.data_ptr<float>(), *slack = norms + n;
  for (int64_t c = 0; c < n; ++c) {
    double sq = 0;
    for (int64_t k = 0; k < k_len; ++k) sq += double(w.data_ptr<float>()[c * k_len + k]) * w.data_ptr<float>()[c * k_len + k];
    const double norm = std::sqrt(sq) * (1 + 1e-6);  // rounded up: rounding must not shrink the bound
    const double b = bias.has_value() && bias->defined() ? std::fabs(double(bias->data_ptr<float>()[c])) : 0.0;
    norms[c] = static_cast<float>(norm);
    slack[c] = static_cast<float>((tiny * (1 + norm) + std::ldexp(b, -20)) * (1 + 1e-6));
  }
  return {pack_linear_weight_cpu(w.to(at::kBFloat16)), bounds};
}

at::Tensor skinny_argmax_screened_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& screen,
                                      const at::Tensor& bounds, const c10::optional<at::Tensor>& bias) {
  const int64_t out_features = weight.size(0);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat && x.size(1) == weight.size(1),
              "skinny_argmax_screened: fp32 x [rows, in_features] and contiguous fp32 weight [out, in_features], "
              "got ", x.scalar_type(), " ", x.sizes(), " and ", weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(bounds.dim() == 2 && bounds.size(0) == 2 && bounds.size(1) == out_features &&
                  bounds.is_contiguous() && bounds.scalar_type() == at::kFloat,
              "skinny_argmax_screened: bounds must be pack_argmax_screen's [2, ", out_features, "]");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                "skinny_argmax_screened: bias must be contiguous fp32 [", out_features, "]");
    b = bias->data_ptr<float>();
  }
#ifdef PAGEDSERVE_SKINNY_BF16
  const int64_t panels = (out_features + kPanel - 1) / kPanel, pairs = (x.size(1) + 1) / 2;
  TORCH_CHECK(screen.dim() == 3 && screen.is_contiguous() && screen.scalar_type() == at::kBFloat16 &&
                  screen.size(0) == panels && screen.size(1) == pairs && screen.size(2) == 2 * kPanel,
              "skinny_argmax_screened: screen must be pack_argmax_screen's, got ", screen.scalar_type(), " ",
              screen.sizes());
  if (x.size(0) == 0) return at::empty({0}, x.options().dtype(at::kLong));
  if (auto idx = screened_argmax(x.contiguous(), weight, screen, bounds, b)) return *idx;
#endif
  const at::Tensor logits = at::linear(x, weight, bias);
  return row_argmax_cpu(logits);
}

}  // namespace pagedserve
