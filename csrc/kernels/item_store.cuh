// An item's results: its output (single pass, through the epilogue or plain) or its split's
// partials, from the block combine's numbers; refused and idle rows' outputs. Torch-free.
#pragma once

#include <cuda_runtime.h>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "attend_common.cuh"
#include "decode_traits.cuh"
#include "mmha_params.h"
#include "output_epilogue.cuh"
#include "score_mods.cuh"
#include "split_merge.cuh"
#include "work_items.cuh"

namespace mmha {

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

// Head g's values at dims d to d + 3 (d % 4 == 0): acc4's one read where the caller gives it, else
// acc's four.
template <class Acc, class Acc4>
__device__ __forceinline__ float4 four_values(Acc acc, Acc4 acc4, int g, int d) {
  if constexpr (std::is_same_v<Acc4, std::nullptr_t>) {
    return make_float4(acc(g, d), acc(g, d + 1), acc(g, d + 2), acc(g, d + 3));
  } else {
    return acc4(g, d);
  }
}

// PRE_N > 0 (one-column items through the epilogue): pre holds each value's channel values. acc4
// (optional) gives acc's values four at a time where four values go to one store.
template <typename T, int HEAD_DIM, bool EPI, bool VEC = false, int PRE_N = 0, class Max, class Sum, class Acc,
          class Acc4 = std::nullptr_t>
__device__ __forceinline__ void store_item(const MmhaParams& p, const WorkItem& w, Max m, Sum l, Acc acc,
                                           float value_scale, int tid, int nthreads,
                                           const ItemChannels<PRE_N, HEAD_DIM>* pre = nullptr,
                                           Acc4 acc4 = nullptr) {
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
      *reinterpret_cast<float4*>(part.acc + slot * HEAD_DIM + d) = four_values(acc, acc4, g, d);
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
        const float4 a = four_values(acc, acc4, g, d);
        x = make_float4(a.x * f / sum * value_scale, a.y * f / sum * value_scale, a.z * f / sum * value_scale,
                        a.w * f / sum * value_scale);
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
    const float f = exp2f(s_m[wp][g] - m_ref);
    a = wp == 0 ? acc_w[wp][g][d] * f : __fmaf_rn(acc_w[wp][g][d], f, a);
  }
  return a;
}

template <int WARPS, int QB>
__device__ __forceinline__ float warps_sum(const float (*s_m)[QB], const float (*s_l)[QB], int g) {
  const float mb = warps_max<WARPS, QB>(s_m, g);
  const float m_ref = mb == -INFINITY ? 0.f : mb;
  float sum = 0.f;
#pragma unroll
  for (int wp = 0; wp < WARPS; ++wp) sum = __fmaf_rn(s_l[wp][g], exp2f(s_m[wp][g] - m_ref), sum);
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
    sum = __fmaf_rn(s_l[wp][g], f, sum);
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
    a = wp == 0 ? acc_w[wp][g][d] * s_f[wp][g] : __fmaf_rn(acc_w[wp][g][d], s_f[wp][g], a);
  }
  return a;
}

// folded_acc at dims d to d + 3 (d % 4 == 0), one 16-byte read a warp's buffer: a warp's lanes on
// consecutive fours read 512 contiguous bytes (four wavefronts) where four 4-byte reads at a
// 16-byte stride took four each. The same operations in the same order.
template <int WARPS, int QB, int HEAD_DIM>
__device__ __forceinline__ float4 folded_acc4(const float (*s_f)[QB], const float (*acc_w)[QB][HEAD_DIM], int g,
                                              int d) {
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int wp = 0; wp < WARPS; ++wp) {
    const float4 v = *reinterpret_cast<const float4*>(&acc_w[wp][g][d]);
    const float f = s_f[wp][g];
    if (wp == 0) {
      a = make_float4(v.x * f, v.y * f, v.z * f, v.w * f);
    } else {
      a = make_float4(__fmaf_rn(v.x, f, a.x), __fmaf_rn(v.y, f, a.y), __fmaf_rn(v.z, f, a.z), __fmaf_rn(v.w, f, a.w));
    }
  }
  return a;
}

}  // namespace mmha
