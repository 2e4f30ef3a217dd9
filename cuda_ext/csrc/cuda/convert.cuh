// fp32 <-> storage dtype conversions used by every kernel.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "launch.h"

namespace pagedserve::cuda {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(int8_t x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }

template <typename C>
constexpr bool kIsCode = std::is_same_v<C, int8_t> || std::is_same_v<C, __nv_fp8_e4m3>;

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

// An attention score after logit soft-capping (0: off), the eager formula's order: cap * tanh(s / cap).
__device__ __forceinline__ float soft_cap(float s, float cap) { return cap > 0.f ? cap * tanhf(s / cap) : s; }

// Head h's sink logit (gpt-oss), -inf when the call has none.
__device__ __forceinline__ float sink_of(const AttentionArgs& a, int h) { return a.sinks ? a.sinks[h] : -INFINITY; }

// A row's softmax denominator relative to its running max m: the keys' sum l plus the sink's share (the sink logit
// joins the denominator only; -inf: none, exactly l). A sink far above m overflows to inf: a zero row, as the exact
// softmax rounds it.
__device__ __forceinline__ float denominator(float m, float l, float sink) { return l + expf(sink - m); }

// Calls fn(T{}) with the storage type of dtype.
template <typename Fn>
cudaError_t with_dtype(Dtype dtype, Fn&& fn) {
  switch (dtype) {
    case Dtype::f32: return fn(float{});
    case Dtype::f16: return fn(__half{});
    case Dtype::bf16: return fn(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

// Calls fn(C{}) with the cache element type: T itself for an unquantized cache, else the codes' type.
template <typename T, typename Fn>
cudaError_t with_cache_type(KVCodes codes, Fn&& fn) {
  switch (codes) {
    case KVCodes::none: return fn(T{});
    case KVCodes::i8: return fn(int8_t{});
    case KVCodes::fp8: return fn(__nv_fp8_e4m3{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagedserve::cuda
