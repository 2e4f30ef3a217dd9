// Structured output's masks on the GPU, as csrc/cpu/token_bitmask.cpp: token j of masked row i is allowed when bit
// j % 32 of bitmask[i][j / 32] is set (tokens past the bitmask's width are forbidden). apply_token_bitmask writes
// -inf over the forbidden tokens; masked_row_argmax is row_argmax of the masked row without writing it.
#include <cmath>
#include <cstdint>

#include "convert.cuh"

namespace pagedserve::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocksPerRow = 64;

// Grid (column blocks, masked rows): a thread per token, in a strided loop over the row.
template <typename T>
__global__ void token_bitmask_kernel(TokenBitmaskArgs a) {
  T* row = static_cast<T*>(a.logits) + a.rows[blockIdx.y] * a.stride;
  const int32_t* words = a.bitmask + blockIdx.y * a.num_words;
  for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < a.n; j += int64_t{gridDim.x} * blockDim.x) {
    const int64_t w = j / 32;
    if (w >= a.num_words || !((static_cast<uint32_t>(words[w]) >> (j % 32)) & 1u)) row[j] = from_float<T>(-INFINITY);
  }
}

// One block per masked row: each thread scans words, keeping its first maximum and first NaN; then a shared
// reduction keeps the lowest index on ties. No allowed value above -inf: 0, row_argmax's answer on an all -inf row.
template <typename T>
__global__ void masked_argmax_kernel(TokenBitmaskArgs a, int64_t* out) {
  const T* row = static_cast<const T*>(a.logits) + a.rows[blockIdx.x] * a.stride;
  const int32_t* words = a.bitmask + blockIdx.x * a.num_words;
  float best = -INFINITY;
  int64_t at = INT64_MAX, nan_at = INT64_MAX;
  for (int64_t w = threadIdx.x; w < a.num_words && w * 32 < a.n; w += blockDim.x) {
    uint32_t bits = static_cast<uint32_t>(words[w]);
    if (a.n - w * 32 < 32) bits &= (1u << (a.n - w * 32)) - 1u;
    for (; bits; bits &= bits - 1u) {
      const int64_t j = w * 32 + __ffs(bits) - 1;
      const float x = to_float(row[j]);
      if (isnan(x)) nan_at = j < nan_at ? j : nan_at;
      else if (x > best) best = x, at = j;
    }
  }
  __shared__ float s_best[kThreads];
  __shared__ int64_t s_at[kThreads], s_nan[kThreads];
  s_best[threadIdx.x] = best, s_at[threadIdx.x] = at, s_nan[threadIdx.x] = nan_at;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const int o = threadIdx.x + stride;
      if (s_nan[o] < s_nan[threadIdx.x]) s_nan[threadIdx.x] = s_nan[o];
      if (s_best[o] > s_best[threadIdx.x] || (s_best[o] == s_best[threadIdx.x] && s_at[o] < s_at[threadIdx.x]))
        s_best[threadIdx.x] = s_best[o], s_at[threadIdx.x] = s_at[o];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0)
    out[blockIdx.x] = s_nan[0] != INT64_MAX ? s_nan[0] : (s_best[0] == -INFINITY ? 0 : s_at[0]);
}

}  // namespace

cudaError_t masked_row_argmax(const TokenBitmaskArgs& args, int64_t* out, Dtype dtype, cudaStream_t stream) {
  if (args.k == 0) return cudaSuccess;
  return with_dtype(dtype, [&](auto zero) {
    masked_argmax_kernel<decltype(zero)><<<static_cast<unsigned>(args.k), kThreads, 0, stream>>>(args, out);
    return cudaGetLastError();
  });
}

cudaError_t apply_token_bitmask(const TokenBitmaskArgs& args, Dtype dtype, cudaStream_t stream) {
  if (args.k == 0 || args.n == 0) return cudaSuccess;
  const int64_t per_row = (args.n + kThreads - 1) / kThreads;
  const dim3 grid(static_cast<unsigned>(per_row < kMaxBlocksPerRow ? per_row : kMaxBlocksPerRow),
                  static_cast<unsigned>(args.k));
  return with_dtype(dtype, [&](auto zero) {
    token_bitmask_kernel<decltype(zero)><<<grid, kThreads, 0, stream>>>(args);
    return cudaGetLastError();
  });
}

}  // namespace pagedserve::cuda
