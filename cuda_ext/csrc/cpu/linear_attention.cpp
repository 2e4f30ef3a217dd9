// Gated DeltaNet's two state-carrying ops (Qwen3-Next, Qwen3.5), over a step's sequences one after another
// (query_start_loc), each reading and writing its state slot of a pool in place (cuda_ext/reference_recurrent.py
// has the contract and the reference):
//   causal_conv1d     depthwise causal convolution + SiLU over the sequence's last K - 1 inputs and its rows;
//   gated_delta_rule  S <- S * exp(g); S += k (beta (v - S^T k))^T; o = S^T q, per value head.
// The delta rule runs token by token here (a prefill too): a head's state (Dk x Dv fp32) stays in cache while its
// tokens stream past, which on a CPU beats the chunked form's small matmuls; the rounding differs from the
// chunked reference only in fp32's last bits. A save slot gets the state after save_offsets[i] rows.
#include <ATen/Dispatch.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <vector>

#include "../ops.h"

namespace pagedserve {
namespace {

struct SeqRun {
  int64_t begin, end, slot, save, save_at;
  bool initial;
};

std::vector<SeqRun> seq_runs(const at::Tensor& slots, const at::Tensor& query_start_loc,
                             const at::Tensor& has_initial, const at::Tensor& save_slots,
                             const at::Tensor& save_offsets, int64_t num_slots, const char* op) {
  const int64_t n = slots.numel();
  TORCH_CHECK(query_start_loc.numel() == n + 1 && has_initial.numel() == n && save_slots.numel() == n &&
                  save_offsets.numel() == n,
              op, ": slots, has_initial, save_slots, save_offsets need one entry per sequence and query_start_loc one more");
  auto qsl = query_start_loc.to(at::kLong).contiguous(), sl = slots.to(at::kLong).contiguous();
  auto init = has_initial.to(at::kBool).contiguous(), ss = save_slots.to(at::kLong).contiguous();
  auto so = save_offsets.to(at::kLong).contiguous();
  std::vector<SeqRun> runs(n);
  for (int64_t i = 0; i < n; ++i) {
    SeqRun r{qsl.data_ptr<int64_t>()[i], qsl.data_ptr<int64_t>()[i + 1], sl.data_ptr<int64_t>()[i],
             ss.data_ptr<int64_t>()[i], so.data_ptr<int64_t>()[i], init.data_ptr<bool>()[i]};
    TORCH_CHECK(r.slot >= 0 && r.slot < num_slots && r.save < num_slots, op, ": slot out of range");
    TORCH_CHECK(r.save < 0 || (r.save_at > 0 && r.save_at <= r.end - r.begin), op, ": save offset ", r.save_at,
                " outside the sequence's ", r.end - r.begin, " rows");
    runs[i] = r;
  }
  return runs;
}

// One value head of one sequence through its tokens: state [dk, dv] in place.
void delta_head(const float* q, const float* k, const float* v, const float* g, const float* beta, float* out,
                float* state, float* save, int64_t save_at, int64_t tokens, int64_t q_stride, int64_t v_stride,
                int64_t gh_stride, int64_t dk, int64_t dv) {
  std::vector<float> qn(dk), kn(dk), delta(dv);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
  for (int64_t t = 0; t < tokens; ++t) {
    const float *qt = q + t * q_stride, *kt = k + t * q_stride, *vt = v + t * v_stride;
    float qq = 0.f, kk = 0.f;
    for (int64_t d = 0; d < dk; ++d) qq += qt[d] * qt[d], kk += kt[d] * kt[d];
    const float qinv = 1.0f / std::sqrt(qq + 1e-6f) * scale, kinv = 1.0f / std::sqrt(kk + 1e-6f);
    for (int64_t d = 0; d < dk; ++d) qn[d] = qt[d] * qinv, kn[d] = kt[d] * kinv;
    const float decay = std::exp(g[t * gh_stride]), b = beta[t * gh_stride];
    for (int64_t j = 0; j < dv; ++j) delta[j] = 0.f;
    for (int64_t d = 0; d < dk; ++d) {
      float* row = state + d * dv;
      for (int64_t j = 0; j < dv; ++j) row[j] *= decay, delta[j] += row[j] * kn[d];
    }
    for (int64_t j = 0; j < dv; ++j) delta[j] = (vt[j] - delta[j]) * b;
    float* o = out + t * v_stride;
    for (int64_t j = 0; j < dv; ++j) o[j] = 0.f;
    for (int64_t d = 0; d < dk; ++d) {
      float* row = state + d * dv;
      for (int64_t j = 0; j < dv; ++j) row[j] += kn[d] * delta[j], o[j] += row[j] * qn[d];
    }
    if (save != nullptr && t + 1 == save_at) std::copy(state, state + dk * dv, save);
  }
}

}  // namespace

at::Tensor gated_delta_rule_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, at::Tensor& states, const at::Tensor& slots,
                                const at::Tensor& query_start_loc, const at::Tensor& has_initial,
                                const at::Tensor& save_slots, const at::Tensor& save_offsets) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "gated_delta_rule: q, k [T, Hk, Dk] and v [T, Hv, Dv] expected");
  const int64_t hk = q.size(1), dk = q.size(2), hv = v.size(1), dv = v.size(2);
  TORCH_CHECK(hv % hk == 0, "gated_delta_rule: value heads ", hv, " not a multiple of key heads ", hk);
  TORCH_CHECK(states.scalar_type() == at::kFloat && states.is_contiguous() && states.dim() == 4 &&
                  states.size(1) == hv && states.size(2) == dk && states.size(3) == dv,
              "gated_delta_rule: states must be contiguous fp32 [slots, ", hv, ", ", dk, ", ", dv, "]");
  const auto runs = seq_runs(slots, query_start_loc, has_initial, save_slots, save_offsets, states.size(0),
                             "gated_delta_rule");
  auto qf = q.to(at::kFloat).contiguous(), kf = k.to(at::kFloat).contiguous(), vf = v.to(at::kFloat).contiguous();
  auto gf = g.to(at::kFloat).contiguous(), bf = beta.to(at::kFloat).contiguous();
  auto out = at::empty(vf.sizes(), vf.options());
  const int64_t group = hv / hk, state_size = dk * dv, num = static_cast<int64_t>(runs.size());
  float* pool = states.data_ptr<float>();
  at::parallel_for(0, num * hv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> state(state_size);
    for (int64_t item = lo; item < hi; ++item) {
      const SeqRun& r = runs[item / hv];
      const int64_t h = item % hv, kh = h / group;
      float* slot = pool + (r.slot * hv + h) * state_size;
      if (r.initial) std::copy(slot, slot + state_size, state.begin());
      else std::fill(state.begin(), state.end(), 0.f);
      float* save = r.save >= 0 ? pool + (r.save * hv + h) * state_size : nullptr;
      delta_head(qf.data_ptr<float>() + (r.begin * hk + kh) * dk, kf.data_ptr<float>() + (r.begin * hk + kh) * dk,
                 vf.data_ptr<float>() + (r.begin * hv + h) * dv, gf.data_ptr<float>() + r.begin * hv + h,
                 bf.data_ptr<float>() + r.begin * hv + h, out.data_ptr<float>() + (r.begin * hv + h) * dv,
                 state.data(), save, r.save_at, r.end - r.begin, hk * dk, hv * dv, hv, dk, dv);
      std::copy(state.begin(), state.end(), slot);
    }
  });
  return out.to(v.scalar_type());
}

namespace {

template <typename T>
void conv_channels(const std::vector<SeqRun>& runs, const float* x, const float* weight, T* pool, float* out,
                   int64_t channels, int64_t width, int64_t lo, int64_t hi) {
  std::vector<float> window;
  for (const SeqRun& r : runs) {
    const int64_t n = r.end - r.begin;
    for (int64_t c = lo; c < hi; ++c) {
      T* slot = pool + (r.slot * channels + c) * width;
      window.assign(width + n, 0.f);
      if (r.initial)
        for (int64_t j = 0; j < width; ++j) window[j] = static_cast<float>(slot[j]);
      for (int64_t t = 0; t < n; ++t) window[width + t] = x[(r.begin + t) * channels + c];
      const float* w = weight + c * (width + 1);
      for (int64_t t = 0; t < n; ++t) {
        float acc = 0.f;
        for (int64_t j = 0; j <= width; ++j) acc += w[j] * window[t + j];
        acc = static_cast<float>(static_cast<T>(acc));  // rounded before the SiLU, as transformers' conv does
        out[(r.begin + t) * channels + c] = acc / (1.f + std::exp(-acc));
      }
      if (r.save >= 0) {
        T* save = pool + (r.save * channels + c) * width;
        for (int64_t j = 0; j < width; ++j) save[j] = static_cast<T>(window[r.save_at + j]);
      }
      for (int64_t j = 0; j < width; ++j) slot[j] = static_cast<T>(window[n + j]);
    }
  }
}

}  // namespace

at::Tensor causal_conv1d_cpu(const at::Tensor& x, const at::Tensor& weight, at::Tensor& conv_states,
                             const at::Tensor& slots, const at::Tensor& query_start_loc, const at::Tensor& has_initial,
                             const at::Tensor& save_slots, const at::Tensor& save_offsets) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(0) == x.size(1),
              "causal_conv1d: x [T, C] and weight [C, K] expected");
  const int64_t channels = x.size(1), width = weight.size(1) - 1;
  TORCH_CHECK(conv_states.is_contiguous() && conv_states.dim() == 3 && conv_states.size(1) == channels &&
                  conv_states.size(2) == width && conv_states.scalar_type() == x.scalar_type(),
              "causal_conv1d: conv_states must be contiguous [slots, ", channels, ", ", width, "] in x's dtype");
  const auto runs = seq_runs(slots, query_start_loc, has_initial, save_slots, save_offsets, conv_states.size(0),
                             "causal_conv1d");
  auto xf = x.to(at::kFloat).contiguous(), wf = weight.to(at::kFloat).contiguous();
  auto out = at::empty(xf.sizes(), xf.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "causal_conv1d", [&] {
    at::parallel_for(0, channels, 16, [&](int64_t lo, int64_t hi) {
      conv_channels<scalar_t>(runs, xf.data_ptr<float>(), wf.data_ptr<float>(), conv_states.data_ptr<scalar_t>(),
                              out.data_ptr<float>(), channels, width, lo, hi);
    });
  });
  return out.to(x.scalar_type());
}

}  // namespace pagedserve
