// W4A16 linear layer on the GPU: y = x @ W.T + bias, W the 4-bit layer in cpu/skinny_w4.cpp's packed layout (one
// layout, packed once on the host: per panel of 64 output columns and per 4 input columns, 128 bytes; column c's
// byte 2c + t holds code[k + t] low and code[k + 2 + t] high), with its per-panel, per-group fp32 scales and
// zero * scale offsets. A block computes one panel of one row: 4 slices of 64 threads split the input columns
// (thread c reads column c's two bytes per quad: a warp's loads are contiguous), each keeps per group
// scale * sum(x * code) - offset * sum(x), and shared memory adds the slices up.
#include "convert.cuh"
#include "launch.h"

namespace pagedserve::cuda {
namespace {

constexpr int kPanelCols = 64;
constexpr int kSlices = 4;
constexpr int kQuadBytes = 2 * kPanelCols;

template <typename T>
__global__ void w4_linear_kernel(W4LinearArgs a) {
  const int p = blockIdx.x, c = threadIdx.x % kPanelCols, slice = threadIdx.x / kPanelCols;
  const int64_t r = blockIdx.y, quads = a.k / 4, group_quads = quads / a.groups;
  const T* x = static_cast<const T*>(a.x) + r * a.x_stride;
  const uint8_t* panel = a.packed + p * quads * kQuadBytes + 2 * c;
  float total = 0.f;
  for (int g = 0; g < a.groups; ++g) {
    float acc = 0.f, xsum = 0.f;
    for (int64_t q = g * group_quads + slice; q < (g + 1) * group_quads; q += kSlices) {
      const uint8_t b0 = panel[q * kQuadBytes], b1 = panel[q * kQuadBytes + 1];
      const float x0 = to_float(x[4 * q]), x1 = to_float(x[4 * q + 1]);
      const float x2 = to_float(x[4 * q + 2]), x3 = to_float(x[4 * q + 3]);
      acc += x0 * float(b0 & 0xF) + x1 * float(b1 & 0xF) + x2 * float(b0 >> 4) + x3 * float(b1 >> 4);
      xsum += (x0 + x1) + (x2 + x3);
    }
    const int64_t at = (int64_t{p} * a.groups + g) * kPanelCols + c;
    total += a.scales[at] * acc - a.offsets[at] * xsum;
  }
  __shared__ float part[kSlices][kPanelCols];
  part[slice][c] = total;
  __syncthreads();
  const int64_t col = int64_t{p} * kPanelCols + c;
  if (slice != 0 || col >= a.n) return;
  float y = (part[0][c] + part[1][c]) + (part[2][c] + part[3][c]);
  if (a.bias != nullptr) y += to_float(static_cast<const T*>(a.bias)[col]);
  static_cast<T*>(a.y)[r * a.y_stride + col] = from_float<T>(y);
}

}  // namespace

cudaError_t w4_linear(const W4LinearArgs& args, Dtype dtype, cudaStream_t stream) {
  if (args.rows == 0 || args.n == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((args.n + kPanelCols - 1) / kPanelCols), static_cast<unsigned>(args.rows));
  return with_dtype(dtype, [&](auto zero) {
    w4_linear_kernel<decltype(zero)><<<grid, kPanelCols * kSlices, 0, stream>>>(args);
    return cudaGetLastError();
  });
}

}  // namespace pagedserve::cuda
