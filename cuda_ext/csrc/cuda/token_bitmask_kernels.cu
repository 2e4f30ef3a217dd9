// Structured output's mask on the GPU: logits[rows[i], j] = -inf where bit j % 32 of bitmask[i][j / 32] is
// clear (xgrammar's layout; tokens past the bitmask's width are forbidden), as csrc/cpu/token_bitmask.cpp.
#include <cmath>

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

}  // namespace

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
