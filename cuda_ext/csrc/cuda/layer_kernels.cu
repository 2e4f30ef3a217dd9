// CUDA decoder-layer kernels: residual add + RMSNorm, in-place rotary (neox
// layout), SiLU-and-mul and GELU(tanh)-and-mul. fp32 math; a 16-bit result is rounded wherever the
// eager formula rounds, as the CPU kernels do (csrc/cpu/layer_ops.cpp).
#include "convert.cuh"

namespace pagedserve::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ float round_as(float x) { return to_float(from_float<T>(x)); }

// One CUDA block per row: add into the residual, reduce the sum of squares, normalise.
template <typename T>
__global__ void add_rms_norm_kernel(AddRmsNormArgs a) {
  T* res = static_cast<T*>(a.residual) + blockIdx.x * a.res_stride;
  const T* x = static_cast<const T*>(a.x) + blockIdx.x * a.x_stride;
  const T* w = static_cast<const T*>(a.weight);
  T* out = static_cast<T*>(a.out) + blockIdx.x * a.n;
  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < a.n; i += blockDim.x) {
    const T h = from_float<T>(to_float(res[i]) + to_float(x[i]));
    res[i] = h;
    sum_sq += to_float(h) * to_float(h);
  }
  __shared__ float partial[kThreads];
  partial[threadIdx.x] = sum_sq;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  const float inv_rms = rsqrtf(partial[0] / a.n + a.eps);
  for (int i = threadIdx.x; i < a.n; i += blockDim.x)  // each thread rereads only what it wrote
    out[i] = from_float<T>(to_float(w[i]) * round_as<T>(to_float(res[i]) * inv_rms));
}

// One CUDA block per token; threads walk its (head, pair) elements.
template <typename T>
__global__ void rotary_kernel(RotaryArgs a) {
  const int64_t t = blockIdx.x, pos = a.positions[t];
  const T* cos = static_cast<const T*>(a.cos) + pos * a.half;
  const T* sin = static_cast<const T*>(a.sin) + pos * a.half;
  for (int i = threadIdx.x; i < a.heads * a.half; i += blockDim.x) {
    const int h = i / a.half, j = i % a.half;
    T* head = static_cast<T*>(a.x) + t * a.stride_t + h * a.stride_h;
    const float x1 = to_float(head[j]), x2 = to_float(head[j + a.half]);
    const float c = to_float(cos[j]), s = to_float(sin[j]);
    head[j] = from_float<T>(round_as<T>(x1 * c) - round_as<T>(x2 * s));
    head[j + a.half] = from_float<T>(round_as<T>(x2 * c) + round_as<T>(x1 * s));
  }
}

struct Silu {
  __device__ float operator()(float g) const { return g / (1.f + expf(-g)); }
};

struct GeluTanh {  // torch's formula: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
  __device__ float operator()(float g) const {
    return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * (g * g * g))));
  }
};

template <typename T, typename Act>
__global__ void act_and_mul_kernel(ActAndMulArgs a) {
  const int64_t total = a.rows * a.d;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / a.d, j = i % a.d;
    const T* row = static_cast<const T*>(a.x) + r * a.x_stride;
    static_cast<T*>(a.out)[i] = from_float<T>(round_as<T>(Act{}(to_float(row[j]))) * to_float(row[j + a.d]));
  }
}

template <typename Act>
cudaError_t act_and_mul(const ActAndMulArgs& args, Dtype dtype, cudaStream_t stream) {
  const int64_t total = args.rows * args.d;
  if (total == 0) return cudaSuccess;
  const int blocks = static_cast<int>((total + kThreads - 1) / kThreads < 65535 ? (total + kThreads - 1) / kThreads : 65535);
  return with_dtype(dtype, [&](auto zero) {
    act_and_mul_kernel<decltype(zero), Act><<<blocks, kThreads, 0, stream>>>(args);
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t fused_add_rms_norm(const AddRmsNormArgs& args, Dtype dtype, cudaStream_t stream) {
  if (args.rows == 0) return cudaSuccess;
  return with_dtype(dtype, [&](auto zero) {
    add_rms_norm_kernel<decltype(zero)><<<args.rows, kThreads, 0, stream>>>(args);
    return cudaGetLastError();
  });
}

cudaError_t rotary_embedding(const RotaryArgs& args, Dtype dtype, cudaStream_t stream) {
  if (args.tokens == 0) return cudaSuccess;
  return with_dtype(dtype, [&](auto zero) {
    rotary_kernel<decltype(zero)><<<args.tokens, kThreads, 0, stream>>>(args);
    return cudaGetLastError();
  });
}

cudaError_t silu_and_mul(const ActAndMulArgs& args, Dtype dtype, cudaStream_t stream) {
  return act_and_mul<Silu>(args, dtype, stream);
}

cudaError_t gelu_tanh_and_mul(const ActAndMulArgs& args, Dtype dtype, cudaStream_t stream) {
  return act_and_mul<GeluTanh>(args, dtype, stream);
}

}  // namespace pagedserve::cuda
