// Score modifiers (mmha.reference.ScoreMods) as the kernel applies them: the seam for how scores
// are modified. Both main loops work in the log2 domain (score * log2 e); each modifier is a
// uniform flag in ScoreModParams (MmhaParams::mods), so a step without them pays one warp-uniform test per tile.
//   window:  a row attends to slots [pos - window + 1, pos]; the work item range starts at the
//            window's tile (bytes before it are never read) and keys before it are masked.
//   softcap: score = softcap * tanh(score / softcap), on the scaled score, before the online max.
//   ALiBi:   score += slope[h] * (slot - pos), after the soft-cap.
//   sinks:   a logit per head that joins the softmax sum once (the store of a single pass, the
//            merge of a split), with no value.
//   tree:    a tree step's node sees the slots of its root path only among the tree's slots
//            [base, base + nodes): TreeMask, per column, after the other modifiers.
// Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attend_common.cuh"
#include "mmha_params.h"
#include "lean_kernels.h"
#include "ptx.cuh"

namespace mmha {

// The first slot a row whose new token sits at pos attends to.
__device__ __forceinline__ int window_start(const ScoreModParams& m, int pos) {
  if constexpr (kLeanKernels) return 0;
  return m.window > 0 ? max(0, pos - m.window + 1) : 0;
}

// tanh(x) as 1 - 2 / (e^2x + 1) with ex2.approx and a fast reciprocal: an absolute error of a
// few 2^-24 for every x (the soft-cap's score then within a few fp32 steps of its cap's size),
// in 6 instructions where tanhf takes about 20 and a branch. +-1 past |x| ~ 44, NaN stays NaN.
__device__ __forceinline__ float tanh_fast(float x) {
  return 1.f - __fdividef(2.f, exp2_ftz(x * (2.f * kLog2e)) + 1.f);
}

// What one thread needs to modify the scores of up to N heads: the soft-cap and the heads'
// ALiBi slopes, in the log2 domain.
template <int N>
struct ScoreTransform {
  bool on;           // a soft-cap or ALiBi: warp-uniform
  float cap;         // softcap * log2 e (0: none)
  float inv_cap;     // 1 / cap
  float slope[N];    // slope[h] * log2 e (0 without ALiBi)

  // heads[i]: the query head of slot i (< 0: a padding head, slope 0).
  __device__ __forceinline__ void init(const ScoreModParams& m, const int (&heads)[N]) {
    if constexpr (kLeanKernels) {
      on = false;
      cap = inv_cap = 0.f;
#pragma unroll
      for (int i = 0; i < N; ++i) slope[i] = 0.f;
      return;
    }
    cap = m.softcap > 0.f ? m.softcap * kLog2e : 0.f;
    inv_cap = cap > 0.f ? 1.f / cap : 0.f;
    on = cap > 0.f || m.alibi_slopes != nullptr;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      slope[i] = m.alibi_slopes != nullptr && heads[i] >= 0 ? m.alibi_slopes[heads[i]] * kLog2e : 0.f;
    }
  }

  // Score of head slot i for the key at slot `slot`, the query at slot pos. FAST: the soft-cap's
  // tanh as tanh_fast (the tensor-core loops), else tanhf.
  template <bool FAST = false>
  __device__ __forceinline__ float apply(float s, int i, int slot, int pos) const {
    if (cap > 0.f) s = cap * (FAST ? tanh_fast(s * inv_cap) : tanhf(s * inv_cap));
    return s + slope[i] * static_cast<float>(slot - pos);
  }
};

// A tree step's mask for up to N columns: slot base + j is seen by column i iff bit j of anc[i]
// (its node's root path, itself included); slots before base are the cache, seen by every node.
template <int N>
struct TreeMask {
  bool on;  // a tree step: warp-uniform
  int base;
  uint64_t anc[N];

  __device__ __forceinline__ bool hidden(int i, int slot) const {
    const int j = slot - base;
    return on && j >= 0 && (j >= kMaxTreeNodes || !((anc[i] >> j) & 1ull));
  }
};

// Head h's sink in the log2 domain; -inf without sinks.
__device__ __forceinline__ float sink_log2(const ScoreModParams& m, int h) {
  if constexpr (kLeanKernels) return -INFINITY;
  return m.sinks != nullptr ? m.sinks[h] * kLog2e : -INFINITY;
}

}  // namespace mmha
