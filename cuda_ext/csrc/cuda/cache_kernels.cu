// CUDA cache kernels: write new K/V into their slots, copy whole blocks.
#include "convert.cuh"

namespace pagedserve::cuda {
namespace {

// One CUDA block per token: its [heads, head_size] K and V rows into their slot.
template <typename T>
__global__ void reshape_and_cache_kernel(CacheWriteArgs a) {
  const int64_t t = blockIdx.x, slot = a.slot_mapping[t];
  if (slot < 0) return;  // padding token
  const int64_t blk = slot / a.block_size, off = slot % a.block_size;
  const T* key = static_cast<const T*>(a.key);
  const T* value = static_cast<const T*>(a.value);
  T* key_cache = static_cast<T*>(a.key_cache);
  T* value_cache = static_cast<T*>(a.value_cache);
  for (int i = threadIdx.x; i < a.heads * a.head_size; i += blockDim.x) {
    const int h = i / a.head_size, d = i % a.head_size;
    const int64_t dst = (h * a.block_size + off) * a.head_size + d;
    key_cache[blk * a.k_stride_b + dst] = key[t * a.key_stride_t + h * a.key_stride_h + d];
    value_cache[blk * a.v_stride_b + dst] = value[t * a.value_stride_t + h * a.value_stride_h + d];
  }
}

// One CUDA block per (src, dst) pair: a whole block row (all layers) in W-sized words.
template <typename W>
__global__ void copy_blocks_kernel(W* pool, const int64_t* mapping, int64_t row_words) {
  const W* src = pool + mapping[2 * blockIdx.x] * row_words;
  W* dst = pool + mapping[2 * blockIdx.x + 1] * row_words;
  for (int64_t i = threadIdx.x; i < row_words; i += blockDim.x) dst[i] = src[i];
}

}  // namespace

cudaError_t reshape_and_cache(const CacheWriteArgs& args, Dtype dtype, cudaStream_t stream) {
  const int threads = args.heads * args.head_size < 512 ? args.heads * args.head_size : 512;
  return with_dtype(dtype, [&](auto zero) {
    reshape_and_cache_kernel<decltype(zero)><<<args.num_tokens, threads, 0, stream>>>(args);
    return cudaGetLastError();
  });
}

cudaError_t copy_blocks(void* pool, const int64_t* mapping, int64_t num_pairs, int64_t row_bytes, cudaStream_t stream) {
  if (row_bytes % sizeof(int4) == 0 && reinterpret_cast<uintptr_t>(pool) % sizeof(int4) == 0)
    copy_blocks_kernel<<<num_pairs, 256, 0, stream>>>(static_cast<int4*>(pool), mapping, row_bytes / sizeof(int4));
  else
    copy_blocks_kernel<<<num_pairs, 256, 0, stream>>>(static_cast<char*>(pool), mapping, row_bytes);
  return cudaGetLastError();
}

}  // namespace pagedserve::cuda
