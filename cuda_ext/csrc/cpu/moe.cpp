// fused_moe: a sparse MoE block's experts as grouped GEMMs. The tokens x top-k (token, expert) pairs are sorted
// by expert, so each expert's tokens form one contiguous group: the rows are gathered once, each group goes
// through its expert's gate|up projection as one GEMM, one gated activation (SiLU-and-mul, Gemma's GELU-tanh-and-mul
// or gpt-oss's clamped SwiGLU) runs over all groups, then one GEMM per group through its down projection (each GEMM with the expert's bias, where given);
// each token's k outputs are summed, weighted, in fp32 and rounded once.
//
// ATen ops only, so the one function serves CPU and CUDA tensors. On the CPU the pairs are counting-sorted here
// and the groups' GEMMs spread over torch's threads (grouped_mm); on CUDA they are sorted on the device and the group sizes read back to
// the host (one sync per call, which keeps MoE models out of CUDA graph capture: engine/models/moe.py).
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <utility>
#include <vector>

#include "../ops.h"

namespace pagedserve {
namespace {

void check_fused_moe(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                     const at::Tensor& topk_ids, const at::Tensor& topk_weights) {
  TORCH_CHECK(hidden.dim() == 2, "fused_moe: hidden must be [tokens, hidden], got ", hidden.sizes());
  const int64_t tokens = hidden.size(0), size = hidden.size(1);
  TORCH_CHECK(w13.dim() == 3 && w13.size(2) == size && w13.size(1) % 2 == 0,
              "fused_moe: w13 must be [experts, 2 * intermediate, ", size, "], got ", w13.sizes());
  TORCH_CHECK(w2.dim() == 3 && w2.size(0) == w13.size(0) && w2.size(1) == size && 2 * w2.size(2) == w13.size(1),
              "fused_moe: w2 must be [experts, hidden, intermediate] = [", w13.size(0), ", ", size, ", ",
              w13.size(1) / 2, "], got ", w2.sizes());
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == tokens && topk_ids.size(1) <= w13.size(0),
              "fused_moe: topk_ids must be [", tokens, ", k <= ", w13.size(0), "], got ", topk_ids.sizes());
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong, "fused_moe: topk_ids must be int64, got ", topk_ids.scalar_type());
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "fused_moe: topk_weights must be ", topk_ids.sizes(),
              ", got ", topk_weights.sizes());
  for (const at::Tensor* t : {&w13, &w2})
    TORCH_CHECK(t->scalar_type() == hidden.scalar_type(), "fused_moe: expert weights in ", t->scalar_type(),
                ", hidden in ", hidden.scalar_type());
  for (const at::Tensor* t : {&w13, &w2, &topk_ids, &topk_weights})
    TORCH_CHECK(t->device() == hidden.device(), "fused_moe: every tensor on ", hidden.device(), ", one on ",
                t->device());
}

// Each expert's bias row: [experts, outputs] beside its weights, in their dtype and on their device.
void check_bias(const c10::optional<at::Tensor>& bias, const at::Tensor& weights, const char* name) {
  if (!bias) return;
  TORCH_CHECK(bias->dim() == 2 && bias->size(0) == weights.size(0) && bias->size(1) == weights.size(1),
              "fused_moe: ", name, " must be [", weights.size(0), ", ", weights.size(1), "], got ", bias->sizes());
  TORCH_CHECK(bias->scalar_type() == weights.scalar_type() && bias->device() == weights.device(), "fused_moe: ",
              name, " must be ", weights.scalar_type(), " on ", weights.device());
}

// The pairs (row t * k + j of topk_ids) in expert order, as a tensor on ids' device, and where each expert's
// group starts (experts + 1 offsets, on the host). Stable: a group keeps its tokens in order.
std::pair<at::Tensor, std::vector<int64_t>> group_by_expert(const at::Tensor& topk_ids, int64_t experts) {
  const at::Tensor ids = topk_ids.reshape(-1);
  std::vector<int64_t> offsets(experts + 1, 0);
  if (ids.is_cuda()) {
    const at::Tensor counts = at::bincount(ids, {}, experts).cpu();  // the host sync
    TORCH_CHECK(counts.size(0) == experts, "fused_moe: an expert id past the ", experts, " experts");
    const int64_t* c = counts.data_ptr<int64_t>();
    for (int64_t e = 0; e < experts; ++e) offsets[e + 1] = offsets[e] + c[e];
    return {at::argsort(ids, /*stable=*/true), std::move(offsets)};
  }
  const at::Tensor host = ids.contiguous();
  const int64_t* id = host.data_ptr<int64_t>();
  const int64_t pairs = host.numel();
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < experts, "fused_moe: expert id ", id[p], " outside [0, ", experts, ")");
    ++offsets[id[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  at::Tensor order = at::empty({pairs}, host.options());
  int64_t* out = order.data_ptr<int64_t>();
  std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) out[next[id[p]]++] = p;
  return {order, std::move(offsets)};
}

// out's rows of each group = x's rows of the group @ weights[e].T (+ bias[e]): one GEMM per expert that has
// tokens. On the CPU the groups run side by side, one GEMM per thread in a single OpenMP region (the BLAS runs
// single-threaded inside it): a multi-threaded GEMM per group would be a region per group, each one waiting at
// its barrier for the slowest thread, which on a loaded machine (measured: 2 threads on 2 busy cores) costs more
// than the GEMMs.
at::Tensor grouped_mm(const at::Tensor& x, const at::Tensor& weights, const c10::optional<at::Tensor>& bias,
                      const std::vector<int64_t>& offsets) {
  at::Tensor out = at::empty({x.size(0), weights.size(1)}, x.options());
  std::vector<int64_t> hit;
  for (size_t e = 0; e + 1 < offsets.size(); ++e)
    if (offsets[e + 1] > offsets[e]) hit.push_back(static_cast<int64_t>(e));
  const at::ThreadLocalState caller;  // inference mode: the OpenMP threads write inference tensors too
  const auto gemm = [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard as_caller(caller);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = hit[i], rows = offsets[e + 1] - offsets[e];
      at::Tensor group = out.narrow(0, offsets[e], rows);
      at::mm_out(group, x.narrow(0, offsets[e], rows), weights[e].t());
      if (bias) group.add_((*bias)[e]);
    }
  };
  if (x.is_cuda())
    gemm(0, static_cast<int64_t>(hit.size()));
  else
    at::parallel_for(0, static_cast<int64_t>(hit.size()), 1, gemm);
  return out;
}

// The registered act_and_mul op ``name`` (silu_and_mul, gelu_tanh_and_mul) of x's device (csrc/cpu/layer_ops.cpp,
// csrc/cuda/layer_kernels.cu).
at::Tensor act_and_mul(const at::Tensor& x, const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow(name, "")
      .typed<at::Tensor(const at::Tensor&)>()
      .call(x);
}

// gpt-oss's expert activation on x = [gate | up]: g = min(gate, limit), u = clamp(up, -limit, limit),
// (u + 1) * g * sigmoid(g * alpha), in transformers' order.
at::Tensor clamped_swiglu(const at::Tensor& x, double alpha, double limit) {
  const auto halves = x.chunk(2, -1);
  const at::Tensor gate = halves[0].clamp_max(limit), up = halves[1].clamp(-limit, limit);
  return at::mul(at::add(up, 1), at::mul(gate, at::sigmoid(at::mul(gate, alpha))));
}

// The experts' gated activation on x = [gate | up]: ``activation`` names the gate's function (silu, gelu_tanh);
// swiglu_alpha > 0 picks gpt-oss's clamped form of SiLU.
at::Tensor expert_activation(const at::Tensor& x, c10::string_view activation, double swiglu_alpha,
                             double swiglu_limit) {
  TORCH_CHECK(activation == "silu" || activation == "gelu_tanh",
              "fused_moe: activation must be 'silu' or 'gelu_tanh', got '", activation, "'");
  TORCH_CHECK(swiglu_alpha <= 0 || activation == "silu", "fused_moe: the clamped SwiGLU (swiglu_alpha > 0) gates with "
              "silu, not ", activation);
  if (swiglu_alpha > 0) return clamped_swiglu(x, swiglu_alpha, swiglu_limit);
  return act_and_mul(x, activation == "silu" ? "pagedserve::silu_and_mul" : "pagedserve::gelu_tanh_and_mul");
}

}  // namespace

at::Tensor fused_moe(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                     const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                     const c10::optional<at::Tensor>& w13_bias, const c10::optional<at::Tensor>& w2_bias,
                     double swiglu_alpha, double swiglu_limit, c10::string_view activation) {
  check_fused_moe(hidden, w13, w2, topk_ids, topk_weights);
  check_bias(w13_bias, w13, "w13_bias");
  check_bias(w2_bias, w2, "w2_bias");
  const int64_t tokens = hidden.size(0), k = topk_ids.size(1);
  if (tokens == 0 || k == 0) return at::zeros_like(hidden);
  const auto [order, offsets] = group_by_expert(topk_ids, w13.size(0));
  const at::Tensor x = hidden.index_select(0, at::floor_divide(order, k));  // pair p's token is p / k
  const at::Tensor gate_up = grouped_mm(x, w13, w13_bias, offsets);
  const at::Tensor act = expert_activation(gate_up, activation, swiglu_alpha, swiglu_limit);
  const at::Tensor down = grouped_mm(act, w2, w2_bias, offsets);
  // Back in pair order ([tokens, k, hidden]), then each token's k outputs summed under their weights.
  const at::Tensor pairs = at::empty_like(down).index_copy_(0, order, down).view({tokens, k, hidden.size(1)});
  const at::Tensor weighted = at::mul(pairs.to(at::kFloat), topk_weights.to(at::kFloat).unsqueeze(-1));
  return weighted.sum(1).to(hidden.scalar_type());
}

}  // namespace pagedserve
