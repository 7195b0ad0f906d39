// A new token's values as the step uses them: bias, q/k norm and rotary embedding in fp32, and
// the fp8 scale test. Shared by the attention kernel and a tree step's append (tree_step.cuh). Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "mmha_params.h"
#include "vec.cuh"

namespace mmha {

// An fp8 scale the kernel accepts: finite and positive (NaN fails both tests).
__device__ __forceinline__ bool scale_ok(float s) { return s > 0.f && s <= 3.4028235e38f; }


// Element d of one head's raw values `row` (global or shared memory) after its bias (global,
// or nullptr), in fp32.
template <typename T>
__device__ __forceinline__ float biased(const T* row, const T* bias, int d) {
  float v = to_float(row[d]);
  if (bias != nullptr) v += to_float(bias[d]);
  return v;
}

// A head's q/k norm as the values of one row use it (QKNormParams): w nullptr is none; inv the
// row's rsqrt(mean(x^2) + eps) (head_inv_rms).
struct HeadNorm {
  const float* w = nullptr;
  float inv = 1.f;
  bool cast_first = true;
};

// rsqrt(mean(x^2) + eps) over the HEAD_DIM biased values x of `row`, in fp32; every lane of a
// whole warp calls it (a shuffle reduction) and gets it.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ float head_inv_rms(const T* row, const T* bias, float eps, int lane) {
  float squares = 0.f;
  for (int d = lane; d < HEAD_DIM; d += 32) {
    const float v = biased(row, bias, d);
    squares = __fmaf_rn(v, v, squares);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, o);
  return rsqrtf(squares / static_cast<float>(HEAD_DIM) + eps);
}

// Element d of a head's values after its bias (v) and its q/k norm n (none where n.w is nullptr).
template <typename T>
__device__ __forceinline__ float normed(float v, int d, const HeadNorm& n) {
  if (n.w == nullptr) return v;
  const float x = v * n.inv;
  return to_float(from_float<T>(n.cast_first ? to_float(from_float<T>(x)) * n.w[d] : x * n.w[d]));
}

// Element d of a head's values after its bias and its q/k norm (if any), in fp32: the value a
// separate row norm in the activations' dtype T would leave in the qkv row.
template <typename T>
__device__ __forceinline__ float prepared(const T* row, const T* bias, int d, const HeadNorm& n) {
  return normed<T>(biased(row, bias, d), d, n);
}

// The rotation of a sequence of seq_len tokens: its row of a table by length (RotaryParams).
__device__ __forceinline__ RotaryParams for_length(RotaryParams r, int seq_len) {
  if (r.table_rows > 1) {
    const int row = min(max(seq_len - r.table_start, 0), r.table_rows - 1);
    r.inv_freq += static_cast<int64_t>(row) * (r.dim / 2);
  }
  return r;
}

// 1 / theta^(2 i / dim), out of line: the Python API hands the kernel theta as a table
// (Rotary.kernel_table), so this runs only for raw calls and a theta first seen in a capture.
static __device__ __noinline__ float theta_frequency(int i, float theta, int dim) {
  return 1.f / powf(theta, static_cast<float>(2 * i) / static_cast<float>(dim));
}

// Pair i's frequency: the table's, or theta's.
__device__ __forceinline__ float pair_frequency(int i, const RotaryParams& r) {
  if (r.inv_freq != nullptr) return r.inv_freq[i];
  return theta_frequency(i, r.theta, r.dim);
}

// Element d after bias, norm n (none where n.w is nullptr: prepared) and rotary embedding at
// position pos.
template <typename T>
__device__ float rotated(const T* row, const T* bias, int d, int pos, const RotaryParams& r,
                         const HeadNorm& n = HeadNorm{}) {
  const auto value = [&](int i) { return prepared(row, bias, i, n); };
  const float x = value(d);
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
  const float y = value(partner);
  float s, c;
  sincosf(static_cast<float>(pos) * pair_frequency(i, r), &s, &c);
  if (r.factor != 1.f) s = __fmul_rn(s, r.factor), c = __fmul_rn(c, r.factor);
  return __fmaf_rn(x, c, __fmul_rn(sign * y, s));  // as rotate_pair: every path rounds alike
}

// The rotation pairs of one head: pair i < rotary_dim / 2 holds dims d0 (rotated by -sin) and d1
// (by +sin), i.e. (i, i + rd / 2) or (2 i, 2 i + 1) when interleaved; pairs past it hold
// unrotated dims (rd + 2 k, rd + 2 k + 1). A caller that rotates many rows at one position
// computes each pair's angle once (rotated() recomputes it per element).
struct RotaryPair {
  int d0, d1;
  bool rotated;
  float inv_freq;  // pair_frequency, as rotated() takes it
  float factor;    // cos and sin times it (RotaryParams::factor)
};

__device__ __forceinline__ RotaryPair rotary_pair(int i, const RotaryParams& rot) {
  const int rd = rot.dim;
  RotaryPair r;
  r.rotated = 2 * i < rd;
  if (r.rotated) {
    r.d0 = rot.interleaved ? 2 * i : i;
    r.d1 = rot.interleaved ? 2 * i + 1 : i + rd / 2;
    r.inv_freq = pair_frequency(i, rot);
  } else {
    r.d0 = rd + 2 * (i - rd / 2);
    r.d1 = r.d0 + 1;
    r.inv_freq = 0.f;
  }
  r.factor = rot.factor;
  return r;
}

// A rotation pair's two raw values (dims d0, d1 of a row, as stored), read now and converted
// later: a thread that reads several pairs before it uses any waits for them once.
template <typename T>
struct RawPair {
  T v0, v1;
  __device__ __forceinline__ static RawPair read(const T* row, const RotaryPair& r) { return {row[r.d0], row[r.d1]}; }
  // The values after their bias (b: the bias's pair, read where `bias` is not nullptr), as biased().
  __device__ __forceinline__ float a0(const T* bias, const RawPair& b) const {
    return bias != nullptr ? to_float(v0) + to_float(b.v0) : to_float(v0);
  }
  __device__ __forceinline__ float a1(const T* bias, const RawPair& b) const {
    return bias != nullptr ? to_float(v1) + to_float(b.v1) : to_float(v1);
  }
};

// (x0, x1) = pair r's dims (d0, d1), a and b after bias and norm, rotated by pos * inv_freq. sn,
// cs: sincosf(pos * inv_freq) (unused for unrotated pairs).
__device__ __forceinline__ void rotate_prepared(float a, float b, const RotaryPair& r, float sn, float cs, float& x0,
                                                float& x1) {
  if (r.rotated) {  // explicit roundings: the same bits as rotated() whatever the compiler contracts
    if (r.factor != 1.f) sn = __fmul_rn(sn, r.factor), cs = __fmul_rn(cs, r.factor);
    x0 = __fmaf_rn(a, cs, __fmul_rn(-b, sn));
    x1 = __fmaf_rn(b, cs, __fmul_rn(a, sn));
  } else {
    x0 = a;
    x1 = b;
  }
}

// (x0, x1) = row's dims (d0, d1) of pair r after bias, norm n and rotation by pos * inv_freq: the
// values rotated() gives for d0 and d1.
template <typename T>
__device__ __forceinline__ void rotate_pair(const T* row, const T* bias, const RotaryPair& r, float sn, float cs,
                                            float& x0, float& x1, const HeadNorm& n = HeadNorm{}) {
  rotate_prepared(prepared(row, bias, r.d0, n), prepared(row, bias, r.d1, n), r, sn, cs, x0, x1);
}

// rotate_pair of values already read and biased (a, b: dims d0, d1 after their bias).
template <typename T>
__device__ __forceinline__ void rotate_values(float a, float b, const RotaryPair& r, float sn, float cs, float& x0,
                                              float& x1, const HeadNorm& n = HeadNorm{}) {
  rotate_prepared(normed<T>(a, r.d0, n), normed<T>(b, r.d1, n), r, sn, cs, x0, x1);
}

}  // namespace mmha
