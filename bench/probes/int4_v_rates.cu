// How fast can a consumer warp turn int4 V codes into P V products? The int4 step takes about 4e12
// K/V values a second on an H200's long rows, int8's rate, where its bytes alone would allow
// twice that (docs/status.md, 2026-12-03 afternoon); V's widening and mmas are a third of its
// instructions. This probe times the V loop alone, its tile in shared memory (no DRAM, no K, no
// softmax), in two forms:
//   half  the kernel's form (attend_int4.cuh): a lane's 32-bit word of nibbles (8 values of a
//         16-channel x 16-key A fragment) to fp16 codes less 8 (one shift, four lop3, four hsub2),
//         one m16n8k16 per word against P^T as fp16 (two packs of four fp32 weights).
//   u8    V on integer products: two words (16 values of a 16-channel x 32-key fragment) to bytes
//         (the low and high nibbles of each word masked apart: three instructions a word), one
//         m16n8k32 u8 x u8 -> s32 per two words against P^T as u8 (eight fp32 weights rounded to
//         bytes and packed), the s32 sums moved to fp32 every FLUSH tiles (I2F + FFMA each).
//         The layout it assumes (four keys of a channel in one register) is not the cache's today:
//         V is stored a token a row; this measures what the change would buy before building it.
//         Its P' in fixed point fails on long rows with a tail of small weights (one byte up to 2x
//         the output's size at 128K keys, two bytes 6 %: bench/probes/fixed_point_p.py), so a u8
//         form would need a scale per 32-key slice (its sums to fp32 every slice: twice the
//         conversions of FLUSH = 1 below, which moves them once a 64-key tile).
// Each block (4 warps) streams its warps over one 64-key x 128-channel tile `iters` times; the grid
// puts `bps` blocks on each SM. Reported: V values a second (keys x 128 channels, all warps).
// For scale: the 0.30x bar on the long rows needs about 7.6e12 K + V values a second, half of
// them V, beside everything else a step does.
//
// Build and run on an sm_80+ GPU:
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/int4_v_rates \
//     bench/probes/int4_v_rates.cu && /tmp/int4_v_rates
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "../../csrc/kernels/ptx.cuh"  // the kernels' mma wrappers and and_or
#include "probe_check.h"

namespace {

constexpr int kWarps = 4;
constexpr int kKeys = 64;
constexpr int kChannels = 128;
constexpr int kMTiles = kChannels / 16;
constexpr int kTileWords = kKeys * kChannels / 8;  // 32-bit words of nibbles: 1,024 (4 KB)

__device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *reinterpret_cast<const uint32_t*>(&h); }
__device__ __forceinline__ __half2 bits_h2(uint32_t u) { return *reinterpret_cast<const __half2*>(&u); }

__device__ __forceinline__ void mma_16832_u8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A lane's first weights, different across lanes, in [0.25, 0.33).
__device__ __forceinline__ void first_weights(float (&p)[8], int lane) {
#pragma unroll
  for (int e = 0; e < 8; ++e) p[e] = 0.25f + 0.01f * ((lane + e) % 8);
}

// Weights that change every slice, as P does (two FFMA a value), in [0.25, 1).
__device__ __forceinline__ void next_weights(float* p, int n) {
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    if (e < n) p[e] = fmaf(p[e], 0.75f, 0.25f);
  }
}

__global__ void __launch_bounds__(kWarps * 32) v_half(const uint32_t* codes, int iters, float* out) {
  __shared__ uint32_t tile[kTileWords];
  for (int i = threadIdx.x; i < kTileWords; i += blockDim.x) tile[i] = codes[i];
  __syncthreads();
  const int lane = threadIdx.x % 32;
  float acc[kMTiles][4] = {};
  float p[8];
  first_weights(p, lane);
  for (int it = 0; it < iters; ++it) {
#pragma unroll 1
    for (int slice = 0; slice < kKeys / 16; ++slice) {
      next_weights(p, 4);
      const uint32_t b0 = mmha::pack_rn<__half>(p[0], p[1]), b1 = mmha::pack_rn<__half>(p[2], p[3]);
#pragma unroll
      for (int i = 0; i < kMTiles; ++i) {
        const uint32_t w = tile[(slice * kMTiles + i) * 32 + lane];
        uint32_t a[4];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t x = w >> (8 * j);
          a[2 * j] = h2_bits(__hsub2(bits_h2(mmha::and_or(x, 0x000F000Fu, 0x64006400u)), __float2half2_rn(1032.f)));
          a[2 * j + 1] = h2_bits(__hsub2(bits_h2(mmha::and_or(x, 0x00F000F0u, 0x54005400u)), __float2half2_rn(72.f)));
        }
        mmha::mma_16816<__half>(acc[i], a, b0, b1);
      }
    }
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kMTiles; ++i) s += acc[i][0] + acc[i][1] + acc[i][2] + acc[i][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <int FLUSH>
__global__ void __launch_bounds__(kWarps * 32) v_u8(const uint32_t* codes, int iters, float* out) {
  __shared__ uint2 tile[kTileWords / 2];
  const uint2* src = reinterpret_cast<const uint2*>(codes);
  for (int i = threadIdx.x; i < kTileWords / 2; i += blockDim.x) tile[i] = src[i];
  __syncthreads();
  const int lane = threadIdx.x % 32;
  float acc[kMTiles][4] = {};
  int sums[kMTiles][4] = {};
  float p[8];
  first_weights(p, lane);
  for (int it = 0; it < iters; ++it) {
#pragma unroll 1
    for (int slice = 0; slice < kKeys / 32; ++slice) {
      next_weights(p, 8);
      uint32_t q[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) q[e] = __float2uint_rn(p[e] * 255.f);
      const uint32_t b0 = __byte_perm(__byte_perm(q[0], q[1], 0x0040), __byte_perm(q[2], q[3], 0x0040), 0x5410);
      const uint32_t b1 = __byte_perm(__byte_perm(q[4], q[5], 0x0040), __byte_perm(q[6], q[7], 0x0040), 0x5410);
#pragma unroll
      for (int i = 0; i < kMTiles; ++i) {
        const uint2 w = tile[(slice * kMTiles + i) * 32 + lane];
        const uint32_t a[4] = {w.x & 0x0F0F0F0Fu, (w.x >> 4) & 0x0F0F0F0Fu, w.y & 0x0F0F0F0Fu,
                               (w.y >> 4) & 0x0F0F0F0Fu};
        mma_16832_u8(sums[i], a, b0, b1);
      }
    }
    if constexpr (FLUSH > 0) {
      if ((it + 1) % FLUSH != 0) continue;
#pragma unroll
      for (int i = 0; i < kMTiles; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc[i][e] = fmaf(static_cast<float>(sums[i][e]), 1.f / 255.f, acc[i][e]);
          sums[i][e] = 0;
        }
      }
    }
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kMTiles; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s += acc[i][e] + static_cast<float>(sums[i][e]);
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

__global__ void random_words(uint32_t* x, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i + 1) * 2654435761u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = h;
  }
}

}  // namespace

int main() {
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, dev));
  uint32_t* codes = nullptr;
  float* out = nullptr;
  CHECK(cudaMalloc(&codes, kTileWords * sizeof(uint32_t)));
  CHECK(cudaMalloc(&out, static_cast<size_t>(sms) * 16 * kWarps * 32 * sizeof(float)));
  random_words<<<4, 256>>>(codes, kTileWords);
  CHECK(cudaGetLastError());
  const int iters = 4096;
  std::printf("%s, %d SMs; V values a second (1e12), the tile in shared memory, %d warps a block\n",
              prop.name, sms, kWarps);
  std::printf("warps/SM   half    u8 flush/tile   u8 flush/16 tiles   u8 never\n");
  const int per_sm[] = {1, 2, 3, 4, 6, 8};
  for (int bps : per_sm) {
    const int blocks = sms * bps;
    const double values = static_cast<double>(blocks) * kWarps * iters * kKeys * kChannels;
    auto rate = [&](auto kernel) {
      const float ms = best_of_runs([&](int) { kernel<<<blocks, kWarps * 32>>>(codes, iters, out); });
      return values / (ms * 1e-3) / 1e12;
    };
    std::printf("%8d  %6.2f  %14.2f  %18.2f  %9.2f\n", bps * kWarps, rate(v_half), rate(v_u8<1>), rate(v_u8<16>),
                rate(v_u8<0>));
  }
  CHECK(cudaFree(codes));
  CHECK(cudaFree(out));
  return 0;
}
