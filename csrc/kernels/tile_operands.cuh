// How the tile loop's consumer warps read a stage's K and V as tensor-core fragments: 16-bit
// caches as cached (ldmatrix), fp8 e4m3 caches and int8 V widened to fp16 in registers after the
// same ldmatrix, int8 K as it lies for integer products (no dequantised copy anywhere; fp8's
// scales are applied to q and to the output, int8's per-token scales to the scores and the
// probabilities: attend_tiles.cuh).
// Torch-free.
//
// An operand reader provides, for cache elements C and head dim HEAD_DIM:
//   M                          the mma element type (C, or __half for e4m3 and int8)
//   q_dim(j, tq, h)            the head-dim index of q's B-fragment register h (0: b0, 1: b1) of
//                              lane quad tq at K step j; elements d and d + 1 go in its halves
//   out_dim(i, g, h)           the head-dim index of O^T's accumulator row g (h = 0) or g + 8
//                              (h = 1) of M tile i
//   k_pair(a, stage, key0, j, lane, kg)
//                              A fragments of S^T = K Q^T for K steps j and j + 1 (keys key0 ..
//                              key0 + 15; step j + 1 only where it exists), K in groups of 2^kg
//                              keys (TileLayout::k_off)
//   k_bytes(r, stage, key0, j, lane, kg)
//                              one-byte caches: the same K steps' bytes unwidened (int8: the A
//                              fragment of an m16n8k32 product)
//   v_pair(a, stage, key0, i, lane, kg)
//                              A fragments of O^T += V^T P^T for M tiles i and i + 1
// q_dim and out_dim say which head dims a fragment row stands for: an fp8 chunk is 16 dims of
// one key, and ldmatrix hands each lane 4 consecutive bytes, so the readers of fp8 permute the
// head dim (consistently for q and K, and for V and the output) instead of the bytes.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "ptx.cuh"
#include "tile_layout.cuh"
#include "vec.cuh"

namespace mmha {

template <typename C, int HEAD_DIM>
struct TileOperands {
  using L = TileLayout<C, HEAD_DIM>;
  using M = C;
  static constexpr int KSTEPS = HEAD_DIM / 16;

  __device__ __forceinline__ static int q_dim(int j, int tq, int h) { return 16 * j + 2 * tq + 8 * h; }
  __device__ __forceinline__ static int out_dim(int i, int g, int h) { return 16 * i + g + 8 * h; }

  // Lanes 0-15 address keys 0-15 of 8-element chunk 2j, lanes 16-31 of chunk 2j + 1 (a lane's
  // address moves by 2^kg * 16 bytes per chunk).
  template <typename G>
  __device__ __forceinline__ static void k_pair(uint32_t (&a)[2][4], const unsigned char* stage, int key0, int j,
                                                int lane, G kg) {
    const unsigned char* base = stage + L::k_off(key0 + lane % 16, lane / 16, kg);
    ldmatrix_x4<false>(a[0], base + ((2 * j) << (kg + 4)));
    if (j + 1 < KSTEPS) ldmatrix_x4<false>(a[1], base + ((2 * j + 2) << (kg + 4)));
  }

  // ldmatrix.trans of keys v_row (+ 8), chunks 2i + v_half.
  template <typename G>
  __device__ __forceinline__ static void v_pair(uint32_t (&a)[2][4], const unsigned char* stage, int key0, int i,
                                                int lane, G kg) {
    const int v_row = key0 + lane % 8 + (lane / 16) * 8;
    const int v_half = (lane / 8) % 2;
    ldmatrix_x4<true>(a[0], stage + L::v_off(v_row, 2 * i + v_half, kg));
    if (i + 1 < KSTEPS) ldmatrix_x4<true>(a[1], stage + L::v_off(v_row, 2 * i + 2 + v_half, kg));
  }
};

// One-byte caches (fp8 e4m3, int8 codes): a 16-byte chunk is 16 dims of one key. One ldmatrix
// (b16 view) covers two K steps (or M tiles); each lane's 4 bytes are widened to two half2
// exactly: e4m3 by cvt.rn.f16x2.e4m3x2 to its value, an int8 code by a byte permute to 1152 +
// code (kInt8Bias; the consumer takes the bias out of its sums).
template <typename C, int HEAD_DIM>
struct ByteTileOperands {
  using L = TileLayout<C, HEAD_DIM>;
  using M = __half;
  static constexpr int KSTEPS = HEAD_DIM / 16;
  static constexpr bool kInt8 = std::is_same_v<C, s8>;

  // K: lane (g, tq) receives bytes 4tq .. 4tq + 3 of key g's chunk, i.e. dims 4tq, 4tq + 1 (the
  // fragment's columns 2tq, 2tq + 1) and 4tq + 2, 4tq + 3 (columns 2tq + 8, 2tq + 9).
  __device__ __forceinline__ static int q_dim(int j, int tq, int h) { return 16 * j + 4 * tq + 2 * h; }
  // V: lane (g, tq) receives dims 2g, 2g + 1 of keys 2tq, 2tq + 1: rows g and g + 8 of the M
  // tile stand for dims 2g and 2g + 1.
  __device__ __forceinline__ static int out_dim(int i, int g, int h) { return 16 * i + 2 * g + h; }

  // The bytes of K steps j and j + 1 as they lie (zeros past the last K step). Lanes 0-7 address
  // keys 0-7 of chunk j, 8-15 keys 8-15 of chunk j, 16-31 the same of j + 1, so lane (g, tq) holds
  // bytes 4tq .. 4tq + 3 of key g (r[0]) and key g + 8 (r[1]) of chunk j, r[2] and r[3] of chunk
  // j + 1: for int8 codes, the A fragment of one m16n8k32 product over 32 dims.
  template <typename G>
  __device__ __forceinline__ static void k_bytes(uint32_t (&r)[4], const unsigned char* stage, int key0, int j,
                                                 int lane, G kg) {
    if (j + 1 < KSTEPS) {
      ldmatrix_x4<false>(r, stage + L::k_off(key0 + lane % 16, lane / 16, kg) + (j << (kg + 4)));
    } else {
      uint32_t r2[2];
      ldmatrix_x2<false>(r2, stage + L::k_off(key0 + lane % 16, 0, kg) + (j << (kg + 4)));
      r[0] = r2[0], r[1] = r2[1], r[2] = r[3] = 0;
    }
  }

  // K steps j and j + 1 widened to fp16 A fragments.
  template <typename G>
  __device__ __forceinline__ static void k_pair(uint32_t (&a)[2][4], const unsigned char* stage, int key0, int j,
                                                int lane, G kg) {
    uint32_t r[4];
    k_bytes(r, stage, key0, j, lane, kg);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if constexpr (kInt8) {
        s8x4_to_biased_half2x2(r[2 * u], a[u][0], a[u][2]);
        s8x4_to_biased_half2x2(r[2 * u + 1], a[u][1], a[u][3]);
      } else {
        e4m3x4_to_half2x2(r[2 * u], a[u][0], a[u][2]);      // key g: dims 4tq, 4tq + 1 | 4tq + 2, 4tq + 3
        e4m3x4_to_half2x2(r[2 * u + 1], a[u][1], a[u][3]);  // key g + 8
      }
    }
  }

  // Transposed: lane (g, tq) receives [key 2tq: dims 2g, 2g + 1][key 2tq + 1: the same] of each
  // matrix; a byte permute makes it [dim 2g: keys 2tq, 2tq + 1][dim 2g + 1: the same].
  template <typename G>
  __device__ __forceinline__ static void v_pair(uint32_t (&a)[2][4], const unsigned char* stage, int key0, int i,
                                                int lane, G kg) {
    uint32_t r[4];
    if (i + 1 < KSTEPS) {
      ldmatrix_x4<true>(r, stage + L::v_off(key0 + lane % 16, i + lane / 16, kg));
    } else {
      uint32_t r2[2];
      ldmatrix_x2<true>(r2, stage + L::v_off(key0 + lane % 16, i, kg));
      r[0] = r2[0], r[1] = r2[1], r[2] = r[3] = 0;
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if constexpr (kInt8) {  // the permute folded into the widening's byte selectors
        s8x4_to_biased_half2x2_across(r[2 * u], a[u][0], a[u][1]);
        s8x4_to_biased_half2x2_across(r[2 * u + 1], a[u][2], a[u][3]);
      } else {
        const uint32_t lo = __byte_perm(r[2 * u], 0, 0x3120);      // keys 2tq, 2tq + 1
        const uint32_t hi = __byte_perm(r[2 * u + 1], 0, 0x3120);  // keys 2tq + 8, 2tq + 9
        e4m3x4_to_half2x2(lo, a[u][0], a[u][1]);  // dim 2g | dim 2g + 1
        e4m3x4_to_half2x2(hi, a[u][2], a[u][3]);
      }
    }
  }
};

template <int HEAD_DIM>
struct TileOperands<e4m3, HEAD_DIM> : ByteTileOperands<e4m3, HEAD_DIM> {};
template <int HEAD_DIM>
struct TileOperands<s8, HEAD_DIM> : ByteTileOperands<s8, HEAD_DIM> {};

}  // namespace mmha
