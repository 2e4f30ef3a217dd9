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
// int8 weights (skinny_linear_w8, any build): panels laid out as fp32's, one signed byte per weight, widened to
// fp32 in registers; each output column's sum is multiplied by its scale when stored (per-output-channel
// symmetric quantisation, y = (x @ q.T) * scale + bias). x is fp32, or bf16 widened to fp32 first (the output
// then rounded to bf16 as the bf16 layer's is).
//
// int8 weights and int8 activations (skinny_linear_w8a8, AVX512-VNNI builds): each row of x is quantized at
// call time (symmetric per row, t_r = max|x_r| / 127, offset by 128 since vpdpbusd multiplies unsigned by
// signed bytes); panels are [ceil(K / 4), kPanel, 4] signed bytes, 4 k per 32-bit lane. The integer sums
// minus 128 sum_k q_ck (the offset's share, given at pack time) times t_r and the column's scale are y. Half
// the bf16 weight bytes and 64 multiply-adds per instruction, twice vdpbf16ps's.
//
// bf16 (builds for AVX512-BF16 CPUs only): a panel is [ceil(K / 2), kPanel, 2], k
// pairs interleaved for vdpbf16ps, which multiplies a broadcast pair of x by a
// pair of weights per lane and adds both products to the fp32 accumulator.
#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>

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
#include "skinny_amx.h"
#include "skinny_tile.h"

namespace pagedserve {
namespace {

using namespace skinny;

// dst[0:cols] = src * scale + bias (src is scratch: both are applied in place; either may be null), rounded
// once to the layer's dtype R and stored as O: R itself, or fp32 holding the R value (the LM head's logits).
template <typename R, typename O>
void store_row(float* src, const float* scale, const float* bias, int64_t cols, O* dst) {
  if (scale != nullptr) at::vec::map2([](Vec a, Vec b) { return a * b; }, src, src, scale, cols);
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

// Where the AMX blocks beat the vdpbf16ps tiles (bf16, this many rows and more; Qwen2-0.5B's shapes on a
// Xeon: even at 1 row, ahead from 2): at 1 row the vdpbf16ps tiles keep up with the weight stream.
inline constexpr int64_t kAmxMinRows = 2;

template <typename S, typename T = typename S::T, typename W = typename S::W>
void group_tile(bool amx, int64_t rows, const T* x, int64_t ldx, const W* panel, int64_t k_len, float* out) {
#ifdef PAGEDSERVE_SKINNY_AMX
  if constexpr (std::is_same_v<S, Bf16Step>)
    if (amx) return amx_block(x, ldx, rows, panel, k_len, out);
#endif
  tile_group<S>(rows, x, ldx, panel, k_len, out);
}

// One panel's output rows, of a layer in dtype R; with ``best``, each row's columns also go into its running
// argmax (fp32 output only). ``amx``: x has whole 16-row blocks (padded past m) and the thread's tiles are
// configured.
// W8A8's per-row scales t_r and per-column offsets 128 sum_k q_ck (see the header); null for other layers.
struct ActQuant {
  const float* row_scale = nullptr;
  const float* col_offset = nullptr;
};

template <typename S, typename R, typename O, typename T = typename S::T, typename W = typename S::W>
void run_panel(const T* xp, int64_t m, int64_t ldx, int64_t k_len, const W* panel, const float* scale,
               const float* bias, int64_t p, int64_t cols, O* yp, int64_t ldy, RowBest* best, bool amx,
               const ActQuant& act) {
  float tmp[std::max(kGroupRows, int64_t{16}) * kPanel];
  const int64_t group = amx ? 16 : kGroupRows;
  for (int64_t g0 = 0; g0 < m; g0 += group) {
    const int64_t rows = std::min(group, m - g0);
    group_tile<S>(amx, rows, xp + g0 * ldx, ldx, panel, k_len, tmp);
    for (int64_t r = 0; r < rows; ++r) {
      O* out = yp + (g0 + r) * ldy + p * kPanel;
      if (act.row_scale != nullptr) {
        const Vec t(act.row_scale[g0 + r]);
        at::vec::map2([t](Vec a, Vec o) { return (a - o) * t; }, tmp + r * kPanel, tmp + r * kPanel,
                      act.col_offset + p * kPanel, cols);
      }
      store_row<R>(tmp + r * kPanel, scale, bias, cols, out);
      if constexpr (std::is_same_v<O, float>)
        if (best != nullptr) best->update(g0 + r, out, p * kPanel, cols);
    }
  }
}

// x as the AMX blocks read it: whole 16-row blocks. Returns (rows, row stride, whether AMX applies); x is
// copied into ``padded`` (zero rows past its own) only when m is not a multiple of 16, by hand: a torch op
// here would wake OpenMP's threads, which then spin against this op's own (parallel.h).
template <typename S, typename T = typename S::T>
std::tuple<const T*, int64_t, bool> amx_rows(const at::Tensor& x, std::vector<T>& padded) {
  const int64_t m = x.size(0), k = x.size(1), ldx = x.stride(0);
#ifdef PAGEDSERVE_SKINNY_AMX
  if constexpr (std::is_same_v<S, Bf16Step>) {
    if (m >= kAmxMinRows && amx_usable()) {
      if (m % kAmxRows == 0) return {x.data_ptr<T>(), ldx, true};
      padded.assign((m + kAmxRows - m % kAmxRows) * k, T(0.f));
      for (int64_t r = 0; r < m; ++r) std::memcpy(padded.data() + r * k, x.data_ptr<T>() + r * ldx, k * sizeof(T));
      return {padded.data(), k, true};
    }
  }
#endif
  return {x.data_ptr<T>(), ldx, false};
}

// y = x @ the packed layer (in dtype R, its bias too) [* scale, per column], as O. With ``chunks`` (one entry
// per panel), the thread that computes panels [begin, end) leaves its rows' argmax in chunks[begin].
template <typename S, typename R = typename S::T, typename O = R, typename T = typename S::T,
          typename W = typename S::W>
void run(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor& y,
         std::vector<RowBest::Result>* chunks = nullptr, const float* scale = nullptr, const ActQuant& act = {}) {
  const int64_t m = x.size(0), out_features = y.size(1), panels = packed.size(0),
                panel_numel = packed.size(1) * packed.size(2);  // not packed[0].numel(): a tensor per call
  std::vector<float> bias_f;
  if (bias.has_value() && bias->defined()) {
    bias_f.resize(panels * kPanel);
    at::vec::convert(bias->data_ptr<R>(), bias_f.data(), out_features);
  }
  std::vector<T> padded;
  const T* xp;
  int64_t ldx;
  bool amx;
  std::tie(xp, ldx, amx) = amx_rows<S>(x, padded);  // not structured bindings: C++17 lambdas cannot capture them
  const W* pk = static_cast<const W*>(packed.const_data_ptr());  // W8A8: the signed bytes, read as I8Step's
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(m * panel_numel, 1));
  parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    std::optional<RowBest> best;
    if (chunks != nullptr) best.emplace(m);
#ifdef PAGEDSERVE_SKINNY_AMX
    std::optional<AmxTiles> tiles;
    if (amx) tiles.emplace();
#endif
    for (int64_t p = begin; p < end; ++p)
      run_panel<S, R, O>(xp, m, ldx, x.size(1), pk + p * panel_numel, scale == nullptr ? nullptr : scale + p * kPanel,
                         bias_f.empty() ? nullptr : bias_f.data() + p * kPanel,
                         p, std::min(kPanel, out_features - p * kPanel), y.data_ptr<O>(), y.stride(0),
                         best ? &*best : nullptr, amx, act);
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

}  // namespace

bool skinny_linear_supports_cpu(at::ScalarType dtype) {
#ifdef PAGEDSERVE_SKINNY_BF16
  if (dtype == at::kBFloat16) return true;
#endif
  return dtype == at::kFloat;
}

at::Tensor pack_linear_weight_cpu(const at::Tensor& weight) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(weight.dim() == 2 && (skinny_linear_supports_cpu(dtype) || dtype == at::kChar),
              "pack_linear_weight: weight must be [out_features, in_features] in a dtype this build supports "
              "(fp32, int8; bf16 on AVX512-BF16 CPUs), got ", dtype, " ", weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  // Zero rows pad the last panel, so the kernel never branches on the column count.
  const at::Tensor padded = at::constant_pad_nd(weight, {0, 0, 0, panels * kPanel - n}, 0);
  if (dtype != at::kBFloat16) return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
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
  if (x.scalar_type() == at::kBFloat16)
    run<Bf16Step, BFloat16, float>(x, packed, bias, y, &chunks);
  else
#endif
    run<F32Step>(x, packed, bias, y, &chunks);
  return {y, combine_chunks(chunks, y)};
}

namespace {

// x, the scales and the bias of an int8 layer (``op``: its name in errors).
void check_w8_operands(const char* op, const at::Tensor& x, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, int64_t out_features) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16) && x.stride(1) == 1,
              op, ": x must be fp32 or bf16 [rows, in_features] with a dense last dim, got ", dtype, " ", x.sizes(),
              " strides ", x.strides());
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == out_features && scale.is_contiguous() &&
                  scale.scalar_type() == at::kFloat,
              op, ": scale must be contiguous fp32 [", out_features, "], got ", scale.scalar_type(), " ",
              scale.sizes());
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                    bias->scalar_type() == dtype,
                op, ": bias must be contiguous ", dtype, " [", out_features, "]");
}

void check_w8_inputs(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& bias, int64_t out_features) {
  check_w8_operands("skinny_linear_w8", x, scale, bias, out_features);
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.size(0) == panels && packed.size(1) == x.size(1) && packed.size(2) == kPanel,
              "skinny_linear_w8: packed weight ", packed.scalar_type(), " ", packed.sizes(), " does not fit x ",
              x.sizes(), " and out_features ", out_features, " (expected int8 [", panels, ", ", x.size(1), ", ", kPanel,
              "] from pack_linear_weight)");
}

// x as W8Step reads it: fp32 (bf16 rows widened into ``wide``, by hand: see amx_rows).
at::Tensor as_fp32(const at::Tensor& x, std::vector<float>& wide) {
  if (x.scalar_type() == at::kFloat) return x;
  const int64_t m = x.size(0), k = x.size(1);
  wide.resize(m * k);
  for (int64_t r = 0; r < m; ++r) at::vec::convert(x.data_ptr<BFloat16>() + r * x.stride(0), wide.data() + r * k, k);
  return at::from_blob(wide.data(), {m, k}, x.options().dtype(at::kFloat));
}

// y (O: the layer's dtype R, or fp32 for the argmax's logits) of the int8 layer.
template <typename R, typename O = R>
void run_w8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
            const c10::optional<at::Tensor>& bias, at::Tensor& y, std::vector<RowBest::Result>* chunks = nullptr) {
  std::vector<float> wide;
  run<W8Step, R, O>(as_fp32(x, wide), packed, bias, y, chunks, scale.data_ptr<float>());
}

}  // namespace

at::Tensor skinny_linear_w8_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                const c10::optional<at::Tensor>& bias, int64_t out_features) {
  check_w8_inputs(x, packed, scale, bias, out_features);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return y;
  if (x.scalar_type() == at::kBFloat16)
    run_w8<BFloat16>(x, packed, scale, bias, y);
  else
    run_w8<float>(x, packed, scale, bias, y);
  return y;
}

std::tuple<at::Tensor, at::Tensor> skinny_linear_w8_argmax_cpu(const at::Tensor& x, const at::Tensor& packed,
                                                               const at::Tensor& scale,
                                                               const c10::optional<at::Tensor>& bias,
                                                               int64_t out_features) {
  TORCH_CHECK(out_features > 0 && out_features < (int64_t{1} << 24),
              "skinny_linear_w8_argmax: 0 < out_features < 2^24, got ", out_features);
  check_w8_inputs(x, packed, scale, bias, out_features);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
  if (x.size(0) == 0) return {y, at::empty({0}, x.options().dtype(at::kLong))};
  std::vector<RowBest::Result> chunks(packed.size(0));
  if (x.scalar_type() == at::kBFloat16)
    run_w8<BFloat16, float>(x, packed, scale, bias, y, &chunks);
  else
    run_w8<float>(x, packed, scale, bias, y, &chunks);
  return {y, combine_chunks(chunks, y)};
}

namespace {

#ifdef PAGEDSERVE_SKINNY_INT8
// Row r of x (fp32 or bf16, K values) as I8Step reads it: round(x / t_r) + 128 in [1, 255], padded to K4 with
// 128 (a zero); t_r = max|x_r| / 127 (1 for a zero row). NaN/inf rows give garbage, as a bf16 GEMM gives NaN.
template <typename T>
float quantize_row(const T* x, int64_t k_len, int64_t k4, float* wide, uint8_t* out) {
  at::vec::convert(x, wide, k_len);
  __m512 top = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kW <= k_len; k += kW) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(wide + k)));
  float m = _mm512_reduce_max_ps(top);
  for (int64_t j = k; j < k_len; ++j) m = std::max(m, std::fabs(wide[j]));
  const float scale = m > 0.f ? m / 127.f : 1.f, inv = 1.f / scale;
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), offset = _mm512_set1_epi32(128);
  for (k = 0; k + kW <= k_len; k += kW) {
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(wide + k), _mm512_set1_ps(inv)));  // to nearest even
    q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), offset);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtepi32_epi8(q));
  }
  for (; k < k_len; ++k)
    out[k] = static_cast<uint8_t>(std::clamp<int>(static_cast<int>(std::nearbyint(wide[k] * inv)), -127, 127) + 128);
  std::fill(out + k_len, out + k4, uint8_t{128});
  return scale;
}

// Every row of x quantized into ``q`` [m, K4], their scales into ``row_scale``.
void quantize_rows(const at::Tensor& x, at::Tensor& q, std::vector<float>& row_scale) {
  const int64_t m = x.size(0), k_len = x.size(1), k4 = q.size(1);
  row_scale.resize(m);
  std::vector<float> wide(k_len);
  for (int64_t r = 0; r < m; ++r) {
    uint8_t* out = q.data_ptr<uint8_t>() + r * k4;
    row_scale[r] = x.scalar_type() == at::kFloat
                       ? quantize_row(x.data_ptr<float>() + r * x.stride(0), k_len, k4, wide.data(), out)
                       : quantize_row(x.data_ptr<BFloat16>() + r * x.stride(0), k_len, k4, wide.data(), out);
  }
}
#endif

void check_w8a8_inputs(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& col_offset, const c10::optional<at::Tensor>& bias, int64_t out_features) {
  check_w8_operands("skinny_linear_w8a8", x, scale, bias, out_features);
  const int64_t panels = (out_features + kPanel - 1) / kPanel, k4 = (x.size(1) + 3) / 4 * 4;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.size(0) == panels && packed.size(1) == k4 / 4 && packed.size(2) == 4 * kPanel,
              "skinny_linear_w8a8: packed weight ", packed.scalar_type(), " ", packed.sizes(), " does not fit x ",
              x.sizes(), " and out_features ", out_features, " (expected int8 [", panels, ", ", k4 / 4, ", ",
              4 * kPanel, "] from pack_linear_weight_w8a8)");
  TORCH_CHECK(col_offset.dim() == 1 && col_offset.size(0) == out_features && col_offset.is_contiguous() &&
                  col_offset.scalar_type() == at::kFloat,
              "skinny_linear_w8a8: col_offset must be contiguous fp32 [", out_features, "]");
}

}  // namespace

bool skinny_linear_w8a8_supports_cpu() {
#ifdef PAGEDSERVE_SKINNY_INT8
  return true;
#else
  return false;
#endif
}

std::tuple<at::Tensor, at::Tensor> pack_linear_weight_w8a8_cpu(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar,
              "pack_linear_weight_w8a8: weight must be int8 [out_features, in_features], got ", q.scalar_type(), " ",
              q.sizes());
  const int64_t n = q.size(0), k = q.size(1), panels = (n + kPanel - 1) / kPanel, k4 = (k + 3) / 4 * 4;
  // [panels, K4 / 4, kPanel, 4]: zero rows pad the last panel, zero columns K to a multiple of 4.
  const at::Tensor padded = at::constant_pad_nd(q, {0, k4 - k, 0, panels * kPanel - n}, 0);
  at::Tensor packed = padded.view({panels, kPanel, k4 / 4, 4}).permute({0, 2, 1, 3}).reshape({panels, k4 / 4, 4 * kPanel});
  at::Tensor col_offset = q.sum(1, /*keepdim=*/false, at::kInt).to(at::kFloat).mul_(128.f);
  return {packed.contiguous(), col_offset};
}

at::Tensor skinny_linear_w8a8_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                  const at::Tensor& col_offset, const c10::optional<at::Tensor>& bias,
                                  int64_t out_features) {
  check_w8a8_inputs(x, packed, scale, col_offset, bias, out_features);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return y;
#ifdef PAGEDSERVE_SKINNY_INT8
  at::Tensor q = at::empty({x.size(0), packed.size(1) * 4}, x.options().dtype(at::kByte));
  std::vector<float> row_scale;
  quantize_rows(x, q, row_scale);
  const ActQuant act{row_scale.data(), col_offset.data_ptr<float>()};
  if (x.scalar_type() == at::kBFloat16)
    run<I8Step, BFloat16>(q, packed, bias, y, nullptr, scale.data_ptr<float>(), act);
  else
    run<I8Step, float>(q, packed, bias, y, nullptr, scale.data_ptr<float>(), act);
  return y;
#else
  TORCH_CHECK(false, "skinny_linear_w8a8 needs a build for an AVX512-VNNI CPU (skinny_linear_w8a8_supports)");
#endif
}

}  // namespace pagedserve
