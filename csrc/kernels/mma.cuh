// Tensor-core Q.K for grouped-query blocks: mma.sync m16n8k16 (fp16/bf16 in, fp32 accumulate).
// Torch-free.
//
// One mma computes S^T[16 keys][8 heads] += K[16 keys][16 dims] . q^T[16 dims][8 heads].
// The dot product sums over dims, so which dim sits at which k-index is free as long as K and q
// agree. Lane (r = lane / 4, c = lane % 4) loads whole 16-byte chunks of keys r and r + 8:
// chunk X = 4p + c for p = 0 .. CHUNKS/4 - 1, and uses its halves {0,1 | 2,3} as its A k-indices
// {2c, 2c+1 | 2c+8, 2c+9} of mma 2p and halves {4,5 | 6,7} of mma 2p + 1. For each K chunk the
// 8 lanes of one c read 8 consecutive keys: 128 contiguous bytes in the [D/x, S_max, x] layout.
// q is held as B fragments in the same dim order, split into a 16-bit high part and a 16-bit
// remainder so that q keeps ~fp32 precision (two mmas per step, both exact products).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace mmha {

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <typename T>
__device__ __forceinline__ float round_trip(float v) {
  return to_float(from_float<T>(v));
}

// d[4] += A (4 x b32: rows r / r+8, k 2c.. / 2c+8..) . B (2 x b32: k 2c.. / 2c+8.., col r).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();
#endif
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();
#endif
}

// B fragments of q (fp32 in shared memory, rows = heads, zero past the block's heads): for mma j
// = 2p + s, lane (r, c) holds q[r][8X + 4s + {0,1}] and q[r][8X + 4s + {2,3}] with X = 4p + c.
template <typename T, int HEAD_DIM, int QB>
struct QFragments {
  static constexpr int MMAS = HEAD_DIM / 16;
  uint32_t hi[MMAS][2];
  uint32_t lo[MMAS][2];

  __device__ __forceinline__ void load(const float (*s_q)[HEAD_DIM], int lane) {
    const int r = lane / 4;
    const int c = lane % 4;
#pragma unroll
    for (int j = 0; j < MMAS; ++j) {
      const int base = (4 * (j / 2) + c) * 8 + 4 * (j % 2);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float x0 = r < QB ? s_q[r][base + 2 * h] : 0.f;
        const float x1 = r < QB ? s_q[r][base + 2 * h + 1] : 0.f;
        const float h0 = round_trip<T>(x0);
        const float h1 = round_trip<T>(x1);
        hi[j][h] = pack2<T>(h0, h1);
        lo[j][h] = pack2<T>(x0 - h0, x1 - h1);
      }
    }
  }
};

}  // namespace mmha
