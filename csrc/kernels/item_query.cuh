// An item's query columns and new tokens, built at its first tile: q in fp32 (bias, q/k norm,
// rotary) into shared memory, the new token's K/V as the cache stores them (rounded, fp8, int8 or
// int4 quantised), a fused tree's nodes; and the appends that write them. Torch-free.
#pragma once

#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cache_slots.cuh"
#include "decode_traits.cuh"
#include "int4_step.cuh"
#include "mmha_params.h"
#include "new_token.cuh"
#include "lean_kernels.h"
#include "tree_step.cuh"
#include "vec.cuh"
#include "work_items.cuh"

namespace mmha {

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
  warp_absmax_kv(km, vm);
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

// Lean one-token kernels over int8 caches: the stager warp builds an owner item's new token
// (quantised) into the block's new-token arrays and appends it (stage_new_token), so that the
// consumers neither quantise nor append it (16-bit caches' tokens are a rounding: kept there).
template <typename C>
constexpr bool kStagedToken = kLeanKernels && std::is_same_v<C, s8>;

// A fused tree step's q columns read from qkv, biased, into s_q (its rotation is
// load_query_and_new_token's second pass): each thread reads a run of kPrefetchQ elements of a
// column (and their bias) together, unconditionally (a column past the item's reads its last
// one's; columns past w.nh get zeros). Needs of w only what work_item_head gives (b, kvh, c0,
// nh), so the consumers may run it for the block's first item before its header.
template <typename T, int HEAD_DIM, int QB>
__device__ __forceinline__ void fused_query_biased(const MmhaParams& p, const WorkItem& w,
                                                   float (&s_q)[QB][HEAD_DIM + kQRowPad], int tid, int nthreads) {
  const T* bias = static_cast<const T*>(p.qkv_bias);
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
}

// A fused tree step's node rows (each node's k and v rows of item w's kv head in its qkv row)
// into L1, a line a thread: the item that owns the nodes reads them in build_tree_nodes, after
// its header (the stager's derivation of the tree) and the q build; the consumers issue this
// beside the block's first item's q reads, before the header. Needs of w only b and kvh.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void prefetch_tree_node_rows(const MmhaParams& p, const WorkItem& w, int tid, int nthreads) {
  constexpr int64_t kLine = 128;                   // bytes
  constexpr int64_t kRow = sizeof(T) * HEAD_DIM;  // bytes a row
  constexpr int kTouch = static_cast<int>(kRow / kLine) + 1;  // lines a row may span
  const char* qkv = static_cast<const char*>(p.qkv);
#pragma unroll 1
  for (int i = tid; i < p.tree.nodes * 2 * kTouch; i += nthreads) {
    const int t = i / (2 * kTouch);
    const int kv = i / kTouch % 2;  // 0: the k row, 1: the v row
    const int64_t row = static_cast<int64_t>(w.b) * p.tree.nodes + t;
    const int64_t at = row * p.qkv_row_stride + (p.num_heads + kv * p.num_kv_heads + w.kvh) * HEAD_DIM;
    prefetch_l1(qkv + at * static_cast<int64_t>(sizeof(T)) + min((i % kTouch) * kLine, kRow - 1));
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
// from the slot (its nodes' K/V: build_tree_nodes); q_biased_ready: s_q holds its biased q
// already (fused_query_biased before the header).
template <typename T, typename C, int HEAD_DIM, int QB, bool FUSED = false, typename Sync>
__device__ __forceinline__ void load_query_and_new_token(const MmhaParams& p, const WorkItem& w, const T* q_rows,
                                                         const TokenRows<T>& rows, float k_scale, float v_scale,
                                                         float (&s_q)[QB][HEAD_DIM + kQRowPad],
                                                         C (&s_new_k)[HEAD_DIM], C (&s_new_v)[HEAD_DIM],
                                                         float* s_new_scales, int tid, int nthreads, Sync sync,
                                                         TreeNodes<C, HEAD_DIM>* tn = nullptr, int slot = 0,
                                                         Int4Token<T, HEAD_DIM>* tok4 = nullptr,
                                                         bool q_biased_ready = false) {
  const T* bias = static_cast<const T*>(p.qkv_bias);
  const int rpos = p.rows.positions != nullptr ? __ldg(p.rows.positions + w.b) : w.pos;  // rotary position (one-token steps)
  const RotaryParams rot = for_length(p.rotary, rpos + 1);  // tree steps take one table (host-checked)
#if MMHA_LEAN_KERNELS
  const QKNormParams qn{};  // lean kernels: no norms (lean_kernels.h)
#else
  const QKNormParams& qn = p.qk_norm;
#endif
  const T* k_bias = bias ? bias + (p.num_heads + w.kvh) * HEAD_DIM : nullptr;
  // Column g's raw q and its bias (a one-token step's from q_rows, a tree step's from its node's row).
  const auto q_of = [&](int g, const T*& q_bias) -> const T* {
    if (!tree_step<FUSED>(p)) {
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
      } else if (g == QB && w.owner() && !FUSED && qn.k_weight != nullptr) {
        inv = head_inv_rms<T, HEAD_DIM>(rows.k, k_bias, qn.eps, lane);
      }
      if (lane == 0) s_inv[g] = inv;
    }
    sync();
  }
  const auto q_norm = [&](int g) {
    return qn.q_weight != nullptr ? HeadNorm{qn.q_weight, s_inv[g], qn.cast_first} : HeadNorm{};
  };
  if (!tree_step<FUSED>(p)) {
    for (int idx = tid; idx < QB * HEAD_DIM; idx += nthreads) {
      const int g = idx / HEAD_DIM;
      const int d = idx % HEAD_DIM;
      s_q[g][d] = g < w.nh ? rotated(q_rows + g * HEAD_DIM, bias ? bias + (w.h0 + g) * HEAD_DIM : nullptr,
                                              d, rpos, rot, q_norm(g))
                           : 0.f;
    }
  } else if constexpr (FUSED) {
    // A fused tree step: the same values in two passes. The twin stages no rows, and one pair at
    // a time was a chain of dependent loads before the item's first tile: first the biased q
    // (fused_query_biased, done before the header for the block's first item: q_biased_ready),
    // then a thread per (column, pair) rotates them in s_q.
    constexpr int PAIRS = HEAD_DIM / 2;
    if (!q_biased_ready) fused_query_biased<T, HEAD_DIM, QB>(p, w, s_q, tid, nthreads);
    sync();
#pragma unroll 1
    for (int idx = tid; idx < w.nh * PAIRS; idx += nthreads) {
      const int g = idx / PAIRS;
      const RotaryPair rp = rotary_pair(idx % PAIRS, p.rotary);
      const Column c = column_of(p, w, g);
      float sn = 0.f, cs = 1.f;
      if (rp.rotated) sincosf(static_cast<float>(query_position<FUSED>(p, w, c, slot_depth)) * rp.inv_freq, &sn, &cs);
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
        if (rp.rotated) sincosf(static_cast<float>(query_position<FUSED>(p, w, c, slot_depth)) * rp.inv_freq, &sn, &cs);
        rotate_pair(global_q<T, HEAD_DIM>(p, c), bias ? bias + c.head * HEAD_DIM : nullptr, rp, sn, cs, x0, x1,
                    q_norm(g));
      }
      s_q[g][rp.d0] = x0;
      s_q[g][rp.d1] = x1;
    }
  }
  if (w.owner() && !FUSED && !kStagedToken<C>) {  // (kStagedToken: the stager builds it, stage_new_token)
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

// kStagedToken: an owner item's new token built by the stager warp from its slot's raw rows
// (k_row, v_row, written by every lane before this) into the block's new-token arrays (new_k,
// new_v, new_scales): k (bias, rotary) and v (bias) as int8 codes with their scales in
// new_scales[0] (k) and [1] (v), the values load_query_and_new_token computes (rotated, biased;
// quantize_new_token_s8's maxima over one warp); then the append (append_new_token with the
// warp's 32 lanes).
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void stage_new_token(const MmhaParams& p, const WorkItem& w, const T* k_row,
                                                const T* v_row, s8* new_k, s8* new_v, float* new_scales, int lane) {
  constexpr int N = (HEAD_DIM + 31) / 32;
  __syncwarp();  // every lane's raw values are in the slot
  const T* bias = static_cast<const T*>(p.qkv_bias);
  const int rpos = p.rows.positions != nullptr ? __ldg(p.rows.positions + w.b) : w.pos;
  const RotaryParams rot = for_length(p.rotary, rpos + 1);
  const T* k_bias = bias ? bias + (p.num_heads + w.kvh) * HEAD_DIM : nullptr;
  const T* v_bias = bias ? bias + (p.num_heads + p.num_kv_heads + w.kvh) * HEAD_DIM : nullptr;
  float kx[N], vx[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int d = lane + 32 * j;
    kx[j] = d < HEAD_DIM ? rotated(k_row, k_bias, d, rpos, rot, HeadNorm{}) : 0.f;
    vx[j] = d < HEAD_DIM ? biased(v_row, v_bias, d) : 0.f;
  }
  float km = 0.f, vm = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    km = absmax_nan(km, fabsf(kx[j]));
    vm = absmax_nan(vm, fabsf(vx[j]));
  }
  warp_absmax_kv(km, vm);
  const float ks = int8_scale(km), vs = int8_scale(vm);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int d = lane + 32 * j;
    if (d < HEAD_DIM) {
      new_k[d] = quantize_s8(kx[j], ks);
      new_v[d] = quantize_s8(vx[j], vs);
    }
  }
  if (lane == 0) {
    new_scales[0] = ks;
    new_scales[1] = vs;
    if (!isfinite(ks) || !isfinite(vs)) atomicOr(p.rows.status + w.b, kStatusScale);
  }
  __syncwarp();
  append_new_token<s8, HEAD_DIM>(p, w, *reinterpret_cast<const s8(*)[HEAD_DIM]>(new_k),
                                 *reinterpret_cast<const s8(*)[HEAD_DIM]>(new_v), lane, 32, new_scales);
}

// A fused tree step's item that holds node slots: those nodes' K/V (the nodes of its keys [start,
// end)) into its node area, as tree_prepare_kernel appends them: bias, k norm (a warp per node,
// then a barrier of the nthreads threads), rotary at pos + depth, rounded or quantised with the
// fp8 scales, a thread per (node, rotation pair); int8 codes and each node's scales
// (quantize_node_s8), a warp per node.
template <typename T, typename C, int HEAD_DIM>
__device__ __forceinline__ void build_tree_nodes(const MmhaParams& p, const WorkItem& w, TreeNodes<C, HEAD_DIM>& tn,
                                              int slot, float k_scale, float v_scale, int tid, int nthreads) {
  const int n0 = max(w.start - w.pos, 0);
  const int n1 = min(w.end - w.pos, w.nodes);
  const T* bias = static_cast<const T*>(p.qkv_bias);
  const T* k_bias = bias ? bias + (p.num_heads + w.kvh) * HEAD_DIM : nullptr;  // the k norm's
#if MMHA_LEAN_KERNELS
  const QKNormParams qn{};  // lean kernels: no norms (lean_kernels.h)
#else
  const QKNormParams& qn = p.qk_norm;
#endif
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
  if constexpr (std::is_same_v<C, s8>) {  // a warp per node, quantised per token as the append's
    float* scales = tn.scales(p.tree.nodes);
    for (int t = n0 + tid / 32; t < n1; t += nthreads / 32) {  // warp-uniform: shuffles
      const HeadNorm k_norm = qn.k_weight != nullptr ? HeadNorm{qn.k_weight, tn.k_inv[t], qn.cast_first} : HeadNorm{};
      s8* k = tn.k(t);
      s8* v = tn.v(t, p.tree.nodes);
      quantize_node_s8<T, HEAD_DIM>(
          p, k_row(t), k_row(t) + p.num_kv_heads * HEAD_DIM, k_bias,
          bias ? bias + (p.num_heads + p.num_kv_heads + w.kvh) * HEAD_DIM : nullptr, k_norm, w.pos + tn.depth[slot][t],
          w.b, tid % 32,
          [&](const RotaryPair& rp, s8 k0, s8 k1, s8 v0, s8 v1) {
            k[rp.d0] = k0, k[rp.d1] = k1;
            v[rp.d0] = v0, v[rp.d1] = v1;
          },
          [&](float ks, float vs) {
            scales[t] = ks;
            scales[p.tree.nodes + t] = vs;
          });
    }
  } else {
    node_pairs<T, HEAD_DIM, kPrefetchNodePairs>(
        p, w.b, w.kvh, n0, n1, tid, nthreads, [&](int t) { return w.pos + tn.depth[slot][t]; },
        [&](int t) { return qn.k_weight != nullptr ? HeadNorm{qn.k_weight, tn.k_inv[t], qn.cast_first} : HeadNorm{}; },
        [&](int t, const RotaryPair& rp, float k0, float k1, float v0, float v1) {
          C* k = tn.k(t);
          C* v = tn.v(t, p.tree.nodes);
          k[rp.d0] = to_cache<C>(k0, k_scale);
          k[rp.d1] = to_cache<C>(k1, k_scale);
          v[rp.d0] = to_cache<C>(v0, v_scale);
          v[rp.d1] = to_cache<C>(v1, v_scale);
        });
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
  if constexpr (std::is_same_v<C, s8>) {  // the nodes' scales beside their codes
    const TokenScales ts = token_scales(p.cache, p.num_kv_heads, w.b, w.kvh);
    const float* scales = tn.scales(p.tree.nodes);
    const int n = s1 - s0;
    for (int idx = tid; idx < 2 * n; idx += nthreads) {
      const int slot = s0 + idx % n;
      const int blk = slots.table != nullptr ? slots.block(slot) : 0;
      (idx < n ? ts.k : ts.v)[ts.at(blk, slot)] = scales[(idx < n ? 0 : p.tree.nodes) + slot - w.pos];
    }
  }
}

}  // namespace mmha
