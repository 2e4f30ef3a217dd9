// Split paged attention, bandwidth-oriented (flash-decoding / vLLM v2 design).
//
// Decode rows (query length 1): one CTA per (sequence, KV head, context partition of kSplitPartition tokens)
// takes every query head of the GQA group (up to kSplitMaxGroup), so each K/V row is read once, with 16-byte
// loads, a few lanes per key. A row over several partitions is merged by split_merge_kernel from each
// partition's (max, sum-exp, normalised out); a row in one partition is written directly.
// Prefill rows (query length > 1): one CTA per tile of kTileRows (token, group head) rows of one sequence and
// KV head, streaming kTileKeys-key K/V tiles from the block table through shared memory, online softmax, the
// two products on tensor cores (WMMA) for fp16 / bf16 and on CUDA cores for fp32.
// fp32 accumulation and exact expf throughout; reference: cuda_ext.reference.paged_attention_split.
#include <mma.h>

#include <cfloat>
#include <type_traits>

#include "../head_sizes.h"
#include "convert.cuh"

namespace pagedserve::cuda {
namespace {

constexpr int kThreads = 128, kWarps = kThreads / 32;
constexpr int kPartition = kSplitPartition, kMaxGroup = kSplitMaxGroup;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(kFull, x, offset);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFull, x, offset));
  return x;
}

// Row j of one sequence's cache for kv_head: [num_blocks, num_kv_heads, block_size, D] with any block stride.
template <typename T, int D>
__device__ __forceinline__ const T* cache_row(const void* cache, int64_t stride_b, const int32_t* table,
                                              int kv_head, int block_size, int j) {
  const int64_t block = table[j / block_size];
  return static_cast<const T*>(cache) + block * stride_b + (static_cast<int64_t>(kv_head) * block_size + j % block_size) * D;
}

// 16 bytes at p (16-byte aligned: the bindings check the caches) as fp32.
template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float* f) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < int(16 / sizeof(T)); ++i) f[i] = to_float(e[i]);
}

constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }

// How a warp reads K/V rows: kLanes lanes per key (a power of two), each kPerLane 16-byte vectors of kVec.
template <typename T, int D>
struct RowSplit {
  static constexpr int kVec = 16 / sizeof(T);
  static constexpr int kVecs = D / kVec;  // every compiled head size is a multiple of 8
  static constexpr int kLanes = pow2_at_least(kVecs) < 32 ? pow2_at_least(kVecs) : 32;
  static constexpr int kPerLane = (kVecs + kLanes - 1) / kLanes;
  static constexpr int kKeysPerStep = kWarps * (32 / kLanes);
};

// The partitions of decode sequence b's visible keys [first, seq_len): count, and the first one's index.
struct Partitions {
  int first_key, first, count;
};

__device__ __forceinline__ Partitions partitions_of(const AttentionArgs& a, int seq_len) {
  const int first_key = a.window > 0 && seq_len > a.window ? seq_len - a.window : 0;
  const int first = first_key / kPartition;  // partitions wholly before the window are skipped
  return {first_key, first, (seq_len + kPartition - 1) / kPartition - first};
}

// s_p[h][c] = scaled (and soft-capped) q_h . k_c for the partition's keys [lo, lo + n).
template <typename T, int D>
__device__ void partition_scores(const AttentionArgs& a, const int32_t* table, int kv_head, int lo, int n,
                                 int heads, const float (*s_q)[D], float (*s_p)[kPartition]) {
  using R = RowSplit<T, D>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sub = lane % R::kLanes;
  for (int c0 = 0; c0 < n; c0 += R::kKeysPerStep) {
    const int c = c0 + warp * (32 / R::kLanes) + lane / R::kLanes;
    float dot[kMaxGroup] = {};
    if (c < n) {
      const T* k = cache_row<T, D>(a.key_cache, a.k_stride_b, table, kv_head, a.block_size, lo + c);
#pragma unroll
      for (int v = 0; v < R::kPerLane; ++v) {
        const int vi = sub + v * R::kLanes;
        if (vi >= R::kVecs) break;
        float kf[R::kVec];
        load_vec(k + vi * R::kVec, kf);
#pragma unroll
        for (int h = 0; h < kMaxGroup; ++h)
          if (h < heads)
#pragma unroll
            for (int e = 0; e < R::kVec; ++e) dot[h] += kf[e] * s_q[h][vi * R::kVec + e];
      }
    }
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h)
      if (h < heads)  // uniform over the CTA: every lane shuffles
        for (int offset = R::kLanes / 2; offset > 0; offset /= 2) dot[h] += __shfl_xor_sync(kFull, dot[h], offset);
    if (c < n && sub == 0)
#pragma unroll
      for (int h = 0; h < kMaxGroup; ++h)
        if (h < heads) s_p[h][c] = soft_cap(dot[h], a.softcap);  // a constant index keeps dot in registers
  }
}

// In place: s_p[h][c] = exp(score - max_h); s_max / s_sum per head. One warp per head.
__device__ void partition_softmax(int n, int heads, float (*s_p)[kPartition], float* s_max, float* s_sum) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int h = warp; h < heads; h += kWarps) {
    float m = -INFINITY;
    for (int c = lane; c < n; c += 32) m = fmaxf(m, s_p[h][c]);
    m = warp_max(m);
    float l = 0.f;
    for (int c = lane; c < n; c += 32) {
      const float e = expf(s_p[h][c] - m);
      s_p[h][c] = e;
      l += e;
    }
    l = warp_sum(l);
    if (lane == 0) s_max[h] = m, s_sum[h] = l;
  }
}

// s_out[h][d] = sum_c s_p[h][c] v_c[d]: per-lane accumulators, summed over a warp's keys by shuffles, then
// over warps in a fixed order (deterministic).
template <typename T, int D>
__device__ void partition_values(const AttentionArgs& a, const int32_t* table, int kv_head, int lo, int n,
                                 int heads, const float (*s_p)[kPartition], float (*s_out)[D]) {
  using R = RowSplit<T, D>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sub = lane % R::kLanes;
  float acc[kMaxGroup][R::kPerLane * R::kVec] = {};
  for (int c0 = 0; c0 < n; c0 += R::kKeysPerStep) {
    const int c = c0 + warp * (32 / R::kLanes) + lane / R::kLanes;
    if (c >= n) continue;
    const T* v = cache_row<T, D>(a.value_cache, a.v_stride_b, table, kv_head, a.block_size, lo + c);
#pragma unroll
    for (int i = 0; i < R::kPerLane; ++i) {
      const int vi = sub + i * R::kLanes;
      if (vi >= R::kVecs) break;
      float vf[R::kVec];
      load_vec(v + vi * R::kVec, vf);
#pragma unroll
      for (int h = 0; h < kMaxGroup; ++h)
        if (h < heads)
#pragma unroll
          for (int e = 0; e < R::kVec; ++e) acc[h][i * R::kVec + e] += s_p[h][c] * vf[e];
    }
  }
#pragma unroll
  for (int h = 0; h < kMaxGroup; ++h)
    if (h < heads)
#pragma unroll
      for (int e = 0; e < R::kPerLane * R::kVec; ++e)
        for (int offset = 16; offset >= R::kLanes; offset /= 2) acc[h][e] += __shfl_xor_sync(kFull, acc[h][e], offset);
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w && lane < R::kLanes)
#pragma unroll
      for (int i = 0; i < R::kPerLane; ++i) {
        const int vi = sub + i * R::kLanes;
        if (vi >= R::kVecs) break;
#pragma unroll
        for (int h = 0; h < kMaxGroup; ++h)
          if (h < heads)
#pragma unroll
            for (int e = 0; e < R::kVec; ++e) s_out[h][vi * R::kVec + e] += acc[h][i * R::kVec + e];
      }
    __syncthreads();
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) split_decode_kernel(SplitAttentionArgs s) {
  const AttentionArgs& a = s.attn;
  const int b = blockIdx.z, q_row = a.query_start_loc[b];
  if (a.query_start_loc[b + 1] - q_row != 1) return;  // not a decode row: the prefill kernel's
  const int seq_len = a.seq_lens[b];
  const Partitions parts = partitions_of(a, seq_len);
  if (static_cast<int>(blockIdx.x) >= parts.count) return;
  const int part = parts.first + blockIdx.x;
  const int lo = max(parts.first_key, part * kPartition), n = min(seq_len, (part + 1) * kPartition) - lo;
  const int group = a.num_heads / a.num_kv_heads, kv_head = blockIdx.y / s.head_chunks;
  const int h0 = kv_head * group + (blockIdx.y % s.head_chunks) * kMaxGroup;
  const int heads = min(kMaxGroup, (kv_head + 1) * group - h0);

  __shared__ float s_q[kMaxGroup][D], s_out[kMaxGroup][D], s_p[kMaxGroup][kPartition];
  __shared__ float s_max[kMaxGroup], s_sum[kMaxGroup];
  const T* q = static_cast<const T*>(a.query) + q_row * a.q_stride_t;
  for (int i = threadIdx.x; i < kMaxGroup * D; i += kThreads) {
    const int h = i / D, d = i % D;
    s_q[h][d] = h < heads ? to_float(q[(h0 + h) * a.q_stride_h + d]) * a.scale : 0.f;
    s_out[h][d] = 0.f;
  }
  __syncthreads();
  const int32_t* table = a.block_tables + b * a.table_stride;
  partition_scores<T, D>(a, table, kv_head, lo, n, heads, s_q, s_p);
  __syncthreads();
  partition_softmax(n, heads, s_p, s_max, s_sum);
  __syncthreads();
  partition_values<T, D>(a, table, kv_head, lo, n, heads, s_p, s_out);  // ends synchronised

  for (int i = threadIdx.x; i < heads * D; i += kThreads) {
    const int h = i / D, d = i % D;
    // A lone partition is the whole row, its sink joins here; several merge with it in split_merge_kernel.
    const float l = parts.count == 1 ? denominator(s_max[h], s_sum[h], sink_of(a, h0 + h)) : s_sum[h];
    const float o = s_out[h][d] / l;
    if (parts.count == 1) {
      static_cast<T*>(a.out)[q_row * a.out_stride_t + (h0 + h) * a.out_stride_h + d] = from_float<T>(o);
      continue;
    }
    const int64_t slot = (static_cast<int64_t>(b) * a.num_heads + h0 + h) * s.max_partitions + blockIdx.x;
    s.partials[slot * D + d] = o;
    if (d == 0) s.maxes[slot] = s_max[h], s.sums[slot] = s_sum[h];
  }
}

// out = sum_p w_p o_p / sum_p w_p with w_p = sum_p * exp(max_p - max): each partition's share of the mass.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) split_merge_kernel(SplitAttentionArgs s) {
  const AttentionArgs& a = s.attn;
  const int h = blockIdx.x, b = blockIdx.y, q_row = a.query_start_loc[b];
  if (a.query_start_loc[b + 1] - q_row != 1) return;
  const int count = partitions_of(a, a.seq_lens[b]).count;
  if (count == 1) return;  // written by the decode kernel
  const int64_t slot = (static_cast<int64_t>(b) * a.num_heads + h) * s.max_partitions;
  const float sink = sink_of(a, h);
  float top = fmaxf(-FLT_MAX, sink);
  for (int p = 0; p < count; ++p) top = fmaxf(top, s.maxes[slot + p]);
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float o = 0.f, total = expf(sink - top);
    for (int p = 0; p < count; ++p) {
      const float w = s.sums[slot + p] * expf(s.maxes[slot + p] - top);
      o += w * s.partials[(slot + p) * D + d];
      total += w;
    }
    static_cast<T*>(a.out)[q_row * a.out_stride_t + h * a.out_stride_h + d] = from_float<T>(o / total);
  }
}

// ---- prefill ----

constexpr int kTileRows = 32, kTileKeys = 32;  // 2 x 2 16x16 MMA tiles of scores, one per warp
static_assert(kWarps == 4 && kTileKeys == 32, "one warp per score tile, one lane per key of a tile");

constexpr size_t align128(size_t bytes) { return (bytes + 127) / 128 * 128; }

// Shared-memory carve-up of a prefill CTA: byte offsets of each tile, head size padded to the MMA's 16.
template <typename T, int D>
struct PrefillSmem {
  static constexpr int kDp = (D + 15) / 16 * 16;
  static constexpr size_t q = 0;                                              // T [kTileRows][kDp]
  static constexpr size_t k = align128(q + kTileRows * kDp * sizeof(T));      // T [kTileKeys][kDp]
  static constexpr size_t v = align128(k + kTileKeys * kDp * sizeof(T));      // T [kTileKeys][kDp]
  static constexpr size_t s = align128(v + kTileKeys * kDp * sizeof(T));      // float [kTileRows][kTileKeys]
  static constexpr size_t p = align128(s + kTileRows * kTileKeys * 4);        // T [kTileRows][kTileKeys]
  static constexpr size_t o = align128(p + kTileRows * kTileKeys * sizeof(T));  // float [kTileRows][kDp]
  static constexpr size_t stats = align128(o + kTileRows * kDp * 4);          // float max, sum [kTileRows]
  static constexpr size_t bytes = stats + 2 * kTileRows * 4;
};

// s[r][c] = q_r . k_c: tensor cores for fp16 / bf16 (fp32 accumulation), CUDA cores for fp32.
template <typename T, int Dp>
__device__ void tile_scores(const T* q, const T* k, float* s) {
  using namespace nvcuda;
  if constexpr (std::is_same_v<T, float>) {
    for (int i = threadIdx.x; i < kTileRows * kTileKeys; i += kThreads) {
      const int r = i / kTileKeys, c = i % kTileKeys;
      float acc = 0.f;
      for (int d = 0; d < Dp; ++d) acc += q[r * Dp + d] * k[c * Dp + d];
      s[i] = acc;
    }
  } else {
    const int warp = threadIdx.x / 32, r0 = (warp / 2) * 16, c0 = (warp % 2) * 16;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.f);
    for (int d = 0; d < Dp; d += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fq;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fk;  // k row-major = k^T column-major
      wmma::load_matrix_sync(fq, q + r0 * Dp + d, Dp);
      wmma::load_matrix_sync(fk, k + c0 * Dp + d, Dp);
      wmma::mma_sync(acc, fq, fk, acc);
    }
    wmma::store_matrix_sync(s + r0 * kTileKeys + c0, acc, kTileKeys, wmma::mem_row_major);
  }
}

// o[r][d] += sum_c p[r][c] v_c[d], same split of the work as tile_scores.
template <typename T, int Dp>
__device__ void tile_accumulate(const T* p, const T* v, float* o) {
  using namespace nvcuda;
  if constexpr (std::is_same_v<T, float>) {
    for (int i = threadIdx.x; i < kTileRows * Dp; i += kThreads) {
      const int r = i / Dp, d = i % Dp;
      float acc = o[i];
      for (int c = 0; c < kTileKeys; ++c) acc += p[r * kTileKeys + c] * v[c * Dp + d];
      o[i] = acc;
    }
  } else {
    for (int t = threadIdx.x / 32; t < (kTileRows / 16) * (Dp / 16); t += kWarps) {
      const int r0 = (t % (kTileRows / 16)) * 16, d0 = (t / (kTileRows / 16)) * 16;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, o + r0 * Dp + d0, Dp, wmma::mem_row_major);
      for (int c = 0; c < kTileKeys; c += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fp;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fv;
        wmma::load_matrix_sync(fp, p + r0 * kTileKeys + c, kTileKeys);
        wmma::load_matrix_sync(fv, v + c * Dp + d0, Dp);
        wmma::mma_sync(acc, fp, fv, acc);
      }
      wmma::store_matrix_sync(o + r0 * Dp + d0, acc, Dp, wmma::mem_row_major);
    }
  }
}

// Keys [k0, k0 + kTileKeys) into the K / V tiles; keys at or past hi become zeros (their scores are masked, and a
// zero keeps a masked 0 * v finite).
template <typename T, int D, int Dp>
__device__ void load_kv_tile(const AttentionArgs& a, const int32_t* table, int kv_head, int k0, int hi, T* k_tile,
                             T* v_tile) {
  constexpr int kVec = 16 / sizeof(T), kVecs = D / kVec;
  for (int i = threadIdx.x; i < kTileKeys * kVecs; i += kThreads) {
    const int c = i / kVecs, e = (i % kVecs) * kVec, j = k0 + c;
    uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
    if (j < hi) {
      kx = __ldg(reinterpret_cast<const uint4*>(cache_row<T, D>(a.key_cache, a.k_stride_b, table, kv_head,
                                                                a.block_size, j) + e));
      vx = __ldg(reinterpret_cast<const uint4*>(cache_row<T, D>(a.value_cache, a.v_stride_b, table, kv_head,
                                                                a.block_size, j) + e));
    }
    *reinterpret_cast<uint4*>(k_tile + c * Dp + e) = kx;
    *reinterpret_cast<uint4*>(v_tile + c * Dp + e) = vx;
  }
}

// One online-softmax step per row (a warp per row, a lane per key): masks the tile's scores, turns them into
// p in p_tile, rescales the row's out accumulator and updates its (max, sum).
template <typename T, int Dp>
__device__ void tile_softmax(const AttentionArgs& a, int rows, int group, int row0, int pos0, int k0, int hi,
                             const float* s, T* p_tile, float* o, float* row_max, float* row_sum) {
  const int lane = threadIdx.x % 32, j = k0 + lane;
  for (int r = threadIdx.x / 32; r < kTileRows; r += kWarps) {
    const int pos = pos0 + (row0 + r) / group;  // causal: row i of the sequence sits at seq_len - q_len + i
    const bool visible = r < rows && j < hi && j <= pos && (a.window == 0 || j > pos - a.window);
    const float x = visible ? soft_cap(s[r * kTileKeys + lane] * a.scale, a.softcap) : -INFINITY;
    const float m_old = row_max[r], m_new = fmaxf(m_old, warp_max(x));
    const float e = visible ? expf(x - m_new) : 0.f;
    const float alpha = m_new == -INFINITY ? 1.f : expf(m_old - m_new);
    const float l = warp_sum(e);
    p_tile[r * kTileKeys + lane] = from_float<T>(e);
    for (int d = lane; d < Dp; d += 32) o[r * Dp + d] *= alpha;
    if (lane == 0) row_max[r] = m_new, row_sum[r] = row_sum[r] * alpha + l;
  }
}

// Rows of the tile are (token, head of the group) pairs, token-major, so the group shares each K/V tile.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) split_prefill_kernel(AttentionArgs a) {
  using L = PrefillSmem<T, D>;
  constexpr int Dp = L::kDp;
  extern __shared__ __align__(128) unsigned char smem[];
  T *q_tile = reinterpret_cast<T*>(smem + L::q), *k_tile = reinterpret_cast<T*>(smem + L::k);
  T *v_tile = reinterpret_cast<T*>(smem + L::v), *p_tile = reinterpret_cast<T*>(smem + L::p);
  float *s_tile = reinterpret_cast<float*>(smem + L::s), *o_tile = reinterpret_cast<float*>(smem + L::o);
  float *row_max = reinterpret_cast<float*>(smem + L::stats), *row_sum = row_max + kTileRows;

  const int b = blockIdx.z, kv_head = blockIdx.y, group = a.num_heads / a.num_kv_heads;
  const int q_start = a.query_start_loc[b], q_len = a.query_start_loc[b + 1] - q_start;
  const int row0 = blockIdx.x * kTileRows;
  if (q_len <= 1 || row0 >= q_len * group) return;  // decode rows are the decode kernel's
  const int rows = min(kTileRows, q_len * group - row0), pos0 = a.seq_lens[b] - q_len;
  const int first_pos = pos0 + row0 / group, hi = pos0 + (row0 + rows - 1) / group + 1;
  const int lo = a.window > 0 ? max(0, first_pos - a.window + 1) : 0;

  const T* query = static_cast<const T*>(a.query);
  for (int i = threadIdx.x; i < kTileRows * Dp; i += kThreads) {
    const int r = i / Dp, d = i % Dp, row = row0 + r;
    const int64_t at = (q_start + row / group) * a.q_stride_t + (kv_head * group + row % group) * a.q_stride_h + d;
    q_tile[i] = r < rows && d < D ? query[at] : from_float<T>(0.f);
    o_tile[i] = 0.f;
  }
  for (int i = threadIdx.x; i < kTileKeys * Dp; i += kThreads)  // the padding columns past D stay zero
    k_tile[i] = v_tile[i] = from_float<T>(0.f);
  for (int r = threadIdx.x; r < kTileRows; r += kThreads) row_max[r] = -INFINITY, row_sum[r] = 0.f;
  __syncthreads();

  const int32_t* table = a.block_tables + b * a.table_stride;
  for (int k0 = lo; k0 < hi; k0 += kTileKeys) {
    load_kv_tile<T, D, Dp>(a, table, kv_head, k0, hi, k_tile, v_tile);
    __syncthreads();
    tile_scores<T, Dp>(q_tile, k_tile, s_tile);
    __syncthreads();
    tile_softmax<T, Dp>(a, rows, group, row0, pos0, k0, hi, s_tile, p_tile, o_tile, row_max, row_sum);
    __syncthreads();
    tile_accumulate<T, Dp>(p_tile, v_tile, o_tile);
    __syncthreads();
  }
  T* out = static_cast<T*>(a.out);
  for (int i = threadIdx.x; i < rows * D; i += kThreads) {
    const int r = i / D, d = i % D, row = row0 + r, head = kv_head * group + row % group;
    const int64_t at = (q_start + row / group) * a.out_stride_t + head * a.out_stride_h + d;
    out[at] = from_float<T>(o_tile[r * Dp + d] / denominator(row_max[r], row_sum[r], sink_of(a, head)));
  }
}

template <typename T, int D>
cudaError_t launch_split(const SplitAttentionArgs& s, cudaStream_t stream) {
  const AttentionArgs& a = s.attn;
  const dim3 decode_grid(s.max_partitions, a.num_kv_heads * s.head_chunks, a.num_seqs);
  split_decode_kernel<T, D><<<decode_grid, kThreads, 0, stream>>>(s);
  if (s.max_partitions > 1) split_merge_kernel<T, D><<<dim3(a.num_heads, a.num_seqs), kThreads, 0, stream>>>(s);
  if (s.max_query_len > 1) {
    constexpr size_t bytes = PrefillSmem<T, D>::bytes;
    const cudaError_t err =
        cudaFuncSetAttribute(split_prefill_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return err;
    const int group = a.num_heads / a.num_kv_heads;
    const dim3 grid((s.max_query_len * group + kTileRows - 1) / kTileRows, a.num_kv_heads, a.num_seqs);
    split_prefill_kernel<T, D><<<grid, kThreads, bytes, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch(const SplitAttentionArgs& s, cudaStream_t stream) {
  switch (s.attn.head_size) {
#define PAGEDSERVE_CASE(D) \
  case D: return launch_split<T, D>(s, stream);
    PAGEDSERVE_HEAD_SIZES(PAGEDSERVE_CASE)
#undef PAGEDSERVE_CASE
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t paged_attention_split(const SplitAttentionArgs& args, Dtype dtype, cudaStream_t stream) {
  if (args.attn.num_tokens == 0 || args.attn.num_seqs == 0) return cudaSuccess;
  return with_dtype(dtype, [&](auto zero) { return launch<decltype(zero)>(args, stream); });
}

}  // namespace pagedserve::cuda
