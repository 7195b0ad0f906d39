// The tile loop's consumer warps over an int4 cache (mmha/int4.py; one-token steps, contiguous
// or paged caches; the tiles: int4_tiles.cuh, the step around them: int4_step.cuh). Torch-free.
//
// A tile of committed keys is one K group (its codes, scales and zero points). The row's
// last group (the keys still in the K residual, the new token among them) is read by the item
// that holds it from the residual area (fp16, after the stages), which the consumers fill at the
// item's first tile; on the step that completes a group (slot pos % 64 == 63) they quantise it
// there and attend to its dequantised values, as mmha.int4 reads a committed group (column block
// 0 writes the group's codes, scales and zero points to the cache with the append).
//
// The consumer warps (kConsumerWarps, 16 keys each, as in attend_tiles.cuh) compute
//   S^T = K Q^T    m16n8k16, A = K: a committed key's nibbles as the halves 1024 + code (even
//                  nibbles) and 64 + code (odd ones), one lop3 each; B = q' = q * k_scale (fp16,
//                  per tile: the group's scales fold into q). Two more mmas a K step add the
//                  tile's bias, the same for every key: A = the zero points against B = q (q . z),
//                  and A = -1024 / -64 against q' (the codes' offsets). Residual keys as stored
//                  against q. q is one fp16 part (as for fp8), scaled so q' stays finite.
//   O^T += V^T P^T A = V^T as the codes less 8 (1024 + code less 1032, exact, in [-8, 7]: the
//                  mma's fp32 chain loses low bits one-sidedly at acc's magnitude, so what the
//                  sums carry besides the values' spread, an offset or the codes' mean, leaves
//                  acc an error that grows with the row; centred codes carry ~0.5 of it against
//                  7.5); B = P * v_scale[key] / v_unit (v_unit the largest V scale the warp has
//                  seen, as int8's). Each key's zero point, plus 8 of its scales, adds
//                  P * (zero + 8 scale) to every channel: z_sum (fp32 adds, rounded to nearest).
// K's nibble order (mmha/int4.py, K_NIBBLES) puts channels 2i, 2i + 1 side by side in the halves a
// mask of a word gives, so q, the K scales and the zero points pair channels as they lie. V's
// nibbles reach a lane four channels apart, so the output is in a permuted head-dim order
// (out_dim) that the stores follow.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attend_common.cuh"
#include "int4_tiles.cuh"
#include "ptx.cuh"
#include "score_mods.cuh"
#include "vec.cuh"
#include "warp_combine.cuh"

namespace mmha {

__device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *reinterpret_cast<const uint32_t*>(&h); }
__device__ __forceinline__ __half2 bits_h2(uint32_t u) { return *reinterpret_cast<const __half2*>(&u); }

// K's nibbles 2j and 2j + 1 of each 16-bit half of w (channel pairs j and j + 2 of the word's 8,
// K_NIBBLES: channels 2j, 2j + 1 and 2j + 4, 2j + 5) as the halves 1024 + code and 64 + code, one
// lop3 each after one shift (none for j = 0), exact (the code as the low mantissa bits of 1024.0,
// or as bits 4-7 of 64.0, whose unit there is 1).
__device__ __forceinline__ void k_nibble_halves(uint32_t w, int j, uint32_t& even, uint32_t& odd) {
  const uint32_t x = w >> (8 * j);
  even = and_or(x, 0x000F000Fu, 0x64006400u);
  odd = and_or(x, 0x00F000F0u, 0x54005400u);
}
constexpr uint32_t kInt4EvenOffset = 0xE400E400u;  // -1024.0 twice: taken off the even halves
constexpr uint32_t kInt4OddOffset = 0xD400D400u;   // -64.0 twice: taken off the odd halves

// Nibbles 2j and 2j + 1 of each 16-bit half of w (low half: bits 8j.., high half: bits 16 + 8j..)
// as exact fp16 codes less 8 (kInt4VCentre): one shift for both (none for j = 0), then one lop3
// and one half op each. The even nibble reads as 1024 + code (less 1032), the odd one in place as
// 64 + code (less 72): both exact, in [-8, 7].
constexpr float kInt4VCentre = 8.f;
__device__ __forceinline__ void nibble_pair_codes(uint32_t w, int j, __half2& even, __half2& odd) {
  const uint32_t x = w >> (8 * j);
  even = __hsub2(bits_h2(and_or(x, 0x000F000Fu, 0x64006400u)), __float2half2_rn(kInt4Bias + kInt4VCentre));
  odd = __hsub2(bits_h2(and_or(x, 0x00F000F0u, 0x54005400u)), __float2half2_rn(64.f + kInt4VCentre));
}

// One consumer warp over an int4 cache: its q fragments and running (max, sum, acc), for up to
// 8 query heads of one kv head (the interface of TileConsumer, attend_tiles.cuh).
template <int HEAD_DIM, int QB>
struct Int4Consumer {
  static_assert(QB <= 8, "one m16n8k16 tile holds at most 8 query heads");
  using L = TileLayout<u4, HEAD_DIM>;
  static constexpr int KSTEPS = HEAD_DIM / 16;
  static constexpr int CHUNKS = HEAD_DIM / kInt4Channels;
  static constexpr int RES_PITCH = HEAD_DIM + 8;  // halves per residual row (16 bytes of padding)
  static constexpr float kRescaleSlack = 8.f;
  // The fragment columns a lane weighs: heads 2tq and 2tq + 1, only the first where an item has
  // one head (the second is never a head: its P is 0).
  static constexpr int kLaneHeads = QB == 1 ? 1 : 2;

  uint32_t qh[KSTEPS][2];  // B fragments of q^T (fp16), channels q_dim and q_dim + 1 in each register
  float m[2], l[2];        // heads 2tq, 2tq + 1
  float acc[KSTEPS][4];    // O^T in units of v_unit (without the codes' bias): rows out_dim(i, g, 0 / 1)
  float s_unit;            // scores are the mma's times this power of two
  float v_unit;            // the largest V scale of the warp's keys so far
  float v_inv;             // 1 / v_unit (0 while v_unit is 0), taken when v_unit grows
  float z_sum[2];          // sum of P * (v_zero + 8 v_scale) over this lane's keys (absolute units)
  ScoreTransform<2> mods;
  int res_k0;              // the tile read from the residual area (its first key), or -1
  const __half* res;       // the residual area: [KEYS][RES_PITCH] fp16, channels at res_col

  // K step j, lane quad tq, register h: channels q_dim and q_dim + 1 (a committed key's channels
  // 8tq + 2i and 8tq + 2i + 1 of its chunk, i = j % 2 + 2h: word i of the lane's scales).
  __device__ __forceinline__ static int q_dim(int j, int tq, int h) { return 32 * (j / 2) + 8 * tq + 2 * (j % 2) + 4 * h; }
  // M tile i, row g (h = 0) or g + 8 (h = 1): nibble 2 (i % 2) + h of the 16-bit unit g of a V row's chunk i / 2.
  __device__ __forceinline__ static int out_dim(int i, int g, int h) { return 32 * (i / 2) + 4 * g + 2 * (i % 2) + h; }
  // Where channel d sits in a residual row: the 16-bit K reader's column of the q pairing.
  __device__ __forceinline__ static int res_col(int d) {
    const int c = d / 32, r = d % 32;
    const int tq = r / 8, s = (r % 4) / 2, h = (r % 8) / 4, e = r % 2;
    return 16 * (2 * c + s) + 2 * tq + e + 8 * h;
  }

  template <class ColumnOf>
  __device__ __forceinline__ void init(const float (&s_q)[QB][HEAD_DIM + kQRowPad], int nh, float scale_log2, int lane,
                                       const MmhaParams& p, ColumnOf column, bool, int, const uint64_t* = nullptr) {
    const int g = lane / 4;
    const int tq = lane % 4;
    int heads[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool used = 2 * tq + h < nh;
      heads[h] = used ? column(2 * tq + h).head : -1;
    }
    mods.init(p.mods, heads);
    float qv[KSTEPS][2][2];
    float qmax = 0.f;
#pragma unroll
    for (int j = 0; j < KSTEPS; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int d = q_dim(j, tq, h);  // even: (d, d + 1) one 8-byte load (rows padded: kQRowPad)
        const float2 q2 = *reinterpret_cast<const float2*>(&s_q[g < QB ? g : 0][d]);
        qv[j][h][0] = g < nh ? q2.x * scale_log2 : 0.f;
        qv[j][h][1] = g < nh ? q2.y * scale_log2 : 0.f;
        qmax = fmaxf(qmax, fmaxf(fabsf(qv[j][h][0]), fabsf(qv[j][h][1])));
      }
    }
#pragma unroll
    for (int off = 1; off < 32; off *= 2) qmax = fmaxf(qmax, __shfl_xor_sync(kFullMask, qmax, off));
    // q's largest |value| to [2, 4): q' = q * k_scale then stays below fp16's largest (a finite
    // scale is at most 2 * 65504 / 15).
    float q_unit = 1.f;
    s_unit = 1.f;
    if (qmax > 0.f && qmax <= 3.0e38f) {
      int e = 0;
      frexpf(qmax, &e);
      const int shift = max(-100, min(100, 2 - e));
      q_unit = ldexpf(1.f, shift);
      s_unit = ldexpf(1.f, -shift);
    }
#pragma unroll
    for (int j = 0; j < KSTEPS; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) qh[j][h] = h2_bits(__floats2half2_rn(qv[j][h][0] * q_unit, qv[j][h][1] * q_unit));
    }
    v_unit = 0.f;
    v_inv = 0.f;
    z_sum[0] = z_sum[1] = 0.f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
    }
    res_k0 = -1;
    res = nullptr;
  }

  __device__ __forceinline__ void residual(int k0, const __half* area) {
    res_k0 = k0;
    res = area;
  }

  // The new token (slot pos, if among keys [it, it + 16) of the warp): its V codes and V scale
  // and zero point into the stage. (Its K is in the residual area.)
  __device__ __forceinline__ static void patch(unsigned char* stage, int key0, int it, int pos, const uint8_t* v_codes,
                                               const float* v_range, int lane) {
    if (it <= pos && pos < it + 16) {
      const int key = key0 + pos - it;
      for (int c = lane; c < L::CHUNKS; c += 32) {
        *reinterpret_cast<uint4*>(stage + L::v_off(key, c, 0)) = *reinterpret_cast<const uint4*>(v_codes + 16 * c);
      }
      if (lane < 2) {
        reinterpret_cast<__half*>(stage + (lane == 0 ? L::V_SCALE_OFF : L::V_ZERO_OFF))[key] =
            __float2half_rn(v_range[lane]);
      }
    }
    fence_proxy_async_smem();
    __syncwarp();
  }

  template <int N>
  __device__ __forceinline__ void steps(const unsigned char* const (&stage)[N], int key0, int kg, const int (&its)[N],
                                        int lo, int end, int pos, int lane) {
#pragma unroll
    for (int n = 0; n < N; ++n) step(stage[n], key0, kg, its[n], lo, end, pos, lane);
  }

  // Attend over keys [key0, key0 + 16) of a stage, the cache's keys [it, it + 16) (those before lo
  // or at or past end masked), the query at slot pos.
  __device__ __forceinline__ void step(const unsigned char* stage, int key0, int, int it, int lo, int end, int pos,
                                       int lane) {
    const int g = lane / 4;
    const int tq = lane % 4;
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    float s_odd[4] = {0.f, 0.f, 0.f, 0.f};  // odd K steps: a second chain
    if (it - key0 == res_k0) {
      const __half* base = res + (key0 + lane % 16) * RES_PITCH + (lane / 16) * 8;
#pragma unroll
      for (int j = 0; j < KSTEPS; ++j) {
        uint32_t a[4];
        ldmatrix_x4<false>(a, base + 16 * j);
        mma_16816<__half>(j % 2 ? s_odd : s, a, qh[j][0], qh[j][1]);
      }
    } else {
      // The tile's bias (the same for every key) in chains of its own: q . z and q' . offsets.
      // The zero points' A is the lane's 4 words as loaded: for K step 2c its rows g hold
      // channel pairs 0 and 2 against q's (the bias of every key), for step 2c + 1 its rows g + 8
      // pairs 1 and 3; each chain's other rows are left unread.
      float s_z0[4] = {0.f, 0.f, 0.f, 0.f};
      float s_z1[4] = {0.f, 0.f, 0.f, 0.f};
      float s_c[4] = {0.f, 0.f, 0.f, 0.f};
      const __half* k_scale = reinterpret_cast<const __half*>(stage + L::SCALE_OFF);
      const __half* k_zero = reinterpret_cast<const __half*>(stage + L::K_ZERO_OFF);
      const uint32_t off[4] = {kInt4EvenOffset, kInt4EvenOffset, kInt4OddOffset, kInt4OddOffset};
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        uint32_t r[2];  // keys g and g + 8: channels 32c + 8tq .. 32c + 8tq + 7
        ldmatrix_x2<false>(r, stage + L::k_off(key0 + lane % 16, c, 0));
        const uint4 sc = *reinterpret_cast<const uint4*>(k_scale + 32 * c + 8 * tq);
        const uint4 zc = *reinterpret_cast<const uint4*>(k_zero + 32 * c + 8 * tq);
        const uint32_t sw[4] = {sc.x, sc.y, sc.z, sc.w};  // channel pairs 8tq + 2i, 8tq + 2i + 1
        const uint32_t z[4] = {zc.x, zc.y, zc.z, zc.w};
#pragma unroll
        for (int sub = 0; sub < 2; ++sub) {
          const int j = 2 * c + sub;
          uint32_t a[4];  // [key g / g + 8] of the even halves (pair sub), then of the odd (sub + 2)
          k_nibble_halves(r[0], sub, a[0], a[2]);
          k_nibble_halves(r[1], sub, a[1], a[3]);
          const uint32_t q0 = h2_bits(__hmul2(bits_h2(qh[j][0]), bits_h2(sw[sub])));
          const uint32_t q1 = h2_bits(__hmul2(bits_h2(qh[j][1]), bits_h2(sw[sub + 2])));
          mma_16816<__half>(sub ? s_odd : s, a, q0, q1);
          mma_16816<__half>(sub ? s_z1 : s_z0, z, qh[j][0], qh[j][1]);
          mma_16816<__half>(s_c, off, q0, q1);
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) s[e] += s_c[e] + (s_z0[e & 1] + s_z1[2 + (e & 1)]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) s[e] = (s[e] + s_odd[e]) * s_unit;
    if (mods.on) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[e] = mods.apply<true>(s[e], e & 1, it + g + (e & 2 ? 8 : 0), pos);
    }
    if (it + g >= end || it + g < lo) s[0] = s[1] = -INFINITY;
    if (it + g + 8 >= end || it + g + 8 < lo) s[2] = s[3] = -INFINITY;

    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int h = 0; h < kLaneHeads; ++h) {
      mx[h] = fmaxf(s[h], s[h + 2]);  // the lane's: reduced only where m is raised
    }
    float alpha[2];
    if (raise_max(m, l, acc, mx, kRescaleSlack, alpha)) {  // warp_combine.cuh
      z_sum[0] *= alpha[0];
      z_sum[1] *= alpha[1];
    }
    // The V scales and zero points of keys g and g + 8 (none outside [lo, end): their copies may
    // be strays), the scales over v_unit (raised first where a key outgrew it).
    const __half* v_scale = reinterpret_cast<const __half*>(stage + L::V_SCALE_OFF) + key0 + g;
    const __half* v_zero = reinterpret_cast<const __half*>(stage + L::V_ZERO_OFF) + key0 + g;
    const int t = it + g;
    const bool in0 = t < end && t >= lo, in1 = t + 8 < end && t + 8 >= lo;
    float vw[2] = {in0 ? __half2float(v_scale[0]) : 0.f, in1 ? __half2float(v_scale[8]) : 0.f};
    // The zero points with the codes' centre: value = (code - 8) scale + (zero + 8 scale).
    const float vz[2] = {in0 ? fmaf(kInt4VCentre, vw[0], __half2float(v_zero[0])) : 0.f,
                         in1 ? fmaf(kInt4VCentre, vw[1], __half2float(v_zero[8])) : 0.f};
    const float vmax_lane = fmaxf(vw[0], vw[1]);
    if (__any_sync(kFullMask, vmax_lane > v_unit)) {  // a key outgrew the unit: reduced only then
      const float vmax = lanes_max<4, 16>(vmax_lane);
      const float r = v_unit / vmax;
#pragma unroll
      for (int i = 0; i < KSTEPS; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] *= r;
      }
      v_unit = vmax;
      v_inv = 1.f / vmax;
    }
    vw[0] *= v_inv;
    vw[1] *= v_inv;
#pragma unroll
    for (int h = 0; h < kLaneHeads; ++h) {
      const float m_ref = m[h] == -INFINITY ? 0.f : m[h];
      s[h] = exp2_ftz(s[h] - m_ref);
      s[h + 2] = exp2_ftz(s[h + 2] - m_ref);
      l[h] += s[h] + s[h + 2];
      z_sum[h] += s[h] * vz[0] + s[h + 2] * vz[1];
      s[h] *= vw[0];
      s[h + 2] *= vw[1];
    }
    if constexpr (kLaneHeads == 1) s[1] = s[3] = 0.f;
    const __half2 p0 = __floats2half2_rn(s[0], s[1]);  // key g: heads 2tq, 2tq + 1
    const __half2 p1 = __floats2half2_rn(s[2], s[3]);  // key g + 8
    const uint32_t ph0 = movmatrix_trans(h2_bits(p0));
    const uint32_t ph1 = movmatrix_trans(h2_bits(p1));
    // O^T += V^T P^T: chunk c of the keys' V rows gives M tiles 2c and 2c + 1 (rows g, g + 8:
    // nibbles 2 sub, 2 sub + 1 of the lane's 16-bit units).
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      uint32_t r[2];  // keys 2tq, 2tq + 1 | 2tq + 8, 2tq + 9: channels 32c + 4g .. 32c + 4g + 3
      ldmatrix_x2<true>(r, stage + L::v_off(key0 + lane % 16, c, 0));
#pragma unroll
      for (int sub = 0; sub < 2; ++sub) {
        __half2 n[4];  // rows g, g + 8 of keys 2tq, 2tq + 1, then of keys 2tq + 8, 2tq + 9
        nibble_pair_codes(r[0], sub, n[0], n[1]);
        nibble_pair_codes(r[1], sub, n[2], n[3]);
        uint32_t a[4] = {h2_bits(n[0]), h2_bits(n[1]), h2_bits(n[2]), h2_bits(n[3])};
        mma_16816<__half>(acc[2 * c + sub], a, ph0, ph1);
      }
    }
  }

  // At an item's end, before its combine: acc back from units of v_unit, plus the zero points'
  // part (the codes' centre with it).
  __device__ __forceinline__ void finish() {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int off = 4; off < 32; off *= 2) {
        z_sum[h] += __shfl_xor_sync(kFullMask, z_sum[h], off);
      }
    }
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][e] = fmaf(acc[i][e], v_unit, z_sum[e & 1]);
    }
  }

  // The block combine through a buffer per warp (stash_warp, warp_combine.cuh).
  __device__ __forceinline__ void stash(float (*s_m)[QB], float (*s_l)[QB], float (*acc_w)[QB][HEAD_DIM], int warp,
                                        int lane) {
    stash_warp<QB, HEAD_DIM, KSTEPS>(m, l, acc, s_m, s_l, acc_w, warp, lane,
                                     [](int i, int g, int h) { return out_dim(i, g, h); });
  }

  // The block combine warp by warp into buf (combine_warps, warp_combine.cuh).
  __device__ __forceinline__ void combine(float (*s_m)[QB], float (*s_l)[QB], float* buf, int warp, int lane) {
    combine_warps<QB, HEAD_DIM, KSTEPS>(m, l, acc, s_m, s_l, buf, warp, lane,
                                        [](int i, int g, int h) { return out_dim(i, g, h); });
  }
};

}  // namespace mmha
