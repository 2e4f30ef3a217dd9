// Torch-facing side of the CUDA ops: checks, device guard, current stream, and
// registration under the CUDA dispatch key. Only c10 core headers, so it also
// compiles against a CPU-only torch (the nvcc check syntax-checks it).
#include <ATen/core/Tensor.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/to.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include "../checks.h"
#include "../ops.h"
#include "launch.h"

namespace pagedserve {
namespace {

cudaStream_t current_stream(const at::Device& device) {
  return static_cast<cudaStream_t>(
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device).native_handle());
}

cuda::Dtype dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return cuda::Dtype::f32;
    case at::kHalf: return cuda::Dtype::f16;
    case at::kBFloat16: return cuda::Dtype::bf16;
    default: TORCH_CHECK(false, "CUDA pagedserve ops support float32, float16 and bfloat16, got ", t.scalar_type());
  }
}

cuda::KVCodes codes_of(const at::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kChar: return cuda::KVCodes::i8;
    case at::kFloat8_e4m3fn: return cuda::KVCodes::fp8;
    default: return cuda::KVCodes::none;
  }
}

void check_cuda(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, " failed: ", cudaGetErrorString(err));
}

void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping,
                            const c10::optional<at::Tensor>& key_scale, const c10::optional<at::Tensor>& value_scale) {
  const bool quantized = check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, key_scale,
                                                 value_scale);
  if (key.size(0) == 0) return;
  const c10::DeviceGuard guard(key.device());
  const auto slots = slot_mapping.contiguous();
  cuda::CacheWriteArgs args{key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                                  slots.data_ptr<int64_t>(), key.size(0), key.stride(0), key.stride(1),
                                  value.stride(0), value.stride(1), key_cache.stride(0), value_cache.stride(0),
                                  static_cast<int>(key.size(1)), static_cast<int>(key_cache.size(2)),
                                  static_cast<int>(key.size(2))};
  if (quantized) {
    args.key_scale = key_scale->data_ptr(), args.value_scale = value_scale->data_ptr();
    args.ks_stride_b = key_scale->stride(0), args.vs_stride_b = value_scale->stride(0);
  }
  check_cuda(cuda::reshape_and_cache(args, dtype_of(key), codes_of(key_cache), current_stream(key.device())),
             "reshape_and_cache");
}

cuda::AttentionArgs attention_args(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                   const at::Tensor& value_cache, const at::Tensor& block_tables,
                                   const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                                   int64_t sliding_window, double softcap, const c10::optional<at::Tensor>& key_scale,
                                   const c10::optional<at::Tensor>& value_scale,
                                   const c10::optional<at::Tensor>& sinks) {
  const bool quantized = check_paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                                               query_start_loc, key_scale, value_scale, sinks);
  TORCH_CHECK(sliding_window >= 0, "paged_attention: sliding_window must be >= 0 (0: none), got ", sliding_window);
  TORCH_CHECK(softcap >= 0, "paged_attention: softcap must be >= 0 (0: none), got ", softcap);
  return {out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
          block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
          out.stride(0), out.stride(1), query.stride(0), query.stride(1), key_cache.stride(0), value_cache.stride(0),
          block_tables.stride(0), static_cast<int>(query.size(0)), static_cast<int>(block_tables.size(0)),
          static_cast<int>(query.size(1)), static_cast<int>(key_cache.size(1)), static_cast<int>(key_cache.size(3)),
          static_cast<int>(key_cache.size(2)), static_cast<float>(scale), static_cast<int>(sliding_window),
          static_cast<float>(softcap),
          quantized ? key_scale->data_ptr() : nullptr, quantized ? value_scale->data_ptr() : nullptr,
          quantized ? key_scale->stride(0) : 0, quantized ? value_scale->stride(0) : 0,
          sinks ? sinks->data_ptr<float>() : nullptr};
}

void paged_attention_cuda(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, int64_t /*max_query_len*/, int64_t /*max_seq_len*/,
                          double scale, int64_t sliding_window, double softcap,
                          const c10::optional<at::Tensor>& key_scale, const c10::optional<at::Tensor>& value_scale,
                          const c10::optional<at::Tensor>& sinks) {
  const auto args = attention_args(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                   scale, sliding_window, softcap, key_scale, value_scale, sinks);
  const c10::DeviceGuard guard(query.device());
  check_cuda(cuda::paged_attention(args, dtype_of(query), codes_of(key_cache), current_stream(query.device())),
             "paged_attention");
}

// The split kernels read K/V rows with 16-byte loads.
void check_16_byte_rows(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(cache.data_ptr()) % 16 == 0 && cache.stride(0) * cache.element_size() % 16 == 0,
              "paged_attention_split: ", name, " must start and have its blocks at 16-byte aligned addresses");
}

// max_query_len and max_seq_len size the grids and the partition scratch: they must bound the batch.
void paged_attention_split_cuda(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t max_query_len,
                                int64_t max_seq_len, double scale, int64_t sliding_window, double softcap,
                                const c10::optional<at::Tensor>& key_scale,
                                const c10::optional<at::Tensor>& value_scale, const c10::optional<at::Tensor>& sinks) {
  if (key_scale)  // the split kernels stage 16-bit / fp32 K/V rows: a quantized cache runs the simple kernel
    return paged_attention_cuda(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                max_query_len, max_seq_len, scale, sliding_window, softcap, key_scale, value_scale,
                                sinks);
  const auto attn = attention_args(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                   scale, sliding_window, softcap, key_scale, value_scale, sinks);
  check_16_byte_rows(key_cache, "key_cache");
  check_16_byte_rows(value_cache, "value_cache");
  TORCH_CHECK(max_query_len >= 0 && max_seq_len >= 0, "paged_attention_split: max_query_len and max_seq_len must be "
              ">= 0, got ", max_query_len, " and ", max_seq_len);
  const c10::DeviceGuard guard(query.device());
  const int parts = cuda::split_partitions(static_cast<int>(max_seq_len), attn.window);
  const int64_t seqs = attn.num_seqs, heads = attn.num_heads;
  const auto options = query.options().dtype(at::kFloat);
  // One partition writes the output directly: no scratch.
  const auto stats = at::empty({parts > 1 ? 2 * seqs * heads * parts : 0}, options);
  const auto partials = at::empty({parts > 1 ? seqs * heads * parts * attn.head_size : 0}, options);
  const int group = attn.num_heads / attn.num_kv_heads;
  const cuda::SplitAttentionArgs args{attn, stats.data_ptr<float>(), stats.data_ptr<float>() + seqs * heads * parts,
                                      partials.data_ptr<float>(), parts,
                                      (group + cuda::kSplitMaxGroup - 1) / cuda::kSplitMaxGroup,
                                      static_cast<int>(max_query_len)};
  check_cuda(cuda::paged_attention_split(args, dtype_of(query), current_stream(query.device())),
             "paged_attention_split");
}

void copy_blocks_cuda(at::Tensor& kv_cache, const at::Tensor& block_mapping) {
  check_block_mapping(block_mapping);
  const int64_t row_bytes = block_row_numel(kv_cache, "kv_cache") * kv_cache.element_size();
  if (block_mapping.size(0) == 0) return;
  if (block_mapping.is_cpu())  // a device mapping is trusted: checking it would sync
    check_mapping_range(block_mapping.contiguous().data_ptr<int64_t>(), block_mapping.size(0), kv_cache.size(0),
                        kv_cache.size(0));
  const c10::DeviceGuard guard(kv_cache.device());
  const auto mapping = block_mapping.to(kv_cache.device(), /*non_blocking=*/true).contiguous();
  check_cuda(cuda::copy_blocks(kv_cache.data_ptr(), mapping.data_ptr<int64_t>(), mapping.size(0), row_bytes,
                               current_stream(kv_cache.device())),
             "copy_blocks");
}

// Device <-> host block rows as async copies on the current stream, ordered with
// the model's kernels; a pinned host pool keeps them truly asynchronous.
void swap_blocks_cuda(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  check_block_mapping(block_mapping);
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "swap_blocks: src and dst differ in dtype");
  const int64_t row_bytes = block_row_numel(src, "src") * src.element_size();
  TORCH_CHECK(row_bytes == block_row_numel(dst, "dst") * dst.element_size(),
              "swap_blocks: src and dst block rows differ in size");
  const auto mapping = block_mapping.to(at::kCPU).contiguous();
  const int64_t* m = mapping.data_ptr<int64_t>();
  const at::Device device = src.is_cuda() ? src.device() : dst.device();
  const c10::DeviceGuard guard(device);
  const cudaStream_t stream = current_stream(device);
  check_mapping_range(m, mapping.size(0), src.size(0), dst.size(0));
  for (int64_t i = 0; i < mapping.size(0); ++i)
    check_cuda(cudaMemcpyAsync(static_cast<char*>(dst.data_ptr()) + m[2 * i + 1] * row_bytes,
                               static_cast<const char*>(src.data_ptr()) + m[2 * i] * row_bytes, row_bytes,
                               cudaMemcpyDefault, stream),
               "swap_blocks");
}

at::Tensor fused_add_rms_norm_cuda(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_add_rms_norm(residual, x, weight);
  const c10::DeviceGuard guard(x.device());
  auto out = at::empty(x.sizes(), x.options());
  const cuda::AddRmsNormArgs args{residual.data_ptr(), x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.size(0),
                                  residual.stride(0), x.stride(0), static_cast<int>(x.size(1)),
                                  static_cast<float>(eps)};
  check_cuda(cuda::fused_add_rms_norm(args, dtype_of(x), current_stream(x.device())), "fused_add_rms_norm");
  return out;
}

// Positions are trusted here (checking them would sync); the CPU op checks them.
void rotary_embedding_cuda(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  check_rotary(x, positions, cos, sin);
  const c10::DeviceGuard guard(x.device());
  const auto pos = positions.contiguous();
  const cuda::RotaryArgs args{x.data_ptr(), pos.data_ptr<int64_t>(), cos.data_ptr(), sin.data_ptr(), x.size(0),
                              x.stride(0), x.stride(1), static_cast<int>(x.size(1)), static_cast<int>(x.size(2) / 2)};
  check_cuda(cuda::rotary_embedding(args, dtype_of(x), current_stream(x.device())), "rotary_embedding");
}

using ActAndMulLaunch = cudaError_t (*)(const cuda::ActAndMulArgs&, cuda::Dtype, cudaStream_t);

at::Tensor act_and_mul_cuda(const at::Tensor& x, const char* op, ActAndMulLaunch launch) {
  check_act_and_mul(x, op);
  const c10::DeviceGuard guard(x.device());
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  const cuda::ActAndMulArgs args{x.data_ptr(), out.data_ptr(), x.size(0), x.stride(0), x.size(1) / 2};
  check_cuda(launch(args, dtype_of(x), current_stream(x.device())), op);
  return out;
}

at::Tensor silu_and_mul_cuda(const at::Tensor& x) { return act_and_mul_cuda(x, "silu_and_mul", cuda::silu_and_mul); }

at::Tensor gelu_tanh_and_mul_cuda(const at::Tensor& x) {
  return act_and_mul_cuda(x, "gelu_tanh_and_mul", cuda::gelu_tanh_and_mul);
}

// The 4-bit layer packed on the host by pack_linear_weight_w4 and moved to the device (one layout for both).
at::Tensor skinny_linear_w4_cuda(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales,
                                 const at::Tensor& offsets, const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_cuda(), "skinny_linear_w4: x must be a 2-D CUDA tensor, got ", x_in.sizes());
  const int64_t panels = (out_features + 63) / 64;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(0) == panels &&
                  packed.size(1) * 4 == x_in.size(1) && packed.size(2) == 128 && packed.is_contiguous(),
              "skinny_linear_w4: packed weight ", packed.sizes(), " does not fit x ", x_in.sizes(), " and out_features ",
              out_features, " (pack_linear_weight_w4)");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == panels && scales.size(2) == 64 && offsets.sizes() == scales.sizes()
                  && scales.scalar_type() == at::kFloat && offsets.scalar_type() == at::kFloat && scales.is_contiguous()
                  && offsets.is_contiguous() && (packed.size(1) % scales.size(1)) == 0,
              "skinny_linear_w4: scales and offsets must be contiguous fp32 [", panels, ", groups, 64]");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == x.scalar_type() && b.numel() == out_features, "skinny_linear_w4: bias must be [",
                out_features, "] in x's dtype");
  }
  const c10::DeviceGuard guard(x.device());
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  const cuda::W4LinearArgs args{x.data_ptr(), packed.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                                offsets.data_ptr<float>(), b.defined() ? b.data_ptr() : nullptr, y.data_ptr(),
                                x.size(0), x.size(1), out_features, x.stride(0), y.stride(0),
                                static_cast<int>(scales.size(1))};
  check_cuda(cuda::w4_linear(args, dtype_of(x), current_stream(x.device())), "skinny_linear_w4");
  return y;
}

// torch's own argmax is already parallel on the GPU.
at::Tensor row_argmax_cuda(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "row_argmax: x must be [rows, n > 0], got ", x.sizes());
  return at::argmax(x, -1);
}

// The bitmask and rows come from the host (xgrammar fills the bitmask there): rows are range-checked before the
// copy, a device tensor of rows is trusted (checking it would sync).
cuda::TokenBitmaskArgs token_bitmask_args(const char* op, const at::Tensor& logits, at::Tensor& words,
                                          at::Tensor& targets) {
  check_token_bitmask(op, logits, words, targets);
  if (targets.is_cpu()) check_row_range(op, targets.contiguous().data_ptr<int64_t>(), targets.size(0), logits.size(0));
  words = words.to(logits.device(), /*non_blocking=*/true).contiguous();
  targets = targets.to(logits.device(), /*non_blocking=*/true).contiguous();
  return {logits.data_ptr(), words.data_ptr<int32_t>(), targets.data_ptr<int64_t>(), targets.size(0), logits.size(1),
          logits.stride(0), words.size(1)};
}

void apply_token_bitmask_cuda(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  const c10::DeviceGuard guard(logits.device());
  at::Tensor words = bitmask, targets = rows;  // the device copies live until the kernel is queued
  const auto args = token_bitmask_args("apply_token_bitmask", logits, words, targets);
  check_cuda(cuda::apply_token_bitmask(args, dtype_of(logits), current_stream(logits.device())), "apply_token_bitmask");
}

at::Tensor masked_row_argmax_cuda(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  const c10::DeviceGuard guard(logits.device());
  at::Tensor words = bitmask, targets = rows;
  const auto args = token_bitmask_args("masked_row_argmax", logits, words, targets);
  auto out = at::empty({targets.size(0)}, logits.options().dtype(at::kLong));
  check_cuda(cuda::masked_row_argmax(args, out.data_ptr<int64_t>(), dtype_of(logits), current_stream(logits.device())),
             "masked_row_argmax");
  return out;
}

// Gated DeltaNet: the per-sequence metadata on the device in the kernels' types; activations as fp32.
struct SeqTensors {
  at::Tensor qsl, slots, initial, saves, save_at;
  cuda::SeqStates view() const {
    return {qsl.data_ptr<int32_t>(), slots.data_ptr<int64_t>(), initial.data_ptr<uint8_t>(), saves.data_ptr<int64_t>(),
            save_at.data_ptr<int64_t>(), static_cast<int>(slots.numel())};
  }
};

SeqTensors seq_tensors(const at::Tensor& slots, const at::Tensor& qsl, const at::Tensor& initial,
                       const at::Tensor& saves, const at::Tensor& save_at, const at::Device& device, const char* op) {
  const int64_t n = slots.numel();
  TORCH_CHECK(qsl.numel() == n + 1 && initial.numel() == n && saves.numel() == n && save_at.numel() == n, op,
              ": slots, has_initial, save_slots, save_offsets need one entry per sequence and query_start_loc one more");
  auto on = [&](const at::Tensor& t, at::ScalarType type) { return t.to(device, type).contiguous(); };
  return {on(qsl, at::kInt), on(slots, at::kLong), on(initial, at::kByte), on(saves, at::kLong), on(save_at, at::kLong)};
}

at::Tensor gated_delta_rule_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                 const at::Tensor& beta, at::Tensor& states, const at::Tensor& slots,
                                 const at::Tensor& query_start_loc, const at::Tensor& has_initial,
                                 const at::Tensor& save_slots, const at::Tensor& save_offsets) {
  const c10::DeviceGuard guard(q.device());
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0) &&
                  v.size(1) % q.size(1) == 0, "gated_delta_rule: q, k [T, Hk, Dk] and v [T, Hv, Dv] expected");
  TORCH_CHECK(states.scalar_type() == at::kFloat && states.is_contiguous() && states.dim() == 4 &&
                  states.size(1) == v.size(1) && states.size(2) == q.size(2) && states.size(3) == v.size(2),
              "gated_delta_rule: states must be contiguous fp32 [slots, Hv, Dk, Dv]");
  TORCH_CHECK(q.size(2) <= cuda::kMaxDeltaKeyDim, "gated_delta_rule: key head dim over ", cuda::kMaxDeltaKeyDim);
  const auto seqs = seq_tensors(slots, query_start_loc, has_initial, save_slots, save_offsets, q.device(),
                                "gated_delta_rule");
  auto f = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
  const auto qf = f(q), kf = f(k), vf = f(v), gf = f(g), bf = f(beta);
  auto out = at::empty(vf.sizes(), vf.options());
  const cuda::DeltaRuleArgs args{seqs.view(), qf.data_ptr<float>(), kf.data_ptr<float>(), vf.data_ptr<float>(),
                                 gf.data_ptr<float>(), bf.data_ptr<float>(), out.data_ptr<float>(),
                                 states.data_ptr<float>(), static_cast<int>(q.size(1)), static_cast<int>(v.size(1)),
                                 static_cast<int>(q.size(2)), static_cast<int>(v.size(2))};
  check_cuda(cuda::gated_delta_rule(args, current_stream(q.device())), "gated_delta_rule");
  return out.to(v.scalar_type());
}

at::Tensor causal_conv1d_cuda(const at::Tensor& x, const at::Tensor& weight, at::Tensor& conv_states,
                              const at::Tensor& slots, const at::Tensor& query_start_loc, const at::Tensor& has_initial,
                              const at::Tensor& save_slots, const at::Tensor& save_offsets) {
  const c10::DeviceGuard guard(x.device());
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(0) == x.size(1),
              "causal_conv1d: x [T, C] and weight [C, K] expected");
  TORCH_CHECK(conv_states.is_contiguous() && conv_states.dim() == 3 && conv_states.size(1) == x.size(1) &&
                  conv_states.size(2) == weight.size(1) - 1 && conv_states.scalar_type() == x.scalar_type(),
              "causal_conv1d: conv_states must be contiguous [slots, C, K - 1] in x's dtype");
  const auto seqs = seq_tensors(slots, query_start_loc, has_initial, save_slots, save_offsets, x.device(),
                                "causal_conv1d");
  const auto xf = x.to(at::kFloat).contiguous(), wf = weight.to(at::kFloat).contiguous();
  auto out = at::empty(xf.sizes(), xf.options());
  const cuda::ConvArgs args{seqs.view(), xf.data_ptr<float>(), wf.data_ptr<float>(), out.data_ptr<float>(),
                            conv_states.data_ptr(), static_cast<int>(x.size(1)), static_cast<int>(weight.size(1) - 1)};
  check_cuda(cuda::causal_conv1d(args, dtype_of(x), current_stream(x.device())), "causal_conv1d");
  return out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedserve, CUDA, m) {
  m.impl("reshape_and_cache", &reshape_and_cache_cuda);
  m.impl("paged_attention", &paged_attention_cuda);
  m.impl("paged_attention_split", &paged_attention_split_cuda);
  m.impl("copy_blocks", &copy_blocks_cuda);
  m.impl("swap_blocks", &swap_blocks_cuda);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_cuda);
  m.impl("rotary_embedding", &rotary_embedding_cuda);
  m.impl("skinny_linear_w4", &skinny_linear_w4_cuda);
  m.impl("silu_and_mul", &silu_and_mul_cuda);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul_cuda);
  m.impl("row_argmax", &row_argmax_cuda);
  m.impl("apply_token_bitmask", &apply_token_bitmask_cuda);
  m.impl("masked_row_argmax", &masked_row_argmax_cuda);
  m.impl("fused_moe", &fused_moe);  // ATen ops on the device (cpu/moe.cpp)
  m.impl("gated_delta_rule", &gated_delta_rule_cuda);
  m.impl("causal_conv1d", &causal_conv1d_cuda);
}

}  // namespace pagedserve
