// One Llama-family decoder layer (pre-norm attention + gated MLP, optional biases and q/k norms) in one CPU
// call: the same ops in the same order as the model's Python forward (engine/models/llama.py), so the result is
// bit-identical to it. What it saves is the Python and dispatch between the ops, ~0.2-0.3 ms a layer: time in
// which memory sat idle between weight-streaming GEMMs and the GEMM's helper threads fell back asleep.
#include <ATen/Functions.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include "../ops.h"

namespace pagedserve {
namespace {

// RMSNorm's formula without a residual, as the Python layer computes it: fp32 through torch's fused op,
// other dtypes normalised in fp32, cast, then scaled.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t n = x.size(-1);
  if (x.scalar_type() == at::kFloat) return at::rms_norm(x, {n}, weight, eps);
  return at::mul(weight, at::rms_norm(x.to(at::kFloat), {n}, c10::nullopt, eps).to(x.scalar_type()));
}

// Linear layer ``i`` of qkv, o, gate_up, down: packed weights[(1, 2, 4, 5)[i]], its bias optional[i]; quantized
// layers (optional has 14 entries) also have two tensors at optional[6 + 2i], [7 + 2i]: a W8A8 layer's (int8
// panels) scale and column offsets, a 4-bit layer's (uint8 panels) group scales and offsets; None for a layer
// left in the model's dtype (a 4-bit model's layer whose width its group size does not divide).
at::Tensor linear(const at::Tensor& x, int64_t i, at::TensorList weights,
                  const c10::List<c10::optional<at::Tensor>>& optional, int64_t out_features) {
  static constexpr int64_t kWeight[] = {1, 2, 4, 5};
  const at::Tensor& weight = weights[kWeight[i]];
  const c10::optional<at::Tensor> bias = optional.get(i);
  if (optional.size() == 6 || !optional.get(6 + 2 * i).has_value())
    return skinny_linear_cpu(x, weight, bias, out_features);
  const at::Tensor scale = *optional.get(6 + 2 * i), offsets = *optional.get(7 + 2 * i);
  if (weight.scalar_type() == at::kByte) return skinny_linear_w4_cpu(x, weight, scale, offsets, bias, out_features);
  return skinny_linear_w8a8_cpu(x, weight, scale, offsets, bias, out_features);
}

}  // namespace

at::Tensor llama_decoder_layer_cpu(at::Tensor& residual, const c10::optional<at::Tensor>& hidden,
                                   at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& optional,
                                   at::IntArrayRef sizes, const at::Tensor& positions, const at::Tensor& cos,
                                   const at::Tensor& sin, at::Tensor& key_cache, at::Tensor& value_cache,
                                   const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                   const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                   int64_t max_query_len, int64_t max_seq_len, double eps, double scale,
                                   int64_t sliding_window, const c10::optional<at::Tensor>& key_scale,
                                   const c10::optional<at::Tensor>& value_scale) {
  TORCH_CHECK(weights.size() == 6 && (optional.size() == 6 || optional.size() == 14) && sizes.size() == 7,
              "llama_decoder_layer takes 6 weights (input norm, qkv, o, post-attention norm, gate_up, down), "
              "6 optional ones (qkv, o, gate_up and down biases, q and k norms; then, for W8A8 or 4-bit "
              "layers, each linear's scales and offsets) and 7 sizes, got ", weights.size(), ", ", optional.size(), " and ",
              sizes.size());
  const int64_t tokens = residual.size(0), heads = sizes[0], kv_heads = sizes[1], d = sizes[2];
  // Without `hidden` (the first layer) the residual stream is the layer's input as it is.
  const at::Tensor x = hidden ? fused_add_rms_norm_cpu(residual, *hidden, weights[0], eps)
                              : rms_norm(residual, weights[0], eps);
  const at::Tensor qkv = linear(x, 0, weights, optional, sizes[3]).view({tokens, -1, d});
  at::Tensor qk = qkv.narrow(1, 0, heads + kv_heads);
  const c10::optional<at::Tensor> q_norm = optional.get(4), k_norm = optional.get(5);
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "llama_decoder_layer: a q norm without a k norm or back");
  if (q_norm)  // each head normalised (Qwen3), into a new q|k as the Python forward's two norms and cat
    qk = at::cat(
        {rms_norm(qk.narrow(1, 0, heads), *q_norm, eps), rms_norm(qk.narrow(1, heads, kv_heads), *k_norm, eps)}, 1);
  at::Tensor rotated = qk.narrow(2, 0, 2 * cos.size(1));  // partial rotary (Phi-4-mini): the leading dims alone
  rotary_embedding_cpu(rotated, positions, cos, sin);
  const at::Tensor q = qk.narrow(1, 0, heads);
  reshape_and_cache_cpu(qk.narrow(1, heads, kv_heads), qkv.narrow(1, heads + kv_heads, kv_heads), key_cache,
                        value_cache, slot_mapping, key_scale, value_scale);
  at::Tensor attn = at::empty({tokens, heads, d}, residual.options());
  paged_attention_cpu(attn, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                      max_seq_len, scale, sliding_window, /*softcap=*/0.0, key_scale, value_scale,
                      /*sinks=*/c10::nullopt);
  const at::Tensor o = linear(attn.view({tokens, heads * d}), 1, weights, optional, sizes[4]);
  const at::Tensor h = fused_add_rms_norm_cpu(residual, o, weights[3], eps);
  const at::Tensor gate_up = linear(h, 2, weights, optional, sizes[5]);
  return linear(silu_and_mul_cpu(gate_up), 3, weights, optional, sizes[6]);
}

}  // namespace pagedserve
