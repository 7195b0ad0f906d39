// Where every value of the attention output is written: plain (the activations' dtype) or through
// the output epilogue (shift, smooth, int8 / e4m3 quantisation; mmha/epilogue.py defines it).
// Torch-free.
#pragma once

#include <cstdint>

#include "mmha_params.h"
#include "vec.cuh"

namespace mmha {

// The quantised output's byte for y * scale (y after shift and smooth): e4m3 (saturated to +-448,
// nearest even), or int8 by cvt.rni / roundf to int32 (NaN -> 0, saturating), then [out_min, 127].
__device__ __forceinline__ uint32_t quantised_byte(const MmhaParams& p, float y, float scale) {
  y = __fmul_rn(y, scale);
  if (p.out_kind == OutKind::kE4M3) return __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
  const int v = p.out_round == 0 ? __float2int_rn(y) : __float2int_rn(roundf(y));
  return static_cast<uint8_t>(static_cast<int8_t>(min(127, max(p.out_min, v))));
}

// The per-channel values of channel c (those the epilogue has): loaded apart from the store so
// that a kernel can issue the loads early and keep the values in registers.
struct ChannelValue {
  float shift, smooth, scale;
};

__device__ __forceinline__ ChannelValue load_channel(const MmhaParams& p, int channel) {
  return ChannelValue{p.out_shift != nullptr ? p.out_shift[channel] : 0.f,
                      p.out_smooth != nullptr ? p.out_smooth[channel] : 1.f,
                      p.out_scales != nullptr ? p.out_scales[channel] : p.out_scale};
}

// y = (x + shift[c]) * smooth[c], then for a quantised output q = saturate(round(y * scale)).
// Each step one fp32 operation (no contraction into a fused multiply-add), as mmha.epilogue
// computes it, so the same x gives the same bits. int8: a NaN x converts to 0; an infinite one
// saturates to a bound. cv: channel c's values (load_channel).
__device__ __forceinline__ void store_out_epilogue(const MmhaParams& p, int64_t i, float x, int plain_bytes,
                                                   const ChannelValue& cv) {
  float y = x;
  if (p.out_shift != nullptr) y = __fadd_rn(y, cv.shift);
  if (p.out_smooth != nullptr) y = __fmul_rn(y, cv.smooth);
  if (p.out_kind == OutKind::kActivations) {
    // The activations' dtype (plain_bytes 4: fp32; 2: fp16 or bf16, by p.dtype).
    if (plain_bytes == 4) {
      static_cast<float*>(p.out)[i] = y;
    } else if (p.dtype == DType::kBFloat16) {
      static_cast<__nv_bfloat16*>(p.out)[i] = __float2bfloat16_rn(y);
    } else {
      static_cast<__half*>(p.out)[i] = __float2half_rn(y);
    }
    return;
  }
  static_cast<uint8_t*>(p.out)[i] = static_cast<uint8_t>(quantised_byte(p, y, cv.scale));
}

__device__ __forceinline__ void store_out_epilogue(const MmhaParams& p, int64_t i, int channel, float x,
                                                   int plain_bytes) {
  store_out_epilogue(p, i, x, plain_bytes, load_channel(p, channel));
}

// Output element i (flat over [rows, Hq * D]) of channel c = head * D + d from the fp32 value x:
// EPI, a kernel compiled with the epilogue (launched only when the step has one), or plain.
template <typename T, bool EPI>
__device__ __forceinline__ void store_out(const MmhaParams& p, int64_t i, int channel, float x) {
  if constexpr (EPI) {
    store_out_epilogue(p, i, channel, x, sizeof(T));
  } else {
    static_cast<T*>(p.out)[i] = from_float<T>(x);
  }
}

// Four consecutive output elements i .. i + 3 (channels c .. c + 3, both multiples of 4) through
// the epilogue, as store_out_epilogue computes each: one 16-byte load per per-channel tensor and
// one store of 4 outputs.
__device__ __forceinline__ void store_out4_epilogue(const MmhaParams& p, int64_t i, int channel, float4 x,
                                                    int plain_bytes) {
  float y[4] = {x.x, x.y, x.z, x.w};
  if (p.out_shift != nullptr) {
    const float4 s = *reinterpret_cast<const float4*>(p.out_shift + channel);
    y[0] = __fadd_rn(y[0], s.x), y[1] = __fadd_rn(y[1], s.y), y[2] = __fadd_rn(y[2], s.z), y[3] = __fadd_rn(y[3], s.w);
  }
  if (p.out_smooth != nullptr) {
    const float4 s = *reinterpret_cast<const float4*>(p.out_smooth + channel);
    y[0] = __fmul_rn(y[0], s.x), y[1] = __fmul_rn(y[1], s.y), y[2] = __fmul_rn(y[2], s.z), y[3] = __fmul_rn(y[3], s.w);
  }
  if (p.out_kind == OutKind::kActivations) {
    if (plain_bytes == 4) {
      *reinterpret_cast<float4*>(static_cast<float*>(p.out) + i) = make_float4(y[0], y[1], y[2], y[3]);
    } else if (p.dtype == DType::kBFloat16) {
      __nv_bfloat162 h[2] = {__floats2bfloat162_rn(y[0], y[1]), __floats2bfloat162_rn(y[2], y[3])};
      *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.out) + i) = *reinterpret_cast<uint2*>(h);
    } else {
      __half2 h[2] = {__floats2half2_rn(y[0], y[1]), __floats2half2_rn(y[2], y[3])};
      *reinterpret_cast<uint2*>(static_cast<__half*>(p.out) + i) = *reinterpret_cast<uint2*>(h);
    }
    return;
  }
  float4 sc = make_float4(p.out_scale, p.out_scale, p.out_scale, p.out_scale);
  if (p.out_scales != nullptr) sc = *reinterpret_cast<const float4*>(p.out_scales + channel);
  const uint32_t packed = quantised_byte(p, y[0], sc.x) | quantised_byte(p, y[1], sc.y) << 8 |
                          quantised_byte(p, y[2], sc.z) << 16 | quantised_byte(p, y[3], sc.w) << 24;
  *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(p.out) + i) = packed;
}

template <typename T, bool EPI>
__device__ __forceinline__ void store_out4(const MmhaParams& p, int64_t i, int channel, float4 x) {
  if constexpr (EPI) {
    store_out4_epilogue(p, i, channel, x, sizeof(T));
  } else {
    T* o = static_cast<T*>(p.out) + i;
    o[0] = from_float<T>(x.x);
    o[1] = from_float<T>(x.y);
    o[2] = from_float<T>(x.z);
    o[3] = from_float<T>(x.w);
  }
}

}  // namespace mmha
