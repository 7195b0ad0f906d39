// Where every value of the attention output is written: plain (the activations' dtype) or through
// the output epilogue (shift, smooth, int8 / e4m3 quantisation; mmha/epilogue.py defines it).
// Torch-free.
#pragma once

#include <cstdint>
#include <type_traits>

#include "mmha_params.h"
#include "vec.cuh"

namespace mmha {

// The quantised output's byte for y * scale (y after shift and smooth): e4m3 (saturated to +-448,
// nearest even), or int8 by cvt.rni / roundf to int32 (NaN -> 0, saturating), then [min, 127].
__device__ __forceinline__ uint32_t quantised_byte(const OutputParams& o, float y, float scale) {
  y = __fmul_rn(y, scale);
  if (o.kind == OutKind::kE4M3) return __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
  const int v = o.round == 0 ? __float2int_rn(y) : __float2int_rn(roundf(y));
  return static_cast<uint8_t>(static_cast<int8_t>(min(127, max(o.min, v))));
}

// The per-channel values of channel c (those the epilogue has): loaded apart from the store so
// that a kernel can issue the loads early and keep the values in registers.
struct ChannelValue {
  float shift, smooth, scale;
};

__device__ __forceinline__ ChannelValue load_channel(const OutputParams& o, int channel) {
  return ChannelValue{o.shift != nullptr ? o.shift[channel] : 0.f, o.smooth != nullptr ? o.smooth[channel] : 1.f,
                      o.scales != nullptr ? o.scales[channel] : o.scale};
}

// y = (x + shift[c]) * smooth[c], then for a quantised output q = saturate(round(y * scale)).
// Each step one fp32 operation (no contraction into a fused multiply-add), as mmha.epilogue
// computes it, so the same x gives the same bits. int8: a NaN x converts to 0; an infinite one
// saturates to a bound. cv: channel c's values (load_channel). T: the activations' type, what a
// plain (unquantised) output holds.
template <typename T>
__device__ __forceinline__ void store_out_epilogue(const OutputParams& o, int64_t i, float x, const ChannelValue& cv) {
  float y = x;
  if (o.shift != nullptr) y = __fadd_rn(y, cv.shift);
  if (o.smooth != nullptr) y = __fmul_rn(y, cv.smooth);
  if (o.kind == OutKind::kActivations) {
    static_cast<T*>(o.out)[i] = from_float<T>(y);
    return;
  }
  static_cast<uint8_t*>(o.out)[i] = static_cast<uint8_t>(quantised_byte(o, y, cv.scale));
}

// Output element i (flat over [rows, Hq * D]) of channel c = head * D + d from the fp32 value x:
// EPI, a kernel compiled with the epilogue (launched only when the step has one), or plain.
template <typename T, bool EPI>
__device__ __forceinline__ void store_out(const OutputParams& o, int64_t i, int channel, float x) {
  if constexpr (EPI) {
    store_out_epilogue<T>(o, i, x, load_channel(o, channel));
  } else {
    static_cast<T*>(o.out)[i] = from_float<T>(x);
  }
}

// Four consecutive elements i .. i + 3 (i a multiple of 4) of an output in T, rounded as
// from_float rounds each: one 16-byte (fp32) or 8-byte (16-bit) store (out aligned to four
// elements: an epilogue's out always is, a plain one is checked by store_out4).
template <typename T>
__device__ __forceinline__ void store_activations4(void* out, int64_t i, float4 x) {
  if constexpr (std::is_same_v<T, float>) {
    *reinterpret_cast<float4*>(static_cast<float*>(out) + i) = x;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 h[2] = {__floats2bfloat162_rn(x.x, x.y), __floats2bfloat162_rn(x.z, x.w)};
    *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(out) + i) = *reinterpret_cast<uint2*>(h);
  } else {
    __half2 h[2] = {__floats2half2_rn(x.x, x.y), __floats2half2_rn(x.z, x.w)};
    *reinterpret_cast<uint2*>(static_cast<__half*>(out) + i) = *reinterpret_cast<uint2*>(h);
  }
}

// Four consecutive output elements i .. i + 3 (channels c .. c + 3, both multiples of 4) through
// the epilogue, as store_out_epilogue computes each: one 16-byte load per per-channel tensor and
// one store of 4 outputs.
template <typename T>
__device__ __forceinline__ void store_out4_epilogue(const OutputParams& o, int64_t i, int channel, float4 x) {
  float y[4] = {x.x, x.y, x.z, x.w};
  if (o.shift != nullptr) {
    const float4 s = *reinterpret_cast<const float4*>(o.shift + channel);
    y[0] = __fadd_rn(y[0], s.x), y[1] = __fadd_rn(y[1], s.y), y[2] = __fadd_rn(y[2], s.z), y[3] = __fadd_rn(y[3], s.w);
  }
  if (o.smooth != nullptr) {
    const float4 s = *reinterpret_cast<const float4*>(o.smooth + channel);
    y[0] = __fmul_rn(y[0], s.x), y[1] = __fmul_rn(y[1], s.y), y[2] = __fmul_rn(y[2], s.z), y[3] = __fmul_rn(y[3], s.w);
  }
  if (o.kind == OutKind::kActivations) {
    store_activations4<T>(o.out, i, make_float4(y[0], y[1], y[2], y[3]));
    return;
  }
  float4 sc = make_float4(o.scale, o.scale, o.scale, o.scale);
  if (o.scales != nullptr) sc = *reinterpret_cast<const float4*>(o.scales + channel);
  const uint32_t packed = quantised_byte(o, y[0], sc.x) | quantised_byte(o, y[1], sc.y) << 8 |
                          quantised_byte(o, y[2], sc.z) << 16 | quantised_byte(o, y[3], sc.w) << 24;
  *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(o.out) + i) = packed;
}

template <typename T, bool EPI>
__device__ __forceinline__ void store_out4(const OutputParams& o, int64_t i, int channel, float4 x) {
  if constexpr (EPI) {
    store_out4_epilogue<T>(o, i, channel, x);
  } else if (reinterpret_cast<uintptr_t>(o.out) % (4 * sizeof(T)) == 0) {  // a plain out may start anywhere
    store_activations4<T>(o.out, i, x);
  } else {
    T* out = static_cast<T*>(o.out) + i;
    out[0] = from_float<T>(x.x);
    out[1] = from_float<T>(x.y);
    out[2] = from_float<T>(x.z);
    out[3] = from_float<T>(x.w);
  }
}

}  // namespace mmha
