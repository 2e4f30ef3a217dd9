// CPU cache ops: write new K/V into their slots, copy and swap whole blocks.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>

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
                           at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
  const auto slots = slot_mapping.contiguous();
  const int64_t* s = slots.data_ptr<int64_t>();
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
