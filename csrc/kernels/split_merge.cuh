// The split merge: the partials of a (row, kv head, column block)'s splits, each a max, a sum and
// an accumulator rescaled to that max (store_value writes them to global memory), become out and
// lse. The last item of the column block to finish merges them, in split order (bit-identical
// run to run). Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attend_common.cuh"
#include "mmha_params.h"
#include "output_epilogue.cuh"
#include "ptx.cuh"
#include "score_mods.cuh"
#include "timeline.cuh"
#include "work_items.cuh"

namespace mmha {

// Where the splits' partials lie in p.sched.partials: split s of flat head h (query row x Hq + head) at
// slot h * num_splits + s; its accumulator at acc + slot * HEAD_DIM (every row 16-byte aligned
// for the merge's vector loads), its (max, sum) at ml + slot, past all the accumulators.
// store_value writes them, the merges read them.
template <int HEAD_DIM>
struct SplitPartials {
  float* acc;
  float2* ml;

  __device__ __forceinline__ explicit SplitPartials(const MmhaParams& p)
      : acc(p.sched.partials),
        ml(reinterpret_cast<float2*>(p.sched.partials + static_cast<int64_t>(p.rows.batch) * p.tree.nodes * p.num_heads *
                                                      p.sched.num_splits * HEAD_DIM)) {}
};

// The merge of a one-column item: a thread per 4 dims loads its splits' (max, sum) and values
// together, 8 splits a batch (those past the active splits predicated off), and sums them
// online: one L2 round trip for up to 8 splits and no barrier, where the weights first leave
// three warps idle and take a round trip of their own (H100, decode timing: B=1 Hkv=32 S=4K
// 29.92 -> 29.50 us, at D=64 19.12 -> 18.50). With several columns the weights first do better
// (B=1 Hkv=8 S=4K, 16 splits: 13.64 us against 14.06 online 16 a batch, 14.13 8 a batch).
constexpr int kOnlineBatch = 8;

template <typename T, int HEAD_DIM, bool EPI>
__device__ __forceinline__ void merge_online(const MmhaParams& p, const WorkItem& w, float value_scale, int tid,
                                             int nthreads) {
  const int num_splits = p.sched.num_splits;
  const SplitPartials<HEAD_DIM> part(p);
  constexpr int C4 = HEAD_DIM / 4;
  for (int idx = tid; idx < w.nh * C4; idx += nthreads) {
    const Column col = column_of(p, w, idx / C4);
    if (col.node >= w.nodes) continue;
    const int64_t h = col.flat(p.num_heads);
    const float4* acc = reinterpret_cast<const float4*>(part.acc + h * num_splits * HEAD_DIM) + idx % C4;
    const float2* ml = part.ml + h * num_splits;
    float mx = sink_log2(p.mods, col.head);  // the head's sink joins the max and the sum once
    float sum = mx == -INFINITY ? 0.f : 1.f;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < w.active; s += kOnlineBatch) {
      float2 ms[kOnlineBatch];
      float4 v[kOnlineBatch];
#pragma unroll
      for (int u = 0; u < kOnlineBatch; ++u) {
        const bool on = s + u < w.active;
        ms[u] = on ? __ldcg(ml + s + u) : make_float2(-INFINITY, 0.f);
        v[u] = on ? __ldcg(acc + (s + u) * C4) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      float top = mx;
#pragma unroll
      for (int u = 0; u < kOnlineBatch; ++u) top = fmaxf(top, ms[u].x);
      const float m_ref = top == -INFINITY ? 0.f : top;
      const float r = exp2f(mx - m_ref);  // what the batches before summed, to the new max
      sum *= r;
      a = make_float4(a.x * r, a.y * r, a.z * r, a.w * r);
#pragma unroll
      for (int u = 0; u < kOnlineBatch; ++u) {
        const float e = exp2f(ms[u].x - m_ref);
        sum += ms[u].y * e;
        a.x += e * v[u].x;
        a.y += e * v[u].y;
        a.z += e * v[u].z;
        a.w += e * v[u].w;
      }
      mx = top;
    }
    if (idx % C4 == 0) p.output.lse[h] = (mx + log2f(sum)) * kLn2;
    store_out4<T, EPI>(p.output, h * HEAD_DIM + 4 * (idx % C4), col.head * HEAD_DIM + 4 * (idx % C4),
                       make_float4(a.x / sum * value_scale, a.y / sum * value_scale, a.z / sum * value_scale,
                                   a.w / sum * value_scale));
  }
}

// The merge of a wide item (kWideColumns columns, tree steps): a thread per (column, kWideChunks
// float4 chunks), online over the splits like merge_online, kWideBatch splits' (max, sum) and values
// loaded together, so a round of nthreads / (C4 / kWideChunks) columns costs one L2 round trip per
// kWideBatch splits: 8 for 64 columns of head dim 128 on 128 threads at up to 4 splits, where the
// weights-first merge took 24 (a round per 8 columns' weights, then one per (column, chunk) round of
// the values; B=1 T=64 1K: 15.8 us on the merging block's timeline). Four chunks a thread (4 round
// trips) spilled the wide kernels' tile loop (their O stays live across the merge unless cleared:
// WideConsumer::clear_acc) and cost rows that never merge 6-7 % (docs/data/ab_wide_merge_forms_h200.md).
// Kept apart from merge_online: one template for both moved the one-token kernels' merge code
// and put spills back into the wide kernels' tile loop (fp16 TMA kernel 0 -> 21 spill instructions).
constexpr int kWideChunks = 2;
constexpr int kWideBatch = 4;

template <typename T, int HEAD_DIM>
__device__ __forceinline__ void merge_wide(const MmhaParams& p, const WorkItem& w, float value_scale, int tid,
                                           int nthreads) {
  constexpr int C4 = HEAD_DIM / 4;
  static_assert(C4 % kWideChunks == 0, "whole chunk groups per column");
  constexpr int TPC = C4 / kWideChunks;  // threads per column
  const int num_splits = p.sched.num_splits;
  const SplitPartials<HEAD_DIM> part(p);
  const int per_round = nthreads / TPC;
  const int sub = tid % TPC;
  for (int g = tid / TPC; g < w.nh; g += per_round) {
    const Column col = column_of(p, w, g);
    if (col.node >= w.nodes) continue;
    const int64_t h = col.flat(p.num_heads);
    const float4* acc = reinterpret_cast<const float4*>(part.acc + h * num_splits * HEAD_DIM) + sub;
    const float2* ml = part.ml + h * num_splits;
    float mx = sink_log2(p.mods, col.head);  // the head's sink joins the max and the sum once
    float sum = mx == -INFINITY ? 0.f : 1.f;
    float4 a[kWideChunks];
#pragma unroll
    for (int j = 0; j < kWideChunks; ++j) a[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < w.active; s += kWideBatch) {
      float2 ms[kWideBatch];
      float4 v[kWideBatch][kWideChunks];
#pragma unroll
      for (int u = 0; u < kWideBatch; ++u) {
        const bool on = s + u < w.active;
        ms[u] = on ? __ldcg(ml + s + u) : make_float2(-INFINITY, 0.f);
#pragma unroll
        for (int j = 0; j < kWideChunks; ++j) {
          v[u][j] = on ? __ldcg(acc + (s + u) * C4 + TPC * j) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
      float top = mx;
#pragma unroll
      for (int u = 0; u < kWideBatch; ++u) top = fmaxf(top, ms[u].x);
      const float m_ref = top == -INFINITY ? 0.f : top;
      const float r = exp2f(mx - m_ref);  // what the batches before summed, to the new max
      sum *= r;
#pragma unroll
      for (int j = 0; j < kWideChunks; ++j) a[j] = make_float4(a[j].x * r, a[j].y * r, a[j].z * r, a[j].w * r);
#pragma unroll
      for (int u = 0; u < kWideBatch; ++u) {
        const float e = exp2f(ms[u].x - m_ref);
        sum += ms[u].y * e;
#pragma unroll
        for (int j = 0; j < kWideChunks; ++j) {
          a[j].x += e * v[u][j].x;
          a[j].y += e * v[u][j].y;
          a[j].z += e * v[u][j].z;
          a[j].w += e * v[u][j].w;
        }
      }
      mx = top;
    }
    if (sub == 0) p.output.lse[h] = (mx + log2f(sum)) * kLn2;
    const float k = value_scale / sum;
#pragma unroll
    for (int j = 0; j < kWideChunks; ++j) {
      const int d = 4 * (sub + TPC * j);
      store_out4<T, false>(p.output, h * HEAD_DIM + d, col.head * HEAD_DIM + d,
                           make_float4(a[j].x * k, a[j].y * k, a[j].z * k, a[j].w * k));
    }
  }
}

// Split sequence: the item that makes the count of this (row, column block) reach the row's
// active splits merges every split's partial. `sync` is a barrier of the nthreads taking part.
// The count is one release-acquire atomic of thread 0 after the barrier (cumulative over the
// block's partial stores that the barrier ordered before it), not a fence per thread and a
// relaxed atomic (H100, decode timing: B=1 Hq=Hkv=32 S=1K 13.31 -> 12.77 us).
// One-column items: merge_online. Several columns: weights exp2(m_s - M) / sum first, one warp
// per column, lanes over splits, the head's sink (if any) joining the sum once; then a thread per
// (column, 4 dims), its loads of up to 16 splits issued together, those past the active splits
// predicated off (a loop of dependent L2 round trips cost ~0.3 us per split; batches of 8 left
// 16 splits two round trips). Columns of tree nodes the row does not use were written by
// store_item.
constexpr int kMergeBatch = 16;  // value loads in flight per merging thread

// Merges a lean kernel's consumers put off until their block's last item is done (lean_kernels.h:
// the lean units' several-column kernels of head dim >= kMaxSplits): after the loop its registers
// are free, so a thread's kMergeBatch value loads are all in flight, where inside the loop the
// register cap left a rolling window of about three (SASS, fp16 head dim 128). The same merge
// (merge_weights_first) either way: the same bits. Past kPendingMerges a block merges at once.
constexpr int kPendingMerges = 4;
struct PendingMerges {
  struct Item {
    int index;  // the item's number (work_item_head)
    int nodes, active;
    float value_scale;
  };
  Item item[kPendingMerges];
  int n;
  template <int QB>
  __device__ __forceinline__ WorkItem work(const MmhaParams& p, int i) const {
    WorkItem w = work_item_head<QB>(p, item[i].index);
    w.nodes = item[i].nodes;
    w.active = item[i].active;
    return w;
  }
};

// The merge of a several-column item's splits (merge_if_last): the weights, then the values.
template <typename T, int HEAD_DIM, int QB, bool EPI, class Sync>
__device__ __forceinline__ void merge_weights_first(const MmhaParams& p, const WorkItem& w,
                                                    float (*s_w)[kMaxSplits], float value_scale, int tid,
                                                    int nthreads, Sync sync, bool stamp = false) {
  const int num_splits = p.sched.num_splits;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const SplitPartials<HEAD_DIM> part(p);
  constexpr int C4 = HEAD_DIM / 4;
  const auto acc4 = [&](int64_t h, int c, int s) {
    return __ldcg(reinterpret_cast<const float4*>(part.acc + (h * num_splits + s) * HEAD_DIM) + c);
  };
  // The weights: LANES lanes per column (half a warp where a block's warps would otherwise take
  // two rounds of L2 loads for 8 columns), each lane PER splits.
  constexpr int LANES = QB >= 8 ? 16 : 32;
  constexpr int PER = kMaxSplits / LANES;
  constexpr int COLS = 32 / LANES;  // columns per warp and round
  const int sub = lane / LANES;
  const int sl = lane % LANES;
  const int warps = nthreads / 32;
  for (int g0 = COLS * warp; g0 < w.nh; g0 += COLS * warps) {
    const int g = g0 + sub;
    const Column col = column_of(p, w, g < w.nh ? g : g0);
    const bool used = g < w.nh && col.node < w.nodes;  // lanes of a column the row does not use still shuffle
    const int64_t h = col.flat(p.num_heads);
    const float2* ml = part.ml + h * num_splits;
    float ms[PER], ls[PER];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int s = sl + LANES * i;
      const float2 v = used && s < w.active ? __ldcg(ml + s) : make_float2(-INFINITY, 0.f);
      ms[i] = v.x;
      ls[i] = v.y;
      mx = fmaxf(mx, ms[i]);
    }
#pragma unroll
    for (int off = 1; off < LANES; off *= 2) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, off));
    const float sink = sink_log2(p.mods, col.head);
    mx = fmaxf(mx, sink);
    const float m_ref = mx == -INFINITY ? 0.f : mx;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      ms[i] = exp2f(ms[i] - m_ref);
      sum += ls[i] * ms[i];
    }
#pragma unroll
    for (int off = 1; off < LANES; off *= 2) sum += __shfl_xor_sync(kFullMask, sum, off);
    if (p.mods.sinks != nullptr) sum += exp2f(sink - m_ref);
    if (!used) continue;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int s = sl + LANES * i;
      if (s < w.active) s_w[g][s] = ms[i] / sum;
    }
    if (sl == 0) p.output.lse[h] = (mx + log2f(sum)) * kLn2;
  }
  sync();
  if (stamp && tid == 0) timeline_mark(p, kTlWeighed);
  for (int idx = tid; idx < w.nh * C4; idx += nthreads) {
    const int g = idx / C4;
    const int c = idx % C4;
    const Column col = column_of(p, w, g);
    if (col.node >= w.nodes) continue;
    const int64_t h = col.flat(p.num_heads);
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < w.active; s += kMergeBatch) {
      float4 v[kMergeBatch];
#pragma unroll
      for (int u = 0; u < kMergeBatch; ++u) {
        v[u] = s + u < w.active ? acc4(h, c, s + u) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kMergeBatch; ++u) {
        const float wt = s + u < w.active ? s_w[g][s + u] : 0.f;
        a.x = __fmaf_rn(wt, v[u].x, a.x);  // explicit: the same bits in and after the loop
        a.y = __fmaf_rn(wt, v[u].y, a.y);
        a.z = __fmaf_rn(wt, v[u].z, a.z);
        a.w = __fmaf_rn(wt, v[u].w, a.w);
      }
    }
    if (stamp && idx == 0) timeline_mark(p, kTlSummed);
    store_out4<T, EPI>(p.output, h * HEAD_DIM + 4 * c, col.head * HEAD_DIM + 4 * c,
                       make_float4(a.x * value_scale, a.y * value_scale, a.z * value_scale, a.w * value_scale));
  }
}

// defer: a lean kernel's list of merges put off (PendingMerges), or nullptr (merge now).
template <typename T, int HEAD_DIM, int QB, bool EPI, class Sync>
__device__ __forceinline__ void merge_if_last(const MmhaParams& p, const WorkItem& w, float (*s_w)[kMaxSplits],
                                              bool& s_last, float value_scale, int tid, int nthreads, Sync sync,
                                              bool stamp = false, PendingMerges* defer = nullptr) {
  sync();  // every thread's partial stores are issued
  if (tid == 0) {
    int32_t* counter = p.sched.counters + (static_cast<int64_t>(w.b) * p.num_kv_heads + w.kvh) * p.sched.q_groups + w.qg;
    const int arrived = atomic_add_acq_rel_gpu(counter, 1);
    s_last = arrived == w.active - 1;
    if (s_last) *counter = 0;  // every active split has arrived: ready for the next launch
    if (stamp) timeline_mark(p, kTlCounted);
    if (s_last && defer != nullptr && defer->n < kPendingMerges) {  // merged after the block's last item
      const int index = ((w.b * p.num_kv_heads + w.kvh) * p.sched.q_groups + w.qg) * p.sched.num_splits + w.split;
      defer->item[defer->n++] = {index, w.nodes, w.active, value_scale};
      s_last = false;
    }
  }
  sync();
  if (!s_last) return;
  if constexpr (QB == 1) {
    merge_online<T, HEAD_DIM, EPI>(p, w, value_scale, tid, nthreads);
  } else if constexpr (QB == kWideColumns && !EPI) {
    merge_wide<T, HEAD_DIM>(p, w, value_scale, tid, nthreads);
  } else {
    merge_weights_first<T, HEAD_DIM, QB, EPI>(p, w, s_w, value_scale, tid, nthreads, sync, stamp);
  }
}

// The merges a block put off (merge_if_last's defer), after its last item; `sync` a barrier of the
// nthreads (the list was written before one).
template <typename T, int HEAD_DIM, int QB, bool EPI, class Sync>
__device__ __forceinline__ void merge_pending(const MmhaParams& p, const PendingMerges& pending,
                                              float (*s_w)[kMaxSplits], int tid, int nthreads, Sync sync) {
  const int n = pending.n;
  for (int i = 0; i < n; ++i) {
    if (i > 0) sync();  // the weights of the merge before are read
    merge_weights_first<T, HEAD_DIM, QB, EPI>(p, pending.work<QB>(p, i), s_w, pending.item[i].value_scale, tid,
                                              nthreads, sync);
  }
}

}  // namespace mmha
