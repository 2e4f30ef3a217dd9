// Per-device implementations of the pagedserve ops (schemas in registration.cpp).
#pragma once
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace pagedserve {

// key_scale / value_scale: the bf16 scales of an int8 / fp8 KV cache (nullopt: unquantized; checks.h).
void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping,
                           const c10::optional<at::Tensor>& key_scale, const c10::optional<at::Tensor>& value_scale);
void paged_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, int64_t max_query_len, int64_t max_seq_len, double scale,
                         int64_t sliding_window, double softcap, const c10::optional<at::Tensor>& key_scale,
                         const c10::optional<at::Tensor>& value_scale, const c10::optional<at::Tensor>& sinks);
void copy_blocks_cpu(at::Tensor& kv_cache, const at::Tensor& block_mapping);
void swap_blocks_cpu(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping);
bool skinny_linear_supports_cpu(at::ScalarType dtype);
at::Tensor pack_linear_weight_cpu(const at::Tensor& weight);
at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                             int64_t out_features);
std::tuple<at::Tensor, at::Tensor> skinny_linear_argmax_cpu(const at::Tensor& x, const at::Tensor& packed,
                                                            const c10::optional<at::Tensor>& bias,
                                                            int64_t out_features);
// int8 weights packed by pack_linear_weight, per-output-channel fp32 scales; x fp32 or bf16.
at::Tensor skinny_linear_w8_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                const c10::optional<at::Tensor>& bias, int64_t out_features);
std::tuple<at::Tensor, at::Tensor> skinny_linear_w8_argmax_cpu(const at::Tensor& x, const at::Tensor& packed,
                                                               const at::Tensor& scale,
                                                               const c10::optional<at::Tensor>& bias,
                                                               int64_t out_features);
// int8 weights and per-row int8 activations (VNNI builds; skinny_linear_w8a8_supports says): the weight packed
// by pack_linear_weight_w8a8, which also returns each column's offset term (128 sum_k q_ck).
bool skinny_linear_w8a8_supports_cpu();
std::tuple<at::Tensor, at::Tensor> pack_linear_weight_w8a8_cpu(const at::Tensor& q);
at::Tensor skinny_linear_w8a8_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                                  const at::Tensor& col_offset, const c10::optional<at::Tensor>& bias,
                                  int64_t out_features);
// 4-bit weights (engine/int4.py's codes, per-group scales and zeros; AVX-512 builds: skinny_linear_w4_supports):
// packed by pack_linear_weight_w4 into (panels, scales, zero * scale); x fp32 or bf16 (cpu/skinny_w4.cpp).
bool skinny_linear_w4_supports_cpu();
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_linear_weight_w4_cpu(const at::Tensor& codes, const at::Tensor& scale,
                                                                         const c10::optional<at::Tensor>& zero);
at::Tensor skinny_linear_w4_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                const at::Tensor& offsets, const c10::optional<at::Tensor>& bias, int64_t out_features);
bool argmax_screen_supports_cpu(at::ScalarType dtype);
std::tuple<at::Tensor, at::Tensor> pack_argmax_screen_cpu(const at::Tensor& weight,
                                                          const c10::optional<at::Tensor>& bias);
at::Tensor skinny_argmax_screened_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& screen,
                                      const at::Tensor& bounds, const c10::optional<at::Tensor>& bias);
// The bf16 screen (argmax_screen_int8.cpp), behind pack_argmax_screen / skinny_argmax_screened: its pack of a
// contiguous bf16 weight, and the argmax (nullopt: the screen does not apply here, or cannot bound x).
bool argmax_screen_int8_supports_cpu();
std::tuple<at::Tensor, at::Tensor> pack_argmax_screen_int8_cpu(const at::Tensor& weight);
std::optional<at::Tensor> skinny_argmax_screened_int8_cpu(const at::Tensor& x, const at::Tensor& packed,
                                                          const at::Tensor& screen, const at::Tensor& bounds,
                                                          const float* bias);
at::Tensor fused_add_rms_norm_cpu(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps);
void rotary_embedding_cpu(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul_cpu(const at::Tensor& x);
at::Tensor gelu_tanh_and_mul_cpu(const at::Tensor& x);
at::Tensor row_argmax_cpu(const at::Tensor& x);
void apply_token_bitmask_cpu(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows);
at::Tensor masked_row_argmax_cpu(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows);
at::Tensor llama_decoder_layer_cpu(at::Tensor& residual, const c10::optional<at::Tensor>& hidden,
                                   at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& optional,
                                   at::IntArrayRef sizes, const at::Tensor& positions, const at::Tensor& cos,
                                   const at::Tensor& sin, at::Tensor& key_cache, at::Tensor& value_cache,
                                   const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                   const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                   int64_t max_query_len, int64_t max_seq_len, double eps, double scale,
                                   int64_t sliding_window, const c10::optional<at::Tensor>& key_scale,
                                   const c10::optional<at::Tensor>& value_scale);
// Sparse MoE experts as grouped GEMMs (cpu/moe.cpp): ATen ops only, registered for CPU and CUDA alike.
at::Tensor fused_moe(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                     const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                     const c10::optional<at::Tensor>& w13_bias, const c10::optional<at::Tensor>& w2_bias,
                     double swiglu_alpha, double swiglu_limit, c10::string_view activation);

// Gated DeltaNet's state-carrying ops over per-sequence state slots (cpu/linear_attention.cpp).
at::Tensor gated_delta_rule_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, at::Tensor& states, const at::Tensor& slots,
                                const at::Tensor& query_start_loc, const at::Tensor& has_initial,
                                const at::Tensor& save_slots, const at::Tensor& save_offsets);
at::Tensor causal_conv1d_cpu(const at::Tensor& x, const at::Tensor& weight, at::Tensor& conv_states,
                             const at::Tensor& slots, const at::Tensor& query_start_loc, const at::Tensor& has_initial,
                             const at::Tensor& save_slots, const at::Tensor& save_offsets);

}  // namespace pagedserve
