// Op schemas of the `pagedserve` namespace and their CPU kernels. The CUDA
// kernels register under the same names in csrc/cuda/*.cu when built (the
// skinny GEMM ops and the decoder layer built on them are CPU-only).
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(pagedserve, m) {
  // key_scale / value_scale: an int8 / fp8 cache's bf16 scales (None: unquantized; csrc/checks.h).
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, Tensor(c!)? key_scale=None, Tensor(d!)? value_scale=None) -> ()");
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, int max_query_len, int max_seq_len, float scale, "
        "int sliding_window=0, float softcap=0.0, Tensor? key_scale=None, Tensor? value_scale=None, "
        "Tensor? sinks=None) -> ()");
  // The split (flash-decoding) kernels on CUDA; on the CPU the same kernel as paged_attention.
  m.def("paged_attention_split(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int max_query_len, int max_seq_len, "
        "float scale, int sliding_window=0, float softcap=0.0, Tensor? key_scale=None, "
        "Tensor? value_scale=None, Tensor? sinks=None) -> ()");
  m.def("copy_blocks(Tensor(a!) kv_cache, Tensor block_mapping) -> ()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_embedding(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  m.def("row_argmax(Tensor x) -> Tensor");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  m.def("masked_row_argmax(Tensor logits, Tensor bitmask, Tensor rows) -> Tensor");
  m.def("llama_decoder_layer(Tensor(a!) residual, Tensor? hidden, Tensor[] weights, Tensor?[] optional, int[] sizes, "
        "Tensor positions, Tensor cos, Tensor sin, Tensor(b!) key_cache, Tensor(c!) value_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int max_query_len, int max_seq_len, "
        "float eps, float scale, int sliding_window=0, Tensor(d!)? key_scale=None, Tensor(e!)? value_scale=None) "
        "-> Tensor");
  // Each token's top-k experts' gated MLPs, summed under their routing weights (cpu/moe.cpp). The gate's
  // activation: silu or gelu_tanh (Gemma 4); optional expert biases and gpt-oss's clamped SwiGLU (swiglu_alpha > 0).
  m.def("fused_moe(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_ids, Tensor topk_weights, Tensor? w13_bias=None, "
        "Tensor? w2_bias=None, float swiglu_alpha=0.0, float swiglu_limit=0.0, str activation=\"silu\") -> Tensor");
  // Gated DeltaNet over per-sequence state slots, updated in place (cpu/linear_attention.cpp).
  m.def("gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) states, Tensor slots, "
        "Tensor query_start_loc, Tensor has_initial, Tensor save_slots, Tensor save_offsets) -> Tensor");
  m.def("causal_conv1d(Tensor x, Tensor weight, Tensor(a!) conv_states, Tensor slots, Tensor query_start_loc, "
        "Tensor has_initial, Tensor save_slots, Tensor save_offsets) -> Tensor");
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("skinny_linear_argmax(Tensor x, Tensor packed, Tensor? bias, int out_features) -> (Tensor, Tensor)");
  m.def("skinny_linear_w8(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int out_features) -> Tensor");
  m.def("skinny_linear_w8_argmax(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int out_features) -> "
        "(Tensor, Tensor)");
  m.def("pack_linear_weight_w8a8(Tensor q) -> (Tensor, Tensor)");
  m.def("skinny_linear_w8a8(Tensor x, Tensor packed, Tensor scale, Tensor col_offset, Tensor? bias, "
        "int out_features) -> Tensor");
  m.def("pack_linear_weight_w4(Tensor codes, Tensor scale, Tensor? zero) -> (Tensor, Tensor, Tensor)");
  m.def("skinny_linear_w4(Tensor x, Tensor packed, Tensor scales, Tensor offsets, Tensor? bias, int out_features) "
        "-> Tensor");
  m.def("pack_argmax_screen(Tensor weight, Tensor? bias) -> (Tensor, Tensor)");
  m.def("skinny_argmax_screened(Tensor x, Tensor weight, Tensor screen, Tensor bounds, Tensor? bias) -> Tensor");
  // No tensor argument to dispatch on: one kernel for every device.
  m.def("skinny_linear_supports(ScalarType dtype) -> bool", &pagedserve::skinny_linear_supports_cpu);
  m.def("argmax_screen_supports(ScalarType dtype) -> bool", &pagedserve::argmax_screen_supports_cpu);
  m.def("skinny_linear_w8a8_supports() -> bool", &pagedserve::skinny_linear_w8a8_supports_cpu);
  m.def("skinny_linear_w4_supports() -> bool", &pagedserve::skinny_linear_w4_supports_cpu);
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("reshape_and_cache", &pagedserve::reshape_and_cache_cpu);
  m.impl("paged_attention", &pagedserve::paged_attention_cpu);
  m.impl("paged_attention_split", &pagedserve::paged_attention_cpu);
  m.impl("copy_blocks", &pagedserve::copy_blocks_cpu);
  m.impl("swap_blocks", &pagedserve::swap_blocks_cpu);
  m.impl("fused_add_rms_norm", &pagedserve::fused_add_rms_norm_cpu);
  m.impl("rotary_embedding", &pagedserve::rotary_embedding_cpu);
  m.impl("silu_and_mul", &pagedserve::silu_and_mul_cpu);
  m.impl("gelu_tanh_and_mul", &pagedserve::gelu_tanh_and_mul_cpu);
  m.impl("row_argmax", &pagedserve::row_argmax_cpu);
  m.impl("apply_token_bitmask", &pagedserve::apply_token_bitmask_cpu);
  m.impl("masked_row_argmax", &pagedserve::masked_row_argmax_cpu);
  m.impl("llama_decoder_layer", &pagedserve::llama_decoder_layer_cpu);
  m.impl("fused_moe", &pagedserve::fused_moe);
  m.impl("gated_delta_rule", &pagedserve::gated_delta_rule_cpu);
  m.impl("causal_conv1d", &pagedserve::causal_conv1d_cpu);
  m.impl("pack_linear_weight", &pagedserve::pack_linear_weight_cpu);
  m.impl("skinny_linear", &pagedserve::skinny_linear_cpu);
  m.impl("skinny_linear_argmax", &pagedserve::skinny_linear_argmax_cpu);
  m.impl("skinny_linear_w8", &pagedserve::skinny_linear_w8_cpu);
  m.impl("skinny_linear_w8_argmax", &pagedserve::skinny_linear_w8_argmax_cpu);
  m.impl("pack_linear_weight_w8a8", &pagedserve::pack_linear_weight_w8a8_cpu);
  m.impl("skinny_linear_w8a8", &pagedserve::skinny_linear_w8a8_cpu);
  m.impl("pack_linear_weight_w4", &pagedserve::pack_linear_weight_w4_cpu);
  m.impl("skinny_linear_w4", &pagedserve::skinny_linear_w4_cpu);
  m.impl("pack_argmax_screen", &pagedserve::pack_argmax_screen_cpu);
  m.impl("skinny_argmax_screened", &pagedserve::skinny_argmax_screened_cpu);
}
