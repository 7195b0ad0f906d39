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
__device__ float rotated(const T* row, const T* bias, int d, int pos, const MmhaParams& p) {
  const float x = biased(row, bias, d);
  const int rd = p.rotary_dim;
  if (d >= rd) return x;
  int i, partner;
  float sign;
  if (p.rotary_interleaved) {
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
  const float inv_freq = 1.f / powf(p.rotary_theta, static_cast<float>(2 * i) / static_cast<float>(rd));
  float s, c;
  sincosf(static_cast<float>(pos) * inv_freq, &s, &c);
  return x * c + sign * y * s;
}

}  // namespace mmha
