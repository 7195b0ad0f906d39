// 16-byte vectors of cache elements and their conversion to fp32. Torch-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace mmha {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Elements of T in one 16-byte load: the "x" of the K cache layout.
template <typename T>
constexpr int kVec = 16 / sizeof(T);

// Read-only streaming load of 16 bytes. The cache slot this kernel writes is never read back
// through this path (the new token is taken from shared memory), so the non-coherent path is safe.
__device__ __forceinline__ uint4 load16(const void* ptr) {
  return __ldg(reinterpret_cast<const uint4*>(ptr));
}

__device__ __forceinline__ void convert16(const uint4& raw, float (&f)[4]) {
  f[0] = __uint_as_float(raw.x);
  f[1] = __uint_as_float(raw.y);
  f[2] = __uint_as_float(raw.z);
  f[3] = __uint_as_float(raw.w);
}

__device__ __forceinline__ void convert16_half(const uint4& raw, float (&f)[8]) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __half22float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

__device__ __forceinline__ void convert16_bf16(const uint4& raw, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

template <typename T>
__device__ __forceinline__ void convert16(const uint4& raw, float (&f)[kVec<T>]);
template <>
__device__ __forceinline__ void convert16<float>(const uint4& raw, float (&f)[4]) {
  convert16(raw, f);
}
template <>
__device__ __forceinline__ void convert16<__half>(const uint4& raw, float (&f)[8]) {
  convert16_half(raw, f);
}
template <>
__device__ __forceinline__ void convert16<__nv_bfloat16>(const uint4& raw, float (&f)[8]) {
  convert16_bf16(raw, f);
}

}  // namespace mmha
