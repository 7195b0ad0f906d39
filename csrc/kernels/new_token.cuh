// A new token's values as the step uses them: bias and rotary embedding in fp32, and the fp8
// scale test. Shared by the attention kernel and a tree step's append (tree_step.cuh). Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "mmha_params.h"
#include "vec.cuh"

namespace mmha {

// An fp8 scale the kernel accepts: finite and positive (NaN fails both tests).
__device__ __forceinline__ bool scale_ok(float s) { return s > 0.f && s <= 3.4028235e38f; }


// Element d of one head's raw values `row` (global or shared memory) after its bias (global,
// or nullptr) and rotary embedding at position pos, in fp32.
template <typename T>
__device__ __forceinline__ float biased(const T* row, const T* bias, int d) {
  float v = to_float(row[d]);
  if (bias != nullptr) v += to_float(bias[d]);
  return v;
}

template <typename T>
__device__ float rotated(const T* row, const T* bias, int d, int pos, const RotaryParams& r) {
  const float x = biased(row, bias, d);
  const int rd = r.dim;
  if (d >= rd) return x;
  int i, partner;
  float sign;
  if (r.interleaved) {
    i = d / 2;
    partner = d ^ 1;
    sign = (d & 1) ? 1.f : -1.f;
  } else {
    const int half = rd / 2;
    i = d < half ? d : d - half;
    partner = d < half ? d + half : d - half;
    sign = d < half ? -1.f : 1.f;
  }
  const float y = biased(row, bias, partner);
  const float inv_freq = 1.f / powf(r.theta, static_cast<float>(2 * i) / static_cast<float>(rd));
  float s, c;
  sincosf(static_cast<float>(pos) * inv_freq, &s, &c);
  return __fmaf_rn(x, c, __fmul_rn(sign * y, s));  // as rotate_pair: every path rounds alike
}

// The rotation pairs of one head: pair i < rotary_dim / 2 holds dims d0 (rotated by -sin) and d1
// (by +sin), i.e. (i, i + rd / 2) or (2 i, 2 i + 1) when interleaved; pairs past it hold
// unrotated dims (rd + 2 k, rd + 2 k + 1). A caller that rotates many rows at one position
// computes each pair's angle once (rotated() recomputes it per element).
struct RotaryPair {
  int d0, d1;
  bool rotated;
  float inv_freq;  // 1 / theta^(2 i / rd), as rotated() computes it
};

__device__ __forceinline__ RotaryPair rotary_pair(int i, const RotaryParams& rot) {
  const int rd = rot.dim;
  RotaryPair r;
  r.rotated = 2 * i < rd;
  if (r.rotated) {
    r.d0 = rot.interleaved ? 2 * i : i;
    r.d1 = rot.interleaved ? 2 * i + 1 : i + rd / 2;
    r.inv_freq = 1.f / powf(rot.theta, static_cast<float>(2 * i) / static_cast<float>(rd));
  } else {
    r.d0 = rd + 2 * (i - rd / 2);
    r.d1 = r.d0 + 1;
    r.inv_freq = 0.f;
  }
  return r;
}

// (x0, x1) = row's dims (d0, d1) of pair r after bias and rotation by pos * inv_freq: the values
// rotated() gives for d0 and d1. sn, cs: sincosf(pos * inv_freq) (unused for unrotated pairs).
template <typename T>
__device__ __forceinline__ void rotate_pair(const T* row, const T* bias, const RotaryPair& r, float sn, float cs,
                                            float& x0, float& x1) {
  const float a = biased(row, bias, r.d0);
  const float b = biased(row, bias, r.d1);
  if (r.rotated) {  // explicit roundings: the same bits as rotated() whatever the compiler contracts
    x0 = __fmaf_rn(a, cs, __fmul_rn(-b, sn));
    x1 = __fmaf_rn(b, cs, __fmul_rn(a, sn));
  } else {
    x0 = a;
    x1 = b;
  }
}

}  // namespace mmha
