// CPU cache ops: write new K/V into their slots, copy and swap whole blocks.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "../checks.h"
#include "../ops.h"
#include "parallel.h"

namespace pagedserve {
namespace {

// One token's [heads, head_size] row into offset `off` of block `blk` of a cache view.
void scatter_token(const char* src, int64_t src_head_stride, char* cache, int64_t blk, int64_t off,
                   const at::Tensor& c, int64_t elem) {
  const int64_t heads = c.size(1), bs = c.size(2), d = c.size(3);
  char* base = cache + (blk * c.stride(0) + off * d) * elem;
  for (int64_t h = 0; h < heads; ++h)
    std::memcpy(base + h * bs * d * elem, src + h * src_head_stride * elem, d * elem);
}

// A quantized cache's codes: int8 rounded half to even, or fp8 (its own round-to-nearest-even cast).
template <typename C>
C to_code(float x);
template <>
int8_t to_code<int8_t>(float x) { return static_cast<int8_t>(std::nearbyint(std::clamp(x, -kInt8KVMax, kInt8KVMax))); }
template <>
c10::Float8_e4m3fn to_code<c10::Float8_e4m3fn>(float x) {
  return c10::Float8_e4m3fn(std::clamp(x, -kFp8KVMax, kFp8KVMax));
}

// One token's [heads, head_size] row into offset `off` of block `blk`, quantized: each head's codes into the
// cache view, its bf16 scale (absmax / max code, cuda_ext/reference.py quantize_kv) into the scale view.
template <typename T, typename C>
void quantize_token(const T* src, int64_t src_head_stride, const at::Tensor& c, const at::Tensor& s, int64_t blk,
                    int64_t off, float max_code) {
  const int64_t heads = c.size(1), bs = c.size(2), d = c.size(3);
  C* codes = c.data_ptr<C>() + blk * c.stride(0) + off * d;
  c10::BFloat16* scales = s.data_ptr<c10::BFloat16>() + blk * s.stride(0) + off;
  for (int64_t h = 0; h < heads; ++h) {
    const T* x = src + h * src_head_stride;
    float absmax = 0.f;
    for (int64_t i = 0; i < d; ++i) absmax = std::max(absmax, std::abs(static_cast<float>(x[i])));
    const c10::BFloat16 scale(absmax / max_code);
    const float divisor = static_cast<float>(scale) == 0.f ? 1.f : static_cast<float>(scale);
    for (int64_t i = 0; i < d; ++i) codes[h * bs * d + i] = to_code<C>(static_cast<float>(x[i]) / divisor);
    scales[h * s.stride(1)] = scale;
  }
}

template <typename T, typename C>
void quantize_tokens(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                     const int64_t* slots, const at::Tensor& key_scale, const at::Tensor& value_scale) {
  const int64_t bs = key_cache.size(2), num_slots = key_cache.size(0) * bs;
  const float max_code = std::is_same_v<C, int8_t> ? kInt8KVMax : kFp8KVMax;
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  parallel_for(0, key.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;  // padding token
      TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " out of range (", num_slots, " slots)");
      const int64_t blk = slots[t] / bs, off = slots[t] % bs;
      quantize_token<T, C>(k + t * key.stride(0), key.stride(1), key_cache, key_scale, blk, off, max_code);
      quantize_token<T, C>(v + t * value.stride(0), value.stride(1), value_cache, value_scale, blk, off, max_code);
    }
  });
}

void copy_rows(const char* src, int64_t src_rows, char* dst, int64_t dst_rows, int64_t row_bytes,
               const at::Tensor& mapping) {
  const int64_t* m = mapping.data_ptr<int64_t>();
  const int64_t n = mapping.size(0);
  check_mapping_range(m, n, src_rows, dst_rows);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / row_bytes);  // >= 1 MiB per thread
  parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      std::memcpy(dst + m[2 * i + 1] * row_bytes, src + m[2 * i] * row_bytes, row_bytes);
  });
}

}  // namespace

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping,
                           const c10::optional<at::Tensor>& key_scale, const c10::optional<at::Tensor>& value_scale) {
  const bool quantized = check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, key_scale,
                                                 value_scale);
  const auto slots = slot_mapping.contiguous();
  const int64_t* s = slots.data_ptr<int64_t>();
  if (quantized) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "reshape_and_cache", [&] {
      if (key_cache.scalar_type() == at::kChar)
        quantize_tokens<scalar_t, int8_t>(key, value, key_cache, value_cache, s, *key_scale, *value_scale);
      else
        quantize_tokens<scalar_t, c10::Float8_e4m3fn>(key, value, key_cache, value_cache, s, *key_scale,
                                                      *value_scale);
    });
    return;
  }
  const int64_t bs = key_cache.size(2), num_slots = key_cache.size(0) * bs, elem = key.element_size();
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  parallel_for(0, key.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (s[t] < 0) continue;  // padding token
      TORCH_CHECK(s[t] < num_slots, "slot ", s[t], " out of range (", num_slots, " slots)");
      scatter_token(k + t * key.stride(0) * elem, key.stride(1), kc, s[t] / bs, s[t] % bs, key_cache, elem);
      scatter_token(v + t * value.stride(0) * elem, value.stride(1), vc, s[t] / bs, s[t] % bs, value_cache, elem);
    }
  });
}

void copy_blocks_cpu(at::Tensor& kv_cache, const at::Tensor& block_mapping) {
  check_block_mapping(block_mapping);
  const int64_t row_bytes = block_row_numel(kv_cache, "kv_cache") * kv_cache.element_size();
  auto* base = static_cast<char*>(kv_cache.data_ptr());
  copy_rows(base, kv_cache.size(0), base, kv_cache.size(0), row_bytes, block_mapping.contiguous());
}

void swap_blocks_cpu(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  check_block_mapping(block_mapping);
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "swap_blocks: src and dst differ in dtype");
  const int64_t row = block_row_numel(src, "src");
  TORCH_CHECK(row == block_row_numel(dst, "dst"), "swap_blocks: src and dst block rows differ in size");
  copy_rows(static_cast<const char*>(src.data_ptr()), src.size(0), static_cast<char*>(dst.data_ptr()), dst.size(0),
            row * src.element_size(), block_mapping.contiguous());
}

}  // namespace pagedserve
