// Argument checks shared by the CPU and CUDA implementations, so both reject
// bad input with the same messages. KV layout: see cuda_ext/README.md.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "head_sizes.h"

namespace pagedserve {

// Quantized KV caches: int8 or float8_e4m3fn codes, each (slot, KV head) row of K and of V with one bf16 scale,
// the row's absmax / the largest code (cuda_ext/reference.py quantize_kv).
constexpr float kInt8KVMax = 127.f;
constexpr float kFp8KVMax = 448.f;

inline bool is_kv_code_dtype(at::ScalarType t) { return t == at::kChar || t == at::kFloat8_e4m3fn; }

// key_scale / value_scale: both or neither; bf16 [num_blocks, num_kv_heads, block_size] (any stride(0): views of
// one all-layer tensor) beside an int8 / fp8 cache. Returns whether the cache is quantized.
inline bool check_kv_scales(const at::Tensor& key_cache, const c10::optional<at::Tensor>& key_scale,
                            const c10::optional<at::Tensor>& value_scale, const char* op) {
  TORCH_CHECK(key_scale.has_value() == value_scale.has_value(), op, ": key_scale and value_scale go together");
  const bool quantized = key_scale.has_value();
  TORCH_CHECK(quantized == is_kv_code_dtype(key_cache.scalar_type()), op, ": a ", key_cache.scalar_type(),
              " KV cache ", quantized ? "takes no scales" : "needs key_scale and value_scale",
              " (scales go with int8 / float8_e4m3fn caches only)");
  if (!quantized) return false;
  for (const at::Tensor* s : {&*key_scale, &*value_scale}) {
    TORCH_CHECK(s->scalar_type() == at::kBFloat16 && s->dim() == 3 && s->size(0) == key_cache.size(0) &&
                    s->size(1) == key_cache.size(1) && s->size(2) == key_cache.size(2),
                op, ": KV scales must be bfloat16 [num_blocks, num_kv_heads, block_size] = ",
                key_cache.sizes().slice(0, 3), ", got ", s->scalar_type(), " ", s->sizes());
    TORCH_CHECK(s->stride(2) == 1 && s->stride(1) == s->size(2), op,
                ": KV scales must be contiguous in [num_kv_heads, block_size], got strides ", s->strides());
    TORCH_CHECK(s->device() == key_cache.device(), op, ": KV scales on ", s->device(), ", cache on ",
                key_cache.device());
  }
  return true;
}

// [num_blocks, num_kv_heads, block_size, head_size]; any stride(0) (the
// engine passes per-layer views of one all-layer tensor), inner dims dense.
inline void check_cache(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK(key_cache.dim() == 4, "key_cache must be [num_blocks, num_kv_heads, block_size, head_size], got ",
              key_cache.sizes());
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key_cache ", key_cache.sizes(), " and value_cache ",
              value_cache.sizes(), " differ in shape");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "key_cache and value_cache differ in dtype");
  for (const at::Tensor* c : {&key_cache, &value_cache}) {
    const int64_t d = c->size(3), bs = c->size(2);
    TORCH_CHECK(c->stride(3) == 1 && c->stride(2) == d && c->stride(1) == bs * d,
                "kv cache views must be contiguous in [num_kv_heads, block_size, head_size]; got strides ",
                c->strides());
  }
}

// [tokens, heads, head_size] with a dense last dim; rows and heads may be strided
// (e.g. q/k/v sliced out of a fused qkv projection).
inline void check_tokens(const at::Tensor& t, const char* name, int64_t head_size) {
  TORCH_CHECK(t.dim() == 3, name, " must be [num_tokens, num_heads, head_size], got ", t.sizes());
  TORCH_CHECK(t.size(2) == head_size, name, " head_size ", t.size(2), " != cache head_size ", head_size);
  TORCH_CHECK(t.stride(2) == 1, name, " must be contiguous in its last dim");
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.device() == b.device(), what, ": tensors on ", a.device(), " and ", b.device());
}

inline void check_head_size(int64_t d) {
  TORCH_CHECK(supported_head_size(d), "paged_attention: unsupported head_size ", d, " (compiled for", kHeadSizesText,
              ")");
}

// Returns whether the cache is quantized (scales given).
inline bool check_reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                                    const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                                    const c10::optional<at::Tensor>& key_scale,
                                    const c10::optional<at::Tensor>& value_scale) {
  check_cache(key_cache, value_cache);
  const bool quantized = check_kv_scales(key_cache, key_scale, value_scale, "reshape_and_cache");
  const int64_t d = key_cache.size(3);
  check_tokens(key, "key", d);
  check_tokens(value, "value", d);
  TORCH_CHECK(key.sizes() == value.sizes(), "key ", key.sizes(), " and value ", value.sizes(), " differ in shape");
  TORCH_CHECK(key.size(1) == key_cache.size(1), "key has ", key.size(1), " heads, cache has ", key_cache.size(1));
  TORCH_CHECK(key.scalar_type() == value.scalar_type() && (quantized || key.scalar_type() == key_cache.scalar_type()),
              "key/value dtype must match the cache dtype ", key_cache.scalar_type());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) && slot_mapping.scalar_type() == at::kLong,
              "slot_mapping must be int64 [num_tokens=", key.size(0), "]");
  check_same_device(key, key_cache, "reshape_and_cache");
  check_same_device(slot_mapping, key_cache, "reshape_and_cache slot_mapping");
  return quantized;
}

// Attention sinks (gpt-oss): one fp32 logit per query head, dense, beside the query.
inline void check_sinks(const c10::optional<at::Tensor>& sinks, const at::Tensor& query) {
  if (!sinks) return;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == query.size(1) &&
                  sinks->is_contiguous(),
              "paged_attention: sinks must be contiguous float32 [num_heads=", query.size(1), "], got ",
              sinks->scalar_type(), " ", sinks->sizes());
  check_same_device(*sinks, query, "paged_attention sinks");
}

// Returns whether the cache is quantized (scales given).
inline bool check_paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                  const c10::optional<at::Tensor>& key_scale,
                                  const c10::optional<at::Tensor>& value_scale,
                                  const c10::optional<at::Tensor>& sinks) {
  check_cache(key_cache, value_cache);
  const bool quantized = check_kv_scales(key_cache, key_scale, value_scale, "paged_attention");
  const int64_t d = key_cache.size(3);
  check_tokens(query, "query", d);
  check_tokens(out, "out", d);
  TORCH_CHECK(out.sizes() == query.sizes(), "out ", out.sizes(), " must have the query's shape ", query.sizes());
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && (quantized || query.scalar_type() == key_cache.scalar_type()),
              "query/out dtype must match the cache dtype ", key_cache.scalar_type());
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "num query heads ", query.size(1),
              " must be a multiple of num kv heads ", key_cache.size(1));
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "block_tables must be int32 [num_seqs, max_blocks] with a dense last dim");
  const int64_t b = block_tables.size(0);
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == b && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.is_contiguous(),
              "seq_lens must be contiguous int32 [num_seqs=", b, "]");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) == b + 1 &&
                  query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous(),
              "query_start_loc must be contiguous int32 [num_seqs + 1=", b + 1, "]");
  for (const at::Tensor* t : {&out, &query, &block_tables, &seq_lens, &query_start_loc})
    check_same_device(*t, key_cache, "paged_attention");
  check_head_size(key_cache.size(3));
  check_sinks(sinks, query);
  return quantized;
}

// Whole block rows [num_blocks, ...] move as one dense chunk each.
inline int64_t block_row_numel(const at::Tensor& pool, const char* name) {
  TORCH_CHECK(pool.dim() >= 1 && pool.size(0) > 0, name, " must have a leading num_blocks dim");
  TORCH_CHECK(pool[0].is_contiguous() && pool.stride(0) == pool[0].numel(), name,
              " must be contiguous (one dense row per block)");
  return pool[0].numel();
}

inline void check_block_mapping(const at::Tensor& mapping) {
  TORCH_CHECK(mapping.dim() == 2 && mapping.size(1) == 2 && mapping.scalar_type() == at::kLong,
              "block_mapping must be int64 [num_pairs, 2] of (src, dst)");
}

// Host-side (src, dst) pairs, validated before any copy starts.
inline void check_mapping_range(const int64_t* m, int64_t pairs, int64_t src_rows, int64_t dst_rows) {
  for (int64_t i = 0; i < pairs; ++i)
    TORCH_CHECK(m[2 * i] >= 0 && m[2 * i] < src_rows && m[2 * i + 1] >= 0 && m[2 * i + 1] < dst_rows,
                "block_mapping row ", i, " (", m[2 * i], ", ", m[2 * i + 1], ") out of range");
}

// Decoder-layer ops: [tokens, n] rows with a dense last dim (rows may be strided).
inline void check_rows(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, op, ": ", name, " must be [num_tokens, n] with a dense last dim, got ",
              t.sizes(), " strides ", t.strides());
}

inline void check_add_rms_norm(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight) {
  check_rows(x, "fused_add_rms_norm", "x");
  check_rows(residual, "fused_add_rms_norm", "residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "fused_add_rms_norm: residual ", residual.sizes(), " and x ", x.sizes(),
              " differ in shape");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "fused_add_rms_norm: weight must be contiguous [", x.size(1), "], got ", weight.sizes());
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: residual, x and weight must share a dtype");
  check_same_device(residual, x, "fused_add_rms_norm");
  check_same_device(weight, x, "fused_add_rms_norm");
}

// x: [tokens, heads, head_size] (the q|k view of a fused projection: rows and heads strided);
// cos / sin: dense [max_position, head_size / 2] in x's dtype.
inline void check_rotary(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary_embedding: x must be [num_tokens, num_heads, even head_size] with a dense last dim, got ",
              x.sizes());
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == x.size(0) && positions.scalar_type() == at::kLong,
              "rotary_embedding: positions must be int64 [num_tokens=", x.size(0), "]");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 2 && t->size(1) == x.size(2) / 2 && t->is_contiguous(),
                "rotary_embedding: cos / sin must be contiguous [max_position, ", x.size(2) / 2, "], got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "rotary_embedding: cos / sin dtype must match x");
    check_same_device(*t, x, "rotary_embedding");
  }
  TORCH_CHECK(cos.sizes() == sin.sizes(), "rotary_embedding: cos and sin differ in shape");
  check_same_device(positions, x, "rotary_embedding");
}

inline void check_act_and_mul(const at::Tensor& x, const char* op) {
  check_rows(x, op, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, op, ": x must be [num_tokens, 2 * d], got ", x.sizes());
}

// Structured output's masks: logits [rows, n] (dense last dim), xgrammar's int32 bitmask [k, words] and the k
// logits rows it masks (int64). Row indices are range-checked (check_row_range) where they live on the host.
inline void check_token_bitmask(const char* op, const at::Tensor& logits, const at::Tensor& bitmask,
                                const at::Tensor& rows) {
  check_rows(logits, op, "logits");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt, op, ": bitmask must be int32 [rows, words], got ",
              bitmask.scalar_type(), " ", bitmask.sizes());
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0), op,
              ": rows must be int64 [", bitmask.size(0), "], got ", rows.scalar_type(), " ", rows.sizes());
}

inline void check_row_range(const char* op, const int64_t* rows, int64_t k, int64_t num_rows) {
  for (int64_t i = 0; i < k; ++i)
    TORCH_CHECK(rows[i] >= 0 && rows[i] < num_rows, op, ": row ", rows[i], " out of range [0, ", num_rows, ")");
}

}  // namespace pagedserve
