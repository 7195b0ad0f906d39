// What the decode kernel hands to its CUDA-core main loop (attend_simt.cuh), and the constants and
// helpers the consumers share. Torch-free.
#pragma once

#include <cmath>
#include <cstdint>

#include "cache_slots.cuh"
#include "mmha_params.h"
#include "vec.cuh"

namespace mmha {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFullMask = 0xffffffffu;

// One-byte caches' q: the power of two that brings a warp's largest |q| (its lanes' qmax, reduced
// here) into [2^7, 2^8). Returns it (q_unit, which q is multiplied by) and sets s_unit to its
// inverse (the scores undo it); where q is 0 or not finite both are left as they are.
__device__ __forceinline__ float byte_q_unit(float qmax, float& s_unit) {
#pragma unroll
  for (int off = 1; off < 32; off *= 2) qmax = fmaxf(qmax, __shfl_xor_sync(kFullMask, qmax, off));
  float q_unit = 1.f;
  if (qmax > 0.f && qmax <= 3.0e38f) {
    int e = 0;
    frexpf(qmax, &e);  // qmax in [2^(e-1), 2^e)
    const int shift = max(-100, min(100, 8 - e));
    q_unit = ldexpf(1.f, shift);
    s_unit = ldexpf(1.f, -shift);
  }
  return q_unit;
}

// One block's view of one (row, kv head): keys [start, end) of the cache to attend over (those
// before lo, a window's start, masked), with the new token at slot pos (its K/V are read from
// shared memory, not from the cache). The shared arrays (q, new K/V) and the score modifiers
// are passed alongside.
template <typename T, int HEAD_DIM>
struct AttendArgs {
  HeadSlots<T, HEAD_DIM> slots;  // where the (row, kv head)'s slots live
  int start;
  int lo;
  int end;
  int pos;
  float scale_log2;  // softmax scale * log2(e)
};

}  // namespace mmha
