// Fused decode step: append the new token's K/V to the cache and attend over slots 0..lengths[b].
// The step is cut into work items, one per (row, kv head, query-head block, split); one kernel
// body serves both variants: num_splits == 1 walks a row in one item (single pass), num_splits >
// 1 cuts it into chunks whose partials the last item to finish merges. The tile loop runs a grid
// of resident blocks that walk the items (persistent: a block's producer streams the next item's
// tiles while its consumers finish the current one); the CUDA-core loop runs one block per item.
// Torch-free: raw pointers and MmhaParams only.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include <atomic>
#include <type_traits>

#include "attend_simt.cuh"
#include "attend_tiles.cuh"
#include "attend_wide.cuh"
#include "cache_slots.cuh"
#include "decode_launch.h"
#include "int4_step.cuh"
#include "mmha_params.h"
#include "new_token.cuh"
#include "output_epilogue.cuh"
#include "score_mods.cuh"
#include "split_merge.cuh"
#include "tile_source.cuh"
#include "timeline.cuh"
#include "tree_step.cuh"
#include "vec.cuh"
#include "work_items.cuh"

namespace mmha {

// The main loop: the tile loop (tensor cores, attend_tiles.cuh) for fp16 / bf16 / fp8 caches,
// the CUDA-core loop (attend_simt.cuh) for fp32 caches. Mirrored by uses_tensor_cores() in
// mmha/dispatch.py. T is the element of qkv and out, C the cache's (T, or e4m3 / s8 with 16-bit T).
template <typename T>
constexpr bool kTiles = !std::is_same_v<T, float>;
template <typename C>
constexpr bool kFp8 = std::is_same_v<C, e4m3>;
// int8 caches: codes with a scale per token and kv head (one-token steps on narrow items).
template <typename C>
constexpr bool kInt8 = std::is_same_v<C, s8>;
// int4 caches (mmha/int4.py): one-token steps on narrow items over contiguous caches, cp.async
// tiles (attend_int4.cuh).
template <typename C>
constexpr bool kInt4 = std::is_same_v<C, u4>;

// Which instances have a twin for fused small tree steps (the kernels' FUSED parameter; tree_step.cuh's
// TreeNodes): narrow tile-loop items of two or more columns over 16-bit or fp8 caches, without
// the output epilogue. (A tree of two or more nodes has two or more columns; int8 trees quantise
// their nodes in tree_prepare_kernel.) A twin of its own: the fused code inlined into the one-token
// kernels made them slower (H200, 2026-11-28: B=1 Hkv=8 1K 11.1 -> 12.1 us).
template <typename T, typename C, int QB, bool EPI>
constexpr bool kFusedTrees = kTiles<T> && QB > 1 && QB != kWideColumns && !kInt8<C> && !kInt4<C> && !EPI;

// What a thread of a fused tree step reads from global memory before it uses any (one round trip
// for them all): its q columns' elements, its nodes' k / v rotation pairs.
constexpr int kPrefetchQ = 8;          // q elements (a pass before the rotation)
constexpr int kPrefetchNodePairs = 2;  // k and v pairs: four values each (four pairs spill)

template <typename T>
constexpr int kBlockThreads = kTiles<T> ? kTileThreads : kSimtThreads;
// Tile-loop blocks of head_dim <= 128 may run two per SM (stages permitting): 12 warps, 3 per
// SM sub-partition of 16384 registers, so registers are capped at 168 per thread (as with 10
// warps); at head_dim 256 one block per SM.
template <typename T, int HEAD_DIM>
constexpr int kMinBlocks = kTiles<T> ? (HEAD_DIM <= 128 ? 2 : 1) : 0;

template <typename C, int HEAD_DIM, TileSource SRC>
using SourceOf = std::conditional_t<SRC == TileSource::kTma, TmaTiles<C, HEAD_DIM>, CpAsyncTiles<C, HEAD_DIM>>;

// Where an item's raw q and new token come from: column g's D values at q + g * HEAD_DIM (a
// producer's staging slot), the new k and v at k and v.
template <typename T>
struct TokenRows {
  const T* q;
  const T* k;
  const T* v;
};

// Column g's raw q in the global qkv (query row c.qrow), and the row's new k and v.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ const T* global_q(const MmhaParams& p, const Column& c) {
  return static_cast<const T*>(p.qkv) + static_cast<int64_t>(c.qrow) * p.qkv_row_stride + c.head * HEAD_DIM;
}

template <typename T, int HEAD_DIM>
__device__ __forceinline__ TokenRows<T> global_rows(const MmhaParams& p, int b, int kvh) {
  const T* row = static_cast<const T*>(p.qkv) + static_cast<int64_t>(b) * p.qkv_row_stride;
  return {nullptr, row + (p.num_heads + kvh) * HEAD_DIM, row + (p.num_heads + p.num_kv_heads + kvh) * HEAD_DIM};
}

// An int8 cache's new token (one-token steps): its k and v values (k_at(d), v_at(d): fp32, after
// bias, norm and rotary) quantised per kv head as mmha.quant.quantize does it: scale = amax / 127,
// codes rint(x / scale) into s_new_k / s_new_v, the scales into s_new_scales[0] (k) and [1] (v).
// Two passes over the values, with a barrier of the nthreads threads (sync) between for the
// maxima. A scale that is not finite (a non-finite value) flags the row (kStatusScale): its
// output is NaN and check() raises, as for fp8's bad scales.
template <int HEAD_DIM, typename KAt, typename VAt, typename Sync>
__device__ __forceinline__ void quantize_new_token_s8(const MmhaParams& p, const WorkItem& w, KAt k_at, VAt v_at,
                                                      s8 (&s_new_k)[HEAD_DIM], s8 (&s_new_v)[HEAD_DIM],
                                                      float* s_new_scales, int tid, int nthreads, Sync sync) {
  __shared__ float s_absmax[2][kTileThreads / 32];  // each warp's k and v maxima
  float km = 0.f, vm = 0.f;
  for (int d = tid; d < HEAD_DIM; d += nthreads) {
    km = absmax_nan(km, fabsf(k_at(d)));
    vm = absmax_nan(vm, fabsf(v_at(d)));
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    km = absmax_nan(km, __shfl_xor_sync(kFullMask, km, off));
    vm = absmax_nan(vm, __shfl_xor_sync(kFullMask, vm, off));
  }
  if (tid % 32 == 0) {
    s_absmax[0][tid / 32] = km;
    s_absmax[1][tid / 32] = vm;
  }
  sync();
  for (int i = 0; i < nthreads / 32; ++i) {
    km = absmax_nan(km, s_absmax[0][i]);
    vm = absmax_nan(vm, s_absmax[1][i]);
  }
  const float ks = int8_scale(km), vs = int8_scale(vm);
  for (int d = tid; d < HEAD_DIM; d += nthreads) {
    s_new_k[d] = quantize_s8(k_at(d), ks);
    s_new_v[d] = quantize_s8(v_at(d), vs);
  }
  if (tid == 0) {
    s_new_scales[0] = ks;
    s_new_scales[1] = vs;
    if (!isfinite(ks) || !isfinite(vs)) atomicOr(p.rows.status + w.b, kStatusScale);
  }
}

// The item's query columns in fp32 (bias, rotary at the column's position: query_position) into
// s_q: a one-token step's column g (head h0 + g) from q_rows + g * HEAD_DIM (a staging slot or
// the qkv row), a tree step's from its node's qkv row; for the item whose chunk holds the new token of a one-token
// step, its k (bias, rotary) and v as the cache stores them (rounded to C, or quantised with the
// kv head's k_scale / v_scale: to_cache) into s_new_k / s_new_v (append_new_token writes them to
// the caches once the item knows it may). With q/k norms (p.qk_norm) a warp per row first reduces
// its squares, then `sync` (a barrier of the nthreads threads, a multiple of 32). Threads tid <
// nthreads take part. The norm is a runtime branch of one instance: a second, norm-free instance
// of this function made the kernels a fifth larger and the short rows up to 1.5 us slower
// (docs/experiments.md, 2026-11-28).
// A fused tree step (tn: its node area, slot: the item's slot there) takes its columns' depths
// from the slot (its nodes' K/V: build_tree_nodes).
template <typename T, typename C, int HEAD_DIM, int QB, bool FUSED = false, typename Sync>
__device__ __forceinline__ void load_query_and_new_token(const MmhaParams& p, const WorkItem& w, const T* q_rows,
                                                         const TokenRows<T>& rows, float k_scale, float v_scale,
                                                         float (&s_q)[QB][HEAD_DIM],
                                                         C (&s_new_k)[HEAD_DIM], C (&s_new_v)[HEAD_DIM],
                                                         float* s_new_scales, int tid, int nthreads, Sync sync,
                                                         TreeNodes<C, HEAD_DIM>* tn = nullptr, int slot = 0,
                                                         Int4Token<T, HEAD_DIM>* tok4 = nullptr) {
  const T* bias = static_cast<const T*>(p.qkv_bias);
  const int rpos = p.rows.positions != nullptr ? __ldg(p.rows.positions + w.b) : w.pos;  // rotary position (one-token steps)
  const RotaryParams rot = for_length(p.rotary, rpos + 1);  // tree steps take one table (host-checked)
  const QKNormParams& qn = p.qk_norm;
  const T* k_bias = bias ? bias + (p.num_heads + w.kvh) * HEAD_DIM : nullptr;
  // Column g's raw q and its bias (a one-token step's from q_rows, a tree step's from its node's row).
  const auto q_of = [&](int g, const T*& q_bias) -> const T* {
    if (!tree_step(p)) {
      q_bias = bias ? bias + (w.h0 + g) * HEAD_DIM : nullptr;
      return q_rows + g * HEAD_DIM;
    }
    const Column c = column_of(p, w, g);
    q_bias = bias ? bias + c.head * HEAD_DIM : nullptr;
    return global_q<T, HEAD_DIM>(p, c);
  };
  // A fused tree step's depths (its item slot's; else the workspace's).
  const int* slot_depth = FUSED ? tn->depth[slot] : nullptr;
  __shared__ float s_inv[QB + 1];  // the q columns' rsqrt(mean(x^2) + eps), then the new k's
  if (qn.q_weight != nullptr || qn.k_weight != nullptr) {
    const int lane = tid % 32, warps = nthreads / 32;
    for (int g = tid / 32; g <= QB; g += warps) {  // warp-uniform: head_inv_rms shuffles
      float inv = 1.f;
      if (g < QB && g < w.nh && qn.q_weight != nullptr) {
        const T* q_bias;
        const T* q = q_of(g, q_bias);
        inv = head_inv_rms<T, HEAD_DIM>(q, q_bias, qn.eps, lane);
      } else if (g == QB && w.owner() && !(FUSED && tree_step(p)) && qn.k_weight != nullptr) {
        inv = head_inv_rms<T, HEAD_DIM>(rows.k, k_bias, qn.eps, lane);
      }
      if (lane == 0) s_inv[g] = inv;
    }
    sync();
  }
  const auto q_norm = [&](int g) {
    return qn.q_weight != nullptr ? HeadNorm{qn.q_weight, s_inv[g], qn.cast_first} : HeadNorm{};
  };
  if (!tree_step(p)) {
    for (int idx = tid; idx < QB * HEAD_DIM; idx += nthreads) {
      const int g = idx / HEAD_DIM;
      const int d = idx % HEAD_DIM;
      s_q[g][d] = g < w.nh ? rotated(q_rows + g * HEAD_DIM, bias ? bias + (w.h0 + g) * HEAD_DIM : nullptr,
                                              d, rpos, rot, q_norm(g))
                           : 0.f;
    }
  } else if constexpr (FUSED) {
    // A fused tree step: the same values in two passes. The twin stages no rows, and one pair at
    // a time was a chain of dependent loads before the item's first tile: first each thread reads
    // a run of kPrefetchQ elements of a column (and their bias) together, unconditionally (a
    // column past the item's reads its last one's), and leaves them biased in s_q; then a thread
    // per (column, pair) rotates them there.
    constexpr int PAIRS = HEAD_DIM / 2;
    constexpr int RUNS = QB * HEAD_DIM / kPrefetchQ;  // runs of kPrefetchQ elements of one column
    static_assert(HEAD_DIM % kPrefetchQ == 0, "a run within one column");
#pragma unroll 1
    for (int r = tid; r < RUNS; r += nthreads) {
      const int g = r / (HEAD_DIM / kPrefetchQ);
      const int d0 = r % (HEAD_DIM / kPrefetchQ) * kPrefetchQ;
      const Column c = column_of(p, w, min(g, w.nh - 1));
      const T* q = global_q<T, HEAD_DIM>(p, c) + d0;
      const T* q_bias = bias ? bias + c.head * HEAD_DIM + d0 : nullptr;
      T raw[kPrefetchQ], raw_bias[kPrefetchQ];
#pragma unroll
      for (int j = 0; j < kPrefetchQ; ++j) {
        raw[j] = q[j];
        if (q_bias) raw_bias[j] = q_bias[j];
      }
#pragma unroll
      for (int j = 0; j < kPrefetchQ; ++j) {  // biased()
        const float v = q_bias ? to_float(raw[j]) + to_float(raw_bias[j]) : to_float(raw[j]);
        s_q[g][d0 + j] = g < w.nh ? v : 0.f;
      }
    }
    sync();
#pragma unroll 1
    for (int idx = tid; idx < w.nh * PAIRS; idx += nthreads) {
      const int g = idx / PAIRS;
      const RotaryPair rp = rotary_pair(idx % PAIRS, p.rotary);
      const Column c = column_of(p, w, g);
      float sn = 0.f, cs = 1.f;
      if (rp.rotated) sincosf(static_cast<float>(query_position(p, w, c, slot_depth)) * rp.inv_freq, &sn, &cs);
      float x0, x1;
      rotate_values<T>(s_q[g][rp.d0], s_q[g][rp.d1], rp, sn, cs, x0, x1, q_norm(g));
      s_q[g][rp.d0] = x0;
      s_q[g][rp.d1] = x1;
    }
  } else {
    // A tree step: a thread per (column, rotation pair), one angle, one depth load and one powf
    // for both dims (the values rotated() gives); element by element they were a fifth of a B=1
    // T=4 1K step's attention. Not unrolled: two pairs at a time make the one-column kernels
    // spill (36-112 bytes), whose registers this function shares.
    constexpr int PAIRS = HEAD_DIM / 2;
#pragma unroll 1
    for (int idx = tid; idx < QB * PAIRS; idx += nthreads) {
      const int g = idx / PAIRS;
      const RotaryPair rp = rotary_pair(idx % PAIRS, p.rotary);
      float x0 = 0.f, x1 = 0.f;
      if (g < w.nh) {
        const Column c = column_of(p, w, g);
        float sn = 0.f, cs = 1.f;
        if (rp.rotated) sincosf(static_cast<float>(query_position(p, w, c, slot_depth)) * rp.inv_freq, &sn, &cs);
        rotate_pair(global_q<T, HEAD_DIM>(p, c), bias ? bias + c.head * HEAD_DIM : nullptr, rp, sn, cs, x0, x1,
                    q_norm(g));
      }
      s_q[g][rp.d0] = x0;
      s_q[g][rp.d1] = x1;
    }
  }
  if (w.owner() && !(FUSED && tree_step(p))) {
    const int kvh = w.kvh, pos = rpos;
    const T* v_bias = bias ? bias + (p.num_heads + p.num_kv_heads + kvh) * HEAD_DIM : nullptr;
    const HeadNorm k_norm =
        qn.k_weight != nullptr ? HeadNorm{qn.k_weight, s_inv[QB], qn.cast_first} : HeadNorm{};
    const auto k_at = [&](int d) { return rotated(rows.k, k_bias, d, pos, rot, k_norm); };
    const auto v_at = [&](int d) { return biased(rows.v, v_bias, d); };
    if constexpr (kInt4<C>) {
      quantize_new_token_u4<T, HEAD_DIM>(p, w, k_at, v_at, *tok4, tid, nthreads, sync);
    } else if constexpr (std::is_same_v<C, s8>) {
      quantize_new_token_s8<HEAD_DIM>(p, w, k_at, v_at, s_new_k, s_new_v, s_new_scales, tid, nthreads, sync);
    } else {
      for (int d = tid; d < HEAD_DIM; d += nthreads) {
        s_new_k[d] = to_cache<C>(k_at(d), k_scale);
        s_new_v[d] = to_cache<C>(v_at(d), v_scale);
      }
    }
  }
}

// The append of a one-token step: the item holding the new token's slot writes its K/V (from
// s_new_k / s_new_v) into slot pos of both caches, column block 0 only, so exactly once per row
// and kv head (items of other column blocks take the slot from their own shared copy). A paged
// row's block of slot pos was checked by the item's producer (a refused item appends nothing).
template <typename C, int HEAD_DIM>
__device__ __forceinline__ void append_new_token(const MmhaParams& p, const WorkItem& w, const C (&s_new_k)[HEAD_DIM],
                                                 const C (&s_new_v)[HEAD_DIM], int tid, int nthreads,
                                                 const float* s_new_scales = nullptr) {
  constexpr int VEC = kVec<C>;
  if (!w.owner() || w.qg != 0) return;
  const HeadSlots<C, HEAD_DIM> slots = head_slots<C, HEAD_DIM>(p.cache, p.num_kv_heads, w.b, w.kvh);
  const int blk = slots.table != nullptr ? slots.block(w.pos) : 0;
  for (int d = tid; d < HEAD_DIM; d += nthreads) {
    slots.k[slots.k_at(blk, w.pos, d / VEC) + d % VEC] = s_new_k[d];
    slots.v[slots.v_at(blk, w.pos) + d] = s_new_v[d];
  }
  if constexpr (std::is_same_v<C, s8>) {  // the token's scales beside its codes
    if (tid < 2) {
      const TokenScales ts = token_scales(p.cache, p.num_kv_heads, w.b, w.kvh);
      (tid == 0 ? ts.k : ts.v)[ts.at(blk, w.pos)] = s_new_scales[tid];
    }
  }
}

// A fused tree step's item that holds node slots: those nodes' K/V (the nodes of its keys [start,
// end)) into its node area, as tree_prepare_kernel appends them: bias, k norm (a warp per node,
// then a barrier of the nthreads threads), rotary at pos + depth, rounded or quantised with the
// fp8 scales; a thread per (node, rotation pair).
template <typename T, typename C, int HEAD_DIM>
__device__ __forceinline__ void build_tree_nodes(const MmhaParams& p, const WorkItem& w, TreeNodes<C, HEAD_DIM>& tn,
                                              int slot, float k_scale, float v_scale, int tid, int nthreads) {
  constexpr int PAIRS = HEAD_DIM / 2;
  const int n0 = max(w.start - w.pos, 0);
  const int n1 = min(w.end - w.pos, w.nodes);
  const T* bias = static_cast<const T*>(p.qkv_bias);
  const T* k_bias = bias ? bias + (p.num_heads + w.kvh) * HEAD_DIM : nullptr;
  const T* v_bias = bias ? bias + (p.num_heads + p.num_kv_heads + w.kvh) * HEAD_DIM : nullptr;
  const QKNormParams& qn = p.qk_norm;
  const auto k_row = [&](int t) {
    return static_cast<const T*>(p.qkv) + (static_cast<int64_t>(w.b) * p.tree.nodes + t) * p.qkv_row_stride +
           (p.num_heads + w.kvh) * HEAD_DIM;
  };
  if (qn.k_weight != nullptr) {
    for (int t = n0 + tid / 32; t < n1; t += nthreads / 32) {  // warp-uniform: head_inv_rms shuffles
      const float inv = head_inv_rms<T, HEAD_DIM>(k_row(t), k_bias, qn.eps, tid % 32);
      if (tid % 32 == 0) tn.k_inv[t] = inv;
    }
    named_barrier(1, nthreads);
  }
  // Each thread reads its kPrefetchNodePairs pairs of k and v (and bias) before it converts or rotates
  // any, unconditionally (clamped to a pair that exists), as the fused q build does.
#pragma unroll 1
  for (int base = n0 * PAIRS + tid; base < n1 * PAIRS; base += kPrefetchNodePairs * nthreads) {
    RawPair<T> k_in[kPrefetchNodePairs], v_in[kPrefetchNodePairs], kb[kPrefetchNodePairs], vb[kPrefetchNodePairs];
#pragma unroll
    for (int j = 0; j < kPrefetchNodePairs; ++j) {
      const int idx = min(base + j * nthreads, n1 * PAIRS - 1);
      const RotaryPair rp = rotary_pair(idx % PAIRS, p.rotary);
      k_in[j] = RawPair<T>::read(k_row(idx / PAIRS), rp);
      v_in[j] = RawPair<T>::read(k_row(idx / PAIRS) + p.num_kv_heads * HEAD_DIM, rp);
      if (bias) kb[j] = RawPair<T>::read(k_bias, rp), vb[j] = RawPair<T>::read(v_bias, rp);
    }
#pragma unroll
    for (int j = 0; j < kPrefetchNodePairs; ++j) {
      const int idx = base + j * nthreads;
      if (idx >= n1 * PAIRS) break;
      const int t = idx / PAIRS;
      const RotaryPair rp = rotary_pair(idx % PAIRS, p.rotary);
      float sn = 0.f, cs = 1.f;
      if (rp.rotated) sincosf(static_cast<float>(w.pos + tn.depth[slot][t]) * rp.inv_freq, &sn, &cs);
      float k0, k1;
      const HeadNorm k_norm =
          qn.k_weight != nullptr ? HeadNorm{qn.k_weight, tn.k_inv[t], qn.cast_first} : HeadNorm{};
      rotate_values<T>(k_in[j].a0(bias, kb[j]), k_in[j].a1(bias, kb[j]), rp, sn, cs, k0, k1, k_norm);
      C* k = tn.k(t);
      C* v = tn.v(t, p.tree.nodes);
      k[rp.d0] = to_cache<C>(k0, k_scale);
      k[rp.d1] = to_cache<C>(k1, k_scale);
      v[rp.d0] = to_cache<C>(v_in[j].a0(bias, vb[j]), v_scale);
      v[rp.d1] = to_cache<C>(v_in[j].a1(bias, vb[j]), v_scale);
    }
  }
}

// The append of a fused tree step: an item holding node slots writes the nodes of its keys
// ([start, end) within pos .. pos + nodes - 1) from its node area, a 16-byte chunk at a time,
// column block 0 only. The item's producer and stager checked the row's every block (its own
// tiles', and check_blocks_before's) before this runs; a refused item appends nothing.
template <typename C, int HEAD_DIM>
__device__ __forceinline__ void append_tree_nodes(const MmhaParams& p, const WorkItem& w,
                                                  TreeNodes<C, HEAD_DIM>& tn, int tid, int nthreads) {
  constexpr int VEC = kVec<C>;
  constexpr int CHUNKS = HEAD_DIM / VEC;
  if (!w.owner() || w.qg != 0) return;
  const HeadSlots<C, HEAD_DIM> slots = head_slots<C, HEAD_DIM>(p.cache, p.num_kv_heads, w.b, w.kvh);
  const int s0 = max(w.start, w.pos);
  const int s1 = min(w.end, w.pos + w.nodes);
  for (int idx = tid; idx < (s1 - s0) * CHUNKS; idx += nthreads) {
    const int slot = s0 + idx / CHUNKS;
    const int c = idx % CHUNKS;
    const int t = slot - w.pos;
    const int blk = slots.table != nullptr ? slots.block(slot) : 0;
    *reinterpret_cast<uint4*>(slots.k + slots.k_at(blk, slot, c)) = *reinterpret_cast<const uint4*>(tn.k(t) + c * VEC);
    *reinterpret_cast<uint4*>(slots.v + slots.v_at(blk, slot) + c * VEC) =
        *reinterpret_cast<const uint4*>(tn.v(t, p.tree.nodes) + c * VEC);
  }
}

// An out-of-range length (the host checks were bypassed or raced) or an fp8 scale that is not
// finite and positive: nothing is read from or written to the caches; the item's output is NaN
// and its row's status flag (kStatusLength or kStatusScale) is raised. A row that takes no part
// (row_active) gets zeros and lse -inf, and no flag (flag 0, idle).
template <typename T, int HEAD_DIM, bool EPI>
__device__ __forceinline__ void poison_row(const MmhaParams& p, const WorkItem& w, int32_t flag, int tid,
                                           int nthreads, bool idle = false) {
  if (w.split != 0) return;
  for (int idx = tid; idx < w.nh * HEAD_DIM; idx += nthreads) {
    const Column col = column_of(p, w, idx / HEAD_DIM);
    const int64_t f = col.flat(p.num_heads);
    const int d = idx % HEAD_DIM;
    store_out<T, EPI>(p.output, f * HEAD_DIM + d, col.head * HEAD_DIM + d, idle ? 0.f : NAN);
    if (d == 0) p.output.lse[f] = idle ? -INFINITY : NAN;
  }
  if (flag != 0 && w.kvh == 0 && w.qg == 0 && tid == 0) atomicOr(p.rows.status + w.b, flag);
}

// A single pass's head sink (if any) joins its (max, sum), rescaled to max(mx, sink) so that a
// large sink cannot overflow the sum; returns the factor on the accumulator (1 without a sink).
__device__ __forceinline__ float with_sink(const MmhaParams& p, int head, float& mx, float& sum) {
  if (p.mods.sinks == nullptr) return 1.f;
  const float sink = sink_log2(p.mods, head);
  const float top = fmaxf(mx, sink);
  const float f = exp2f(mx - top);
  sum = sum * f + exp2f(sink - top);
  mx = top;
  return f;
}

// One value of an item's result (column col, head dim d; max mx, sum, and a, the accumulator
// already rescaled to mx): out and lse (single pass) or its partial (split; where it lies:
// SplitPartials). Columns of tree nodes past the row's node count get zeros (and lse -inf), as
// in mmha.reference.
// value_scale multiplies the output (an fp8 cache's v scale; 1 otherwise), not the partials. A
// single pass adds the head's sink (if any) to the sum here; a split's merge does. store_item
// stores an item's every value (threads tid < nthreads) from the block's combine.
// PRE: cv holds the epilogue's values of the value's channel, loaded ahead (ItemChannels).
template <typename T, int HEAD_DIM, bool EPI, bool PRE = false>
__device__ __forceinline__ void store_value(const MmhaParams& p, const WorkItem& w, const Column& col, int d,
                                            float a, float mx, float sum, float value_scale,
                                            const ChannelValue& cv = ChannelValue{}) {
  const int num_splits = p.sched.num_splits;
  const int64_t h = col.flat(p.num_heads);
  const auto out = [&](float x) {
    if constexpr (PRE) {
      store_out_epilogue<T>(p.output, h * HEAD_DIM + d, x, cv);
    } else {
      store_out<T, EPI>(p.output, h * HEAD_DIM + d, col.head * HEAD_DIM + d, x);
    }
  };
  if (col.node >= w.nodes) {  // a tree node the row does not use
    if (w.split == 0) {
      out(0.f);
      if (d == 0) p.output.lse[h] = -INFINITY;
    }
  } else if (num_splits == 1) {
    a *= with_sink(p, col.head, mx, sum);
    out(a / sum * value_scale);
    if (d == 0) p.output.lse[h] = (mx + log2f(sum)) * kLn2;
  } else {
    const SplitPartials<HEAD_DIM> part(p);
    const int64_t slot = h * num_splits + w.split;
    part.acc[slot * HEAD_DIM + d] = a;
    if (d == 0) part.ml[slot] = make_float2(mx, sum);
  }
}

// A split's partials: four values per thread, one 16-byte store each (every item). A single
// pass with VEC (several columns per item; with the epilogue 4 or 8): four values per thread,
// one store of four outputs and one 16-byte load of each per-channel tensor. What decides it
// with the epilogue (fp16, head dim 128, bulk copies): 8 columns spill 20 bytes with four
// values and 84 with one; 4 columns spill 16 with four and none with one, but four scalar loads
// per value at the store cost more (B=64 Hkv=8 S=1024 1.025x plain against 1.078x); 1 column
// 12 with four (65 K local-load sectors on B=16 S=512 that the plain kernel does not have) and
// none with one.
// The epilogue's per-channel values of the N values a thread stores for a one-column item
// (value k: head dim tid + k * nthreads), copied into shared memory (cp.async, each thread its
// own values) at the item's first tile, so that their latency hides behind its tiles and no
// register holds them through the tile loop: loaded at the store they cost the B=64 S=256 row
// 5 %; held in registers from the first tile (splits too), B=1 Hkv=32 S=1024 ran 13.0 us fused
// against 11.9 now (H200).
template <int N, int HEAD_DIM>
struct ItemChannels {
  static constexpr int D = N > 0 ? HEAD_DIM : 1;
  float shift[D], smooth[D], scale[D];

  __device__ __forceinline__ void start(const MmhaParams& p, int head, int tid, int nthreads) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const int d = tid + k * nthreads;
      if (d >= HEAD_DIM) continue;
      const int c = head * HEAD_DIM + d;
      if (p.output.shift != nullptr) cp_async4(&shift[d], p.output.shift + c);
      if (p.output.smooth != nullptr) cp_async4(&smooth[d], p.output.smooth + c);
      if (p.output.scales != nullptr) cp_async4(&scale[d], p.output.scales + c);
    }
  }

  // Dim d's channel values (the thread's own copies, after cp_async_wait_all).
  __device__ __forceinline__ ChannelValue get(const MmhaParams& p, int d) const {
    return ChannelValue{p.output.shift != nullptr ? shift[d] : 0.f, p.output.smooth != nullptr ? smooth[d] : 1.f,
                        p.output.scales != nullptr ? scale[d] : p.output.scale};
  }
};

// PRE_N > 0 (one-column items through the epilogue): pre holds each value's channel values.
template <typename T, int HEAD_DIM, bool EPI, bool VEC = false, int PRE_N = 0, class Max, class Sum, class Acc>
__device__ __forceinline__ void store_item(const MmhaParams& p, const WorkItem& w, Max m, Sum l, Acc acc,
                                           float value_scale, int tid, int nthreads,
                                           const ItemChannels<PRE_N, HEAD_DIM>* pre = nullptr) {
  if constexpr (PRE_N > 0) {
    const bool ml = p.sched.num_splits == 1;
    cp_async_wait_all();
#pragma unroll
    for (int k = 0; k < PRE_N; ++k) {
      const int d = tid + k * nthreads;
      if (d >= w.nh * HEAD_DIM) continue;
      store_value<T, HEAD_DIM, EPI, true>(p, w, column_of(p, w, 0), d, acc(0, d), ml || d == 0 ? m(0) : 0.f,
                                          ml || d == 0 ? l(0) : 0.f, value_scale,
                                          ml ? pre->get(p, d) : ChannelValue{});
    }
    return;
  }
  if (p.sched.num_splits > 1) {  // the split's partials: four values per thread, one 16-byte store
    const SplitPartials<HEAD_DIM> part(p);
    for (int idx = 4 * tid; idx < w.nh * HEAD_DIM; idx += 4 * nthreads) {
      const int g = idx / HEAD_DIM;
      const int d = idx % HEAD_DIM;
      const Column col = column_of(p, w, g);
      const int64_t h = col.flat(p.num_heads);
      if (col.node >= w.nodes) {  // a tree node the row does not use: zeros from split 0, as store_value
        if (w.split == 0) {
          store_out4<T, EPI>(p.output, h * HEAD_DIM + d, col.head * HEAD_DIM + d, make_float4(0.f, 0.f, 0.f, 0.f));
          if (d == 0) p.output.lse[h] = -INFINITY;
        }
        continue;
      }
      const int64_t slot = h * p.sched.num_splits + w.split;
      *reinterpret_cast<float4*>(part.acc + slot * HEAD_DIM + d) =
          make_float4(acc(g, d), acc(g, d + 1), acc(g, d + 2), acc(g, d + 3));
      if (d == 0) part.ml[slot] = make_float2(m(g), l(g));
    }
    return;
  }
  if constexpr (VEC) {  // single pass, four values per thread (through the output epilogue, or plain)
    for (int idx = 4 * tid; idx < w.nh * HEAD_DIM; idx += 4 * nthreads) {
      const int g = idx / HEAD_DIM;
      const int d = idx % HEAD_DIM;
      const Column col = column_of(p, w, g);
      const int64_t h = col.flat(p.num_heads);
      float4 x = make_float4(0.f, 0.f, 0.f, 0.f);  // a tree node the row does not use: zeros
      if (col.node < w.nodes) {
        float mx = m(g), sum = l(g);
        const float f = with_sink(p, col.head, mx, sum);  // as store_value computes each value
        x = make_float4(acc(g, d) * f / sum * value_scale, acc(g, d + 1) * f / sum * value_scale,
                        acc(g, d + 2) * f / sum * value_scale, acc(g, d + 3) * f / sum * value_scale);
        if (d == 0) p.output.lse[h] = (mx + log2f(sum)) * kLn2;
      } else if (d == 0) {
        p.output.lse[h] = -INFINITY;
      }
      store_out4<T, EPI>(p.output, h * HEAD_DIM + d, col.head * HEAD_DIM + d, x);
    }
  } else {
    for (int idx = tid; idx < w.nh * HEAD_DIM; idx += nthreads) {
      const int g = idx / HEAD_DIM;
      const int d = idx % HEAD_DIM;
      const bool ml = p.sched.num_splits == 1 || d == 0;  // a partial's (max, sum) go with its dim 0 only
      store_value<T, HEAD_DIM, EPI>(p, w, column_of(p, w, g), d, acc(g, d), ml ? m(g) : 0.f, ml ? l(g) : 0.f,
                                    value_scale);
    }
  }
}

// store_item of an item refused by the paged-cache guard: NaN output (single pass) or NaN
// partials, which make the split merge's output NaN.
template <typename T, int HEAD_DIM, bool EPI>
__device__ __forceinline__ void store_refused_item(const MmhaParams& p, const WorkItem& w, int tid, int nthreads) {
  store_item<T, HEAD_DIM, EPI>(
      p, w, [](int) { return NAN; }, [](int) { return NAN; }, [](int, int) { return NAN; }, 1.f, tid, nthreads);
}

// The max over a block's WARPS loop warps of head g's running max, and their sums rescaled to it.
template <int WARPS, int QB>
__device__ __forceinline__ float warps_max(const float (*s_m)[QB], int g) {
  float mb = -INFINITY;
#pragma unroll
  for (int wp = 0; wp < WARPS; ++wp) mb = fmaxf(mb, s_m[wp][g]);
  return mb;
}

// Head g's value at dim d summed over the warps' accumulators (TileConsumer::stash), each
// rescaled to the block's max, in warp order.
template <int WARPS, int QB, int HEAD_DIM>
__device__ __forceinline__ float warps_acc(const float (*s_m)[QB], const float (*acc_w)[QB][HEAD_DIM], int g, int d) {
  const float mb = warps_max<WARPS, QB>(s_m, g);
  const float m_ref = mb == -INFINITY ? 0.f : mb;
  float a = 0.f;
#pragma unroll
  for (int wp = 0; wp < WARPS; ++wp) {
    const float x = acc_w[wp][g][d] * exp2f(s_m[wp][g] - m_ref);
    a = wp == 0 ? x : a + x;
  }
  return a;
}

template <int WARPS, int QB>
__device__ __forceinline__ float warps_sum(const float (*s_m)[QB], const float (*s_l)[QB], int g) {
  const float mb = warps_max<WARPS, QB>(s_m, g);
  const float m_ref = mb == -INFINITY ? 0.f : mb;
  float sum = 0.f;
#pragma unroll
  for (int wp = 0; wp < WARPS; ++wp) sum += s_l[wp][g] * exp2f(s_m[wp][g] - m_ref);
  return sum;
}

// The block combine's numbers of column g, once (thread g < nh, a barrier after it) instead of
// at every value the store writes: the warps' max -> s_m[0][g], their sums rescaled to it ->
// s_l[0][g] and, with FACTORS (warps' accumulators not yet rescaled), each warp's factor
// 2^(s_m[w][g] - max) -> s_f[w][g]; the values warps_max, warps_sum and warps_acc compute.
// For items of several columns (H100, B=1 Hkv=8 S=4K: the store of four columns took 2250
// cycles, each thread's four values recomputing them); one value per thread does better without
// the barrier.
template <int WARPS, int QB, bool FACTORS>
__device__ __forceinline__ void fold_warps(float (*s_m)[QB], float (*s_l)[QB], float (*s_f)[QB], int g) {
  const float mb = warps_max<WARPS, QB>(s_m, g);
  const float m_ref = mb == -INFINITY ? 0.f : mb;
  float sum = 0.f;
#pragma unroll
  for (int wp = 0; wp < WARPS; ++wp) {
    const float f = exp2f(s_m[wp][g] - m_ref);
    if constexpr (FACTORS) s_f[wp][g] = f;
    sum += s_l[wp][g] * f;
  }
  s_m[0][g] = mb;
  s_l[0][g] = sum;
}

// Head g's value at dim d: the warps' accumulators times their factors (fold_warps), in warp order.
template <int WARPS, int QB, int HEAD_DIM>
__device__ __forceinline__ float folded_acc(const float (*s_f)[QB], const float (*acc_w)[QB][HEAD_DIM], int g, int d) {
  float a = 0.f;
#pragma unroll
  for (int wp = 0; wp < WARPS; ++wp) {
    const float x = acc_w[wp][g][d] * s_f[wp][g];
    a = wp == 0 ? x : a + x;
  }
  return a;
}

// The item slots between a block's stager warp and the rest of the block: two of them, used by
// alternate items. The stager fills a slot with a decided item (range, fp8 scales) and, for
// one-token steps, its raw q and new token, then completes the slot's full barrier (32
// arrivals). The producer takes the item (taken: its 32 lanes) and the consumers the q; each of
// their threads releases the slot (empty). An item of index < 0 says the block has no more items.
// Wide items and fused trees' twins (tree steps) read q from qkv in the consumers: no raw q
// (STAGED false).
template <typename T, int HEAD_DIM, int QB, bool STAGED = QB != kWideColumns>
struct ItemStage {
  static constexpr bool kStaged = STAGED;
  static constexpr int QN = kStaged ? QB * HEAD_DIM : 1;
  static constexpr int KN = kStaged ? HEAD_DIM : 1;
  static constexpr int EMPTY_ARRIVALS = kConsumerWarps * 32 + 32;
  T q[2][QN];
  T k[2][KN];
  T v[2][KN];
  WorkItem item[2];
  int index[2];
  float k_scale[2], v_scale[2];  // the item's kv head's (fp8; 1 for 16-bit caches)
  int before_bad;                // checks_before items, in order: a block before the item's is bad
  uint64_t full[2];
  uint64_t taken[2];
  uint64_t empty[2];
  uint64_t checked;              // 32 stager lanes: before_bad holds the next such item's verdict
};

template <class Stage>
__device__ __forceinline__ void init_item_stage(Stage& st) {
  for (int s = 0; s < 2; ++s) {
    mbar_init(&st.full[s], 32);
    mbar_init(&st.taken[s], 32);
    mbar_init(&st.empty[s], Stage::EMPTY_ARRIVALS);
  }
  mbar_init(&st.checked, 32);
}

// Whether item w of a paged row appends (it holds the new token's slot, or a fused tree's node
// slots) beside keys it does not read ([lo, start): the earlier splits'; [end, pos + nodes): a
// fused tree's nodes in the next split): the blocks of those keys are checked too, so that a row
// with any bad block writes nothing (the stager checks them, check_blocks_before).
template <bool FUSED>
__device__ __forceinline__ bool checks_before(const MmhaParams& p, const WorkItem& w) {
  return p.cache.block_tables != nullptr && w.owner() && (w.start > w.lo || (FUSED && w.end < w.pos + w.nodes));
}

// The stager's check of the blocks of a checks_before item's keys it does not read (before its
// start; a fused tree's nodes past its end), while the item's tiles stream: all
// lanes load kBeforeLoads entries at a time, then check them; the verdict goes to st.before_bad
// and st.checked, which the producer waits for at the item's last tile. (In the producer, a share
// a tile held it ~0.1 us a tile behind the stream: H100, the B = 1 paged rows' appending splits.)
constexpr int kBeforeLoads = 8;
template <typename C, int HEAD_DIM, bool FUSED, class Stage>
__device__ __forceinline__ void check_blocks_before(const MmhaParams& p, const WorkItem& w, Stage& st, int lane) {
  const HeadSlots<C, HEAD_DIM> hs = head_slots<C, HEAD_DIM>(p.cache, p.num_kv_heads, w.b, w.kvh);
  const int e0 = w.lo >> hs.shift;
  const int e1 = ((w.start - 1) >> hs.shift) + 1;
  bool bad = false;
  if constexpr (FUSED) {
    // Entries [e0, e1) (keys [lo, start)), then [e2, e3) (a fused tree's nodes in [end, pos +
    // nodes)), as one run.
    const int e2 = w.end >> hs.shift;
    const int e3 = w.end < w.pos + w.nodes ? ((w.pos + w.nodes - 1) >> hs.shift) + 1 : e2;
    const int n = max(e1 - e0, 0) + e3 - e2;
    const auto entry = [&](int i) { return i < e1 - e0 ? e0 + i : e2 + i - max(e1 - e0, 0); };
    for (int i = lane; i < n; i += 32 * kBeforeLoads) {
      int ids[kBeforeLoads];
#pragma unroll
      for (int u = 0; u < kBeforeLoads; ++u) ids[u] = i + 32 * u < n ? __ldg(hs.table + entry(i + 32 * u)) : 0;
#pragma unroll
      for (int u = 0; u < kBeforeLoads; ++u) bad = bad || !block_ok(p.cache, ids[u]);
    }
  } else {
    for (int e = e0 + lane; e < e1; e += 32 * kBeforeLoads) {
      int ids[kBeforeLoads];
#pragma unroll
      for (int u = 0; u < kBeforeLoads; ++u) ids[u] = e + 32 * u < e1 ? __ldg(hs.table + e + 32 * u) : 0;
#pragma unroll
      for (int u = 0; u < kBeforeLoads; ++u) bad = bad || !block_ok(p.cache, ids[u]);
    }
  }
  bad = __any_sync(kFullMask, bad);
  if (lane == 0) st.before_bad = bad;
  mbar_arrive(&st.checked);  // each lane, after its loads (lane 0 after its write)
}

// An item decided: its range (work_item_range) from its row's length, mode and node count, and
// its kv head's fp8 scales; scales_ok is false where any kv head's scales are bad (fp8 refuses
// the step). A fused tree step's row is derived here (derive_tree; its depths and root paths with
// `paths`, lane t's node t's): a refused row's items are bad, tree_flags says why.
struct DecidedItem {
  WorkItem w;
  float k_scale = 1.f, v_scale = 1.f;
  bool scales_ok = true;
  int tree_flags = 0;
  int depth = 0;
  uint64_t anc = 0;
};

template <typename C, int QB, bool FUSED>
__device__ __forceinline__ DecidedItem decide_item(const MmhaParams& p, int index, int lane, bool paths = false) {
  DecidedItem d;
  d.w = work_item_head<QB>(p, index);
  const int pos = p.rows.lengths[d.w.b];
  int nodes = 1;  // a fused tree's row that takes no part is idle (work_item_range)
  if constexpr (!FUSED) {
    nodes = row_nodes(p, d.w.b);
  } else if (row_takes_part(p.rows, d.w.b)) {
    const WarpTree t = derive_tree(p, d.w.b, pos, lane, paths);
    nodes = t.flags == 0 ? t.n : -1;
    d.tree_flags = t.flags;
    d.depth = t.depth;
    d.anc = t.anc;
  }
  if constexpr (kFp8<C>) {
    // A bad scale of any kv head refuses the whole step: every item checks all of them.
    bool ok = true;
    for (int h = lane; h < p.num_kv_heads; h += 32) ok = ok && scale_ok(p.cache.k_scale[h]) && scale_ok(p.cache.v_scale[h]);
    d.scales_ok = __all_sync(kFullMask, ok);
    d.k_scale = p.cache.k_scale[d.w.kvh];
    d.v_scale = p.cache.v_scale[d.w.kvh];
  }
  work_item_range<FUSED>(p, d.w, pos, nodes, kTileKeys);
  return d;
}

// A one-token item's raw q and new token in a stager lane's registers: loaded with the item's
// length, so that both latencies pass together.
template <typename T, int HEAD_DIM, int QB, bool STAGED = QB != kWideColumns>
struct RawRows {
  static constexpr bool kStaged = STAGED;
  static constexpr int Q_PER_LANE = kStaged ? (QB * HEAD_DIM + 31) / 32 : 1;
  static constexpr int T_PER_LANE = kStaged ? (HEAD_DIM + 31) / 32 : 1;
  T q[Q_PER_LANE];
  T k[T_PER_LANE];
  T v[T_PER_LANE];

  __device__ __forceinline__ void load(const MmhaParams& p, int index, int lane) {
    if constexpr (kStaged) {
      const WorkItem w = work_item_head<QB>(p, index);
      const TokenRows<T> rows = global_rows<T, HEAD_DIM>(p, w.b, w.kvh);
      // One-token steps: the item's columns are consecutive heads of the row. A tree step's
      // consumers read their columns from qkv themselves.
      const T* q_row = global_q<T, HEAD_DIM>(p, Column{w.b, 0, w.h0});
      const int staged = tree_step(p) ? 0 : w.nh * HEAD_DIM;
#pragma unroll
      for (int j = 0; j < Q_PER_LANE; ++j) {
        const int idx = lane + 32 * j;
        q[j] = idx < staged ? q_row[idx] : from_float<T>(0.f);
      }
#pragma unroll
      for (int j = 0; j < T_PER_LANE; ++j) {
        const int d = lane + 32 * j;
        k[j] = d < HEAD_DIM ? rows.k[d] : from_float<T>(0.f);
        v[j] = d < HEAD_DIM ? rows.v[d] : from_float<T>(0.f);
      }
    }
  }

  template <class Stage>
  __device__ __forceinline__ void store(Stage& st, int slot, int lane) const {
    if constexpr (kStaged) {
#pragma unroll
      for (int j = 0; j < Q_PER_LANE; ++j) {
        const int idx = lane + 32 * j;
        if (idx < QB * HEAD_DIM) st.q[slot][idx] = q[j];
      }
#pragma unroll
      for (int j = 0; j < T_PER_LANE; ++j) {
        const int d = lane + 32 * j;
        if (d < HEAD_DIM) {
          st.k[slot][d] = k[j];
          st.v[slot][d] = v[j];
        }
      }
    }
  }
};

// The stager warp of a tile-loop block: block j's first item is item j, later ones come from the
// step's work counter. It decides each item (decide_item): one with nothing to read (a bad,
// refused or idle row, a split past the row's keys) gets its output here and never reaches the
// ring; a busy one goes into the next item slot with its raw q and new token. It takes the next
// number from the counter once the producer has begun the item before (one item ahead, as a
// block's share of the items stays even to the end). Its loads and the counter's atomic stall
// this warp only, so the producer issues tiles without waiting on global memory (H100, B=64
// Hkv=32 S=256, ncu: the producer spent a quarter of its time on them when it did this itself).
template <typename T, typename C, int HEAD_DIM, int QB, bool EPI, bool FUSED = false>
__device__ __forceinline__ void stage_items(const MmhaParams& p, ItemStage<T, HEAD_DIM, QB, !FUSED && QB != kWideColumns>& st,
                                            int items, int lane, TreeNodes<C, HEAD_DIM>* tn = nullptr) {
  int index = blockIdx.x;
  int seq = 0;  // slots filled so far: item seq uses slot seq % 2
  while (index < items) {
    RawRows<T, HEAD_DIM, QB, !FUSED && QB != kWideColumns> raw;
    raw.load(p, index, lane);
    DecidedItem d = decide_item<C, QB, FUSED>(p, index, lane, FUSED);
    WorkItem& w = d.w;
    if (w.bad) {  // a refused tree row's flag was raised by tree_prepare_kernel, a fused one's here
      poison_row<T, HEAD_DIM, EPI>(p, w, tree_step(p) ? d.tree_flags : kStatusLength, lane, 32);
    } else if (w.idle) {
      poison_row<T, HEAD_DIM, EPI>(p, w, 0, lane, 32, true);
    } else if (!d.scales_ok) {
      w.bad = true;
      poison_row<T, HEAD_DIM, EPI>(p, w, kStatusScale, lane, 32);
    }
    if (w.busy()) {
      const int slot = seq & 1;
      if (seq >= 2) mbar_wait(&st.empty[slot], ((seq >> 1) - 1) & 1);
      raw.store(st, slot, lane);
      if constexpr (FUSED) {  // lane t's node's depth and root path
        if (lane < kFusedTreeNodes) {
          tn->depth[slot][lane] = d.depth;
          tn->anc[slot][lane] = d.anc;
        }
      }
      if (lane == 0) {
        st.item[slot] = w;
        st.index[slot] = index;
        st.k_scale[slot] = d.k_scale;
        st.v_scale[slot] = d.v_scale;
      }
      mbar_arrive(&st.full[slot]);  // each lane's writes to the slot
      mbar_wait(&st.taken[slot], (seq >> 1) & 1);
      ++seq;
      if (checks_before<FUSED>(p, w)) check_blocks_before<C, HEAD_DIM, FUSED>(p, w, st, lane);
    }
    const int fetched = lane == 0 ? static_cast<int>(gridDim.x) + atomicAdd(p.sched.work, 1) : 0;
    index = __shfl_sync(kFullMask, fetched, 0);
  }
  const int slot = seq & 1;
  if (seq >= 2) mbar_wait(&st.empty[slot], ((seq >> 1) - 1) & 1);
  if (lane == 0) st.index[slot] = -1;
  mbar_arrive(&st.full[slot]);
}

// The producer warp of a tile-loop block: it takes the items the stager put into the item slots,
// one after the other, issues each one's tiles into the ring and tags every tile with a header;
// after the last item, a header that says so.
template <typename T, typename C, int HEAD_DIM, int QB, TileSource SRC, bool EPI, bool FUSED = false>
__device__ __forceinline__ void produce_tiles(const MmhaParams& p, TileRing& ring, TileHeader* s_hdr,
                                              ItemStage<T, HEAD_DIM, QB, !FUSED && QB != kWideColumns>& st,
                                              unsigned char* stages, int lane) {
  using Source = SourceOf<C, HEAD_DIM, SRC>;
  using L = TileLayout<C, HEAD_DIM>;
  RingCursor cur;
  // The block's first item, decided here too (as the stager decides it), so that its first tiles
  // go out before the stager has staged it; its header still waits for the slot (the q).
  const DecidedItem first = decide_item<C, QB, FUSED>(p, blockIdx.x, lane);
  const bool early = first.w.busy() && first.scales_ok;
  if (lane == 0) timeline_mark(p, kTlDecided);
  int checked_items = 0;  // checks_before items so far (st.checked's phases)
  for (int seq = 0;; ++seq) {  // item seq is in slot seq % 2
    const int slot = seq & 1;
    const bool first_early = seq == 0 && early;  // this item's slot is read at its first header
    int index = static_cast<int>(blockIdx.x);
    WorkItem w = first.w;
    float k_scale = first.k_scale, v_scale = first.v_scale;
    const auto take = [&] {
      mbar_wait(&st.full[slot], (seq >> 1) & 1);
      index = st.index[slot];
      w = st.item[slot];
      k_scale = st.k_scale[slot];
      v_scale = st.v_scale[slot];
      mbar_arrive(&st.taken[slot]);
      mbar_arrive(&st.empty[slot]);  // this lane has read the slot's item
    };
    if (!first_early) take();
    if (index < 0) break;
    const int64_t kv_head = w.kv_head(p.num_kv_heads);
    const HeadSlots<C, HEAD_DIM> hs = head_slots<C, HEAD_DIM>(p.cache, p.num_kv_heads, w.b, w.kvh);
    TileArgs<C> ta{hs.k, hs.v, hs.pitch, w.lo, w.end, w.newslot, static_cast<int>(kv_head), &p.k_map, &p.v_map,
                   hs.table, hs.shift, hs.block_stride, p.num_kv_heads * hs.pitch, w.kvh * hs.pitch};
    if constexpr (kInt4<C>) ta.skip_k0 = int4_residual_tile(w);
    const int nt = w.t1 - w.t0;
    // The stage's K/V groups (TileLayout): wide items' consumers read whole-tile groups only.
    const int kg = QB == kWideColumns ? L::TILE_GROUP : L::k_group(p.cache);
    const TileWalk walk{w.t0, nt, static_cast<int>((kv_head * p.sched.num_splits + w.split) * 37 % nt)};
    // A paged row's blocks: each tile's table entries loaded two tiles ahead and checked one tile
    // ahead (the loads' latency behind a tile's copies, not in the producer's way); for the item
    // that appends, the blocks of the row's keys before its own ([lo, start)) are checked by the
    // stager while the item streams (check_blocks_before), its verdict taken at the last tile. A
    // block outside the pool refuses the item (header flag kPagesRefused, status kStatusPages): NaN
    // output (a split's NaN partial makes the merge NaN) and no append, so the row writes nothing.
    // Tree steps have appended before (tree_prepare_kernel, which refuses a row with a bad block:
    // its items are bad), so their items own no new slot and are never refused here.
    bool pages_bad = false;
    TilePages pages = load_pages(ta, walk.key(0)).checked(p.cache.num_blocks, pages_bad);
    TilePages ahead{{0, 0, 0, 0}};
    if (nt > 1) ahead = load_pages(ta, walk.key(1));
    const bool check_before = checks_before<FUSED>(p, w);
    for (int i = 0; i < nt; ++i) {
      if (cur.n > 0) mbar_wait(&ring.empty[cur.s], (cur.n - 1) & 1);
      if (seq == 0 && i == 0 && lane == 0) timeline_mark(p, kTlFirstIssued);
      Source::issue(ta, pages, stages + cur.s * L::STAGE_BYTES, walk.key(i), &ring.full[cur.s], lane, kg);
      if constexpr (kInt8<C>) {
        stage_token_scales<HEAD_DIM>(ta, token_scales(p.cache, p.num_kv_heads, w.b, w.kvh), pages,
                                     stages + cur.s * L::STAGE_BYTES, walk.key(i), &ring.full[cur.s], lane);
      }
      if constexpr (kInt4<C>) {
        stage_int4_scales<T, HEAD_DIM>(ta, int4_head<T, HEAD_DIM>(p, w.b, w.kvh), pages,
                                       stages + cur.s * L::STAGE_BYTES, walk.key(i), &ring.full[cur.s], lane);
      }
      if (i + 1 < nt) pages = ahead.checked(p.cache.num_blocks, pages_bad);
      if (i + 2 < nt) ahead = load_pages(ta, walk.key(i + 2));
      if (first_early && i == 0) take();  // the same item (the stager decides it alike): its q is staged now
      if (check_before && i == nt - 1) {  // the stager's verdict on the blocks before the item's
        mbar_wait(&st.checked, checked_items & 1);
        ++checked_items;
        pages_bad = pages_bad || st.before_bad;
      }
      const bool refused = i == nt - 1 && ta.table != nullptr && __any_sync(kFullMask, pages_bad);
      if (lane == 0) {
        s_hdr[cur.s] = TileHeader{index, walk.key(i),
                                  (i == 0 ? kFirstTile : 0) | (i == nt - 1 ? kLastTile : 0) | (refused ? kPagesRefused : 0),
                                  slot, (seq >> 1) & 1, w.b, w.kvh, w.qg, w.split, w.nh, w.pos, w.active,
                                  w.start, w.end, w.nodes, w.lo, k_scale, v_scale};
        if (refused) atomicOr(p.rows.status + w.b, kStatusPages);
      }
      mbar_arrive(&ring.header[cur.s]);  // each lane's header writes: consumers may start on q now
      Source::commit(&ring.full[cur.s], lane);
      cur.next(p.sched.stages);
    }
  }
  // No more items: a header that says so, then this block's count toward resetting the
  // work counter (the last block to finish leaves it at zero for the next launch).
  if (cur.n > 0) mbar_wait(&ring.empty[cur.s], (cur.n - 1) & 1);
  if (lane == 0) s_hdr[cur.s].item = -1;
  mbar_arrive(&ring.header[cur.s]);
  if (lane == 0) {
    __threadfence();
    if (atomicAdd(p.sched.work + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      p.sched.work[0] = 0;
      p.sched.work[1] = 0;
    }
  }
  if (lane == 0) timeline_mark(p, kTlProducerDone);
}

// The tile loop: a persistent block (kConsumerWarps consumer warps, a producer warp and a stager
// warp) takes item blockIdx.x, then items from the step's work counter until none is left. The
// stager fetches and decides the items and stages each one's raw q a slot ahead; the producer
// issues the items' tiles and tags every tile with a header (item, first / last tile; its own
// barrier, so the consumers read it before the tile lands). The consumers follow the headers: at an item's first tile they
// build its q while the tile is in flight, at its last they combine, store and merge, with
// named barrier 1 among themselves only, so the producer never waits for an item's epilogue.
// Items are taken in any order, but each item's arithmetic and the merge order are fixed, so
// results are bit-identical run to run.
// FUSED (kFusedTrees): a small tree step checked and appended here (one launch; TreeNodes).
template <typename T, typename C, int HEAD_DIM, int QB, TileSource SRC, bool EPI, bool FUSED>
__device__ __forceinline__ void run_tile_items(const MmhaParams& p) {
  using Source = SourceOf<C, HEAD_DIM, SRC>;
  using L = TileLayout<C, HEAD_DIM>;
  constexpr int CONSUMERS = kConsumerWarps * 32;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int items = num_items(p);

  // The block combine goes through a buffer per warp: static ones for small items; for larger
  // ones the item's last stage, which the consumers hold until the store is done (kHeldStage;
  // H200, one-token rows of 8 columns at head dim 128: 0.94-0.96x warp by warp in s_q), except
  // in the fused twins, whose B=1 tree steps it made 1.1x slower (docs/experiments.md): there
  // warp by warp in s_q (TileConsumer::combine).
  constexpr bool kWarpBuffers = QB * HEAD_DIM <= kWarpBufferValues;
  constexpr bool kHeldStage = !kWarpBuffers && !FUSED && !kInt4<C>;
  // Several columns: their combine numbers once per column (fold_warps), not at every value.
  constexpr bool kFold = QB > 1;
  // A single pass stores four values per thread (store_item's VEC) for several columns (not in a
  // fused tree's twin: at its register cap that spills 36-40 bytes at head dim 128).
  constexpr bool kStore4 = EPI ? QB >= kEpilogueGroupColumns : QB > 1 && !FUSED;
  // Two consecutive tiles of an item in one softmax update, where the ring is deep enough for a
  // consumer to hold two stages (p.sched.stages >= 4): one-byte caches (fp8, int8: consumer-bound;
  // 4 or more stages unless items are short) and 16-bit head dims <= 96 (6 stages on grids of one
  // item per SM; head dim 128 spills with it).
  constexpr bool kPairTiles = !kInt4<C> && (kFp8<C> || kInt8<C> || HEAD_DIM <= 96);
  __shared__ __align__(16) float s_q[QB][HEAD_DIM];  // q of the item; then a twin's combine buffer
  __shared__ __align__(16) float s_acc[kWarpBuffers ? kConsumerWarps : 1][kWarpBuffers ? QB : 1]
                                      [kWarpBuffers ? HEAD_DIM : 1];
  __shared__ __align__(16) C s_new_k[HEAD_DIM];
  __shared__ __align__(16) C s_new_v[HEAD_DIM];
  __shared__ float s_new_scales[2];  // int8: the new token's k and v scales
  __shared__ float s_m[kConsumerWarps][QB];
  __shared__ float s_l[kConsumerWarps][QB];
  __shared__ float s_f[kConsumerWarps][QB];
  __shared__ float s_w[QB][kMaxSplits];
  __shared__ bool s_last;
  __shared__ TileRing ring;
  __shared__ TileHeader s_hdr[kMaxStages];
  __shared__ __align__(16) ItemStage<T, HEAD_DIM, QB, !FUSED> s_item;  // a fused tree's twin: no raw q
  extern __shared__ __align__(16) unsigned char s_dyn[];
  unsigned char* stages = s_dyn + (1024 - smem_addr(s_dyn) % 1024) % 1024;
  // A fused tree step's node area, after the stages (launch_fused_tree sizes it: tree_node_bytes).
  TreeNodes<C, HEAD_DIM>* tn = nullptr;
  if constexpr (FUSED) tn = reinterpret_cast<TreeNodes<C, HEAD_DIM>*>(stages + p.sched.stages * L::STAGE_BYTES);
  // An int4 item's residual area (its row's last K group, fp16) and new token, after the stages.
  __half* s_res = nullptr;
  Int4Token<T, kInt4<C> ? HEAD_DIM : kInt4Channels>* s_tok4 = nullptr;
  if constexpr (kInt4<C>) {
    s_res = reinterpret_cast<__half*>(stages + p.sched.stages * L::STAGE_BYTES);
    s_tok4 = reinterpret_cast<Int4Token<T, HEAD_DIM>*>(s_res + kTileKeys * Int4Consumer<HEAD_DIM, QB>::RES_PITCH);
    static_assert(kTileKeys * Int4Consumer<HEAD_DIM, QB>::RES_PITCH * 2 + sizeof(Int4Token<T, HEAD_DIM>) <=
                      int4_residual_bytes(HEAD_DIM),
                  "the residual area holds the group and the new token");
  }
  if (tid == 0) timeline_mark(p, kTlEntered);
  if (tid == 0) {
    for (int s = 0; s < p.sched.stages; ++s) {
      mbar_init(&ring.full[s], Source::FULL_ARRIVALS);
      mbar_init(&ring.header[s], 32);
      mbar_init(&ring.empty[s], CONSUMERS);
    }
    init_item_stage(s_item);
    mbar_init_fence();
  }
  if (warp == kConsumerWarps && lane == 0) {
    Source::prefetch(TileArgs<C>{nullptr, nullptr, 0, 0, 0, 0, 0, &p.k_map, &p.v_map});
  }
  __syncthreads();
  grid_dependency_wait();  // a tree step's check and append (launch_kernel)
  if (tid == 0) timeline_mark(p, kTlStart);

  if (warp == kConsumerWarps) {
    produce_tiles<T, C, HEAD_DIM, QB, SRC, EPI, FUSED>(p, ring, s_hdr, s_item, stages, lane);
    return;
  }
  if (warp == kConsumerWarps + 1) {
    stage_items<T, C, HEAD_DIM, QB, EPI, FUSED>(p, s_item, items, lane, tn);
    return;
  }

  // ------------------------------------------------------------------ consumers
  const float scale_log2 = p.scale * kLog2e;
  const auto sync = [] { named_barrier(1, CONSUMERS); };
  const int key0 = 16 * warp;
  const int kg = L::k_group(p.cache);
  RingCursor cur;
  using Consumer = std::conditional_t<kInt4<C>, Int4Consumer<HEAD_DIM, QB>, TileConsumer<C, HEAD_DIM, QB>>;
  Consumer c;
  WorkItem w;
  float value_scale = 1.f;
  // One-column items through the epilogue: its per-channel values, loaded at the first tile.
  constexpr int PRE_N = EPI && QB == 1 ? (HEAD_DIM + CONSUMERS - 1) / CONSUMERS : 0;
  __shared__ ItemChannels<PRE_N, HEAD_DIM> s_pre;
  bool first_item = true;  // timeline_mark: the block's first item's events
  for (;;) {
    mbar_wait(&ring.header[cur.s], cur.n & 1);  // the header: an item's q can start before its tile lands
    const TileHeader h = s_hdr[cur.s];
    if (h.item < 0) break;
    unsigned char* stage = stages + cur.s * L::STAGE_BYTES;
    if (h.flags & kFirstTile) {
      if (tid == 0 && first_item) timeline_mark(p, kTlHeaderSeen);
      w.b = h.b, w.kvh = h.kvh, w.qg = h.qg, w.split = h.split, w.nh = h.nh;
      w.c0 = h.qg * QB, w.h0 = h.kvh * p.group + w.c0;
      w.pos = h.pos, w.nodes = h.nodes, w.newslot = tree_step(p) && !FUSED ? -1 : h.pos;
      w.bad = false, w.idle = false, w.active = h.active, w.start = h.start, w.end = h.end, w.lo = h.lo;
      value_scale = h.v_scale;
      if constexpr (PRE_N > 0) {
        // Only a single pass stores through the epilogue here (a split's merge applies it).
        if (p.sched.num_splits == 1) s_pre.start(p, column_of(p, w, 0).head, tid, CONSUMERS);
      }
      mbar_wait(&s_item.full[h.slot], h.slot_parity);  // done: the producer waited on it before this header
      const TokenRows<T> rows{s_item.q[h.slot], s_item.k[h.slot], s_item.v[h.slot]};
      Int4Token<T, HEAD_DIM>* tok4 = nullptr;
      if constexpr (kInt4<C>) tok4 = s_tok4;
      load_query_and_new_token<T, C, HEAD_DIM, QB, FUSED>(p, w, rows.q, rows, h.k_scale, h.v_scale, s_q, s_new_k,
                                                          s_new_v, s_new_scales, tid, CONSUMERS, sync, tn, h.slot,
                                                          tok4);
      if constexpr (FUSED) {
        if (w.owner()) build_tree_nodes<T, C, HEAD_DIM>(p, w, *tn, h.slot, h.k_scale, h.v_scale, tid, CONSUMERS);
      }
      sync();
      if (tid == 0 && first_item) timeline_mark(p, kTlQueryBuilt);
      if constexpr (!FUSED) mbar_arrive(&s_item.empty[h.slot]);  // this thread is done with the staged q (it is in s_q now)
      c.init(s_q, w.nh, scale_log2 * h.k_scale, lane, p, [&](int g) { return column_of(p, w, g); },
             tree_step(p), w.pos, FUSED ? tn->anc[h.slot] : nullptr);
      if constexpr (FUSED) mbar_arrive(&s_item.empty[h.slot]);  // and with the slot's root paths
      if constexpr (kInt4<C>) {  // the row's last K group into the residual area (quantised where it completes)
        const int rk = int4_residual_tile(w);
        if (rk >= 0) {
          load_int4_residual<T, HEAD_DIM, QB>(p, w, rk, int4_commits(w), *s_tok4, s_res, tid, CONSUMERS, sync);
          c.residual(rk, s_res);
        }
      }
    }
    mbar_wait(&ring.full[cur.s], cur.n & 1);
    if (tid == 0 && first_item) {
      if (h.flags & kFirstTile) timeline_mark(p, kTlFirstLanded);
      if (h.flags & kLastTile) timeline_mark(p, kTlLastLanded);
    }
    const int it = h.k0 + key0;
    // The slots taken from shared memory: a one-token step's new token, a fused tree's nodes.
    const auto patch_if = [&](unsigned char* st, int t) {
      if constexpr (kInt4<C>) {
        if (w.owner() && t <= w.newslot && w.newslot < t + 16) {
          Int4Consumer<HEAD_DIM, QB>::patch(st, key0, t, w.newslot, s_tok4->v, s_tok4->v_range, lane);
        }
      } else if constexpr (FUSED) {
        if ((t < w.newslot + w.nodes && w.newslot < t + 16) || t + 16 > w.end || t < w.lo) {
          TileConsumer<C, HEAD_DIM, QB>::patch(st, key0, kg, t, w.lo, w.end, w.newslot, w.nodes, tn->k(0),
                                               tn->v(0, p.tree.nodes), lane);
        }
      } else if ((t <= w.newslot && w.newslot < t + 16) || t + 16 > w.end || t < w.lo) {
        TileConsumer<C, HEAD_DIM, QB>::patch(st, key0, kg, t, w.lo, w.end, w.newslot, 1, s_new_k, s_new_v, lane,
                                             s_new_scales);
      }
    };
    int flags = h.flags;
    if (kPairTiles && p.sched.stages >= 4 && !(flags & kLastTile)) {
      // The item's next tile is in the next stage: both attended in one update.
      RingCursor nxt = cur;
      nxt.next(p.sched.stages);
      mbar_wait(&ring.header[nxt.s], nxt.n & 1);
      const TileHeader h2 = s_hdr[nxt.s];
      unsigned char* stage2 = stages + nxt.s * L::STAGE_BYTES;
      mbar_wait(&ring.full[nxt.s], nxt.n & 1);
      if (tid == 0 && first_item && (h2.flags & kLastTile)) timeline_mark(p, kTlLastLanded);
      const int it2 = h2.k0 + key0;
      if (it < w.end && it2 < w.end) {
        patch_if(stage, it);
        patch_if(stage2, it2);
        const unsigned char* both[2] = {stage, stage2};
        const int its[2] = {it, it2};
        c.template steps<2>(both, key0, kg, its, w.lo, w.end, w.pos, lane);
      } else if (it < w.end || it2 < w.end) {
        unsigned char* one = it < w.end ? stage : stage2;
        const int t = it < w.end ? it : it2;
        patch_if(one, t);
        c.step(one, key0, kg, t, w.lo, w.end, w.pos, lane);
      }
      mbar_arrive(&ring.empty[cur.s]);
      cur.next(p.sched.stages);
      flags = h2.flags;
    } else if (it < w.end) {
      patch_if(stage, it);
      c.step(stage, key0, kg, it, w.lo, w.end, w.pos, lane);
    }
    // kHeldStage: the item's last stage is the combine's, held until the store.
    const int held = cur.s;
    if (!kHeldStage || !(flags & kLastTile)) mbar_arrive(&ring.empty[cur.s]);  // done with the stage and its header
    cur.next(p.sched.stages);
    if (flags & kLastTile) {
      if (tid == 0 && first_item) timeline_mark(p, kTlLastAttended);
      c.finish();
      float (*acc_w)[QB][HEAD_DIM] = nullptr;
      if constexpr (kWarpBuffers) {
        acc_w = s_acc;
        c.stash(s_m, s_l, acc_w, warp, lane);
      } else if constexpr (kHeldStage) {
        static_assert(kConsumerWarps * QB * HEAD_DIM * sizeof(float) <= L::STAGE_BYTES, "warp buffers in a stage");
        acc_w = reinterpret_cast<float (*)[QB][HEAD_DIM]>(stages + held * L::STAGE_BYTES);
        sync();  // every warp is done reading the stage's keys
        c.stash(s_m, s_l, acc_w, warp, lane);
      } else {
        sync();  // every consumer holds its q fragments: s_q becomes the combine buffer
        c.combine(s_m, s_l, &s_q[0][0], warp, lane);
      }
      if constexpr (kFold) {
        if (tid < w.nh) fold_warps<kConsumerWarps, QB, kWarpBuffers || kHeldStage>(s_m, s_l, s_f, tid);
        sync();
      }
      if (tid == 0 && first_item) timeline_mark(p, kTlCombined);
      const auto release = [&] {  // the held stage: this thread's reads and writes before the copy engine's refill
        if constexpr (kHeldStage) {
          fence_proxy_async_smem();
          mbar_arrive(&ring.empty[held]);
        }
      };
      if (flags & kPagesRefused) {
        store_refused_item<T, HEAD_DIM, EPI>(p, w, tid, CONSUMERS);
        release();
      } else {
        const auto m = [&](int g) { return kFold ? s_m[0][g] : warps_max<kConsumerWarps, QB>(s_m, g); };
        const auto l = [&](int g) { return kFold ? s_l[0][g] : warps_sum<kConsumerWarps, QB>(s_m, s_l, g); };
        const auto acc = [&](int g, int d) {
          if constexpr (!kWarpBuffers && !kHeldStage) {
            return s_q[g][d];
          } else if constexpr (kFold) {
            return folded_acc<kConsumerWarps, QB, HEAD_DIM>(s_f, acc_w, g, d);
          } else {
            return warps_acc<kConsumerWarps, QB, HEAD_DIM>(s_m, acc_w, g, d);
          }
        };
        store_item<T, HEAD_DIM, EPI, kStore4, PRE_N>(p, w, m, l, acc, value_scale, tid, CONSUMERS, &s_pre);
        release();
        if (tid == 0 && first_item) timeline_mark(p, kTlOutStored);
        if constexpr (kInt4<C>) {
          append_int4_token<T, HEAD_DIM>(p, w, *s_tok4, tid, CONSUMERS);
        } else if constexpr (FUSED) {
          append_tree_nodes<C, HEAD_DIM>(p, w, *tn, tid, CONSUMERS);
        } else {
          append_new_token<C, HEAD_DIM>(p, w, s_new_k, s_new_v, tid, CONSUMERS, s_new_scales);
        }
      }
      if (tid == 0 && first_item) timeline_mark(p, kTlAppended);
      if (p.sched.num_splits > 1) merge_if_last<T, HEAD_DIM, QB, EPI>(p, w, s_w, s_last, value_scale, tid, CONSUMERS, sync);
      sync();  // s_q, s_acc, s_m, s_l, s_f and s_w are free for the next item
      if (tid == 0 && first_item) timeline_mark(p, kTlItemDone);
      first_item = false;
    }
  }
  if (tid == 0) timeline_mark(p, kTlConsumersDone);
}

// A wide consumer's fragment row r (column col of the item), as store_value stores each value:
// out and lse (single pass), its split's partial, or zeros for a node the row does not use. The
// destination and the factor are decided once per row (WideConsumer::row_pairs).
template <typename T, int HEAD_DIM, class Wide>
__device__ __forceinline__ void store_wide_row(const MmhaParams& p, const WorkItem& w, const Column& col,
                                               const Wide& c, int r, int lane, float value_scale) {
  const int64_t h = col.flat(p.num_heads);
  const bool lead = lane % 4 == 0;  // holds head dim 0 of the row
  if (col.node >= w.nodes || p.sched.num_splits == 1) {
    if (col.node >= w.nodes && w.split != 0) return;
    uint32_t* out = reinterpret_cast<uint32_t*>(static_cast<T*>(p.output.out) + h * HEAD_DIM);
    if (col.node >= w.nodes) {
      c.row_pairs(r, lane, [&](int d, float, float) { out[d / 2] = 0u; });
      if (lead) p.output.lse[h] = -INFINITY;
      return;
    }
    float mx = c.m[r], sum = c.l[r];
    const float f = with_sink(p, col.head, mx, sum) / sum * value_scale;
    c.row_pairs(r, lane, [&](int d, float a0, float a1) { out[d / 2] = pack_rn<T>(a0 * f, a1 * f); });
    if (lead) p.output.lse[h] = (mx + log2f(sum)) * kLn2;
  } else {
    const SplitPartials<HEAD_DIM> part(p);
    const int64_t slot = h * p.sched.num_splits + w.split;
    float2* acc = reinterpret_cast<float2*>(part.acc + slot * HEAD_DIM);
    c.row_pairs(r, lane, [&](int d, float a0, float a1) { acc[d / 2] = make_float2(a0, a1); });
    if (lead) part.ml[slot] = make_float2(c.m[r], c.l[r]);
  }
}

// The tile loop for wide items (tree steps with many columns; attend_wide.cuh): the same
// producer and ring, consumers that each hold 16 columns over all keys of every tile. At an
// item's first tile each warp builds its q from qkv while the tile is in flight; tiles that end
// past the item's keys have their stray V rows zeroed by all consumers together (named barrier
// 1); at the last tile each warp stores its columns, and a split's last item merges.
template <typename T, typename C, int HEAD_DIM, TileSource SRC>
__device__ __forceinline__ void run_wide_items(const MmhaParams& p) {
  using Source = SourceOf<C, HEAD_DIM, SRC>;
  using L = TileLayout<C, HEAD_DIM>;
  using Wide = WideConsumer<C, HEAD_DIM>;
  constexpr int QB = kWideColumns;
  constexpr bool EPI = false;  // steps with an output epilogue take narrow items (columns_block)
  constexpr int CONSUMERS = kConsumerWarps * 32;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int items = num_items(p);

  using M = typename Wide::M;
  // The warps' q staging areas at an item's first tile, the split merge's weights at its last
  // (a barrier ends every merge before any warp stages its next q).
  constexpr int BUF_BYTES = kConsumerWarps * Wide::Q_STAGE_BYTES > QB * kMaxSplits * 4
                                ? kConsumerWarps * Wide::Q_STAGE_BYTES
                                : QB * kMaxSplits * 4;
  __shared__ __align__(16) unsigned char s_buf[BUF_BYTES];
  __shared__ bool s_last;
  __shared__ TileRing ring;
  __shared__ TileHeader s_hdr[kMaxStages];
  __shared__ __align__(16) ItemStage<T, HEAD_DIM, QB> s_item;  // the items only (no raw q)
  extern __shared__ __align__(16) unsigned char s_dyn[];
  unsigned char* stages = s_dyn + (1024 - smem_addr(s_dyn) % 1024) % 1024;
  auto& s_w = *reinterpret_cast<float(*)[QB][kMaxSplits]>(s_buf);
  M* s_q = reinterpret_cast<M*>(s_buf + (Wide::kWg ? 0 : warp * Wide::Q_STAGE_BYTES));
  if (tid == 0) {
    for (int s = 0; s < p.sched.stages; ++s) {
      mbar_init(&ring.full[s], Source::FULL_ARRIVALS);
      mbar_init(&ring.header[s], 32);
      mbar_init(&ring.empty[s], CONSUMERS);
    }
    init_item_stage(s_item);
    mbar_init_fence();
  }
  if (warp == kConsumerWarps && lane == 0) {
    Source::prefetch(TileArgs<C>{nullptr, nullptr, 0, 0, 0, 0, 0, &p.k_map, &p.v_map});
  }
  __syncthreads();
  grid_dependency_wait();  // a tree step's check and append (launch_kernel)

  if (warp == kConsumerWarps) {
    produce_tiles<T, C, HEAD_DIM, QB, SRC, EPI>(p, ring, s_hdr, s_item, stages, lane);
    return;
  }
  if (warp == kConsumerWarps + 1) {
    stage_items<T, C, HEAD_DIM, QB, EPI>(p, s_item, items, lane);
    return;
  }

  const float scale_log2 = p.scale * kLog2e;
  const auto sync = [] { named_barrier(1, CONSUMERS); };
  RingCursor cur;
  Wide c;
  WorkItem w;
  float value_scale = 1.f;
  for (;;) {
    mbar_wait(&ring.header[cur.s], cur.n & 1);
    const TileHeader h = s_hdr[cur.s];
    if (h.item < 0) break;
    unsigned char* stage = stages + cur.s * L::STAGE_BYTES;
    if (h.flags & kFirstTile) {
      w.b = h.b, w.kvh = h.kvh, w.qg = h.qg, w.split = h.split, w.nh = h.nh;
      w.c0 = h.qg * QB, w.h0 = h.kvh * p.group + w.c0;
      w.pos = h.pos, w.nodes = h.nodes, w.newslot = -1;
      w.bad = false, w.idle = false, w.active = h.active, w.start = h.start, w.end = h.end, w.lo = h.lo;
      value_scale = h.v_scale;
      mbar_arrive(&s_item.empty[h.slot]);  // wide items take nothing from the slot but its release
      c.template init<T>(p, w, scale_log2 * h.k_scale, s_q, warp, lane);
      if constexpr (Wide::kWg) sync();  // the warpgroup's products read every warp's q
    }
    mbar_wait(&ring.full[cur.s], cur.n & 1);
    const int it = h.k0;
    if (it + kTileKeys > w.end || it < w.lo) {
      Wide::clear_v(stage, it, w.lo, w.end, tid, CONSUMERS);
      sync();
    }
    if (Wide::kWg || c.busy) c.step(stage, it, w.lo, w.end, lane);  // wgmma: the warpgroup together
    mbar_arrive(&ring.empty[cur.s]);  // this lane is done with the stage and its header
    cur.next(p.sched.stages);
    if (h.flags & kLastTile) {
      if (c.busy) {
        c.finish();
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (Wide::column(warp, lane, r) < w.nh) {
            store_wide_row<T, HEAD_DIM>(p, w, column_of(p, w, Wide::column(warp, lane, r)), c, r, lane, value_scale);
          }
        }
      }
      if (p.sched.num_splits > 1) {
        merge_if_last<T, HEAD_DIM, QB, EPI>(p, w, s_w, s_last, value_scale, tid, CONSUMERS, sync);
        sync();  // s_w is the q staging area again
      }
    }
  }
}

// The CUDA-core loop (fp32 caches): one block of kSimtWarps warps per item.
template <typename T, int HEAD_DIM, int QB, bool EPI>
__device__ __forceinline__ void run_simt_item(const MmhaParams& p) {
  using Simt = SimtAttend<T, HEAD_DIM, QB>;
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  grid_dependency_wait();  // a tree step's check and append (launch_kernel)
  WorkItem w = work_item_head<QB>(p, blockIdx.x);
  work_item_range(p, w, p.rows.lengths[w.b], row_nodes(p, w.b), Simt::KEYS);
  if (w.bad) {  // a refused tree row's flag was raised by tree_prepare_kernel
    poison_row<T, HEAD_DIM, EPI>(p, w, tree_step(p) ? 0 : kStatusLength, tid, nthreads);
    return;
  }
  if (w.idle) poison_row<T, HEAD_DIM, EPI>(p, w, 0, tid, nthreads, true);
  if (!w.busy()) return;

  __shared__ __align__(16) float s_q[QB][HEAD_DIM];
  __shared__ __align__(16) T s_new_k[HEAD_DIM];
  __shared__ __align__(16) T s_new_v[HEAD_DIM];
  __shared__ float s_m[kSimtWarps][QB];
  __shared__ float s_l[kSimtWarps][QB];
  __shared__ float s_w[QB][kMaxSplits];
  __shared__ bool s_last;

  const HeadSlots<T, HEAD_DIM> slots = head_slots<T, HEAD_DIM>(p.cache, p.num_kv_heads, w.b, w.kvh);
  load_query_and_new_token<T, T, HEAD_DIM, QB>(
      p, w, global_q<T, HEAD_DIM>(p, Column{w.b, 0, w.h0}), global_rows<T, HEAD_DIM>(p, w.b, w.kvh), 1.f, 1.f, s_q,
      s_new_k, s_new_v, nullptr, tid, nthreads, [] { __syncthreads(); });
  // A paged row: the blocks of the item's keys (and, for the item that appends, of the row's keys
  // before them) must be in the pool, or the item is refused (NaN, no append, kStatusPages).
  const int first = w.owner() ? w.lo : max(w.lo, w.start);
  if (!__syncthreads_and(blocks_ok(p.cache, slots, first, w.end - 1, tid, nthreads))) {
    if (tid == 0) atomicOr(p.rows.status + w.b, kStatusPages);
    store_refused_item<T, HEAD_DIM, EPI>(p, w, tid, nthreads);
    if (p.sched.num_splits > 1) {
      merge_if_last<T, HEAD_DIM, QB, EPI>(p, w, s_w, s_last, 1.f, tid, nthreads, [] { __syncthreads(); });
    }
    return;
  }
  append_new_token<T, HEAD_DIM>(p, w, s_new_k, s_new_v, tid, nthreads);
  const AttendArgs<T, HEAD_DIM> args{slots, w.start, w.lo, w.end, w.newslot, p.scale * kLog2e};
  int heads[QB];
  TreeMask<QB> tree;
  tree.on = tree_step(p);
  tree.base = w.pos;
#pragma unroll
  for (int g = 0; g < QB; ++g) {
    const Column c = column_of(p, w, g < w.nh ? g : 0);
    heads[g] = g < w.nh ? c.head : -1;
    tree.anc[g] = tree.on && g < w.nh ? p.tree.anc[c.qrow] : 0;
  }
  ScoreTransform<QB> mods;
  mods.init(p.mods, heads);
  const float* s_acc = Simt::run(args, mods, tree, s_m, s_l, s_q, s_new_k, s_new_v);
  // Block combine: the loop warps' (max, sum, acc), rescaled to the block's max.
  const auto block_max = [&](int g) { return warps_max<kSimtWarps, QB>(s_m, g); };
  const auto block_sum = [&](int g) { return warps_sum<kSimtWarps, QB>(s_m, s_l, g); };
  const auto block_acc = [&](int g, int d) {
    const float mb = block_max(g);
    const float m_ref = mb == -INFINITY ? 0.f : mb;
    float a = 0.f;
#pragma unroll
    for (int wp = 0; wp < kSimtWarps; ++wp) {
      float aw = 0.f;
#pragma unroll
      for (int r = 0; r < Simt::ACC_ROWS; ++r) aw += s_acc[((wp * Simt::ACC_ROWS + r) * QB + g) * HEAD_DIM + d];
      a += aw * exp2f(s_m[wp][g] - m_ref);
    }
    return a;
  };
  store_item<T, HEAD_DIM, EPI>(p, w, block_max, block_sum, block_acc, 1.f, tid, nthreads);
  if (p.sched.num_splits > 1) {
    merge_if_last<T, HEAD_DIM, QB, EPI>(p, w, s_w, s_last, 1.f, tid, nthreads, [] { __syncthreads(); });
  }
}

// EPI: the output epilogue (output_epilogue.cuh) is compiled in; a kernel of its own, so that the
// plain kernels' code and registers do not change (1 or kEpilogueColumns columns: columns_block).
// FUSED: the twin that checks and appends a small tree itself (kFusedTrees).
template <typename T, typename C, int HEAD_DIM, int QB, TileSource SRC, bool EPI, bool FUSED = false>
__global__ void __launch_bounds__(kBlockThreads<T>, kMinBlocks<T, HEAD_DIM>)
    decode_attention_kernel(const __grid_constant__ MmhaParams p) {
  if constexpr (QB == kWideColumns) {
    run_wide_items<T, C, HEAD_DIM, SRC>(p);
  } else if constexpr (kTiles<C>) {
    run_tile_items<T, C, HEAD_DIM, QB, SRC, EPI, FUSED>(p);
  } else {
    run_simt_item<T, HEAD_DIM, QB, EPI>(p);
  }
}

// A fused tree step's node area (TreeNodes and its nodes' K/V rows, after the stages) for a step of
// `nodes` nodes; 0 for kernels other than the twins.
template <typename C, int HEAD_DIM, bool FUSED>
constexpr int tree_node_bytes(int nodes) {
  return FUSED ? static_cast<int>(sizeof(TreeNodes<C, HEAD_DIM>)) + 2 * nodes * HEAD_DIM * static_cast<int>(sizeof(C))
               : 0;
}

// The tile loop's stages at `stages` and what follows them (int4: the residual area), with the
// slack that aligns them.
template <typename C, int HEAD_DIM>
constexpr int stages_smem_bytes(int stages) {
  if constexpr (kInt4<C>) {
    return stages * int4_stage_bytes(HEAD_DIM) + 1024 + int4_residual_bytes(HEAD_DIM);
  } else {
    return tile_smem_bytes(HEAD_DIM, static_cast<int>(sizeof(C)), kInt8<C>, stages);
  }
}

// Dynamic shared memory of one launch (the tile loop's stages, a fused tree's node area; the
// CUDA-core loop has static arrays only). Above the default 48 KB the kernel must opt in, once per
// device (the attribute is per device), for the largest launch it may see: kMaxStages, or what
// the device allows.
template <typename T, typename C, int HEAD_DIM, int QB, TileSource SRC, bool EPI, bool FUSED = false>
cudaError_t prepare_decode_attention(int stages, int& smem_bytes, int tree_nodes = 0) {
  if constexpr (!kTiles<T>) {
    smem_bytes = 0;
    return cudaSuccess;
  } else {
    if (stages < kMinStages || stages > kMaxStages) return cudaErrorInvalidValue;
    smem_bytes = stages_smem_bytes<C, HEAD_DIM>(stages) + tree_node_bytes<C, HEAD_DIM, FUSED>(tree_nodes);
    static std::atomic<uint64_t> opted_in{0};
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
    if (bit != 0 && (opted_in.load(std::memory_order_acquire) & bit)) return cudaSuccess;
    int optin = 0;
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err != cudaSuccess) return err;
    cudaFuncAttributes attr{};
    err = cudaFuncGetAttributes(&attr, decode_attention_kernel<T, C, HEAD_DIM, QB, SRC, EPI, FUSED>);
    if (err != cudaSuccess) return err;
    const int most = stages_smem_bytes<C, HEAD_DIM>(kMaxStages) + tree_node_bytes<C, HEAD_DIM, FUSED>(kFusedTreeNodes);
    const int allowed = optin - static_cast<int>(attr.sharedSizeBytes);
    err = cudaFuncSetAttribute(decode_attention_kernel<T, C, HEAD_DIM, QB, SRC, EPI, FUSED>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, most < allowed ? most : allowed);
    if (err == cudaSuccess) opted_in.fetch_or(bit, std::memory_order_acq_rel);
    return err;
  }
}

template <typename T, typename C, int HEAD_DIM, int QB, TileSource SRC, bool EPI>
int blocks_per_sm_of(int stages) {
  int smem_bytes = 0;
  int blocks = 0;
  if (prepare_decode_attention<T, C, HEAD_DIM, QB, SRC, EPI>(stages, smem_bytes) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, decode_attention_kernel<T, C, HEAD_DIM, QB, SRC, EPI>,
                                                    kBlockThreads<T>, smem_bytes) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return blocks;
}

// Blocks of the grid: one per item on the CUDA-core loop; on the tile loop, as many as are
// resident at once (its occupancy at p.sched.stages stages; `resident`: SMs times that, 0 where
// none fits), at most one per item.
template <typename T, typename C, int HEAD_DIM, int QB, TileSource SRC, bool EPI, bool FUSED = false>
cudaError_t grid_blocks(const MmhaParams& p, int smem_bytes, int& blocks, int64_t* resident = nullptr) {
  const int64_t items = static_cast<int64_t>(p.rows.batch) * p.num_kv_heads * p.sched.q_groups * p.sched.num_splits;
  if (items > INT32_MAX) return cudaErrorInvalidValue;
  blocks = static_cast<int>(items);
  if constexpr (kTiles<T>) {
    int device = 0, sms = 0, per_sm = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess) {
      err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &per_sm, decode_attention_kernel<T, C, HEAD_DIM, QB, SRC, EPI, FUSED>, kBlockThreads<T>, smem_bytes);
    }
    if (err != cudaSuccess) return err;
    if (resident != nullptr) *resident = static_cast<int64_t>(sms) * per_sm;
    const int64_t fits = static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1);
    blocks = static_cast<int>(items < fits ? items : fits);
  }
  return cudaSuccess;
}

// A small tree step in one launch (the FUSED twin), where it keeps the plan's grid: the node area
// after the stages must leave the blocks that run at once as they are. Returns cudaErrorNotReady
// (nothing launched) where it does not.
template <typename T, typename C, int HEAD_DIM, int QB, TileSource SRC, bool EPI>
cudaError_t launch_fused_tree(const MmhaParams& p, int blocks, cudaStream_t stream) {
  if constexpr (!kFusedTrees<T, C, QB, EPI>) {
    return cudaErrorNotReady;
  } else {
    if (p.tree.nodes > kFusedTreeNodes) return cudaErrorNotReady;
    int smem_bytes = 0;
    cudaError_t err =
        prepare_decode_attention<T, C, HEAD_DIM, QB, SRC, EPI, true>(p.sched.stages, smem_bytes, p.tree.nodes);
    if (err != cudaSuccess) return err;
    int fused_blocks = 0;
    int64_t resident = 0;
    err = grid_blocks<T, C, HEAD_DIM, QB, SRC, EPI, true>(p, smem_bytes, fused_blocks, &resident);
    if (err != cudaSuccess) return err;
    if (resident == 0 || fused_blocks != blocks) return cudaErrorNotReady;
    decode_attention_kernel<T, C, HEAD_DIM, QB, SRC, EPI, true><<<blocks, kBlockThreads<T>, smem_bytes, stream>>>(p);
    return cudaGetLastError();
  }
}

template <typename T, typename C, int HEAD_DIM, int QB, TileSource SRC, bool EPI>
cudaError_t launch_kernel(const MmhaParams& p, cudaStream_t stream) {
  int smem_bytes = 0;
  cudaError_t err = prepare_decode_attention<T, C, HEAD_DIM, QB, SRC, EPI>(kTiles<T> ? p.sched.stages : kMinStages, smem_bytes);
  if (err != cudaSuccess) return err;
  int blocks = 0;
  err = grid_blocks<T, C, HEAD_DIM, QB, SRC, EPI>(p, smem_bytes, blocks);
  if (err != cudaSuccess) return err;
  if (blocks == 0) return cudaSuccess;
  if (p.tree.parents == nullptr) {
    decode_attention_kernel<T, C, HEAD_DIM, QB, SRC, EPI><<<blocks, kBlockThreads<T>, smem_bytes, stream>>>(p);
    return cudaGetLastError();
  }
  if constexpr (kInt4<C>) {
    return cudaErrorInvalidValue;  // int4 tree steps: the host refuses them
  } else {
    err = launch_fused_tree<T, C, HEAD_DIM, QB, SRC, EPI>(p, blocks, stream);
    if (err != cudaErrorNotReady) return err;
    // A tree step: the trees' check and append first. On sm_90 the attention grid is launched as
    // its programmatic dependent: its blocks start (barriers, descriptor prefetch) as the check's
    // blocks finish and wait for its end (grid_dependency_wait) before they read anything.
    err = launch_tree_prepare<T, C, HEAD_DIM>(p, stream);
    if (err != cudaSuccess) return err;
    int device = 0, major = 0;
    err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (err != cudaSuccess) return err;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(blocks));
    cfg.blockDim = dim3(kBlockThreads<T>);
    cfg.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = major >= 9 ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, decode_attention_kernel<T, C, HEAD_DIM, QB, SRC, EPI>, p);
  }
}

// Bulk tensor copies exist for tile-loop caches whose V rows are whole 128-byte lines.
template <typename C, int HEAD_DIM>
constexpr bool kHasTma = kTiles<C> && !kInt4<C> && v_whole_lines(HEAD_DIM, static_cast<int>(sizeof(C)));

template <typename T, typename C, int HEAD_DIM, int QB, bool EPI>
cudaError_t launch_source(const MmhaParams& params, cudaStream_t stream) {
  if (params.sched.tile_source == TileSource::kTma) {
    if constexpr (kHasTma<C, HEAD_DIM>) {
      return launch_kernel<T, C, HEAD_DIM, QB, TileSource::kTma, EPI>(params, stream);
    } else {
      return cudaErrorInvalidValue;
    }
  }
  return launch_kernel<T, C, HEAD_DIM, QB, TileSource::kCpAsync, EPI>(params, stream);
}

// Kernels with the output epilogue exist for QB kEpilogueColumns, and for one and
// kEpilogueGroupColumns columns on the tile loop (columns_block in mmha_params.h).
template <typename T, int QB>
constexpr bool kHasEpilogue = QB == kEpilogueColumns || (kTiles<T> && (QB == 1 || QB == kEpilogueGroupColumns));

template <typename T, typename C, int HEAD_DIM, int QB>
cudaError_t launch_decode_attention(const MmhaParams& params, cudaStream_t stream) {
  if (params.output.epilogue) {
    if constexpr (kHasEpilogue<T, QB> && !kInt4<C>) return launch_source<T, C, HEAD_DIM, QB, true>(params, stream);
    return cudaErrorInvalidValue;
  }
  return launch_source<T, C, HEAD_DIM, QB, false>(params, stream);
}

template <typename T, typename C, int HEAD_DIM, int QB>
int decode_attention_blocks_per_sm(int stages, TileSource source) {
  if (source == TileSource::kTma) {
    if constexpr (kHasTma<C, HEAD_DIM>) return blocks_per_sm_of<T, C, HEAD_DIM, QB, TileSource::kTma, false>(stages);
    return 0;
  }
  return blocks_per_sm_of<T, C, HEAD_DIM, QB, TileSource::kCpAsync, false>(stages);
}

}  // namespace mmha
