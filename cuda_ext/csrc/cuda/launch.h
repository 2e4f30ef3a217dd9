// Plain-C++ interface between the torch bindings (bindings.cpp) and the CUDA
// kernels (*.cu): raw pointers, strides in elements, the stream to launch on.
// The .cu files include no torch header, so nvcc compiles them anywhere.
#pragma once
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

namespace pagedserve::cuda {

enum class Dtype { f32, f16, bf16 };
// A quantized KV cache's codes (csrc/checks.h), each (slot, KV head) row with a bf16 scale; none: the cache holds
// the activations' dtype.
enum class KVCodes { none, i8, fp8 };

struct CacheWriteArgs {
  const void* key;
  const void* value;
  void* key_cache;
  void* value_cache;
  const int64_t* slot_mapping;
  int64_t num_tokens, key_stride_t, key_stride_h, value_stride_t, value_stride_h, k_stride_b, v_stride_b;
  int heads, block_size, head_size;
  void* key_scale = nullptr;  // quantized: bf16 [num_blocks, heads, block_size] views
  void* value_scale = nullptr;
  int64_t ks_stride_b = 0, vs_stride_b = 0;
};

struct AttentionArgs {
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int64_t out_stride_t, out_stride_h, q_stride_t, q_stride_h, k_stride_b, v_stride_b, table_stride;
  int num_tokens, num_seqs, num_heads, num_kv_heads, head_size, block_size;
  float scale;
  int window;  // sliding window: a row at position t sees keys (t - window, t]; 0 = all of [0, t]
  float softcap;  // scores become softcap * tanh(score / softcap) before the softmax (Gemma 2); 0 = off
  const void* key_scale = nullptr;  // quantized: bf16 [num_blocks, num_kv_heads, block_size] views
  const void* value_scale = nullptr;
  int64_t ks_stride_b = 0, vs_stride_b = 0;
  const float* sinks = nullptr;  // [num_heads] logits joining each row's softmax denominator (gpt-oss); null = none
};

// The split kernels (attention_split.cu): decode rows in context partitions of kSplitPartition tokens, each CTA
// taking up to kSplitMaxGroup query heads of one KV head; a row over several partitions leaves (max, sum-exp,
// normalised out) per partition in the scratch for the merge kernel. max_query_len / max_seq_len must bound the
// batch: they size the grids.
constexpr int kSplitPartition = 512;
constexpr int kSplitMaxGroup = 8;

struct SplitAttentionArgs {
  AttentionArgs attn;
  float* maxes;     // [num_seqs, num_heads, max_partitions]; unused when max_partitions == 1
  float* sums;      // same shape
  float* partials;  // [num_seqs, num_heads, max_partitions, head_size]
  int max_partitions, head_chunks, max_query_len;
};

// Partitions a decode row of at most max_seq_len keys spans: a window of w keys touches at most ceil(w / P) + 1.
inline int split_partitions(int max_seq_len, int window) {
  const int all = std::max(1, (max_seq_len + kSplitPartition - 1) / kSplitPartition);
  return window > 0 ? std::min(all, (window + kSplitPartition - 1) / kSplitPartition + 1) : all;
}

struct AddRmsNormArgs {
  void* residual;
  const void* x;
  const void* weight;
  void* out;  // dense [rows, n]
  int64_t rows, res_stride, x_stride;
  int n;
  float eps;
};

struct RotaryArgs {
  void* x;
  const int64_t* positions;
  const void* cos;  // dense [max_position, half]
  const void* sin;
  int64_t tokens, stride_t, stride_h;
  int heads, half;
};

struct ActAndMulArgs {
  const void* x;
  void* out;  // dense [rows, d]
  int64_t rows, x_stride, d;
};

struct TokenBitmaskArgs {
  void* logits;  // read only by masked_row_argmax
  const int32_t* bitmask;  // dense [k, num_words], on the device
  const int64_t* rows;     // [k], on the device
  int64_t k, n, stride, num_words;
};
// Gated DeltaNet over state slots (linear_attention_kernels.cu): per sequence its rows [qsl[i], qsl[i + 1]),
// its slot, whether the slot's state is its start (else zeros), and a snapshot slot (-1: none) that gets the
// state after save_at[i] rows. q/k/v/g/beta/out fp32, dense: q and k [T, hk, dk], v and out [T, hv, dv],
// g and beta [T, hv]; states fp32 [slots, hv, dk, dv].
struct SeqStates {
  const int32_t* query_start_loc;
  const int64_t* slots;
  const uint8_t* has_initial;
  const int64_t* save_slots;
  const int64_t* save_at;
  int num_seqs;
};

struct DeltaRuleArgs {
  SeqStates seqs;
  const float *q, *k, *v, *g, *beta;
  float* out;
  float* states;
  int hk, hv, dk, dv;
};

// x and out fp32 [T, channels]; weight fp32 [channels, width + 1]; conv_states [slots, channels, width] in dtype.
struct ConvArgs {
  SeqStates seqs;
  const float* x;
  const float* weight;
  float* out;
  void* conv_states;
  int channels, width;
};

// The widest key head and conv window the kernels hold in registers.
constexpr int kMaxDeltaKeyDim = 256;
constexpr int kMaxConvWidth = 8;

cudaError_t gated_delta_rule(const DeltaRuleArgs& args, cudaStream_t stream);
cudaError_t causal_conv1d(const ConvArgs& args, Dtype dtype, cudaStream_t stream);
cudaError_t reshape_and_cache(const CacheWriteArgs& args, Dtype dtype, KVCodes codes, cudaStream_t stream);
cudaError_t copy_blocks(void* pool, const int64_t* mapping, int64_t num_pairs, int64_t row_bytes, cudaStream_t stream);
cudaError_t paged_attention(const AttentionArgs& args, Dtype dtype, KVCodes codes, cudaStream_t stream);
cudaError_t paged_attention_split(const SplitAttentionArgs& args, Dtype dtype, cudaStream_t stream);
cudaError_t fused_add_rms_norm(const AddRmsNormArgs& args, Dtype dtype, cudaStream_t stream);
cudaError_t rotary_embedding(const RotaryArgs& args, Dtype dtype, cudaStream_t stream);
// The 4-bit layer of cpu/skinny_w4.cpp's layout (w4_kernels.cu); x, bias and y in the activations' dtype.
struct W4LinearArgs {
  const void* x;
  const uint8_t* packed;  // [panels, k / 4, 128]
  const float* scales;  // [panels, groups, 64]
  const float* offsets;  // zero * scale, as scales
  const void* bias;  // [n] or null
  void* y;  // [rows, n]
  int64_t rows, k, n, x_stride, y_stride;
  int groups;
};

cudaError_t w4_linear(const W4LinearArgs& args, Dtype dtype, cudaStream_t stream);
cudaError_t silu_and_mul(const ActAndMulArgs& args, Dtype dtype, cudaStream_t stream);
cudaError_t gelu_tanh_and_mul(const ActAndMulArgs& args, Dtype dtype, cudaStream_t stream);
cudaError_t apply_token_bitmask(const TokenBitmaskArgs& args, Dtype dtype, cudaStream_t stream);
cudaError_t masked_row_argmax(const TokenBitmaskArgs& args, int64_t* out, Dtype dtype, cudaStream_t stream);

}  // namespace pagedserve::cuda
