// Fused CPU ops of a decoder layer: residual add + RMSNorm, in-place rotary
// (neox layout), SiLU-and-mul and GELU(tanh)-and-mul. Rows are split across threads; each row goes
// through fp32 scratch with at::vec (vectorised conversions and math). A bf16
// result is rounded wherever the Hugging Face formula rounds (after the residual
// add, after normalising, after each rotary product, after the activation), so bf16
// outputs match the eager model op for op; fp32 math throughout.
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "../checks.h"
#include "../ops.h"
#include "parallel.h"

namespace pagedserve {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kMinElementsPerThread = 1 << 14;  // ~10 us of work, worth a thread's fork

int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(1, row_elements)); }

// Rounds buf to T's precision in place (a no-op for fp32): what storing a T and reading it back does.
template <typename T>
void round_as(float* buf, T* scratch, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) {
    at::vec::convert(buf, scratch, n);
    at::vec::convert(scratch, buf, n);
  }
}

template <typename T>
void add_rms_norm_rows(T* residual, int64_t res_stride, const T* x, int64_t x_stride, const T* weight, T* out,
                       int64_t rows, int64_t n, float eps) {
  parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> h(n), w(n), tmp(n);
    std::vector<T> scratch(n);
    at::vec::convert(weight, w.data(), n);
    for (int64_t r = begin; r < end; ++r) {
      T* res = residual + r * res_stride;
      at::vec::convert(res, h.data(), n);
      at::vec::convert(x + r * x_stride, tmp.data(), n);
      at::vec::map2([](Vec a, Vec b) { return a + b; }, h.data(), h.data(), tmp.data(), n);
      at::vec::convert(h.data(), res, n);  // the new residual, rounded to T
      round_as(h.data(), scratch.data(), n);
      const float sum_sq = at::vec::map_reduce_all([](Vec v) { return v * v; },
                                                   [](Vec a, Vec b) { return a + b; }, h.data(), n);
      const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
      at::vec::map([inv_rms](Vec v) { return v * Vec(inv_rms); }, h.data(), h.data(), n);
      round_as(h.data(), scratch.data(), n);
      at::vec::map2([](Vec a, Vec b) { return a * b; }, h.data(), w.data(), h.data(), n);
      at::vec::convert(h.data(), out + r * n, n);
    }
  });
}

// One [half] pair of a head: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, each product rounded to T.
template <typename T>
void rotate_head(T* head, const float* c, const float* s, int64_t half, float* buf, T* scratch) {
  float *x1 = buf, *x2 = buf + half, *p = buf + 2 * half, *q = buf + 3 * half, *u = buf + 4 * half, *v = buf + 5 * half;
  at::vec::convert(head, x1, 2 * half);  // x1 and x2 are adjacent
  auto mul = [](Vec a, Vec b) { return a * b; };
  at::vec::map2(mul, p, x1, c, half);
  at::vec::map2(mul, q, x2, s, half);
  at::vec::map2(mul, u, x2, c, half);
  at::vec::map2(mul, v, x1, s, half);
  round_as(p, scratch, 4 * half);  // p, q, u, v are adjacent
  at::vec::map2([](Vec a, Vec b) { return a - b; }, x1, p, q, half);
  at::vec::map2([](Vec a, Vec b) { return a + b; }, x2, u, v, half);
  at::vec::convert(x1, head, 2 * half);
}

template <typename T>
void rotary_rows(const at::Tensor& x, const int64_t* positions, const T* cos, const T* sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  T* base = x.data_ptr<T>();
  parallel_for(0, tokens, grain(heads * 2 * half), [&](int64_t begin, int64_t end) {
    std::vector<float> c(half), s(half), buf(6 * half);
    std::vector<T> scratch(4 * half);
    for (int64_t t = begin; t < end; ++t) {
      at::vec::convert(cos + positions[t] * half, c.data(), half);
      at::vec::convert(sin + positions[t] * half, s.data(), half);
      for (int64_t h = 0; h < heads; ++h)
        rotate_head(base + t * x.stride(0) + h * x.stride(1), c.data(), s.data(), half, buf.data(), scratch.data());
    }
  });
}

// act(gate) * up for each row [gate | up], act a Vec -> Vec map; act's result rounded to T as the eager
// formula stores it.
template <typename T, typename Act>
void act_and_mul_rows(const T* x, int64_t x_stride, T* out, int64_t rows, int64_t d, Act act) {
  parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
    std::vector<float> g(d), u(d);
    std::vector<T> scratch(d);
    for (int64_t r = begin; r < end; ++r) {
      at::vec::convert(x + r * x_stride, g.data(), d);
      at::vec::convert(x + r * x_stride + d, u.data(), d);
      at::vec::map(act, g.data(), g.data(), d);
      round_as(g.data(), scratch.data(), d);
      at::vec::map2([](Vec a, Vec b) { return a * b; }, g.data(), g.data(), u.data(), d);
      at::vec::convert(g.data(), out + r * d, d);
    }
  });
}

// torch's own formulas, so fp32 matches F.silu and F.gelu(approximate="tanh").
Vec silu(Vec v) { return v / (Vec(1.f) + v.neg().exp()); }
Vec gelu_tanh(Vec v) {
  const Vec beta(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5)), kappa(0.044715f);
  return Vec(0.5f) * v * (Vec(1.f) + (beta * (v + kappa * (v * v * v))).tanh());
}

// Calls fn(T{}) with the storage type of dtype (fp32 or bf16).
template <typename Fn>
void with_dtype(at::ScalarType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: return fn(float{});
    case at::kBFloat16: return fn(c10::BFloat16{});
    default: TORCH_CHECK(false, op, " on CPU supports float32 and bfloat16, got ", dtype);
  }
}

}  // namespace

at::Tensor fused_add_rms_norm_cpu(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_add_rms_norm(residual, x, weight);
  auto out = at::empty(x.sizes(), x.options());
  with_dtype(x.scalar_type(), "fused_add_rms_norm", [&](auto zero) {
    using T = decltype(zero);
    add_rms_norm_rows<T>(residual.data_ptr<T>(), residual.stride(0), x.data_ptr<T>(), x.stride(0),
                         weight.data_ptr<T>(), out.data_ptr<T>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

void rotary_embedding_cpu(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  check_rotary(x, positions, cos, sin);
  const auto pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < pos.numel(); ++t)
    TORCH_CHECK(p[t] >= 0 && p[t] < cos.size(0), "rotary_embedding: position ", p[t], " outside the table of ",
                cos.size(0));
  with_dtype(x.scalar_type(), "rotary_embedding", [&](auto zero) {
    using T = decltype(zero);
    rotary_rows<T>(x, p, cos.data_ptr<T>(), sin.data_ptr<T>());
  });
}

template <typename Act>
at::Tensor act_and_mul_cpu(const at::Tensor& x, const char* op, Act act) {
  check_act_and_mul(x, op);
  const int64_t d = x.size(1) / 2;
  auto out = at::empty({x.size(0), d}, x.options());
  with_dtype(x.scalar_type(), op, [&](auto zero) {
    using T = decltype(zero);
    act_and_mul_rows<T>(x.data_ptr<T>(), x.stride(0), out.data_ptr<T>(), x.size(0), d, act);
  });
  return out;
}

at::Tensor silu_and_mul_cpu(const at::Tensor& x) { return act_and_mul_cpu(x, "silu_and_mul", silu); }

at::Tensor gelu_tanh_and_mul_cpu(const at::Tensor& x) { return act_and_mul_cpu(x, "gelu_tanh_and_mul", gelu_tanh); }

}  // namespace pagedserve
