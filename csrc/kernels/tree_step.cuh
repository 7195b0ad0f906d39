// The first of a tree step's two launches (mmha.tree): the blocks of a (row, kv head) check the
// row's tree, derive each node's root path (a 64-bit mask of nodes) and depth, and append every
// node's K/V (bias, rotary at length + depth, rounded or quantised as the cache stores them) at
// slot length + t. The attention kernel that follows reads all of it from the cache and the
// workspace, so its items never patch a new token into a tile. Torch-free.
//
// A row is refused (nothing written, tree_rows[b] = -1, its status flag raised; the attention
// kernel gives it NaN output) when its node count is outside [1, nodes] or a parent breaks the
// rules (kStatusTree), its slots length .. length + n - 1 leave [0, S_max) (kStatusLength), or a
// paged row's table names a block outside the pool for a slot it attends to or writes (a window's
// start .. length + n - 1; kStatusPages: the attention kernel then reads only blocks this check
// passed).
// An fp8 scale that is not finite and positive writes nothing either; the attention kernel
// refuses the step for it (kStatusScale), as for one-token steps. int8 caches: each node's k and
// v quantised per kv head as a one-token step's new token (append_node_s8); a node with a value
// that is not finite gets that scale and raises kStatusScale (check() raises).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cache_slots.cuh"
#include "mmha_params.h"
#include "new_token.cuh"
#include "lean_kernels.h"
#include "ptx.cuh"
#include "score_mods.cuh"
#include "vec.cuh"

namespace mmha {

constexpr int kTreePrepareThreads = 128;
// Nodes whose K/V one block appends at most (a row's blocks along y each derive the whole tree, and
// each appends ceil(nodes / gridDim.y) of its nodes: tree_nodes_per_block).
constexpr int kTreeNodesPerBlock = 8;
// (node, pair)s a thread of the append reads before it converts any (node_pairs): 2 keeps the
// kernel at 64 registers, 8 blocks an SM (4: 80 registers, 6 blocks an SM, fewer than B=16 T=64's
// 1,024 blocks in one wave).
constexpr int kPrepareNodePairs = 2;
// Blocks of the check-and-append launch resident on an SM (its launch bounds: at most 64 registers
// a thread), so B=16 Hkv=8 T=64's 1,024 blocks run in one wave on 132 SMs (the int8 append took 72
// registers, 7 blocks an SM, two waves).
constexpr int kTreePrepareBlocksPerSm = 8;

// An int8 cache's node: its k (bias, norm, rotary at angle_pos) and v (bias) quantised per kv
// head as a one-token step's new token (quantize_new_token_s8): a warp per node, each lane its
// rotation pairs kept in registers, the absolute maxima by shuffles; each pair's codes go to
// store(rp, k0, k1, v0, v1) and the node's scales (amax / 127) to scales(ks, vs), lane 0's call.
// A scale that is not finite flags the row (kStatusScale).
template <typename T, int HEAD_DIM, class Store, class Scales>
__device__ __forceinline__ void quantize_node_s8(const MmhaParams& p, const T* k_row, const T* v_row, const T* k_bias,
                                                 const T* v_bias, const HeadNorm& k_norm, int angle_pos, int b,
                                                 int lane, Store store, Scales scales) {
  constexpr int PAIRS = HEAD_DIM / 2;
  constexpr int PER_LANE = (PAIRS + 31) / 32;
  float k[PER_LANE][2], v[PER_LANE][2];
  float km = 0.f, vm = 0.f;
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j) {
    const int pair = lane + 32 * j;
    k[j][0] = k[j][1] = v[j][0] = v[j][1] = 0.f;
    if (pair < PAIRS) {
      const RotaryPair rp = rotary_pair(pair, p.rotary);
      float sn = 0.f, cs = 1.f;
      if (rp.rotated) sincosf(static_cast<float>(angle_pos) * rp.inv_freq, &sn, &cs);
      rotate_pair(k_row, k_bias, rp, sn, cs, k[j][0], k[j][1], k_norm);
      v[j][0] = biased(v_row, v_bias, rp.d0);
      v[j][1] = biased(v_row, v_bias, rp.d1);
      km = absmax_nan(km, absmax_nan(fabsf(k[j][0]), fabsf(k[j][1])));
      vm = absmax_nan(vm, absmax_nan(fabsf(v[j][0]), fabsf(v[j][1])));
    }
  }
  warp_absmax_kv(km, vm);
  const float ks = int8_scale(km), vs = int8_scale(vm);
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j) {
    const int pair = lane + 32 * j;
    if (pair < PAIRS) {
      store(rotary_pair(pair, p.rotary), quantize_s8(k[j][0], ks), quantize_s8(k[j][1], ks),
            quantize_s8(v[j][0], vs), quantize_s8(v[j][1], vs));
    }
  }
  if (lane == 0) {
    scales(ks, vs);
    if (!isfinite(ks) || !isfinite(vs)) atomicOr(p.rows.status + b, kStatusScale);
  }
}

// quantize_node_s8 into the cache at slot (a paged row's block checked by the caller).
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void append_node_s8(const MmhaParams& p, const HeadSlots<s8, HEAD_DIM>& hs,
                                               const TokenScales& ts, const T* k_row, const T* v_row,
                                               const T* k_bias, const T* v_bias, const HeadNorm& k_norm, int slot,
                                               int angle_pos, int b, int lane) {
  constexpr int VEC = kVec<s8>;
  const int blk = hs.table != nullptr ? hs.block(slot) : 0;
  quantize_node_s8<T, HEAD_DIM>(
      p, k_row, v_row, k_bias, v_bias, k_norm, angle_pos, b, lane,
      [&](const RotaryPair& rp, s8 k0, s8 k1, s8 v0, s8 v1) {
        hs.k[hs.k_at(blk, slot, rp.d0 / VEC) + rp.d0 % VEC] = k0;
        hs.k[hs.k_at(blk, slot, rp.d1 / VEC) + rp.d1 % VEC] = k1;
        hs.v[hs.v_at(blk, slot) + rp.d0] = v0;
        hs.v[hs.v_at(blk, slot) + rp.d1] = v1;
      },
      [&](float ks, float vs) {
        ts.k[ts.at(blk, slot)] = ks;
        ts.v[ts.at(blk, slot)] = vs;
      });
}

// A small tree derived by one warp of the attention kernel's fused twin (decode_attention.cuh,
// kFusedTrees; no tree_prepare_kernel launch, the workspace's rows, depth and anc unused), lane t
// holding node t (t < kFusedTreeNodes): the checks tree_prepare_kernel makes (node count,
// parents' rules, the slots' range; a paged row's blocks are checked by the items that append),
// then, with `paths`, pointer jumping by shuffles for the lane's node's depth and root path.
// Every lane gets the row's node count and flags (0: accepted); a refused row's depths and paths
// are 0.
struct WarpTree {
  int n;         // the row's node count
  int flags;     // kStatusTree | kStatusLength, or 0
  int depth;     // this lane's node: its depth
  uint64_t anc;  // and its root path (bit j: node j)
};

__device__ __forceinline__ WarpTree derive_tree(const MmhaParams& p, int b, int len, int lane, bool paths) {
  static_assert(kFusedTreeNodes <= 32, "a lane per node");
  const int nodes = p.tree.nodes;
  WarpTree t;
  t.n = p.tree.node_counts != nullptr ? p.tree.node_counts[b] : nodes;
  const int parent = lane < nodes ? p.tree.parents[static_cast<int64_t>(b) * nodes + lane] : -1;
  const bool used = lane < t.n && lane < nodes;
  int flags = 0;
  if (t.n < 1 || t.n > nodes) flags |= kStatusTree;
  if (len < 0 || len > p.cache.max_seq_len - max(t.n, 1)) flags |= kStatusLength;
  if (__any_sync(kFullMask, used && !(parent >= -1 && parent < lane))) flags |= kStatusTree;
  t.flags = flags;
  int jump = used ? parent : -1;
  t.depth = used && parent >= 0 ? 1 : 0;
  t.anc = used ? uint64_t{1} << lane : 0;
  if (paths && flags == 0) {
    // After round r each node has folded in its 2^r nearest ancestors (all lanes read the
    // round's old values: the shuffles are the barrier tree_prepare_kernel's rounds need).
    const int rounds = nodes > 1 ? 32 - __clz(nodes - 1) : 0;
    for (int round = 0; round < rounds; ++round) {
      const int src = jump >= 0 ? jump : lane;
      const int depth = __shfl_sync(kFullMask, t.depth, src);
      const uint64_t anc = __shfl_sync(kFullMask, t.anc, src);
      const int next = __shfl_sync(kFullMask, jump, src);
      if (jump >= 0) {
        t.depth += depth;
        t.anc |= anc;
        jump = next;
      }
    }
  }
  if (flags != 0) t.depth = 0, t.anc = 0;
  return t;
}

// A fused tree step's node area, in dynamic shared memory after the tile loop's stages: each
// node's k norm and, per item slot (the stager's two), the nodes' depths and root paths; then the
// step's `nodes` K rows and V rows as the cache stores them (built by the items that hold their
// slots, patched into their tiles, appended at the item's end), HEAD_DIM elements each; an int8
// cache's nodes then have their K scales and V scales (`nodes` floats each: kScaleFloats a node).
template <typename C, int HEAD_DIM>
struct TreeNodes {
  static constexpr int kScaleFloats = std::is_same_v<C, s8> ? 2 : 0;
  float k_inv[kFusedTreeNodes];
  int depth[2][kFusedTreeNodes];
  uint64_t anc[2][kFusedTreeNodes];

  __device__ __forceinline__ C* k(int t) { return reinterpret_cast<C*>(this + 1) + t * HEAD_DIM; }
  __device__ __forceinline__ C* v(int t, int nodes) { return reinterpret_cast<C*>(this + 1) + (nodes + t) * HEAD_DIM; }
  // int8: node t's K scale at scales(nodes)[t], its V scale at scales(nodes)[nodes + t].
  __device__ __forceinline__ float* scales(int nodes) { return reinterpret_cast<float*>(k(2 * nodes)); }
};
static_assert(sizeof(TreeNodes<float, 64>) % 16 == 0, "the K/V rows start 16-byte aligned");

// Nodes [n0, n1) of row b, kv head kvh, a thread per (node, rotation pair): k after its bias, norm
// (k_norm(t)) and rotary at angle_pos(t), v after its bias, handed to store(t, rp, k0, k1, v0, v1).
// Each thread reads its PER pairs of k and v (and bias) before it converts or rotates any,
// unconditionally (clamped to a pair that exists), so their loads are in flight together.
template <typename T, int HEAD_DIM, int PER, class AnglePos, class KNorm, class Store>
__device__ __forceinline__ void node_pairs(const MmhaParams& p, int b, int kvh, int n0, int n1, int tid,
                                           int nthreads, AnglePos angle_pos, KNorm k_norm, Store store) {
  constexpr int PAIRS = HEAD_DIM / 2;
  const T* bias = static_cast<const T*>(p.qkv_bias);
  const T* k_bias = bias ? bias + (p.num_heads + kvh) * HEAD_DIM : nullptr;
  const T* v_bias = bias ? bias + (p.num_heads + p.num_kv_heads + kvh) * HEAD_DIM : nullptr;
  const auto k_row = [&](int t) {
    return static_cast<const T*>(p.qkv) + (static_cast<int64_t>(b) * p.tree.nodes + t) * p.qkv_row_stride +
           (p.num_heads + kvh) * HEAD_DIM;
  };
#pragma unroll 1
  for (int base = n0 * PAIRS + tid; base < n1 * PAIRS; base += PER * nthreads) {
    RawPair<T> k_in[PER], v_in[PER], kb[PER], vb[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int idx = min(base + j * nthreads, n1 * PAIRS - 1);
      const RotaryPair rp = rotary_pair(idx % PAIRS, p.rotary);
      k_in[j] = RawPair<T>::read(k_row(idx / PAIRS), rp);
      v_in[j] = RawPair<T>::read(k_row(idx / PAIRS) + p.num_kv_heads * HEAD_DIM, rp);
      if (bias) kb[j] = RawPair<T>::read(k_bias, rp), vb[j] = RawPair<T>::read(v_bias, rp);
    }
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int idx = base + j * nthreads;
      if (idx >= n1 * PAIRS) break;
      const int t = idx / PAIRS;
      const RotaryPair rp = rotary_pair(idx % PAIRS, p.rotary);
      float sn = 0.f, cs = 1.f;
      if (rp.rotated) sincosf(static_cast<float>(angle_pos(t)) * rp.inv_freq, &sn, &cs);
      float k0, k1;
      rotate_values<T>(k_in[j].a0(bias, kb[j]), k_in[j].a1(bias, kb[j]), rp, sn, cs, k0, k1, k_norm(t));
      store(t, rp, k0, k1, v_in[j].a0(bias, vb[j]), v_in[j].a1(bias, vb[j]));
    }
  }
}

template <typename T, typename C, int HEAD_DIM>
__global__ void __launch_bounds__(kTreePrepareThreads, kTreePrepareBlocksPerSm)
    tree_prepare_kernel(const __grid_constant__ MmhaParams p) {
  static_assert(!kLeanKernels || sizeof(T) == 0, "the check-and-append launch: not in a lean unit (lean_kernels.h)");
  constexpr int VEC = kVec<C>;
  const int b = blockIdx.x / p.num_kv_heads;
  const int kvh = blockIdx.x - b * p.num_kv_heads;
  const int tid = threadIdx.x;
  const int nodes = p.tree.nodes;
  __shared__ int s_flags;
  __shared__ int s_jump[kMaxTreeNodes];
  __shared__ int s_depth[kMaxTreeNodes];
  __shared__ uint64_t s_anc[kMaxTreeNodes];

  if (!row_takes_part(p.rows, b)) {  // a released row (row_active): nothing read or written
    if (kvh == 0 && blockIdx.y == 0) {
      for (int t = tid; t < nodes; t += kTreePrepareThreads) {
        p.tree.depth[static_cast<int64_t>(b) * nodes + t] = 0;
        p.tree.anc[static_cast<int64_t>(b) * nodes + t] = 0;
      }
      if (tid == 0) p.tree.rows[b] = 0;
    }
    return;
  }
  // Every load that needs nothing else first, together: the row's length and node count, this
  // thread's parent, and (into L1) every line of the k and v rows of the block's nodes and their
  // bias. The check is on the step's critical path (the attention grid waits for its end), so
  // each dependent global round trip shows in the step: the appends below take a block of 8
  // nodes in two rounds (node_pairs' passes of PER x 128 (node, pair)s; int8: a warp a node), and
  // the second round's rows are in L1 by then.
  const int len = p.rows.lengths[b];
  const int n = p.tree.node_counts != nullptr ? p.tree.node_counts[b] : nodes;
  const int parent = tid < nodes ? p.tree.parents[static_cast<int64_t>(b) * nodes + tid] : -1;
  // This block's nodes: [t0, t0 + per_block) of the tree's (at most kTreeNodesPerBlock).
  const int per_block = (nodes + gridDim.y - 1) / gridDim.y;
  const int t0 = blockIdx.y * per_block;
  {
    constexpr int kLines = HEAD_DIM * static_cast<int>(sizeof(T)) / 128 + 1;  // lines a row may span
    constexpr int kStep = 128 / static_cast<int>(sizeof(T));                  // elements a line
    const int count = min(nodes - t0, per_block);
    const T* qkv = static_cast<const T*>(p.qkv);
    for (int i = tid; i < count * 2 * kLines; i += kTreePrepareThreads) {  // (node, k or v, line)
      const int half = i / kLines % 2;
      const T* row = qkv + (static_cast<int64_t>(b) * nodes + t0 + i / (2 * kLines)) * p.qkv_row_stride;
      prefetch_l1(row + (p.num_heads + half * p.num_kv_heads + kvh) * HEAD_DIM + min(i % kLines * kStep, HEAD_DIM - 1));
    }
    if (p.qkv_bias != nullptr && tid < 2 * kLines) {
      const T* bias = static_cast<const T*>(p.qkv_bias);
      prefetch_l1(bias + (p.num_heads + tid / kLines * p.num_kv_heads + kvh) * HEAD_DIM +
                  min(tid % kLines * kStep, HEAD_DIM - 1));
    }
  }
  if (tid == 0) {
    int flags = 0;
    if (n < 1 || n > nodes) flags |= kStatusTree;
    if (len < 0 || len > p.cache.max_seq_len - max(n, 1)) flags |= kStatusLength;
    s_flags = flags;
  }
  __syncthreads();
  if (paged(p.cache) && n >= 1 && n <= nodes && len >= 0 && len <= p.cache.max_seq_len - n) {
    const HeadSlots<C, HEAD_DIM> hs = head_slots<C, HEAD_DIM>(p.cache, p.num_kv_heads, b, kvh);
    if (!blocks_ok(p.cache, hs, window_start(p.mods, len), len + n - 1, tid, kTreePrepareThreads)) {
      atomicOr(&s_flags, kStatusPages);
    }
  }
  if (tid < nodes) {
    const bool used = tid < n;
    if (used && !(parent >= -1 && parent < tid)) atomicOr(&s_flags, kStatusTree);
    s_jump[tid] = used ? parent : -1;
    s_depth[tid] = used && parent >= 0 ? 1 : 0;
    s_anc[tid] = used ? uint64_t{1} << tid : 0;
  }
  __syncthreads();
  const bool ok = s_flags == 0;
  // Pointer jumping: after round r each node has folded in its 2^r nearest ancestors; a path
  // has at most nodes - 1 of them.
  if (ok) {
    const int rounds = nodes > 1 ? 32 - __clz(nodes - 1) : 0;
    for (int round = 0; round < rounds; ++round) {
      int jump = -1, depth = 0;
      uint64_t anc = 0;
      if (tid < nodes) {
        jump = s_jump[tid];
        depth = s_depth[tid];
        anc = s_anc[tid];
        if (jump >= 0) {
          depth += s_depth[jump];
          anc |= s_anc[jump];
          jump = s_jump[jump];
        }
      }
      __syncthreads();
      if (tid < nodes) {
        s_jump[tid] = jump;
        s_depth[tid] = depth;
        s_anc[tid] = anc;
      }
      __syncthreads();
    }
  }
  if (kvh == 0 && blockIdx.y == 0) {
    const int64_t row = static_cast<int64_t>(b) * nodes;
    for (int t = tid; t < nodes; t += kTreePrepareThreads) {
      p.tree.depth[row + t] = ok ? s_depth[t] : 0;
      p.tree.anc[row + t] = ok ? s_anc[t] : 0;
    }
    if (tid == 0) {
      p.tree.rows[b] = ok ? n : -1;
      if (!ok) atomicOr(p.rows.status + b, s_flags);
    }
  }
  if (!ok) return;
  float k_scale = 1.f, v_scale = 1.f;
  if constexpr (std::is_same_v<C, e4m3>) {
    for (int h = 0; h < p.num_kv_heads; ++h) {
      if (!scale_ok(p.cache.k_scale[h]) || !scale_ok(p.cache.v_scale[h])) return;
    }
    k_scale = p.cache.k_scale[kvh];
    v_scale = p.cache.v_scale[kvh];
  }

  // Append: node t's K/V at slot len + t, its k normed (if so) and rotated at len + depth(t).
  const T* bias = static_cast<const T*>(p.qkv_bias);
  const T* k_bias = bias ? bias + (p.num_heads + kvh) * HEAD_DIM : nullptr;
  const T* v_bias = bias ? bias + (p.num_heads + p.num_kv_heads + kvh) * HEAD_DIM : nullptr;
  const HeadSlots<C, HEAD_DIM> hs = head_slots<C, HEAD_DIM>(p.cache, p.num_kv_heads, b, kvh);
  // This block's nodes [t0, t1) of the row's n, a thread per (node, rotation pair): one angle for
  // both dims (node_pairs; int8 caches: a warp per node, append_node_s8).
  const int t1 = min(n, t0 + per_block);
  // A k norm: each node's rsqrt(mean(k^2) + eps), a warp per node.
  __shared__ float s_k_inv[kTreeNodesPerBlock];
  const QKNormParams& qn = p.qk_norm;
  if (qn.k_weight != nullptr) {
    // Every line of the block's k rows (and their bias and the weights) requested at once: the
    // warps' norms below then wait for one round trip, not one a node.
    constexpr int kTouch = HEAD_DIM * static_cast<int>(sizeof(T)) / 128 + 1;  // lines a row may span
    constexpr int kStep = 128 / static_cast<int>(sizeof(T));                    // elements a line
    for (int i = tid; i < (t1 - t0) * kTouch; i += kTreePrepareThreads) {
      const int d = min(i % kTouch * kStep, HEAD_DIM - 1);
      prefetch_l1(static_cast<const T*>(p.qkv) + (static_cast<int64_t>(b) * nodes + t0 + i / kTouch) * p.qkv_row_stride +
                  (p.num_heads + kvh) * HEAD_DIM + d);
    }
    if (tid < HEAD_DIM / 32 + 1) {
      prefetch_l1(qn.k_weight + min(32 * tid, HEAD_DIM - 1));
      if (k_bias != nullptr) prefetch_l1(k_bias + min(tid * kStep, HEAD_DIM - 1));
    }
    for (int t = t0 + tid / 32; t < t1; t += kTreePrepareThreads / 32) {  // warp-uniform
      const T* k_row = static_cast<const T*>(p.qkv) + (static_cast<int64_t>(b) * nodes + t) * p.qkv_row_stride +
                       (p.num_heads + kvh) * HEAD_DIM;
      const float inv = head_inv_rms<T, HEAD_DIM>(k_row, k_bias, qn.eps, tid % 32);
      if (tid % 32 == 0) s_k_inv[t - t0] = inv;
    }
    __syncthreads();
  }
  if constexpr (std::is_same_v<C, s8>) {
    const TokenScales ts = token_scales(p.cache, p.num_kv_heads, b, kvh);
    for (int t = t0 + tid / 32; t < t1; t += kTreePrepareThreads / 32) {  // warp-uniform
      const T* row = static_cast<const T*>(p.qkv) + (static_cast<int64_t>(b) * nodes + t) * p.qkv_row_stride;
      const HeadNorm k_norm =
          qn.k_weight != nullptr ? HeadNorm{qn.k_weight, s_k_inv[t - t0], qn.cast_first} : HeadNorm{};
      append_node_s8<T, HEAD_DIM>(p, hs, ts, row + (p.num_heads + kvh) * HEAD_DIM,
                                  row + (p.num_heads + p.num_kv_heads + kvh) * HEAD_DIM, k_bias, v_bias, k_norm,
                                  len + t, len + s_depth[t], b, tid % 32);
    }
  } else {
    node_pairs<T, HEAD_DIM, kPrepareNodePairs>(
        p, b, kvh, t0, t1, tid, kTreePrepareThreads, [&](int t) { return len + s_depth[t]; },
        [&](int t) { return qn.k_weight != nullptr ? HeadNorm{qn.k_weight, s_k_inv[t - t0], qn.cast_first} : HeadNorm{}; },
        [&](int t, const RotaryPair& rp, float k0, float k1, float v0, float v1) {
          const int slot = len + t;
          const int blk = hs.table != nullptr ? hs.block(slot) : 0;  // checked above
          hs.k[hs.k_at(blk, slot, rp.d0 / VEC) + rp.d0 % VEC] = to_cache<C>(k0, k_scale);
          hs.k[hs.k_at(blk, slot, rp.d1 / VEC) + rp.d1 % VEC] = to_cache<C>(k1, k_scale);
          hs.v[hs.v_at(blk, slot) + rp.d0] = to_cache<C>(v0, v_scale);
          hs.v[hs.v_at(blk, slot) + rp.d1] = to_cache<C>(v1, v_scale);
        });
  }
  // The attention grid may launch once every block got here or returned; it still waits for this
  // grid's end (grid_dependency_wait) before it reads. Triggered at the start instead, its blocks
  // took their slots while these were resident: B=16 T=4 at 16K ran 1.25x slower on the H100.
  allow_dependent_launch();
}

// Nodes a block of the check-and-append launch appends: kTreeNodesPerBlock, or on grids of
// fewer blocks than SMs (B=1, a few kv heads) the fewest of 2 and 4 that keep it so, so that each
// block appends its nodes in one round (node_pairs' first pass; int8: a warp a node) while every
// block runs at once on its own SM.
inline int tree_nodes_per_block(int64_t row_heads, int nodes, int sms) {
  for (int per = 2; per < kTreeNodesPerBlock; per *= 2) {
    if (row_heads * ((nodes + per - 1) / per) <= sms) return per;
  }
  return kTreeNodesPerBlock;
}

// Launches the tree's check and append (per row and kv head, a block per tree_nodes_per_block
// nodes) on the step's stream.
template <typename T, typename C, int HEAD_DIM>
cudaError_t launch_tree_prepare(const MmhaParams& p, cudaStream_t stream) {
  const int64_t blocks = static_cast<int64_t>(p.rows.batch) * p.num_kv_heads;
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const int per = tree_nodes_per_block(blocks, p.tree.nodes, sms);
  const dim3 grid(static_cast<unsigned>(blocks), (p.tree.nodes + per - 1) / per);
  tree_prepare_kernel<T, C, HEAD_DIM><<<grid, kTreePrepareThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mmha
