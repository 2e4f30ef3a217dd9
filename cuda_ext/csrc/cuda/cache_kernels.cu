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

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// A quantized cache's codes, from a value already clamped to the largest code: int8 rounded half to even, fp8
// by its round-to-nearest-even conversion.
__device__ __forceinline__ void to_code(float x, int8_t* code) { *code = static_cast<int8_t>(__float2int_rn(x)); }
__device__ __forceinline__ void to_code(float x, __nv_fp8_e4m3* code) { *code = __nv_fp8_e4m3(x); }

// One warp quantizes one [head_size] row: bf16 scale = absmax / max_code, codes = x / scale (fp32 division),
// clamped; the arithmetic of cuda_ext/reference.py quantize_kv.
template <typename T, typename C>
__device__ void quantize_row(const T* x, C* codes, __nv_bfloat16* scale, int head_size, float max_code) {
  const int lane = threadIdx.x % 32;
  float absmax = 0.f;
  for (int d = lane; d < head_size; d += 32) absmax = fmaxf(absmax, fabsf(to_float(x[d])));
  const __nv_bfloat16 s = __float2bfloat16(warp_max(absmax) / max_code);
  const float divisor = __bfloat162float(s) == 0.f ? 1.f : __bfloat162float(s);
  for (int d = lane; d < head_size; d += 32)
    to_code(fminf(fmaxf(to_float(x[d]) / divisor, -max_code), max_code), &codes[d]);
  if (lane == 0) *scale = s;
}

// One CUDA block per token, a warp per head: its K and V rows quantized into their slot.
template <typename T, typename C>
__global__ void quantize_and_cache_kernel(CacheWriteArgs a, float max_code) {
  const int64_t t = blockIdx.x, slot = a.slot_mapping[t];
  if (slot < 0) return;  // padding token
  const int64_t blk = slot / a.block_size, off = slot % a.block_size;
  for (int h = threadIdx.x / 32; h < a.heads; h += blockDim.x / 32) {
    const int64_t row = h * a.block_size + off;
    quantize_row(static_cast<const T*>(a.key) + t * a.key_stride_t + h * a.key_stride_h,
                 static_cast<C*>(a.key_cache) + blk * a.k_stride_b + row * a.head_size,
                 static_cast<__nv_bfloat16*>(a.key_scale) + blk * a.ks_stride_b + row, a.head_size, max_code);
    quantize_row(static_cast<const T*>(a.value) + t * a.value_stride_t + h * a.value_stride_h,
                 static_cast<C*>(a.value_cache) + blk * a.v_stride_b + row * a.head_size,
                 static_cast<__nv_bfloat16*>(a.value_scale) + blk * a.vs_stride_b + row, a.head_size, max_code);
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

cudaError_t reshape_and_cache(const CacheWriteArgs& args, Dtype dtype, KVCodes codes, cudaStream_t stream) {
  const int threads = args.heads * args.head_size < 512 ? args.heads * args.head_size : 512;
  const int warps = args.heads < 8 ? args.heads : 8;
  return with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    if (codes == KVCodes::i8)
      quantize_and_cache_kernel<T, int8_t><<<args.num_tokens, 32 * warps, 0, stream>>>(args, 127.f);
    else if (codes == KVCodes::fp8)
      quantize_and_cache_kernel<T, __nv_fp8_e4m3><<<args.num_tokens, 32 * warps, 0, stream>>>(args, 448.f);
    else
      reshape_and_cache_kernel<T><<<args.num_tokens, threads, 0, stream>>>(args);
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
