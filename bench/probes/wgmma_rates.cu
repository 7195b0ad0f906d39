// How fast do a wide tree item's products run on one SM, and what bounds them? The wgmma consumer
// (csrc/kernels/attend_wide.cuh) multiplies, per 64-key tile and warpgroup of 64 query columns,
// S = q K^T as 8 x m64n64k16 with q and K both read from shared memory (SS), waits, makes P, then
// O += P V as 4 x m64n128k16 with P from registers (RS), and waits. Reading q (16 KB) and K (16 KB)
// from shared memory for every 64 x 64 S is 128 bytes a cycle at the tensor pipe's rate, all of
// shared memory's bandwidth, beside the tile's own arrival (32 KB a tile) and V's reads. Each form
// below repeats one tile's work in a loop on operands that stay in shared memory:
//   s_ss      S only, q from shared memory (as the kernel)
//   s_rs      S only, q from registers (A fragments loaded once)
//   pv        P V only
//   tile_ss   S (SS), wait, P V, wait
//   tile_rs   S (RS), wait, P V, wait
//   soft_ss   tile_ss with the softmax between (max, two shuffles, 32 exp2 a thread, sums, packs)
//   soft_rs   soft_ss with q from registers
//   soft_ss128 / soft_rs128  S over 128 keys a product (m64n128k16), one softmax, P V over 128 keys
// each with 1 and 2 blocks an SM (the kernel runs 2), without and with a copy warp that brings
// 32 KB a tile into the block's shared memory by bulk copies (from an L2-resident buffer), as the
// tile's arrival does. Prints TFLOP/s over the whole GPU (2 x 64 x 64 x 128 x 2 a 64-key tile).
//
// Build and run on an sm_90 GPU:
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/wgmma_rates \
//     bench/probes/wgmma_rates.cu && timeout 120 /tmp/wgmma_rates [ITERS]   (default 2000 tiles a block)
// `/tmp/wgmma_rates pairs [TILES]`: a kv head's four readers as two blocks of two warpgroups
// that share each stage (WGS), against four blocks of one, started apart.
// `/tmp/wgmma_rates ring [TILES]` runs the ring forms instead (ring's comment), then four readers
// a tile that start 4, 16 and 64 tiles apart (default 256 tiles a block). `/tmp/wgmma_rates
// clusters [TILES]`: four readers a tile group free, launched as clusters, sharing their stages
// across the cluster and within a window (RingMode), at equal rates and at rates that differ.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "../../csrc/kernels/ptx.cuh"
#include "probe_check.h"
#include "probe_softmax.h"
#include "probe_wgmma.h"
#include "../../csrc/kernels/wgmma.cuh"

using namespace mmha;

constexpr int D = 128;     // head dim
constexpr int KEYS = 128;  // keys laid out in the K / V areas (the 128-key forms use all of them)
constexpr int Q_BYTES = 64 * D * 2;
constexpr int K_BYTES = KEYS * D * 2;
constexpr int V_BYTES = KEYS * D * 2;
constexpr int COPY_BYTES = 32 * 1024;  // a 64-key tile's K and V, brought as two copies into
constexpr int COPY_AREA = 16 * 1024;   // an area of half that (two blocks an SM fit)
constexpr int SMEM = 1024 + Q_BYTES + K_BYTES + V_BYTES + COPY_AREA + 1024;

enum Form { kSSs, kSRs, kPv, kTileSs, kTileRs, kSoftSs, kSoftRs, kSoftSs128, kSoftRs128, kForms };
const char* kNames[] = {"s_ss", "s_rs", "pv", "tile_ss", "tile_rs", "soft_ss", "soft_rs", "soft_ss128", "soft_rs128"};

// S over 128 keys with q from registers.
__device__ __forceinline__ void wgmma_n128_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b, int scale_d) {
  wgmma_m64n128k16_rs<__half, 0>(d, a, b, scale_d);
}

template <int FORM>
__global__ void __launch_bounds__(160, 2) rates(const unsigned char* src, float* sink, int iters, int copies) {
  extern __shared__ unsigned char raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
  unsigned char* sq = smem;
  unsigned char* sk = sq + Q_BYTES;
  unsigned char* sv = sk + K_BYTES;
  unsigned char* scopy = sv + V_BYTES;
  uint64_t* bar = reinterpret_cast<uint64_t*>(scopy + COPY_AREA);
  const int tid = threadIdx.x;
  // Operands: small finite halves from a hash (the products' values do not matter, their rate does).
  for (int i = tid; i < (Q_BYTES + K_BYTES + V_BYTES) / 2; i += blockDim.x) {
    const uint32_t h = (i * 2654435761u) >> 22;
    reinterpret_cast<__half*>(sq)[i] = __float2half((static_cast<int>(h) - 512) * (1.f / 4096.f));
  }
  if (tid == 0) {
    mbar_init(bar, 1);
    mbar_init_fence();
  }
  fence_proxy_async_smem();
  __syncthreads();
  if (tid >= 128) {  // the copy warp: 32 KB a round, one lane
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (copies && tid == 128) {
      for (int r = 0; r < iters; ++r) {
        mbar_expect_tx(bar, COPY_BYTES);
        bulk_load(scopy, src + (blockIdx.x % 64) * COPY_BYTES, COPY_AREA, bar);
        bulk_load(scopy, src + (blockIdx.x % 64) * COPY_BYTES + COPY_AREA, COPY_AREA, bar);
        mbar_arrive(bar);  // the phase's one arrival; it completes once the bytes have landed
        mbar_wait(bar, r & 1);
      }
    }
#endif
    return;
  }
  const int warp = tid / 32, lane = tid % 32;
  uint32_t qa[D / 16][4];  // q's A fragments (the RS forms)
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    // [D / 8][64 rows][8]: the warp's rows 16 warp .. +15, dims 16 j .. +15
    const int r = 16 * warp + (lane % 8) + 8 * ((lane / 8) % 2), c = 2 * j + lane / 16;
    ldmatrix_x4<false>(qa[j], reinterpret_cast<const __half*>(sq) + (c * 64 + r) * 8);
  }
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  float m[2] = {-1e30f, -1e30f}, l[2] = {0.f, 0.f};
  uint32_t pa8[8][4];
#pragma unroll
  for (int kb = 0; kb < 8; ++kb) {
#pragma unroll
    for (int w = 0; w < 4; ++w) pa8[kb][w] = 0x3c003c00u ^ (kb * 4 + w + lane);
  }
  constexpr bool k128 = FORM == kSoftSs128 || FORM == kSoftRs128;
  constexpr bool rs = FORM == kSRs || FORM == kTileRs || FORM == kSoftRs || FORM == kSoftRs128;
  constexpr bool do_s = FORM != kPv;
  constexpr bool do_pv = FORM != kSSs && FORM != kSRs;
  constexpr bool soft = FORM == kSoftSs || FORM == kSoftRs || FORM == kSoftSs128 || FORM == kSoftRs128;
  const int rounds = k128 ? iters / 2 : iters;
  for (int it = 0; it < rounds; ++it) {
    float s[k128 ? 64 : 32];
    if constexpr (do_s) {
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
        const uint64_t kd = wgmma_desc(sk + 2 * j * KEYS * 16, KEYS * 16, 128, false);
        if constexpr (k128) {
          if constexpr (rs) {
            wgmma_n128_rs(reinterpret_cast<float(&)[64]>(s), qa[j], kd, j > 0);
          } else {
            wgmma_n128_ss(reinterpret_cast<float(&)[64]>(s), wgmma_desc(sq + j * 2 * 64 * 16, 64 * 16, 128, false), kd,
                          j > 0);
          }
        } else if constexpr (rs) {
          wgmma_m64n64k16_rs<__half, 0>(reinterpret_cast<float(&)[32]>(s), qa[j], kd, j > 0);
        } else {
          wgmma_m64n64k16_ss<__half, 0>(reinterpret_cast<float(&)[32]>(s),
                                        wgmma_desc(sq + j * 2 * 64 * 16, 64 * 16, 128, false), kd, j > 0);
        }
      }
      wgmma_commit_and_wait();
    }
    constexpr int PB = k128 ? 8 : 4;  // 16-key blocks of P
    uint32_t pa[PB][4];
    if constexpr (soft) {
      softmax(s, m, l, pa);
    } else {
#pragma unroll
      for (int kb = 0; kb < PB; ++kb) {
#pragma unroll
        for (int w = 0; w < 4; ++w) pa[kb][w] = pa8[kb][w] ^ (do_s ? __float_as_uint(s[(8 * kb + 2 * w) % (k128 ? 64 : 32)]) >> 31 : 0u);
      }
    }
    if constexpr (do_pv) {
      wgmma_fence();
#pragma unroll
      for (int kb = 0; kb < PB; ++kb) {
        wgmma_m64n128k16_rs<__half, 1>(acc, pa[kb], wgmma_desc(sv + 16 * kb * 128, KEYS * 128, 1024, true), 1);
      }
      wgmma_commit_and_wait();
    } else if constexpr (!soft) {
      acc[it % 2] += __uint_as_float(pa[0][0]) * 1e-30f;
    }
  }
  float t = l[0] + l[1];
#pragma unroll
  for (int i = 0; i < 64; ++i) t += acc[i];
  if (t == 1.2345f) sink[blockIdx.x * 128 + tid] = t;
}

// Cluster helpers (sm_90): one arrival on barrier `bar` of block `cta` of the cluster, and a
// barrier of every thread of the cluster (not .aligned: called from different places).
__device__ __forceinline__ void arrive_in(uint64_t* bar, uint32_t cta) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .b32 r;\n mapa.shared::cluster.u32 r, %0, %1;\n"
      " mbarrier.arrive.release.cluster.shared::cluster.b64 _, [r];\n}\n" ::"r"(smem_addr(bar)), "r"(cta)
      : "memory");
#endif
}
__device__ __forceinline__ void cluster_barrier() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release;\n barrier.cluster.wait.acquire;\n" ::: "memory");
#endif
}

// How the R readers of a tile group keep together (ring's MODE): kFree, each on its own (a
// plain launch); kClustered, launched as clusters of R but each on its own (placement only);
// kShared, each consumer warp releasing a stage to every block of its cluster (a producer refills
// stage s once all R blocks are done with it: at most the ring apart); kWindow, stages local and
// milestone barriers: every consumer warp arrives on milestone t / kMile of every block of its
// cluster after tile t (t % kMile == kMile - 1), a producer issues tile t once milestone (t -
// kWindow + 1) / kMile - 1 is complete (at most kWindow + kMile - 1 tiles ahead).
enum RingMode { kFree, kClustered, kShared, kWindow };
const char* kModeNames[] = {"free", "clusters", "clusters, shared stages", "clusters, window"};
constexpr int kMile = 2, kWindowTiles = 4, kMiles = 8;
static_assert(kMiles * kMile >= kWindowTiles, "a wait never reads a phase ahead");

// The tile loop's ring: a copy warp brings each 64-key tile (K 16 KB as [16][KEYS][16 B], V 16 KB) into
// one of STAGES stages by two bulk copies (full barrier), the warpgroup waits for it, runs soft_ss
// on it (or S and P V only: SOFT = false) and hands it back (empty barrier). Block b reads the
// `tiles` tiles of group b / R: R neighbouring blocks read the same tiles, as a kv head's R wide
// items do (B=16 T=64 Hq=32 Hkv=8: R = 4), so all but the first read of a tile may come from L2.
// WGS = 2: two warpgroups a block read each tile (the ring's empty barrier counts both), each
// with its own q, as two wide items of a kv head paired in one block; `readers` then counts
// blocks, so a kv head's four items are two blocks of pairs (one block an SM).
template <int STAGES, bool SOFT, int MODE = kFree, int WGS = 1>
__global__ void __launch_bounds__(128 * WGS + 32, 1) ring(const unsigned char* src, float* sink, int tiles, int readers,
                                                          int skew, int jitter) {
  extern __shared__ unsigned char raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
  unsigned char* st = smem + WGS * Q_BYTES;  // stages of 32 KB
  unsigned char* sq = smem + (threadIdx.x / 128 < WGS ? threadIdx.x / 128 : 0) * Q_BYTES;  // this warpgroup's q
  __shared__ uint64_t full[STAGES], empty[STAGES], mile[kMiles];
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  for (int i = tid; i < WGS * Q_BYTES / 2; i += blockDim.x) {
    const uint32_t h = (i * 2654435761u) >> 22;
    reinterpret_cast<__half*>(smem)[i] = __float2half((static_cast<int>(h) - 512) * (1.f / 4096.f));
  }
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], MODE == kShared ? 4 * readers : 128 * WGS);
    }
    for (int m = 0; m < kMiles; ++m) mbar_init(&mile[m], 4 * readers);
    mbar_init_fence();
  }
  fence_proxy_async_smem();
  __syncthreads();
  if constexpr (MODE != kFree) cluster_barrier();  // every block's barriers set up
  const unsigned char* mine = src + static_cast<size_t>(blockIdx.x / readers) * tiles * COPY_BYTES;
  if (tid >= 128 * WGS) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (tid == 128 * WGS) {
      const int first = (static_cast<int>(blockIdx.x) % readers) * skew;  // this reader's first tile
      for (int t = 0; t < tiles; ++t) {
        const int s = t % STAGES;
        const size_t at = static_cast<size_t>((first + t) % tiles) * COPY_BYTES;
        if (t >= STAGES) mbar_wait(&empty[s], (t / STAGES - 1) & 1);
        if constexpr (MODE == kWindow) {
          const int m = t - kWindowTiles + 1;
          if (m > 0 && m % kMile == 0) mbar_wait(&mile[(m / kMile - 1) % kMiles], ((m / kMile - 1) / kMiles) & 1);
        }
        mbar_expect_tx(&full[s], COPY_BYTES);
        bulk_load(st + s * COPY_BYTES, mine + at, COPY_AREA, &full[s]);
        bulk_load(st + s * COPY_BYTES + COPY_AREA, mine + at + COPY_AREA, COPY_AREA, &full[s]);
        mbar_arrive(&full[s]);
      }
    }
#endif
    if constexpr (MODE != kFree) cluster_barrier();  // no block leaves while others may arrive on it
    return;
  }
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  float m[2] = {-1e30f, -1e30f}, l[2] = {0.f, 0.f};
  for (int t = 0; t < tiles; ++t) {
    const int s = t % STAGES;
    mbar_wait(&full[s], (t / STAGES) & 1);
    const unsigned char* sk = st + s * COPY_BYTES;
    const unsigned char* sv = sk + COPY_AREA;
    float sc[32];
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      wgmma_m64n64k16_ss<__half, 0>(sc, wgmma_desc(sq + j * 2 * 64 * 16, 64 * 16, 128, false),
                                    wgmma_desc(sk + 2 * j * 64 * 16, 64 * 16, 128, false), j > 0);
    }
    wgmma_commit_and_wait();
    uint32_t pa[4][4];
    if constexpr (SOFT) {
      softmax(sc, m, l, pa);
    } else {
#pragma unroll
      for (int kb = 0; kb < 4; ++kb) {
#pragma unroll
        for (int w = 0; w < 4; ++w) pa[kb][w] = 0x3c003c00u ^ (__float_as_uint(sc[8 * kb + 2 * w]) >> 31);
      }
    }
    wgmma_fence();
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
      wgmma_m64n128k16_rs<__half, 1>(acc, pa[kb], wgmma_desc(sv + 16 * kb * 128, 64 * 128, 1024, true), 1);
    }
    wgmma_commit_and_wait();
    // (A warp's arrivals at the cluster's blocks from one lane, in order: a later one is never
    // counted in an earlier phase at another block.)
    if constexpr (MODE == kShared) {
      __syncwarp();
      if (lane == 0) {
        for (int b = 0; b < readers; ++b) arrive_in(&empty[s], b);
      }
    } else {
      mbar_arrive(&empty[s]);
    }
    if constexpr (MODE == kWindow) {
      if (t % kMile == kMile - 1 && lane == 0) {
        for (int b = 0; b < readers; ++b) arrive_in(&mile[(t / kMile) % kMiles], b);
      }
    }
    // Readers at different rates (reader r sleeps r x jitter ns a tile), as blocks that share their
    // SMs with other work drift apart.
    if (jitter > 0) __nanosleep(static_cast<unsigned>(jitter * (static_cast<int>(blockIdx.x) % readers)));
  }
  if constexpr (MODE != kFree) cluster_barrier();
  float t = l[0] + l[1];
#pragma unroll
  for (int i = 0; i < 64; ++i) t += acc[i];
  if (t == 1.2345f) sink[blockIdx.x * 128 * WGS + tid] = t;
}

template <int STAGES, bool SOFT, int MODE = kFree, int WGS = 1>
void run_ring(int sms, int per_sm, int tiles, int readers, const unsigned char* src, float* sink, int skew = 0,
              int jitter = 0) {
  const int smem = 1024 + WGS * Q_BYTES + STAGES * COPY_BYTES;
  const auto kernel = ring<STAGES, SOFT, MODE, WGS>;
  const int threads = 128 * WGS + 32;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int fit = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, threads, smem));
  if (fit < per_sm) {
    std::printf("  %d stages: %d block(s) an SM fit\n", STAGES, fit);
    return;
  }
  int blocks = sms * per_sm;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(readers);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg{};
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.attrs = attr;
  cfg.numAttrs = MODE == kFree ? 0 : 1;
  if (MODE != kFree) {  // as many clusters as run at once (a GPC's odd slots stay empty)
    cfg.gridDim = dim3(static_cast<unsigned>(blocks / readers * readers));
    int clusters = 0;
    CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
    blocks = clusters * readers < blocks ? clusters * readers : blocks / readers * readers;
  }
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  const float best = best_of_runs([&](int r) {
    const unsigned char* base = src + (r % 2) * static_cast<size_t>(blocks) * tiles * COPY_BYTES;
    CHECK(cudaLaunchKernelEx(&cfg, kernel, base, sink, tiles, readers, skew, jitter));
  });
  const double flop = 2.0 * 2 * 64 * 64 * D * double(tiles) * blocks * WGS;
  std::printf("  %d stages, %d block%s an SM%s, %d reader%s a tile (%d tiles apart), %s, %s, jitter %d ns, %d blocks: %.0f TFLOP/s, "
              "%.1f us, %.2f TB/s into the SMs\n",
              STAGES, per_sm, per_sm > 1 ? "s" : "", WGS > 1 ? " of two warpgroups" : "", readers, readers > 1 ? "s" : "", skew,
              SOFT ? "softmax" : "products only",
              kModeNames[MODE], jitter, blocks, flop / (best * 1e-3) / 1e12, best * 1e3,
              double(COPY_BYTES) * tiles * blocks / (best * 1e-3) / 1e12);
}

template <int FORM>
float run(int sms, int per_sm, int iters, int copies, const unsigned char* src, float* sink) {
  CHECK(cudaFuncSetAttribute(rates<FORM>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  // (the first launch a warm-up)
  const float best = best_of_runs([&](int) { rates<FORM><<<sms * per_sm, 160, SMEM>>>(src, sink, iters, copies); });
  const bool both = FORM != kSSs && FORM != kSRs && FORM != kPv;
  const double flop = 2.0 * 64 * 64 * D * (both ? 2 : 1) * iters * double(sms) * per_sm;
  return static_cast<float>(flop / (best * 1e-3) / 1e12);
}

template <int... F>
void all(std::integer_sequence<int, F...>, int sms, int iters, const unsigned char* src, float* sink) {
  for (int copies = 0; copies < 2; ++copies) {
    for (int per_sm = 1; per_sm <= 2; ++per_sm) {
      std::printf("%d block%s an SM, %s:", per_sm, per_sm > 1 ? "s" : "", copies ? "tile copies" : "no copies");
      ((std::printf(" %s %.0f", kNames[F], run<F>(sms, per_sm, iters, copies, src, sink))), ...);
      std::printf("  TFLOP/s\n");
    }
  }
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const int iters = argc > 1 ? std::atoi(argv[1]) : 2000;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  unsigned char* src;
  float* sink;
  CHECK(cudaMalloc(&src, 64 * COPY_BYTES));
  fill_random(src, 64 * COPY_BYTES);
  CHECK(cudaMalloc(&sink, 4 * prop.multiProcessorCount * 128 * sizeof(float)));
  const std::string form = argc > 1 ? argv[1] : "";
  if (form == "ring" || form == "clusters" || form == "pairs") {
    const int tiles = argc > 2 ? std::atoi(argv[2]) : 256;
    const int sms = prop.multiProcessorCount;
    const size_t bytes = 2 * static_cast<size_t>(2 * sms) * tiles * COPY_BYTES;
    unsigned char* big;
    CHECK(cudaMalloc(&big, bytes));
    fill_random(big, bytes);  // not zeros: the products' rate depends on their data (probe_check.h)
    std::printf("%s, %d SMs, ring of 64-key tiles, %d tiles a block\n", prop.name, sms, tiles);
    if (form == "pairs") {
      // A kv head's four items as two blocks of two warpgroups (each tile read by both), against
      // four blocks of one, each form with its blocks started 0, 4, 16 and 64 tiles apart.
      for (int skew : {0, 4, 16, 64}) {
        run_ring<2, true>(sms, 2, tiles, 4, big, sink, skew);
        run_ring<2, true, kFree, 2>(sms, 1, tiles, 2, big, sink, skew);
        run_ring<3, true, kFree, 2>(sms, 1, tiles, 2, big, sink, skew);
        run_ring<4, true, kFree, 2>(sms, 1, tiles, 2, big, sink, skew);
      }
      run_ring<3, false, kFree, 2>(sms, 1, tiles, 2, big, sink);
      return 0;
    }
    if (form == "clusters") {
      // The four readers of a tile group kept together or not (RingMode), at rates that differ
      // by jitter ns a tile per reader rank.
      for (int jitter : {0, 100, 300}) {
        run_ring<2, true, kFree>(sms, 2, tiles, 4, big, sink, 0, jitter);
        run_ring<2, true, kClustered>(sms, 2, tiles, 4, big, sink, 0, jitter);
        run_ring<2, true, kShared>(sms, 2, tiles, 4, big, sink, 0, jitter);
        run_ring<2, true, kWindow>(sms, 2, tiles, 4, big, sink, 0, jitter);
      }
      return 0;
    }
    for (int readers : {4, 1}) {
      run_ring<2, true>(sms, 2, tiles, readers, big, sink);
      run_ring<3, true>(sms, 2, tiles, readers, big, sink);
      run_ring<4, true>(sms, 1, tiles, readers, big, sink);
      run_ring<2, false>(sms, 2, tiles, readers, big, sink);
      run_ring<3, false>(sms, 2, tiles, readers, big, sink);
    }
    // Readers apart: reader r of a tile group starts r x skew tiles in (and wraps), as a kv head's
    // wide items that were not started together, or drift, read the same tiles at other times.
    for (int skew : {4, 16, 64}) run_ring<2, true>(sms, 2, tiles, 4, big, sink, skew);
    return 0;
  }
  std::printf("%s, %d SMs, %d tiles a block, %d bytes of shared memory a block\n", prop.name,
              prop.multiProcessorCount, iters, SMEM);
  all(std::make_integer_sequence<int, kForms>{}, prop.multiProcessorCount, iters, src, sink);
  return 0;
}
