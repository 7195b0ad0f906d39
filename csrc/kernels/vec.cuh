// 16-byte vectors of cache elements and their conversion to fp32. Torch-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "constants.h"

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

// One element of an fp8 cache: e4m3 in the OCP "fn" encoding (torch.float8_e4m3fn: no
// infinities, NaN = 0x7f / 0xff, largest finite 448), as stored. Values are value / scale.
struct e4m3 {
  uint8_t bits;
};
constexpr float kE4m3Max = kFp8Max;

// value / scale, saturated to +-448 and rounded to the nearest e4m3 (ties to even); NaN stays NaN.
__device__ __forceinline__ e4m3 quantize_e4m3(float value, float scale) {
  return e4m3{static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fdiv_rn(value, scale), __NV_SATFINITE, __NV_E4M3))};
}

// The two e4m3 in the low 16 bits of `two` (first in the low byte) as a half2, exactly (every
// e4m3 value is an fp16 value). One instruction on sm_89 and newer.
__device__ __forceinline__ uint32_t e4m3x2_to_half2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// The four e4m3 of `four` as two half2: bytes 0, 1 in lo, bytes 2, 3 in hi. On sm_89 and newer
// the two conversions read the register's 16-bit halves directly (no shift for the high pair).
__device__ __forceinline__ void e4m3x4_to_half2x2(uint32_t four, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(four));
#else
  lo = e4m3x2_to_half2(four);
  hi = e4m3x2_to_half2(four >> 16);
#endif
}

// One element of an int8 cache: a code in [-127, 127]; the value is code * the token's scale
// (per token and kv head, CacheParams::k_token_scale / v_token_scale).
struct s8 {
  int8_t code;
};
constexpr float kInt8Max = 127.f;

// A token's int8 scale from the absolute maximum of its D values (mmha.quant.quantize): amax / 127.
__device__ __forceinline__ float int8_scale(float amax) { return __fdiv_rn(amax, kInt8Max); }

// The larger of two absolute values, NaN if either is (as torch's amax): a token with a NaN
// value gets a NaN scale.
__device__ __forceinline__ float absmax_nan(float a, float b) { return a > b || a != a ? a : b; }

// A token's k and v maxima over the warp: each lane's (km, vm) becomes the warp's (absmax_nan).
__device__ __forceinline__ void warp_absmax_kv(float& km, float& vm) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    km = absmax_nan(km, __shfl_xor_sync(0xffffffffu, km, off));
    vm = absmax_nan(vm, __shfl_xor_sync(0xffffffffu, vm, off));
  }
}

// value / scale rounded half to even and clamped to +-127, as mmha.quant.quantize: a scale that
// is not positive (zero, or NaN) divides by 1, a NaN result is code 0, an infinite one saturates.
__device__ __forceinline__ s8 quantize_s8(float value, float scale) {
  const float q = rintf(__fdiv_rn(value, scale > 0.f ? scale : 1.f));
  return s8{static_cast<int8_t>(isnan(q) ? 0.f : fminf(fmaxf(q, -kInt8Max), kInt8Max))};
}

// One byte of an int4 cache (mmha/int4.py): two 4-bit codes. V codes in rows of D / 2 bytes, the
// even channel in the low nibble; K codes in the x-layout's 16-byte chunks (32 channels a chunk),
// each 4-byte word's 8 channels with their nibbles in the order K_NIBBLES (int4_k_channel);
// scales and zero points are fp16 beside them (CacheParams::int4).
struct u4 {
  uint8_t bits;
};
// The channel (of a K chunk's 32) in byte `byte` of the chunk, low (nib 0) or high (nib 1)
// nibble: nibble k of a word holds channel 4 (k % 2) + 2 ((k / 2) % 2) + k / 4 of its 8 (0, 4,
// 2, 6, 1, 5, 3, 7).
__host__ __device__ constexpr int int4_k_channel(int byte, int nib) {
  return 8 * (byte / 4) + 4 * nib + 2 * (byte % 2) + (byte % 4) / 2;
}
static_assert(int4_k_channel(0, 0) == 0 && int4_k_channel(0, 1) == 4 && int4_k_channel(1, 0) == 2 &&
                  int4_k_channel(2, 0) == 1 && int4_k_channel(2, 1) == 5 && int4_k_channel(3, 1) == 7 &&
                  int4_k_channel(5, 0) == 10 && int4_k_channel(6, 1) == 13,
              "K_NIBBLES: mmha/int4.py");
constexpr float kInt4Levels = 15.f;
constexpr float kFp16Max = 65504.f;
// Nibble codes reach the tensor cores as the halves 1024 + code (kInt4Bias), exact: the code as
// the low mantissa bits of 0x6400 (1024.0). The consumer takes the bias out of its sums.
constexpr float kInt4Bias = 1024.f;

// The smaller / larger of two values, NaN if either is (as torch's amin / amax).
__device__ __forceinline__ float min_nan(float a, float b) { return a < b || a != a ? a : b; }
__device__ __forceinline__ float max_nan(float a, float b) { return a > b || a != a ? a : b; }

// An asymmetric 4-bit range as mmha.quant.quantize(x, 4, symmetric=False, scale_dtype=float16)
// stores it, from the values' min, max and absolute max: scale = fp16((hi - lo) / 15), zero =
// fp16(lo); both infinite where a value is past fp16's range (amax > 65504: it reads back NaN),
// NaN where a value is.
struct Int4Range {
  float scale, zero;  // the stored fp16 values
};
__device__ __forceinline__ Int4Range int4_range(float lo, float hi, float amax) {
  if (amax > kFp16Max) return {INFINITY, INFINITY};
  return {__half2float(__float2half_rn(__fdiv_rn(hi - lo, kInt4Levels))), __half2float(__float2half_rn(lo))};
}

// A value's code in a range: rint((x - zero) / scale) in [0, 15] (a scale that is not positive
// divides by 1; NaN gives 0, an infinite quotient saturates), as mmha.quant.quantize.
__device__ __forceinline__ uint32_t int4_code(float x, const Int4Range& r) {
  const float q = rintf(__fdiv_rn(x - r.zero, r.scale > 0.f ? r.scale : 1.f));
  return isnan(q) ? 0u : static_cast<uint32_t>(fminf(fmaxf(q, 0.f), kInt4Levels));
}

// int8 codes reach the tensor cores as the halves 1152 + code (kInt8Bias), exact: flipping a
// code's sign bit gives code + 128 in [0, 255], which as the low byte of 0x64xx is the half
// 1024 + code + 128. The consumer takes the bias out of the sums (attend_tiles.cuh), which spares
// a subtract per two codes in the tile loop.
constexpr float kInt8Bias = 1152.f;
// A lane's sum of the P values fed to the V mma past which its warp takes that bias off acc within
// an item (both consumers' flush_v_bias). The mma's fp32 chain loses low bits one-sidedly at acc's
// magnitude, so a bias carried through a long item leaves an error that grows with the row; at 1
// (about every step of flat weights) one chain's error is the 16-bit cache's; over 128K keys it
// was 2-4x that at 8, 18-34x at 64 (docs/experiments.md, 2026-12-03, evening).
constexpr float kInt8BiasFlush = 1.f;

// Two of the four biased halves of the codes in `four`: bytes SEL_LO and SEL_HI (0-3) of `four`
// as the low and high half.
template <int SEL_LO, int SEL_HI>
__device__ __forceinline__ uint32_t s8_pair_biased(uint32_t flipped) {
  return __byte_perm(flipped, 0x64646464u, SEL_LO | 4 << 4 | SEL_HI << 8 | 5 << 12);
}

// The four codes of `four` as two half2 of 1152 + code: bytes 0, 1 in lo, bytes 2, 3 in hi (as
// e4m3x4_to_half2x2 orders them).
__device__ __forceinline__ void s8x4_to_biased_half2x2(uint32_t four, uint32_t& lo, uint32_t& hi) {
  const uint32_t u = four ^ 0x80808080u;
  lo = s8_pair_biased<0, 1>(u);
  hi = s8_pair_biased<2, 3>(u);
}

// The same with the bytes taken across: bytes 0, 2 in lo, bytes 1, 3 in hi (a transposed V
// fragment's two keys of one dim each, without a byte permute first).
__device__ __forceinline__ void s8x4_to_biased_half2x2_across(uint32_t four, uint32_t& lo, uint32_t& hi) {
  const uint32_t u = four ^ 0x80808080u;
  lo = s8_pair_biased<0, 2>(u);
  hi = s8_pair_biased<1, 3>(u);
}

// How the step stores a new token's k or v value (fp32, after bias and rotary) in a cache of C:
// rounded to C, or for fp8 divided by the kv head's scale and quantised.
template <typename C>
__device__ __forceinline__ C to_cache(float value, float /*scale*/) {
  return from_float<C>(value);
}
template <>
__device__ __forceinline__ e4m3 to_cache<e4m3>(float value, float scale) {
  return quantize_e4m3(value, scale);
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
