// The CUDA-core main loop of the decode kernel, for fp32 caches: each of kSimtWarps warps walks
// its own steps of the block's chunk with its own online softmax; K and V are loaded straight
// into registers, all loads of a step issued before any math. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attend_common.cuh"
#include "mmha_params.h"
#include "score_mods.cuh"

namespace mmha {

// Lanes that share one key in the Q.K step: as many as keep >= 4 chunks (64 bytes) per lane,
// so each lane has several 16-byte loads in flight and the dot-product reduction stays short.
constexpr int pick_threads_per_key(int chunks) {
  int tpk = 1;
  while (tpk < 32 && chunks % (tpk * 2) == 0 && chunks / (tpk * 2) >= 4) tpk *= 2;
  return tpk;
}

// How one warp walks the cache. A warp step covers KEYS keys:
//  - Q.K: lane = ti * KPW + kj holds chunks c * TPK + ti of key kj (K layout [D/x, S, x] makes the
//    KPW keys of one chunk contiguous: 16 * KPW coalesced bytes per lane group);
//  - P.V: lane = vr * VLPR + vc holds chunk vc (+ n * VLPR) of key row vr (V rows are contiguous).
template <typename T, int HEAD_DIM, int QB>
struct WarpTiling {
  static constexpr int VEC = kVec<T>;
  static_assert(HEAD_DIM % VEC == 0, "head_dim must be a multiple of 16 bytes");
  static constexpr int CHUNKS = HEAD_DIM / VEC;
  static constexpr int TPK = pick_threads_per_key(CHUNKS);
  static constexpr int CPT = CHUNKS / TPK;
  static constexpr int KPW = 32 / TPK;
  // About 4 KB of K per warp step (2 KB with >= 4 query heads, whose accumulators take the
  // registers): with 4 warps and >= 3 blocks per SM that keeps ~100 KB of K/V loads in flight
  // per SM, several times the ~30 KB that HBM3 latency x bandwidth needs.
  static constexpr int TARGET_KEYS =
      (QB >= 4 ? 2048 : 4096) / (HEAD_DIM * static_cast<int>(sizeof(T)));
  static constexpr int U = TARGET_KEYS > KPW ? TARGET_KEYS / KPW : 1;
  static constexpr int KEYS = KPW * U;
  static constexpr int VLPR = CHUNKS < 32 ? CHUNKS : 32;
  static_assert(CHUNKS % VLPR == 0, "V chunks must split evenly over lanes");
  static constexpr int VCPL = CHUNKS / VLPR;
  static constexpr int ROWS = 32 / VLPR;
  static constexpr int V_STEPS = (KEYS + ROWS - 1) / ROWS;
};

template <typename T, int HEAD_DIM, int QB>
struct SimtAttend {
  using W = WarpTiling<T, HEAD_DIM, QB>;
  static constexpr int KEYS = W::KEYS;  // keys per warp step: chunks are whole steps
  static constexpr int ACC_ROWS = W::ROWS;

  // Walks keys [a.start, a.end) (those before a.lo neither read nor counted; scores modified by
  // mods; a tree step's slots masked by tree), then leaves per-warp (max, sum) in s_m, s_l and returns the per-warp accumulators
  // [kSimtWarps * ACC_ROWS][QB][HEAD_DIM], after a block barrier.
  __device__ __forceinline__ static const float* run(const AttendArgs<T, HEAD_DIM>& a, const ScoreTransform<QB>& mods,
                                                     const TreeMask<QB>& tree, float (*s_m)[QB], float (*s_l)[QB],
                                                     const float (&s_q)[QB][HEAD_DIM + kQRowPad],
                                                     const T (&s_new_k)[HEAD_DIM], const T (&s_new_v)[HEAD_DIM]) {
    constexpr int VEC = kVec<T>;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int start = a.start, lo = a.lo, end = a.end, pos = a.pos;
    const HeadSlots<T, HEAD_DIM>& slots = a.slots;
    const bool paged = slots.table != nullptr;
    const float scale_log2 = a.scale_log2;
    __shared__ __align__(16) float s_p[kSimtWarps][W::KEYS][QB];
    __shared__ __align__(16) float s_acc_simt[kSimtWarps * W::ROWS][QB][HEAD_DIM];
    const int ti = lane / W::KPW;
    const int kj = lane % W::KPW;
    const int vr = lane / W::VLPR;
    const int vc = lane % W::VLPR;
    const bool v_lane = vr < W::ROWS;

    float m[QB], l[QB];
    float acc[QB][W::VCPL * VEC];
#pragma unroll
    for (int g = 0; g < QB; ++g) {
      m[g] = -INFINITY;
      l[g] = 0.f;
#pragma unroll
      for (int e = 0; e < W::VCPL * VEC; ++e) acc[g][e] = 0.f;
    }

    for (int it = start + warp * W::KEYS; it < end; it += kSimtWarps * W::KEYS) {
      // Issue every K and V load of this step before any math: ~16 x 16 B in flight per lane.
      uint4 kraw[W::U][W::CPT];
      uint4 vraw[W::V_STEPS][W::VCPL];
#pragma unroll
      for (int u = 0; u < W::U; ++u) {
        const int t = it + u * W::KPW + kj;
        const int blk = paged && t < end && t >= lo ? slots.block(t) : 0;
#pragma unroll
        for (int c = 0; c < W::CPT; ++c) {
          const int ch = c * W::TPK + ti;
          if (t >= end || t < lo) {
            kraw[u][c] = make_uint4(0, 0, 0, 0);
          } else if (t == pos) {
            kraw[u][c] = *reinterpret_cast<const uint4*>(&s_new_k[ch * VEC]);
          } else {
            kraw[u][c] = load16(slots.k + slots.k_at(blk, t, ch));
          }
        }
      }
#pragma unroll
      for (int st = 0; st < W::V_STEPS; ++st) {
        const int kk = st * W::ROWS + vr;
        const int t = it + kk;
        const bool valid = v_lane && kk < W::KEYS && t < end && t >= lo;
        const int blk = paged && valid ? slots.block(t) : 0;
#pragma unroll
        for (int n = 0; n < W::VCPL; ++n) {
          const int ch = n * W::VLPR + vc;
          if (!valid) {
            vraw[st][n] = make_uint4(0, 0, 0, 0);
          } else if (t == pos) {
            vraw[st][n] = *reinterpret_cast<const uint4*>(&s_new_v[ch * VEC]);
          } else {
            vraw[st][n] = load16(slots.v + slots.v_at(blk, t) + ch * VEC);
          }
        }
      }

      // Q.K: partial dots over this lane's chunks, then a reduction over the TPK lanes of a key.
      float logit[W::U][QB];
#pragma unroll
      for (int u = 0; u < W::U; ++u) {
#pragma unroll
        for (int g = 0; g < QB; ++g) logit[u][g] = 0.f;
#pragma unroll
        for (int c = 0; c < W::CPT; ++c) {
          const int ch = c * W::TPK + ti;
          float kf[VEC];
          convert16<T>(kraw[u][c], kf);
#pragma unroll
          for (int g = 0; g < QB; ++g) {
#pragma unroll
            for (int e = 0; e < VEC; e += 4) {
              const float4 q4 = *reinterpret_cast<const float4*>(&s_q[g][ch * VEC + e]);
              logit[u][g] += q4.x * kf[e] + q4.y * kf[e + 1] + q4.z * kf[e + 2] + q4.w * kf[e + 3];
            }
          }
        }
        const int t = it + u * W::KPW + kj;
#pragma unroll
        for (int g = 0; g < QB; ++g) {
#pragma unroll
          for (int off = W::KPW; off < 32; off *= 2) {
            logit[u][g] += __shfl_xor_sync(kFullMask, logit[u][g], off);
          }
          logit[u][g] *= scale_log2;
          if (mods.on) logit[u][g] = mods.apply(logit[u][g], g, t, pos);
          if (t >= end || t < lo || tree.hidden(g, t)) logit[u][g] = -INFINITY;
        }
      }

      // Online softmax over this warp's keys (log2 domain).
      float alpha[QB];
#pragma unroll
      for (int g = 0; g < QB; ++g) {
        float mx = logit[0][g];
#pragma unroll
        for (int u = 1; u < W::U; ++u) mx = fmaxf(mx, logit[u][g]);
#pragma unroll
        for (int off = 1; off < W::KPW; off *= 2) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, off));
        const float m_new = fmaxf(m[g], mx);
        const float m_ref = m_new == -INFINITY ? 0.f : m_new;
        alpha[g] = exp2f(m[g] - m_ref);
        float sum = 0.f;
#pragma unroll
        for (int u = 0; u < W::U; ++u) {
          logit[u][g] = exp2f(logit[u][g] - m_ref);
          sum += logit[u][g];
        }
        l[g] = l[g] * alpha[g] + sum;
        m[g] = m_new;
      }
      if (ti == 0) {
#pragma unroll
        for (int u = 0; u < W::U; ++u) {
#pragma unroll
          for (int g = 0; g < QB; ++g) s_p[warp][u * W::KPW + kj][g] = logit[u][g];
        }
      }
      __syncwarp();

      // P.V
#pragma unroll
      for (int g = 0; g < QB; ++g) {
#pragma unroll
        for (int e = 0; e < W::VCPL * VEC; ++e) acc[g][e] *= alpha[g];
      }
#pragma unroll
      for (int st = 0; st < W::V_STEPS; ++st) {
        const int kk = st * W::ROWS + vr;
        float pg[QB];
#pragma unroll
        for (int g = 0; g < QB; ++g) pg[g] = (v_lane && kk < W::KEYS) ? s_p[warp][kk][g] : 0.f;
#pragma unroll
        for (int n = 0; n < W::VCPL; ++n) {
          float vf[VEC];
          convert16<T>(vraw[st][n], vf);
#pragma unroll
          for (int g = 0; g < QB; ++g) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g][n * VEC + e] += pg[g] * vf[e];
          }
        }
      }
      __syncwarp();  // s_p is rewritten by the next step
    }

    // Per-warp (max, sum, acc) to shared memory for the block combine.
#pragma unroll
    for (int g = 0; g < QB; ++g) {
#pragma unroll
      for (int off = 1; off < W::KPW; off *= 2) l[g] += __shfl_xor_sync(kFullMask, l[g], off);
    }
    if (lane == 0) {
#pragma unroll
      for (int g = 0; g < QB; ++g) {
        s_m[warp][g] = m[g];
        s_l[warp][g] = l[g];
      }
    }
    if (v_lane) {
#pragma unroll
      for (int g = 0; g < QB; ++g) {
#pragma unroll
        for (int n = 0; n < W::VCPL; ++n) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            s_acc_simt[warp * W::ROWS + vr][g][(n * W::VLPR + vc) * VEC + e] = acc[g][n * VEC + e];
          }
        }
      }
    }
    __syncthreads();
    return &s_acc_simt[0][0][0];
  }
};

}  // namespace mmha
