// Does a wide tree item's tile loop gain from FlashAttention-3's overlap within a warpgroup, and
// does its ring need K and V released apart for it? The ring of bench/probes/wgmma_rates.cu (a copy
// thread brings each 64-key tile, K 16 KB and V 16 KB, by bulk copies; a kv head's four readers a
// tile group, two blocks an SM, 2 stages; one warpgroup a block multiplying S = q K^T as 8 x
// m64n64k16 with q from shared memory and O += P V as 4 x m64n128k16 with P from registers), in
// three forms of the consumer's loop:
//   serial   S, wait, softmax, P V, wait, release the stage (the kernel's loop today)
//   held     S of tile t and P V of tile t - 1 issued together; wait for S; tile t's softmax while
//            P V runs; wait for P V; release tile t - 1's stage (K and V kept until then)
//   apart    held, with K and V on barriers of their own: tile t's K released once its S is done,
//            tile t - 1's V once its P V is; the copy thread refills each as soon as it is free
// (the softmax is the probes' stand-in, probe_softmax.h: max, two shuffles, 32 exp2 a thread, sums, packs; O
// is not rescaled in any form). P V of tile t - 1 runs beside tile t's softmax, so a stage is held
// half a tile longer than in the serial form: `held` tells what that costs with 2 stages, `apart`
// whether releasing K early gives it back. Between the two waits only the softmax's max, exp2 and
// sums run (in place of S); P's fp16 pack, which defines the next P V's operand registers, follows
// P V's wait, as FlashAttention-3 orders it (defined earlier, ptxas serialises the products:
// C7513 under -Xptxas -v). Prints TFLOP/s over the whole GPU (2 x 64 x 64 x 128 x 2 a tile) and
// each form's registers (two blocks an SM of 160 threads need <= 168).
//
// Build and run on an sm_90 GPU:
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Xptxas -v -o /tmp/wgmma_overlap \
//     bench/probes/wgmma_overlap.cu && timeout 60 /tmp/wgmma_overlap [TILES [zeros] [pieces]]
//   (default 256 tiles a block; K and V random unless `zeros`; `pieces`: the serial form with the
//   decode kernel's pieces, Extra below, instead of the three forms)
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "../../csrc/kernels/ptx.cuh"
#include "probe_check.h"
#include "probe_softmax.h"
#include "probe_wgmma.h"
#include "../../csrc/kernels/wgmma.cuh"

using namespace mmha;

constexpr int D = 128;                 // head dim
constexpr int Q_BYTES = 64 * D * 2;    // the warpgroup's q (64 columns)
constexpr int HALF = 16 * 1024;        // a tile's K (or V): 64 keys x 128 x 2 bytes
constexpr int TILE_BYTES = 2 * HALF;   // a stage
enum Form { kSerial, kHeld, kApart };
const char* kFormNames[] = {"serial", "held", "apart"};
// The decode kernel's pieces the serial form can take on (bits of EXTRA), one at a time or all:
//   kSpills   six values reloaded each tile by L1-cached loads of the thread's own words (as a
//             spill reload: ptxas keeps a volatile local array in registers), the tile's addresses
//             depending on them (the 16-bit wide kernel's tile loop reloads 5-6 spilled values a tile)
//   kHeader   a header per stage (the tile's first key) written by the copy thread before its
//             copies, on a barrier of its own that the consumers wait for, then read, before the
//             full barriers (the kernel's header and full waits)
//   kStager   a sixth warp polling a barrier that completes only at the block's end (the stager
//             waiting for its item slot's release): 192-thread blocks
enum Extra { kSpills = 1, kHeader = 2, kStager = 4 };

// S = q K^T of one tile (issued, not waited for).
__device__ __forceinline__ void issue_scores(float (&sc)[32], const unsigned char* sq, const unsigned char* sk) {
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    wgmma_m64n64k16_ss<__half, 0>(sc, wgmma_desc(sq + j * 2 * 64 * 16, 64 * 16, 128, false),
                                  wgmma_desc(sk + 2 * j * 64 * 16, 64 * 16, 128, false), j > 0);
  }
}

// O += P V of one tile (issued, not waited for).
__device__ __forceinline__ void issue_pv(float (&acc)[64], const uint32_t (&pa)[4][4], const unsigned char* sv) {
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    wgmma_m64n128k16_rs<__half, 1>(acc, pa[kb], wgmma_desc(sv + 16 * kb * 128, 64 * 128, 1024, true), 1);
  }
}

// Block b reads the `tiles` tiles of group b / readers (its readers neighbouring blocks), reader r
// starting r x skew tiles in. Stage s: K at s * TILE_BYTES, V HALF after it; full_k / full_v count
// the copies' bytes, empty_k / empty_v the consumers (kApart; else empty_v alone, for both).
template <int STAGES, int FORM, int EXTRA = 0>
__global__ void __launch_bounds__(192, 1)
    ring(const unsigned char* src, float* sink, const int* scratch, int tiles, int readers, int skew, int zero) {
  static_assert(EXTRA == 0 || FORM == kSerial, "the kernel's pieces go with the serial form");
  extern __shared__ unsigned char raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
  unsigned char* sq = smem;
  unsigned char* st = smem + Q_BYTES;
  __shared__ uint64_t full_k[STAGES], full_v[STAGES], empty_k[STAGES], empty_v[STAGES];
  __shared__ uint64_t header[STAGES], done;
  __shared__ int s_k0[STAGES];
  const int tid = threadIdx.x;
  for (int i = tid; i < Q_BYTES / 2; i += blockDim.x) {
    const uint32_t h = (i * 2654435761u) >> 22;
    reinterpret_cast<__half*>(smem)[i] = __float2half((static_cast<int>(h) - 512) * (1.f / 4096.f));
  }
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full_k[s], 1);
      mbar_init(&full_v[s], 1);
      mbar_init(&empty_k[s], 128);
      mbar_init(&empty_v[s], 128);
      mbar_init(&header[s], 1);
    }
    mbar_init(&done, 1);
    mbar_init_fence();
  }
  fence_proxy_async_smem();
  __syncthreads();
  const unsigned char* mine = src + static_cast<size_t>(blockIdx.x / readers) * tiles * TILE_BYTES;
  if ((EXTRA & kStager) && tid >= 160) {  // the polling warp
    mbar_wait(&done, 0);
    return;
  }
  if (tid >= 128) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (tid == 128) {
      const int first = (static_cast<int>(blockIdx.x) % readers) * skew;
      for (int t = 0; t < tiles; ++t) {
        const int s = t % STAGES;
        const size_t at = static_cast<size_t>((first + t) % tiles) * TILE_BYTES;
        const uint32_t parity = (t / STAGES - 1) & 1;
        if (t >= STAGES) mbar_wait(FORM == kApart ? &empty_k[s] : &empty_v[s], parity);
        if constexpr ((EXTRA & kHeader) != 0) {
          s_k0[s] = 64 * t;
          mbar_arrive(&header[s]);
        }
        mbar_expect_tx(&full_k[s], HALF);
        bulk_load(st + s * TILE_BYTES, mine + at, HALF, &full_k[s]);
        mbar_arrive(&full_k[s]);
        if (FORM == kApart && t >= STAGES) mbar_wait(&empty_v[s], parity);
        mbar_expect_tx(&full_v[s], HALF);
        bulk_load(st + s * TILE_BYTES + HALF, mine + at + HALF, HALF, &full_v[s]);
        mbar_arrive(&full_v[s]);
      }
    }
#endif
    return;
  }
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  float m[2] = {-1e30f, -1e30f}, l[2] = {0.f, 0.f};
  float sc[32];
  uint32_t pa[4][4];
  const auto k_of = [&](int t) { return st + (t % STAGES) * TILE_BYTES; };
  const auto release = [&](uint64_t* bars, int t) { mbar_arrive(&bars[t % STAGES]); };
  const int* spilled = scratch + (static_cast<size_t>(blockIdx.x) * blockDim.x + tid) * 8;  // kSpills
  if constexpr (FORM == kSerial) {
    for (int t = 0; t < tiles; ++t) {
      int off = 0;  // 0, but only known once the loads are back
      if constexpr ((EXTRA & kHeader) != 0) {
        mbar_wait(&header[t % STAGES], (t / STAGES) & 1);
        off |= s_k0[t % STAGES] & zero;
      }
      if constexpr ((EXTRA & kSpills) != 0) {
#pragma unroll
        for (int i = 0; i < 6; ++i) {
          int v;
          asm volatile("ld.global.ca.u32 %0, [%1];" : "=r"(v) : "l"(spilled + i));
          off |= v & zero;
        }
      }
      mbar_wait(&full_k[t % STAGES], (t / STAGES) & 1);
      mbar_wait(&full_v[t % STAGES], (t / STAGES) & 1);
      const unsigned char* tile = k_of(t) + off;
      wgmma_fence();
      issue_scores(sc, sq, tile);
      commit_group();
      wait_group<0>();
      exponentiate(sc, m, l);
      pack_p(sc, pa);
      wgmma_fence();
      issue_pv(acc, pa, tile + HALF);
      commit_group();
      wait_group<0>();
      release(empty_k, t);
      release(empty_v, t);
    }
  } else {
    // Tile 0's S and softmax, then per tile t: S(t) and P V(t - 1) together, S's wait, the
    // softmax of t while P V runs, P V's wait; after the last, its P V.
    mbar_wait(&full_k[0], 0);
    wgmma_fence();
    issue_scores(sc, sq, k_of(0));
    commit_group();
    wait_group<0>();
    if constexpr (FORM == kApart) release(empty_k, 0);
    exponentiate(sc, m, l);
    pack_p(sc, pa);
    for (int t = 1; t < tiles; ++t) {
      mbar_wait(&full_k[t % STAGES], (t / STAGES) & 1);
      mbar_wait(&full_v[(t - 1) % STAGES], ((t - 1) / STAGES) & 1);
      pin_all(sc);
      pin_all(acc);
      pin_all(reinterpret_cast<uint32_t(&)[16]>(pa));
      wgmma_fence();
      issue_scores(sc, sq, k_of(t));
      commit_group();
      issue_pv(acc, pa, k_of(t - 1) + HALF);
      commit_group();
      wait_group<1>();  // S(t) (committed first) is done; P V(t - 1) may still run
      pin_all(sc);
      if constexpr (FORM == kApart) release(empty_k, t);
      exponentiate(sc, m, l);  // while P V runs
      wait_group<0>();
      pack_p(sc, pa);
      pin_all(acc);
      if constexpr (FORM == kApart) {
        release(empty_v, t - 1);
      } else {
        release(empty_k, t - 1);
        release(empty_v, t - 1);
      }
    }
    mbar_wait(&full_v[(tiles - 1) % STAGES], ((tiles - 1) / STAGES) & 1);
    wgmma_fence();
    issue_pv(acc, pa, k_of(tiles - 1) + HALF);
    commit_group();
    wait_group<0>();
    if constexpr (FORM != kApart) release(empty_k, tiles - 1);
    release(empty_v, tiles - 1);
  }
  if ((EXTRA & kStager) && tid == 0) mbar_arrive(&done);
  float t = l[0] + l[1];
#pragma unroll
  for (int i = 0; i < 64; ++i) t += acc[i];
  if (t == 1.2345f) sink[blockIdx.x * 128 + tid] = t;
}

template <int STAGES, int FORM, int EXTRA = 0>
void run_ring(int sms, int per_sm, int tiles, int readers, int skew, const unsigned char* src, float* sink,
              const int* scratch) {
  const int smem = 1024 + Q_BYTES + STAGES * TILE_BYTES;
  const int threads = (EXTRA & kStager) ? 192 : 160;
  const auto kernel = ring<STAGES, FORM, EXTRA>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaFuncAttributes attr{};
  CHECK(cudaFuncGetAttributes(&attr, kernel));
  int fit = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, threads, smem));
  if (fit < per_sm) {
    std::printf("  %s, %d stages: %d block(s) an SM fit (%d registers)\n", kFormNames[FORM], STAGES, fit, attr.numRegs);
    return;
  }
  const int blocks = sms * per_sm;
  const float best = best_of_runs([&](int r) {
    const unsigned char* base = src + (r % 2) * static_cast<size_t>(blocks) * tiles * TILE_BYTES;
    kernel<<<blocks, threads, smem>>>(base, sink, scratch, tiles, readers, skew, 0);
  });
  const double flop = 2.0 * 2 * 64 * 64 * D * double(tiles) * blocks;
  char extras[40];
  std::snprintf(extras, sizeof extras, "%s%s%s", (EXTRA & kSpills) ? " +spills" : "", (EXTRA & kHeader) ? " +header" : "",
                (EXTRA & kStager) ? " +stager" : "");
  std::printf("  %-6s%s %d stages, %d blocks an SM, %d reader%s a tile (%2d tiles apart), %d registers: %.0f TFLOP/s, "
              "%.1f us\n",
              kFormNames[FORM], extras, STAGES, per_sm, readers, readers > 1 ? "s" : " ", skew, attr.numRegs,
              flop / (best * 1e-3) / 1e12, best * 1e3);
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const int tiles = argc > 1 ? std::atoi(argv[1]) : 256;
  bool zeros = false, pieces = false;  // `zeros`: K and V all zero (for comparison); `pieces`: the kernel's pieces only
  for (int a = 2; a < argc; ++a) {
    zeros |= std::strcmp(argv[a], "zeros") == 0;
    pieces |= std::strcmp(argv[a], "pieces") == 0;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  unsigned char* big;
  float* sink;
  const size_t bytes = 2 * static_cast<size_t>(2 * sms) * tiles * TILE_BYTES;
  CHECK(cudaMalloc(&big, bytes));
  if (zeros) {
    CHECK(cudaMemset(big, 0, bytes));
  } else {
    fill_random(big, bytes);
  }
  CHECK(cudaMalloc(&sink, 2 * sms * 128 * sizeof(float)));
  int* scratch;  // kSpills: 8 words a thread of two 192-thread blocks an SM
  CHECK(cudaMalloc(&scratch, 2 * sms * 192 * 8 * sizeof(int)));
  CHECK(cudaMemset(scratch, 0, 2 * sms * 192 * 8 * sizeof(int)));
  std::printf("%s, %d SMs, ring of 64-key tiles, %d tiles a block, K and V %s\n", prop.name, sms, tiles,
              zeros ? "all zero" : "random in [-1, 1)");
  if (pieces) {  // the serial form with the decode kernel's pieces, four readers in step and apart
    for (int skew : {0, 4}) {
      run_ring<2, kSerial>(sms, 2, tiles, 4, skew, big, sink, scratch);
      run_ring<2, kSerial, kSpills>(sms, 2, tiles, 4, skew, big, sink, scratch);
      run_ring<2, kSerial, kHeader>(sms, 2, tiles, 4, skew, big, sink, scratch);
      run_ring<2, kSerial, kStager>(sms, 2, tiles, 4, skew, big, sink, scratch);
      run_ring<2, kSerial, kSpills | kHeader | kStager>(sms, 2, tiles, 4, skew, big, sink, scratch);
    }
    return 0;
  }
  for (int readers : {4, 1}) {
    for (int skew : {0, 4}) {
      if (readers == 1 && skew > 0) continue;
      run_ring<2, kSerial>(sms, 2, tiles, readers, skew, big, sink, scratch);
      run_ring<2, kHeld>(sms, 2, tiles, readers, skew, big, sink, scratch);
      run_ring<2, kApart>(sms, 2, tiles, readers, skew, big, sink, scratch);
    }
  }
  run_ring<3, kHeld>(sms, 2, tiles, 4, 0, big, sink, scratch);  // (3 stages fit two blocks here: no q beyond 16 KB)
  run_ring<3, kApart>(sms, 2, tiles, 4, 0, big, sink, scratch);
  return 0;
}
