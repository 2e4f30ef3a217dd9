// The vectorised pieces of torch.argmax(x, -1)'s rule on fp32 (the first maximum; a NaN counts as the maximum,
// the first NaN wins), shared by row_argmax (argmax.cpp) and masked_row_argmax (token_bitmask.cpp).
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>

namespace pagedserve::argmax {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();

inline float row_max(const float* x, int64_t n) {
  int64_t i = 0;
  float m = x[0];
  if (n >= kW) {
    Vec acc = Vec::loadu(x);
    for (i = kW; i + kW <= n; i += kW) acc = at::vec::maximum(acc, Vec::loadu(x + i));  // NaN propagates
    m = at::vec::vec_reduce_all([](Vec a, Vec b) { return at::vec::maximum(a, b); }, acc);
  }
  for (; i < n; ++i)
    if (std::isnan(x[i]) || x[i] > m) m = x[i];
  return m;
}

inline int64_t first_index_of(const float* x, int64_t n, float m) {
  if (std::isnan(m)) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(x[i])) return i;
  }
  const Vec target(m);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const int equal = ~(Vec::loadu(x + i) == target).zero_mask() & ((1 << kW) - 1);
    if (equal) return i + __builtin_ctz(equal);
  }
  for (; i < n; ++i)
    if (x[i] == m) return i;
  return n - 1;  // unreachable: m is one of the row's values
}

}  // namespace pagedserve::argmax
