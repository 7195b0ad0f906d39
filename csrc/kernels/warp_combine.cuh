// What the narrow consumers (TileConsumer, attend_tiles.cuh, and Int4Consumer, attend_int4.cuh)
// share: the online softmax's raise of the running max (its statistics also the wide items'), and
// the block combine. Each lane holds the running max and sum of heads 2tq, 2tq + 1
// (m, l) and its part of O^T (acc[KSTEPS][4]: M tile i's rows g and g + 8 stand for head dims
// out_dim(i, g, 0) and out_dim(i, g, 1), as the consumer's operand reader orders them). Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "attend_common.cuh"
#include "ptx.cuh"

namespace mmha {

// x's largest value over the lanes whose indices differ from this one's only in bits FIRST ..
// LAST (powers of two): a column's lanes in the narrow consumers' layout (4 .. 16), a quad's
// (1 .. 2), the warp's (1 .. 16).
template <int FIRST, int LAST>
__device__ __forceinline__ float lanes_max(float x) {
#pragma unroll
  for (int off = FIRST; off <= LAST; off *= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, off));
  return x;
}

// The online softmax's reference max m of heads 2tq, 2tq + 1, raised to the warp's new maxima
// only where some head of the warp outgrew it by more than `slack` (log2 units): most steps then
// skip rescaling, and P = 2^(s - m) stays below 2^slack. mx is the lane's own maxima: the vote
// asks whether any lane's exceeds its m + slack (the same question as of the column's maxima,
// m being the same on a column's lanes), and only where one does are they reduced over the
// column's lanes (lanes_max<FIRST, LAST>), so a step that keeps m takes no shuffles and the
// values are those of reducing first. Where it is raised, l is rescaled to the new max and the
// factors left in alpha for the caller's accumulators and other sums; returns whether it was
// (warp-uniform). The wide items (attend_wide.cuh) call it as it is: their accumulators lie in
// another order.
template <int FIRST, int LAST>
__device__ __forceinline__ bool raise_max_stats(float (&m)[2], float (&l)[2], const float (&mx)[2], float slack,
                                                float (&alpha)[2]) {
  if (!__any_sync(kFullMask, mx[0] > m[0] + slack || mx[1] > m[1] + slack)) return false;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m_new = fmaxf(m[h], lanes_max<FIRST, LAST>(mx[h]));
    alpha[h] = m_new == -INFINITY ? 1.f : exp2_ftz(m[h] - m_new);
    l[h] *= alpha[h];
    m[h] = m_new;
  }
  return true;
}

// raise_max_stats over a column's lanes (4 .. 16), with the narrow consumers' acc (heads 2tq,
// 2tq + 1 in elements 0, 2 and 1, 3) rescaled too.
template <int KSTEPS>
__device__ __forceinline__ bool raise_max(float (&m)[2], float (&l)[2], float (&acc)[KSTEPS][4], const float (&mx)[2],
                                          float slack, float (&alpha)[2]) {
  if (!raise_max_stats<4, 16>(m, l, mx, slack, alpha)) return false;
#pragma unroll
  for (int i = 0; i < KSTEPS; ++i) {
    acc[i][0] *= alpha[0];
    acc[i][1] *= alpha[1];
    acc[i][2] *= alpha[0];
    acc[i][3] *= alpha[1];
  }
  return true;
}

// With a buffer per warp (acc_w: static buffers for small items, QB * HEAD_DIM <=
// kWarpBufferValues; else the item's last stage, int4 items aside): each warp writes its
// (max, sum) to s_m / s_l and its accumulator as it is to acc_w[warp], then one barrier (named
// barrier 1); the store sums acc[w] * 2^(s_m[w] - M) over the warps in a fixed order (warps_acc;
// fold_warps and folded_acc for several columns), the same values as combine_warps gives,
// without its barrier per warp. Every form writes its multiply-adds as __fmaf_rn (a warp's first
// term a plain product), so none rounds apart from another by what the compiler contracts (an
// int4 item combines warp by warp, combine_warps).
template <int QB, int HEAD_DIM, int KSTEPS, class OutDim>
__device__ __forceinline__ void stash_warp(const float (&m)[2], float (&l)[2], const float (&acc)[KSTEPS][4],
                                           float (*s_m)[QB], float (*s_l)[QB], float (*acc_w)[QB][HEAD_DIM],
                                           int warp, int lane, OutDim out_dim) {
  const int g = lane / 4;
  const int tq = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int off = 4; off < 32; off *= 2) l[h] += __shfl_xor_sync(kFullMask, l[h], off);
    const int head = 2 * tq + h;
    if (head < QB) {
      if (g == 0) {
        s_m[warp][head] = m[h];
        s_l[warp][head] = l[h];
      }
#pragma unroll
      for (int i = 0; i < KSTEPS; ++i) {
        acc_w[warp][head][out_dim(i, g, 0)] = acc[i][h];
        acc_w[warp][head][out_dim(i, g, 1)] = acc[i][h + 2];
      }
    }
  }
  named_barrier(1, kConsumerWarps * 32);
}

// Warp by warp (named barrier 1): their (max, sum) to s_m / s_l, then sum_w acc_w * 2^(m_w - M)
// into buf ([QB][HEAD_DIM + kQRowPad] fp32: the q staging area, free once every warp holds its q
// fragments), warp after warp in a fixed order so results are bit-identical run to run. The sum
// of the block is sum_w s_l[w] * 2^(s_m[w] - M).
template <int QB, int HEAD_DIM, int KSTEPS, class OutDim>
__device__ __forceinline__ void combine_warps(const float (&m)[2], float (&l)[2], const float (&acc)[KSTEPS][4],
                                              float (*s_m)[QB], float (*s_l)[QB], float* buf, int warp, int lane,
                                              OutDim out_dim) {
  const int g = lane / 4;
  const int tq = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int off = 4; off < 32; off *= 2) l[h] += __shfl_xor_sync(kFullMask, l[h], off);
    if (g == 0 && 2 * tq + h < QB) {
      s_m[warp][2 * tq + h] = m[h];
      s_l[warp][2 * tq + h] = l[h];
    }
  }
  named_barrier(1, kConsumerWarps * 32);
  float sc[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = 2 * tq + h < QB ? 2 * tq + h : 0;
    float mb = -INFINITY;
#pragma unroll
    for (int w = 0; w < kConsumerWarps; ++w) mb = fmaxf(mb, s_m[w][head]);
    sc[h] = exp2f(m[h] - (mb == -INFINITY ? 0.f : mb));
  }
#pragma unroll
  for (int w = 0; w < kConsumerWarps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int head = 2 * tq + h;
        if (head < QB) {
          float* dst = buf + head * (HEAD_DIM + kQRowPad);
#pragma unroll
          for (int i = 0; i < KSTEPS; ++i) {
            float& d0 = dst[out_dim(i, g, 0)];
            float& d1 = dst[out_dim(i, g, 1)];
            d0 = w == 0 ? acc[i][h] * sc[h] : __fmaf_rn(acc[i][h], sc[h], d0);
            d1 = w == 0 ? acc[i][h + 2] * sc[h] : __fmaf_rn(acc[i][h + 2], sc[h], d1);
          }
        }
      }
    }
    named_barrier(1, kConsumerWarps * 32);
  }
}

}  // namespace mmha
