// Structured output's mask on the CPU, xgrammar's layout: token j of masked row i is allowed when bit j % 32 of
// bitmask[i][j / 32] is set (tokens past the bitmask's width, a padded vocabulary, are forbidden).
// apply_token_bitmask writes -inf over the forbidden tokens in place, a word at a time (xgrammar's own CPU apply
// took 4-6 ms for 64 rows of a 32k vocabulary on 2 cores, a large share of a small model's decode step).
// masked_row_argmax is greedy sampling's shortcut: the masked rows' argmax, reading only the allowed tokens (a
// grammar state allows few, so most words are 0), without writing the logits at all.
#include <ATen/Dispatch.h>
#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../checks.h"
#include "../ops.h"
#include "parallel.h"
#include "row_max.h"

namespace pagedserve {
namespace {

template <typename T>
void mask_row(T* row, const int32_t* words, int64_t num_words, int64_t n) {
  const T forbidden = static_cast<T>(-std::numeric_limits<float>::infinity());
  for (int64_t w = 0; w * 32 < n; ++w) {
    const uint32_t bits = w < num_words ? static_cast<uint32_t>(words[w]) : 0u;
    if (bits == 0xFFFFFFFFu) continue;
    T* x = row + w * 32;
    const int64_t width = std::min<int64_t>(32, n - w * 32);
    if (bits == 0) {  // the common word: a grammar state allows few tokens
      std::fill(x, x + width, forbidden);
      continue;
    }
    for (int64_t b = 0; b < width; ++b)
      if (!((bits >> b) & 1u)) x[b] = forbidden;
  }
}

// row_argmax of the masked row: the first maximum among the allowed tokens, the first NaN if one is allowed, and
// 0 when every allowed value is -inf or nothing is allowed (the masked row is then all -inf). fp32 runs of fully
// allowed words (a free-text state allows nearly everything) take row_argmax's vectorised rule.
template <typename T>
int64_t allowed_argmax(const T* row, const int32_t* words, int64_t num_words, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  const int64_t limit = std::min(num_words, (n + 31) / 32);
  for (int64_t w = 0; w < limit; ++w) {
    if (words[w] == 0) continue;  // the common word: a grammar state allows few tokens
    if constexpr (std::is_same_v<T, float>) {
      int64_t end = w;
      while (end < limit && words[end] == -1 && (end + 1) * 32 <= n) ++end;
      if (end > w) {
        const float* x = row + w * 32;
        const int64_t len = (end - w) * 32;
        const float m = argmax::row_max(x, len);
        if (std::isnan(m) || m > best) best = m, at = w * 32 + argmax::first_index_of(x, len, m);
        if (std::isnan(m)) return at;
        w = end - 1;
        continue;
      }
    }
    uint32_t bits = static_cast<uint32_t>(words[w]);
    if (n - w * 32 < 32) bits &= (1u << (n - w * 32)) - 1u;
    for (; bits; bits &= bits - 1u) {
      const int64_t j = w * 32 + __builtin_ctz(bits);
      const float x = static_cast<float>(row[j]);
      if (std::isnan(x)) return j;
      if (x > best) best = x, at = j;
    }
  }
  return at;
}

struct Masked {
  at::Tensor words, targets;  // host copies: int32 [k, num_words], int64 [k]
};

Masked host_mask(const char* op, const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  check_token_bitmask(op, logits, bitmask, rows);
  Masked m{bitmask.to(at::kCPU).contiguous(), rows.to(at::kCPU).contiguous()};
  check_row_range(op, m.targets.data_ptr<int64_t>(), m.targets.size(0), logits.size(0));
  return m;
}

}  // namespace

at::Tensor masked_row_argmax_cpu(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  const Masked m = host_mask("masked_row_argmax", logits, bitmask, rows);
  const int64_t k = m.targets.size(0), n = logits.size(1), num_words = m.words.size(1), stride = logits.stride(0);
  auto out = at::empty({k}, logits.options().dtype(at::kLong));
  const int64_t* r = m.targets.data_ptr<int64_t>();
  const int32_t* w = m.words.data_ptr<int32_t>();
  int64_t* idx = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "masked_row_argmax", [&] {
    const scalar_t* base = logits.data_ptr<scalar_t>();
    parallel_for(0, k, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) idx[i] = allowed_argmax(base + r[i] * stride, w + i * num_words, num_words, n);
    });
  });
  return out;
}

void apply_token_bitmask_cpu(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  const Masked m = host_mask("apply_token_bitmask", logits, bitmask, rows);
  const int64_t k = m.targets.size(0), n = logits.size(1), num_words = m.words.size(1), stride = logits.stride(0);
  const int64_t* r = m.targets.data_ptr<int64_t>();
  const int32_t* w = m.words.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "apply_token_bitmask", [&] {
    scalar_t* base = logits.data_ptr<scalar_t>();
    parallel_for(0, k, std::max<int64_t>(1, (int64_t{1} << 15) / n), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) mask_row(base + r[i] * stride, w + i * num_words, num_words, n);
    });
  });
}

}  // namespace pagedserve
