// Gated DeltaNet's state-carrying ops on CUDA (the CPU twins and the contract: csrc/cpu/linear_attention.cpp).
// gated_delta_rule: one CTA per (sequence, value head), one thread per value column of the head's state, which it
// keeps in registers through the sequence's tokens (each column's update reads only that column and the shared
// q / k); causal_conv1d: one thread per (sequence, channel), its window in registers.
#include "convert.cuh"

namespace pagedserve::cuda {
namespace {

__global__ void delta_rule_kernel(DeltaRuleArgs a) {
  const int seq = blockIdx.x, h = blockIdx.y, j = threadIdx.x, kh = h / (a.hv / a.hk);
  const SeqStates& s = a.seqs;
  const int begin = s.query_start_loc[seq], end = s.query_start_loc[seq + 1];
  const int64_t slot = s.slots[seq], save = s.save_slots[seq], save_at = s.save_at[seq];
  __shared__ float qn[kMaxDeltaKeyDim], kn[kMaxDeltaKeyDim], norms[2];
  float col[kMaxDeltaKeyDim];
  float* state = a.states + (slot * a.hv + h) * a.dk * a.dv;
  for (int d = 0; d < a.dk; ++d) col[d] = s.has_initial[seq] && j < a.dv ? state[d * a.dv + j] : 0.f;
  for (int t = begin; t < end; ++t) {
    const float* qt = a.q + (int64_t(t) * a.hk + kh) * a.dk;
    const float* kt = a.k + (int64_t(t) * a.hk + kh) * a.dk;
    if (j == 0) {  // dk is small: one thread sums, the others wait
      float qq = 0.f, kk = 0.f;
      for (int d = 0; d < a.dk; ++d) qq += qt[d] * qt[d], kk += kt[d] * kt[d];
      norms[0] = rsqrtf(qq + 1e-6f) * rsqrtf(float(a.dk));
      norms[1] = rsqrtf(kk + 1e-6f);
    }
    __syncthreads();
    for (int d = j; d < a.dk; d += blockDim.x) qn[d] = qt[d] * norms[0], kn[d] = kt[d] * norms[1];
    __syncthreads();
    if (j < a.dv) {
      const int64_t gi = int64_t(t) * a.hv + h;
      const float decay = expf(a.g[gi]);
      float remembered = 0.f;
      for (int d = 0; d < a.dk; ++d) col[d] *= decay, remembered += col[d] * kn[d];
      const float delta = (a.v[gi * a.dv + j] - remembered) * a.beta[gi];
      float o = 0.f;
      for (int d = 0; d < a.dk; ++d) col[d] += kn[d] * delta, o += col[d] * qn[d];
      a.out[gi * a.dv + j] = o;
      if (save >= 0 && t + 1 - begin == save_at) {
        float* snap = a.states + (save * a.hv + h) * a.dk * a.dv;
        for (int d = 0; d < a.dk; ++d) snap[d * a.dv + j] = col[d];
      }
    }
    __syncthreads();  // qn / kn are rewritten by the next token
  }
  if (j < a.dv)
    for (int d = 0; d < a.dk; ++d) state[d * a.dv + j] = col[d];
}

template <typename T>
__global__ void conv_kernel(ConvArgs a) {
  const int seq = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= a.channels) return;
  const SeqStates& s = a.seqs;
  const int begin = s.query_start_loc[seq], end = s.query_start_loc[seq + 1], w = a.width;
  const int64_t slot = s.slots[seq], save = s.save_slots[seq], save_at = s.save_at[seq];
  T* pool = static_cast<T*>(a.conv_states);
  float window[kMaxConvWidth], weight[kMaxConvWidth + 1];
  for (int i = 0; i < w; ++i) window[i] = s.has_initial[seq] ? to_float(pool[(slot * a.channels + c) * w + i]) : 0.f;
  for (int i = 0; i <= w; ++i) weight[i] = a.weight[c * (w + 1) + i];
  for (int t = begin; t < end; ++t) {
    const float x = a.x[int64_t(t) * a.channels + c];
    float acc = weight[w] * x;
    for (int i = 0; i < w; ++i) acc += weight[i] * window[i];
    acc = to_float(from_float<T>(acc));  // rounded before the SiLU, as the eager conv then activation round
    a.out[int64_t(t) * a.channels + c] = acc / (1.f + expf(-acc));
    for (int i = 0; i + 1 < w; ++i) window[i] = window[i + 1];
    window[w - 1] = x;
    if (save >= 0 && t + 1 - begin == save_at)
      for (int i = 0; i < w; ++i) pool[(save * a.channels + c) * w + i] = from_float<T>(window[i]);
  }
  for (int i = 0; i < w; ++i) pool[(slot * a.channels + c) * w + i] = from_float<T>(window[i]);
}

}  // namespace

cudaError_t gated_delta_rule(const DeltaRuleArgs& args, cudaStream_t stream) {
  if (args.dk > kMaxDeltaKeyDim || args.seqs.num_seqs == 0) return args.seqs.num_seqs ? cudaErrorInvalidValue : cudaSuccess;
  const int threads = ((std::max(args.dv, 32) + 31) / 32) * 32;
  delta_rule_kernel<<<dim3(args.seqs.num_seqs, args.hv), threads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t causal_conv1d(const ConvArgs& args, Dtype dtype, cudaStream_t stream) {
  if (args.width > kMaxConvWidth) return cudaErrorInvalidValue;
  if (args.seqs.num_seqs == 0) return cudaSuccess;
  const dim3 grid((args.channels + 127) / 128, args.seqs.num_seqs);
  switch (dtype) {
    case Dtype::f32: conv_kernel<float><<<grid, 128, 0, stream>>>(args); break;
    case Dtype::f16: conv_kernel<__half><<<grid, 128, 0, stream>>>(args); break;
    case Dtype::bf16: conv_kernel<__nv_bfloat16><<<grid, 128, 0, stream>>>(args); break;
  }
  return cudaGetLastError();
}

}  // namespace pagedserve::cuda
