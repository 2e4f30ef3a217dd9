// CPU "skinny" GEMM for decode-sized batches: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M small.
//
// MKL's sgemm is slow at a few rows (it packs x and W on every call). Here W is
// packed once, at load, into panels of kPanel output columns, each a dense
// [K, kPanel] run, so a panel streams from memory once and then serves every row
// block of x from cache. The micro-kernel keeps a [kRows, kPanel] accumulator
// tile in registers: per k, kPanel / kW weight vectors times kRows broadcasts of x,
// one FMA each. Threads split the panels (the output dimension). fp32 throughout.
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>

#include "../ops.h"

namespace pagedserve {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();
// Register budget: AVX-512 has 32 vector registers (6 x 4 accumulators + 4 weights + 1
// broadcast), AVX2 has 16 (4 x 2 + 2 + 1).
constexpr int64_t kPanelVecs = kW == 16 ? 4 : 2;
constexpr int64_t kPanel = kPanelVecs * kW;  // output columns per packed panel
constexpr int64_t kRows = kW == 16 ? 6 : 4;  // rows of x per register tile
constexpr int64_t kMinWorkPerThread = 1 << 17;  // multiply-adds (~10 us) worth a thread's fork

// out[r, 0:kPanel] = sum_k x[r, k] * panel[k, 0:kPanel] for R rows; ldo: out row stride.
template <int64_t R>
void tile(const float* x, int64_t ldx, const float* panel, int64_t k_len, float* out, int64_t ldo) {
  Vec acc[R][kPanelVecs];
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int64_t v = 0; v < kPanelVecs; ++v) acc[r][v] = Vec(0.f);
  for (int64_t k = 0; k < k_len; ++k) {
    Vec w[kPanelVecs];
#pragma GCC unroll 4
    for (int64_t v = 0; v < kPanelVecs; ++v) w[v] = Vec::loadu(panel + k * kPanel + v * kW);
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) {
      const Vec a(x[r * ldx + k]);
#pragma GCC unroll 4
      for (int64_t v = 0; v < kPanelVecs; ++v) acc[r][v] = at::vec::fmadd(a, w[v], acc[r][v]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < kPanelVecs; ++v) acc[r][v].store(out + r * ldo + v * kW);
}

void tile_rows(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t k_len, float* out,
               int64_t ldo) {
  switch (rows) {
    case 1: return tile<1>(x, ldx, panel, k_len, out, ldo);
    case 2: return tile<2>(x, ldx, panel, k_len, out, ldo);
    case 3: return tile<3>(x, ldx, panel, k_len, out, ldo);
    case 4: return tile<4>(x, ldx, panel, k_len, out, ldo);
    case 5: return tile<5>(x, ldx, panel, k_len, out, ldo);
    default: return tile<kRows>(x, ldx, panel, k_len, out, ldo);
  }
}

// All rows of x against panel p, written to y's columns [p * kPanel, +cols) with the bias added.
void run_panel(const at::Tensor& x, const float* panel, const float* bias, int64_t p, int64_t cols, at::Tensor& y) {
  const int64_t m = x.size(0), k_len = x.size(1), ldx = x.stride(0), ldy = y.stride(0);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>() + p * kPanel;
  float tmp[kRows * kPanel];  // the last, partial panel goes through here
  for (int64_t r0 = 0; r0 < m; r0 += kRows) {
    const int64_t rows = std::min(kRows, m - r0);
    const bool full = cols == kPanel;
    float* out = full ? yp + r0 * ldy : tmp;
    const int64_t ldo = full ? ldy : kPanel;
    tile_rows(rows, xp + r0 * ldx, ldx, panel, k_len, out, ldo);
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = yp + (r0 + r) * ldy;
      const float* src = out + r * ldo;
      if (bias != nullptr)
        at::vec::map2([](Vec a, Vec b) { return a + b; }, dst, src, bias + p * kPanel, cols);
      else if (!full)
        std::copy(src, src + cols, dst);
    }
  }
}

}  // namespace

at::Tensor pack_linear_weight_cpu(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_linear_weight: weight must be fp32 "
              "[out_features, in_features], got ", weight.scalar_type(), " ", weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  // Zero rows pad the last panel, so the kernel never branches on the column count.
  const at::Tensor padded = at::constant_pad_nd(weight, {0, 0, 0, panels * kPanel - n}, 0);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                             int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "skinny_linear: x must be fp32 [rows, in_features] with a dense last dim, got ", x.scalar_type(), " ",
              x.sizes(), " strides ", x.strides());
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kFloat &&
                  packed.size(0) == panels && packed.size(1) == x.size(1) && packed.size(2) == kPanel,
              "skinny_linear: packed weight ", packed.sizes(), " does not fit x ", x.sizes(), " and out_features ",
              out_features, " (expected [", panels, ", ", x.size(1), ", ", kPanel, "] from pack_linear_weight)");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                "skinny_linear: bias must be contiguous fp32 [", out_features, "]");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return y;
  const int64_t panel_work = x.size(0) * x.size(1) * kPanel;
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(panel_work, 1));
  const float* pk = packed.data_ptr<float>();
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      run_panel(x, pk + p * x.size(1) * kPanel, b, p, std::min(kPanel, out_features - p * kPanel), y);
  });
  return y;
}

}  // namespace pagedserve
