// CPU paged attention: one unified kernel for decode and varlen prefill.
//
// Work item = (sequence, kv head, tile of query rows). All query heads of the
// kv head's GQA group are processed together, so each K/V block is read once
// per item. Keys go in chunks of whole blocks (>= kChunkKeys tokens): scores
// (decode: vectorized dot products; prefill tiles: K transposed into a [D, chunk]
// fp32 panel for a register-blocked GEMM), then causal mask, online softmax
// update and V accumulation, all fp32; the output is cast once at the end.
// An int8 / fp8 cache (per slot and head bf16 scales, csrc/checks.h) is dequantised a block at a time into the
// same fp32 buffers a bf16 cache is converted into.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

#include "../checks.h"
#include "../ops.h"
#include "parallel.h"

namespace pagedserve {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();
constexpr int64_t kTileRows = 64;   // query rows (tokens x group heads) per work item
constexpr int64_t kChunkKeys = 64;  // keys per softmax step (rounded up to whole blocks)
constexpr int64_t kDirectRows = 16;  // up to this many rows (decode), scores skip the K transpose
constexpr int64_t kMinWorkPerThread = 1 << 14;  // (query row x key) pairs, ~50 us, worth a thread

inline Vec load_f32(const float* p) { return Vec::loadu(p); }
inline Vec load_f32(const c10::BFloat16* p) {
  Vec v;
  at::vec::load_to_float(p, v);
  return v;
}

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Dims [0, kVecEnd<D>) go kW at a time; a head size that is no multiple of kW (40 with
// AVX-512) does its last dims one by one.
template <int64_t D>
constexpr int64_t kVecEnd = D / kW * kW;

// Raw pointers and strides (in elements) of one call: queries and outputs of type T, a cache of type C (T, or
// int8 / fp8 codes with scales).
template <typename T, typename C>
struct Problem {
  const T* q;
  T* out;
  const C* k_cache;
  const C* v_cache;
  int64_t q_stride_t, q_stride_h, out_stride_t, out_stride_h, k_stride_b, v_stride_b;
  const int32_t* block_tables;
  int64_t table_stride, max_blocks, num_blocks;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int64_t group, block_size;
  float scale;
  int64_t window;  // sliding window: a row at position t sees keys (t - window, t]; 0 = all of [0, t]
  float softcap;   // scores become softcap * tanh(score / softcap) before the softmax (Gemma 2); 0 = off
  const c10::BFloat16* k_scale = nullptr;  // a quantized cache's [num_blocks, Hkv, block_size] scales
  const c10::BFloat16* v_scale = nullptr;
  int64_t ks_stride_b = 0, vs_stride_b = 0;
  const float* sinks = nullptr;  // [num_heads] logits joining each row's softmax denominator (gpt-oss); null = none
};

template <typename C>
constexpr bool kIsCode = std::is_same_v<C, int8_t> || std::is_same_v<C, c10::Float8_e4m3fn>;

struct WorkItem {
  int64_t seq, kv_head, i0, i1;  // query rows [i0, i1) of the sequence
  int64_t cost;  // query tokens x keys the last one sees: for ordering and thread count
};

// Per-thread buffers, reused across work items.
struct Scratch {
  int64_t block_size, chunk, ld;  // ld: row stride of s and kt (chunk rounded up to a vector)
  std::vector<float> q, acc;      // [rows, D]
  std::vector<float> m, l, alpha;  // [rows]: running max, running sum, this step's rescale
  std::vector<int64_t> valid;     // [rows]: keys of this chunk the row may see
  std::vector<float> s, kt;       // [rows, ld] scores / probabilities; [D, ld] transposed keys
  std::vector<float> kf, vf;      // fp32 copies of one K block [bs, D] and of the chunk's V [chunk, D]
  std::vector<const float*> v_rows;  // per block of the chunk: its fp32 V rows
  Scratch(int64_t rows, int64_t d, int64_t bs)
      : block_size(bs), chunk(round_up(kChunkKeys, bs)), ld(round_up(chunk, kW)), q(rows * d), acc(rows * d),
        m(rows), l(rows), alpha(rows), valid(rows), s(rows * ld), kt(d * ld), kf(bs * d), vf(chunk * d),
        v_rows(chunk / bs) {}
};

template <typename T, typename C, int64_t D>
void load_queries(const Problem<T, C>& p, const WorkItem& w, int64_t q_start, Scratch& sc) {
  const int64_t g_count = p.group;
  for (int64_t i = w.i0; i < w.i1; ++i)
    for (int64_t g = 0; g < g_count; ++g) {
      const int64_t r = (i - w.i0) * g_count + g;
      const T* src = p.q + (q_start + i) * p.q_stride_t + (w.kv_head * g_count + g) * p.q_stride_h;
      for (int64_t d = 0; d < kVecEnd<D>; d += kW) (load_f32(src + d) * Vec(p.scale)).store(&sc.q[r * D + d]);
      for (int64_t d = kVecEnd<D>; d < D; ++d) sc.q[r * D + d] = static_cast<float>(src[d]) * p.scale;
      std::fill_n(&sc.acc[r * D], D, 0.f);
      sc.m[r] = -std::numeric_limits<float>::infinity();
      sc.l[r] = 0.f;
    }
}

// n rows of a cache block as fp32: the block itself for float, converted into buf for bf16, dequantised into buf
// (code * its row's scale) for int8 / fp8.
template <int64_t D, typename C>
const float* as_f32(const C* block, const c10::BFloat16* scales, int64_t n, float* buf) {
  if constexpr (std::is_same_v<C, float>) {
    return block;
  } else if constexpr (kIsCode<C>) {
    for (int64_t t = 0; t < n; ++t) {
      const float s = static_cast<float>(scales[t]);
      for (int64_t d = 0; d < D; ++d) buf[t * D + d] = static_cast<float>(block[t * D + d]) * s;
    }
    return buf;
  } else {
    const int64_t end = n * D / kW * kW;
    for (int64_t i = 0; i < end; i += kW) load_f32(block + i).store(buf + i);
    for (int64_t i = end; i < n * D; ++i) buf[i] = static_cast<float>(block[i]);
    return buf;
  }
}

// Paged blocks sit at addresses the hardware prefetcher cannot guess: request
// the next chunk's blocks one at a time while this chunk is being computed.
template <typename T>
void prefetch(const T* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(bytes + i);
}

// Keys and values of one sequence and kv head, addressed through its block table.
template <typename T, typename C, int64_t D>
struct PagedKV {
  const Problem<T, C>& p;
  const int32_t* table;
  int64_t kv_head, seq, num_keys;

  int64_t phys(int64_t blk) const {
    const int64_t b = table[blk];
    TORCH_CHECK(b >= 0 && b < p.num_blocks, "block_tables[", seq, ", ", blk, "] = ", b, " out of range");
    return b;
  }
  const C* key(int64_t blk) const { return p.k_cache + phys(blk) * p.k_stride_b + kv_head * p.block_size * D; }
  const C* value(int64_t blk) const { return p.v_cache + phys(blk) * p.v_stride_b + kv_head * p.block_size * D; }
  // The block's scales of this head (null for an unquantized cache).
  const c10::BFloat16* key_scales(int64_t blk) const { return scales(p.k_scale, p.ks_stride_b, blk); }
  const c10::BFloat16* value_scales(int64_t blk) const { return scales(p.v_scale, p.vs_stride_b, blk); }
  const c10::BFloat16* scales(const c10::BFloat16* base, int64_t stride, int64_t blk) const {
    return base ? base + phys(blk) * stride + kv_head * p.block_size : nullptr;
  }
  int64_t tokens(int64_t blk) const { return std::min(p.block_size, num_keys - blk * p.block_size); }
  int64_t num_blocks() const { return (num_keys + p.block_size - 1) / p.block_size; }
};

// Prefetch of the block one chunk ahead of blk, so its K and V arrive while this chunk computes.
template <typename T, typename C, int64_t D>
void prefetch_ahead(const PagedKV<T, C, D>& kv, int64_t blk, int64_t per_chunk) {
  const int64_t ahead = blk + per_chunk;
  if (ahead >= kv.num_blocks()) return;
  prefetch(kv.key(ahead), kv.tokens(ahead) * D);
  prefetch(kv.value(ahead), kv.tokens(ahead) * D);
}

// kt[:, c] = k_c for the keys of blocks [b0, b1).
template <typename T, typename C, int64_t D>
void stage_keys(const PagedKV<T, C, D>& kv, int64_t b0, int64_t b1, Scratch& sc) {
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t n = kv.tokens(blk);
    at::vec::transpose_mxn<float>(as_f32<D>(kv.key(blk), kv.key_scales(blk), n, sc.kf.data()), D,
                                  &sc.kt[(blk - b0) * sc.block_size], sc.ld, n, D);
    prefetch_ahead(kv, blk, b1 - b0);
  }
}

// score_direct's K rows: the cache block itself (fp32, or bf16 converted as it is loaded), or a quantized one
// dequantised into buf.
template <typename T, typename C, int64_t D>
auto direct_keys(const PagedKV<T, C, D>& kv, int64_t blk, float* buf) {
  if constexpr (kIsCode<C>)
    return as_f32<D>(kv.key(blk), kv.key_scales(blk), kv.tokens(blk), buf);
  else
    return kv.key(blk);
}

// For a few rows (decode: one GQA group) the transpose costs more than it saves
// (measured: ~1.5x slower at 7 rows): plain dot products straight from the cache
// rows, one horizontal sum each (a quantized block dequantised first). Prefill tiles (64 rows) use the panel.
template <typename T, typename C, int64_t D>
void score_direct(const PagedKV<T, C, D>& kv, int64_t b0, int64_t b1, int64_t rows, Scratch& sc) {
  for (int64_t blk = b0; blk < b1; ++blk) {
    const auto* k = direct_keys(kv, blk, sc.kf.data());
    float* s = &sc.s[(blk - b0) * sc.block_size];
    for (int64_t t = 0, n = kv.tokens(blk); t < n; ++t) {
      Vec kr[D / kW];
      for (int64_t j = 0; j < D / kW; ++j) kr[j] = load_f32(k + t * D + j * kW);
      for (int64_t r = 0; r < rows; ++r) {
        const float* q = &sc.q[r * D];
        Vec a = Vec::loadu(q) * kr[0];
        for (int64_t j = 1; j < D / kW; ++j) a = at::vec::fmadd(Vec::loadu(q + j * kW), kr[j], a);
        float dot = at::vec::vec_reduce_all<float>(std::plus<Vec>(), a);
        for (int64_t d = kVecEnd<D>; d < D; ++d) dot += q[d] * static_cast<float>(k[t * D + d]);
        s[r * sc.ld + t] = dot;
      }
    }
    prefetch_ahead(kv, blk, b1 - b0);
  }
}

// s[r0 + i, :n] = q[r0 + i] . K^T for NR rows: register-blocked over the K panel,
// one FMA per (row, d, kW keys), no horizontal sums.
template <int64_t D, int NR>
void score_rows(int64_t r0, int64_t n, Scratch& sc) {
  for (int64_t c = 0; c < n; c += kW) {
    Vec acc[NR];
    for (int i = 0; i < NR; ++i) acc[i] = Vec(0.f);
    for (int64_t d = 0; d < D; ++d) {
      const Vec k = Vec::loadu(&sc.kt[d * sc.ld + c]);
      for (int i = 0; i < NR; ++i) acc[i] = at::vec::fmadd(Vec(sc.q[(r0 + i) * D + d]), k, acc[i]);
    }
    for (int i = 0; i < NR; ++i) acc[i].store(&sc.s[(r0 + i) * sc.ld + c]);
  }
}

template <int64_t D>
void score_chunk(int64_t n, int64_t rows, Scratch& sc) {
  constexpr int kRows = 8;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) score_rows<D, kRows>(r, n, sc);
  switch (rows - r) {  // remainder rows, unrolled per count
    case 7: return score_rows<D, 7>(r, n, sc);
    case 6: return score_rows<D, 6>(r, n, sc);
    case 5: return score_rows<D, 5>(r, n, sc);
    case 4: return score_rows<D, 4>(r, n, sc);
    case 3: return score_rows<D, 3>(r, n, sc);
    case 2: return score_rows<D, 2>(r, n, sc);
    case 1: return score_rows<D, 1>(r, n, sc);
    default: return;
  }
}

// In place over each row's n scores: softcap * tanh(score / softcap), the eager formula's order.
void softcap_scores(int64_t rows, int64_t n, float softcap, Scratch& sc) {
  const auto cap = [softcap](Vec v) { return Vec(softcap) * (v / Vec(softcap)).tanh(); };
  for (int64_t r = 0; r < rows; ++r) at::vec::map(cap, &sc.s[r * sc.ld], &sc.s[r * sc.ld], n);
}

// Online softmax over scores [first, valid) of row r (earlier keys are outside its sliding window, later ones
// causally masked; the earlier ones get probability 0): probabilities in place, running max/sum updated,
// alpha = accumulator rescale. exp_u20 (ATen's polynomial exp, as in its CPU flash attention) keeps this cheap.
void softmax_update(int64_t r, int64_t first, int64_t valid, Scratch& sc) {
  first = std::max<int64_t>(first, 0);
  sc.valid[r] = first < valid ? valid : 0;
  sc.alpha[r] = 1.f;
  if (first >= valid) return;
  std::fill(&sc.s[r * sc.ld], &sc.s[r * sc.ld] + first, 0.f);
  float* s = &sc.s[r * sc.ld] + first;
  valid -= first;
  const Vec lowest(-std::numeric_limits<float>::infinity());
  Vec top = lowest;
  // Partial loads and stores at the end: s starts `first` into the row, so a whole vector could run past it.
  for (int64_t t = 0; t < valid; t += kW)
    top = at::vec::maximum(top, Vec::set(lowest, Vec::loadu(s + t, std::min(kW, valid - t)), std::min(kW, valid - t)));
  const float m_new = std::max(sc.m[r], at::vec::vec_reduce_all<float>(
                                            [](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, top));
  Vec sum(0.f);
  for (int64_t t = 0; t < valid; t += kW) {
    const int64_t count = std::min(kW, valid - t);
    const Vec e = Vec::set(Vec(0.f), (Vec::loadu(s + t, count) - Vec(m_new)).exp_u20(), count);
    e.store(s + t, static_cast<int>(count));
    sum = sum + e;
  }
  sc.alpha[r] = std::exp(sc.m[r] - m_new);  // 0 for the first chunk (m = -inf)
  sc.l[r] = sc.l[r] * sc.alpha[r] + at::vec::vec_reduce_all<float>(std::plus<Vec>(), sum);
  sc.m[r] = m_new;
}

// acc[r] = acc[r] * alpha[r] + sum_{t < valid[r]} p[r, t] * v_t, the row's
// accumulator held in registers across the chunk.
template <typename T, typename C, int64_t D>
void accumulate_values(const PagedKV<T, C, D>& kv, int64_t b0, int64_t b1, int64_t rows, Scratch& sc) {
  const int64_t bs = sc.block_size;
  for (int64_t blk = b0; blk < b1; ++blk)
    sc.v_rows[blk - b0] = as_f32<D>(kv.value(blk), kv.value_scales(blk), kv.tokens(blk), &sc.vf[(blk - b0) * bs * D]);
  for (int64_t r = 0; r < rows; ++r) {
    if (sc.valid[r] <= 0) continue;
    float* out = &sc.acc[r * D];
    const float* p = &sc.s[r * sc.ld];
    Vec acc[D / kW];
    for (int64_t j = 0; j < D / kW; ++j) acc[j] = Vec::loadu(out + j * kW) * Vec(sc.alpha[r]);
    for (int64_t c = 0; c * bs < sc.valid[r]; ++c) {
      const float* v = sc.v_rows[c];
      for (int64_t t = 0, n = std::min(bs, sc.valid[r] - c * bs); t < n; ++t)
        for (int64_t j = 0; j < D / kW; ++j)
          acc[j] = at::vec::fmadd(Vec(p[c * bs + t]), Vec::loadu(v + t * D + j * kW), acc[j]);
    }
    for (int64_t j = 0; j < D / kW; ++j) acc[j].store(out + j * kW);
    for (int64_t d = kVecEnd<D>; d < D; ++d) {
      float a = out[d] * sc.alpha[r];
      for (int64_t c = 0; c * bs < sc.valid[r]; ++c)
        for (int64_t t = 0, n = std::min(bs, sc.valid[r] - c * bs); t < n; ++t)
          a += p[c * bs + t] * sc.v_rows[c][t * D + d];
      out[d] = a;
    }
  }
}

// acc's factor for the output row: 1 / its softmax denominator relative to the running max m, the keys' sum l plus
// the sink's share (gpt-oss: the sink logit joins the denominator only; -inf: none, exactly 1 / l). A sink far above
// m overflows to inf: a zero row, as the exact softmax rounds it. A row that saw no key writes zeros.
inline float output_scale(float m, float l, float sink) { return l > 0.f ? 1.f / (l + std::exp(sink - m)) : 0.f; }

template <typename T, typename C, int64_t D>
void store_rows(const Problem<T, C>& p, const WorkItem& w, int64_t q_start, const Scratch& sc) {
  constexpr float kNoSink = -std::numeric_limits<float>::infinity();
  for (int64_t i = w.i0; i < w.i1; ++i)
    for (int64_t g = 0; g < p.group; ++g) {
      const int64_t r = (i - w.i0) * p.group + g, head = w.kv_head * p.group + g;
      T* dst = p.out + (q_start + i) * p.out_stride_t + head * p.out_stride_h;
      const float inv = output_scale(sc.m[r], sc.l[r], p.sinks ? p.sinks[head] : kNoSink);
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(sc.acc[r * D + d] * inv);
    }
}

template <typename T, typename C, int64_t D>
void attend(const Problem<T, C>& p, const WorkItem& w, Scratch& sc) {
  const int64_t q_start = p.query_start_loc[w.seq];
  const int64_t q_len = p.query_start_loc[w.seq + 1] - q_start;
  const int64_t first_pos = p.seq_lens[w.seq] - q_len + w.i0;  // position of row i0
  const PagedKV<T, C, D> kv{p, p.block_tables + w.seq * p.table_stride, w.kv_head, w.seq,
                         p.seq_lens[w.seq] - q_len + w.i1};  // keys visible to the last row
  const int64_t rows = (w.i1 - w.i0) * p.group, per_chunk = sc.chunk / p.block_size;
  // The first row's window starts the first chunk: blocks before it no row of the item sees.
  const int64_t lowest = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;
  load_queries<T, C, D>(p, w, q_start, sc);
  for (int64_t b0 = lowest / p.block_size; b0 < kv.num_blocks(); b0 += per_chunk) {
    const int64_t b1 = std::min(kv.num_blocks(), b0 + per_chunk), c0 = b0 * p.block_size;
    const int64_t n = std::min(kv.num_keys, b1 * p.block_size) - c0;
    if (rows <= kDirectRows) {
      score_direct(kv, b0, b1, rows, sc);
    } else {
      stage_keys(kv, b0, b1, sc);
      score_chunk<D>(n, rows, sc);
    }
    if (p.softcap > 0.f) softcap_scores(rows, n, p.softcap, sc);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + r / p.group;
      softmax_update(r, p.window > 0 ? pos - p.window + 1 - c0 : 0, std::min(n, pos + 1 - c0), sc);
    }
    accumulate_values(kv, b0, b1, rows, sc);
  }
  store_rows<T, C, D>(p, w, q_start, sc);
}

template <typename P>
std::vector<WorkItem> plan(const P& p, int64_t num_seqs, int64_t num_kv_heads) {
  const int64_t tile = std::max<int64_t>(1, kTileRows / p.group);
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = p.query_start_loc[b + 1] - p.query_start_loc[b], seq_len = p.seq_lens[b];
    TORCH_CHECK(q_len >= 0 && seq_len >= q_len, "sequence ", b, ": seq_len ", seq_len, " < query length ", q_len);
    TORCH_CHECK((seq_len + p.block_size - 1) / p.block_size <= p.max_blocks, "sequence ", b, ": seq_len ", seq_len,
                " needs more blocks than block_tables has columns (", p.max_blocks, ")");
    for (int64_t i0 = 0; i0 < q_len; i0 += tile)
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t i1 = std::min(q_len, i0 + tile);
        items.push_back({b, h, i0, i1, (seq_len - q_len + i1) * (i1 - i0)});
      }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

template <typename T, typename C, int64_t D>
void run(const Problem<T, C>& p, int64_t num_seqs, int64_t num_kv_heads) {
  const auto items = plan(p, num_seqs, num_kv_heads);
  const int64_t rows = std::max<int64_t>(1, kTileRows / p.group) * p.group;
  int64_t work = 0;
  for (const auto& w : items) work += w.cost * p.group;
  // A fork/join costs more than a tiny batch's whole attention.
  const int64_t threads = std::clamp<int64_t>(work / kMinWorkPerThread, 1, at::get_num_threads());
  std::atomic<int64_t> next{0};
  parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch sc(rows, D, p.block_size);
    for (int64_t i = next++; i < static_cast<int64_t>(items.size()); i = next++) attend<T, C, D>(p, items[i], sc);
  });
}

template <typename T, typename C>
void dispatch_head_size(const Problem<T, C>& p, int64_t d, int64_t num_seqs, int64_t num_kv_heads) {
  switch (d) {
#define PAGEDSERVE_CASE(D) \
  case D: return run<T, C, D>(p, num_seqs, num_kv_heads);
    PAGEDSERVE_HEAD_SIZES(PAGEDSERVE_CASE)
#undef PAGEDSERVE_CASE
    default: check_head_size(d);  // throws
  }
}

template <typename T, typename C>
void launch(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
            double scale, int64_t window, double softcap, const c10::optional<at::Tensor>& key_scale,
            const c10::optional<at::Tensor>& value_scale, const c10::optional<at::Tensor>& sinks) {
  Problem<T, C> p{query.data_ptr<T>(), out.data_ptr<T>(), key_cache.data_ptr<C>(), value_cache.data_ptr<C>(),
                     query.stride(0), query.stride(1), out.stride(0), out.stride(1), key_cache.stride(0),
                     value_cache.stride(0), block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                     block_tables.size(1), key_cache.size(0), seq_lens.data_ptr<int32_t>(),
                     query_start_loc.data_ptr<int32_t>(), query.size(1) / key_cache.size(1), key_cache.size(2),
                     static_cast<float>(scale), window, static_cast<float>(softcap)};
  if (key_scale) {
    p.k_scale = key_scale->data_ptr<c10::BFloat16>(), p.v_scale = value_scale->data_ptr<c10::BFloat16>();
    p.ks_stride_b = key_scale->stride(0), p.vs_stride_b = value_scale->stride(0);
  }
  if (sinks) p.sinks = sinks->data_ptr<float>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] >= 0 && qsl[block_tables.size(0)] <= query.size(0),
              "query_start_loc must stay within the query's ", query.size(0), " rows");
  dispatch_head_size(p, key_cache.size(3), block_tables.size(0), key_cache.size(1));
}

// The cache's element type: T itself, or int8 / fp8 codes.
template <typename T, typename... Args>
void launch_for_cache(const at::Tensor& key_cache, Args&&... args) {
  switch (key_cache.scalar_type()) {
    case at::kChar: return launch<T, int8_t>(std::forward<Args>(args)...);
    case at::kFloat8_e4m3fn: return launch<T, c10::Float8_e4m3fn>(std::forward<Args>(args)...);
    default: return launch<T, T>(std::forward<Args>(args)...);
  }
}

}  // namespace

void paged_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, int64_t /*max_query_len*/, int64_t /*max_seq_len*/,
                         double scale, int64_t sliding_window, double softcap,
                         const c10::optional<at::Tensor>& key_scale, const c10::optional<at::Tensor>& value_scale,
                         const c10::optional<at::Tensor>& sinks) {
  check_paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, key_scale,
                        value_scale, sinks);
  TORCH_CHECK(sliding_window >= 0, "paged_attention: sliding_window must be >= 0 (0: none), got ", sliding_window);
  TORCH_CHECK(softcap >= 0, "paged_attention: softcap must be >= 0 (0: none), got ", softcap);
  switch (query.scalar_type()) {
    case at::kFloat:
      return launch_for_cache<float>(key_cache, out, query, key_cache, value_cache, block_tables, seq_lens,
                                     query_start_loc, scale, sliding_window, softcap, key_scale, value_scale,
                                     sinks);
    case at::kBFloat16:
      return launch_for_cache<c10::BFloat16>(key_cache, out, query, key_cache, value_cache, block_tables, seq_lens,
                                             query_start_loc, scale, sliding_window, softcap, key_scale, value_scale,
                                             sinks);
    default: TORCH_CHECK(false, "CPU paged_attention supports float32 and bfloat16, got ", query.scalar_type());
  }
}

}  // namespace pagedserve
