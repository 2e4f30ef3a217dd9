// CUDA paged attention, unified decode / varlen causal form.
//
// One CUDA block per (query row, query head); its kWarps warps stride over the
// row's visible keys, each lane holding head_size / 32 dims of q and of the
// accumulator. Each warp keeps an online softmax; warps merge in shared memory
// at the end. fp32 math, exact expf. A quantized cache's codes are dequantised in registers: a key's score and
// a value's weight take its row's scale.
#include <cfloat>

#include "../head_sizes.h"
#include "convert.cuh"

namespace pagedserve::cuda {
namespace {

constexpr int kWarps = 4;

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Sequence owning query row t: the last b with query_start_loc[b] <= t.
__device__ int sequence_of(const AttentionArgs& a, int t) {
  int lo = 0, hi = a.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a.query_start_loc[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Merges the warps' (max, sum, acc) partial softmaxes and writes the output row; the head's sink logit (-inf: none)
// joins the max and the denominator.
template <typename T, int D>
__device__ void merge_warps(float m, float l, const float* acc, float sink, T* out) {
  constexpr int kPer = (D + 31) / 32;
  __shared__ float sm_m[kWarps], sm_l[kWarps], sm_acc[kWarps][D];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) sm_m[warp] = m, sm_l[warp] = l;
  for (int i = 0; i < kPer; ++i)
    if (lane + 32 * i < D) sm_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  float top = fmaxf(-FLT_MAX, sink);
  for (int w = 0; w < kWarps; ++w) top = fmaxf(top, sm_m[w]);
  float total = expf(sink - top);
  for (int w = 0; w < kWarps; ++w) total += sm_l[w] * expf(sm_m[w] - top);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.f;
    for (int w = 0; w < kWarps; ++w) o += sm_acc[w][d] * expf(sm_m[w] - top);
    out[d] = from_float<T>(o / total);
  }
}

// Row `row` of block `block`'s scale in a quantized cache; 1 for a plain one (the multiply folds away).
template <typename C>
__device__ __forceinline__ float row_scale(const void* scales, int64_t stride_b, int64_t block, int64_t row) {
  if constexpr (kIsCode<C>)
    return __bfloat162float(static_cast<const __nv_bfloat16*>(scales)[block * stride_b + row]);
  else
    return 1.f;
}

template <typename T, typename C, int D>
__global__ void __launch_bounds__(kWarps * 32) paged_attention_kernel(AttentionArgs a) {
  constexpr int kPer = (D + 31) / 32;
  const int t = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (t >= a.query_start_loc[a.num_seqs]) return;  // padding rows past the last sequence
  const int b = sequence_of(a, t);
  const int q_len = a.query_start_loc[b + 1] - a.query_start_loc[b];
  const int n_keys = a.seq_lens[b] - q_len + (t - a.query_start_loc[b]) + 1;  // causal: keys [0, position]
  const int first = a.window > 0 && n_keys > a.window ? n_keys - a.window : 0;  // the sliding window's first key
  const int kv_head = h / (a.num_heads / a.num_kv_heads);
  const T* q_row = static_cast<const T*>(a.query) + t * a.q_stride_t + h * a.q_stride_h;
  const int32_t* table = a.block_tables + b * a.table_stride;

  float q[kPer], acc[kPer], m = -INFINITY, l = 0.f;
  for (int i = 0; i < kPer; ++i) {
    const int d = lane + 32 * i;
    q[i] = d < D ? to_float(q_row[d]) * a.scale : 0.f;
    acc[i] = 0.f;
  }
  for (int j = first + warp; j < n_keys; j += kWarps) {
    const int64_t block = table[j / a.block_size];
    const int64_t slot = static_cast<int64_t>(kv_head) * a.block_size + j % a.block_size;
    const C* k = static_cast<const C*>(a.key_cache) + block * a.k_stride_b + slot * D;
    const C* v = static_cast<const C*>(a.value_cache) + block * a.v_stride_b + slot * D;
    float s = 0.f;
    for (int i = 0; i < kPer; ++i)
      if (lane + 32 * i < D) s += q[i] * to_float(k[lane + 32 * i]);
    s = soft_cap(warp_sum(s) * row_scale<C>(a.key_scale, a.ks_stride_b, block, slot), a.softcap);
    const float m_new = fmaxf(m, s), alpha = expf(m - m_new), p = expf(s - m_new);
    const float pv = p * row_scale<C>(a.value_scale, a.vs_stride_b, block, slot);
    l = l * alpha + p;
    for (int i = 0; i < kPer; ++i)
      if (lane + 32 * i < D) acc[i] = acc[i] * alpha + pv * to_float(v[lane + 32 * i]);
    m = m_new;
  }
  T* out = static_cast<T*>(a.out) + t * a.out_stride_t + h * a.out_stride_h;
  merge_warps<T, D>(m, l, acc, sink_of(a, h), out);
}

template <typename T, typename C>
cudaError_t launch(const AttentionArgs& a, cudaStream_t stream) {
  const dim3 grid(a.num_tokens, a.num_heads);
  switch (a.head_size) {
#define PAGEDSERVE_CASE(D) \
  case D: paged_attention_kernel<T, C, D><<<grid, kWarps * 32, 0, stream>>>(a); break;
    PAGEDSERVE_HEAD_SIZES(PAGEDSERVE_CASE)
#undef PAGEDSERVE_CASE
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t paged_attention(const AttentionArgs& args, Dtype dtype, KVCodes codes, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  return with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    return with_cache_type<T>(codes, [&](auto cache_zero) { return launch<T, decltype(cache_zero)>(args, stream); });
  });
}

}  // namespace pagedserve::cuda
