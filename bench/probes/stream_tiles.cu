// How fast does the tile loop's copy pattern stream a cache when nothing else runs? One block per
// (row, kv head) walks its keys tile by tile through a ring of stages, as decode_attention_kernel
// does, but its consumers only wait for each tile and hand the stage back: no q, no math, no
// store. Against it: the same walk with K in [S, D] rows (the layout cuDNN reads), with 128-key
// tiles, other stage counts, 16-byte cp.async by the producer warp, and a plain read of each
// block's K/V with vector loads (no ring). It answers whether a row such as B=16 Hkv=8 S=2048
// (one block per SM: mmha 43.6 us under ncu, cuDNN 36.5 with the same grid) loses in the copies
// or in the consumers' work between them. Paged variants: each item's keys in pool blocks of 16
// slots scattered at random (K of a block one 4 KB run, V one 4 KB run), brought by one bulk copy
// per block and K/V (8 a tile, the paged source's count) or by cp.async: whether the copy
// engine's operations bound blocks of 16 on rows of one item per SM (B=1 rows: 1.07-1.13x the
// contiguous cache).
//
// Build and run on an sm_90 GPU (no libcuda link: the encoder comes through the runtime):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/stream_tiles \
//     [-DPROBE_D=64] bench/probes/stream_tiles.cu && /tmp/stream_tiles [B Hkv keys]
// Prints one line per variant: us per launch (median of 20, two buffers alternating so that no
// launch finds its bytes in L2) and GB/s of K/V read, for one launch between two events and for
// launches back to back. A fourth argument MODE,TILE,STAGES[,WORK] runs that variant only (for
// ncu); WORK: cycles each consumer spends on a tile before handing it back.
// READERS=R (environment): R blocks walk each (row, kv head), neighbours in the grid, as a tree
// step's R wide items of one kv head do (B=16 T=64 Hq=32 Hkv=8: R = 4), so all but the first read
// of a tile come from L2; GB/s then counts what the SMs received (R times the K/V). Is the tile
// stream alone what bounds those rows (their attention kernel: 205.5 us at 4K on an H200)?
// SMEM=bytes (environment): each block takes at least that much dynamic shared memory, so that
// as few blocks share an SM as in the kernel (wide items: two; 100000 gives two at 2 stages).
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../../csrc/kernels/ptx.cuh"  // the kernels' own copy and barrier wrappers
#include "probe_check.h"

using namespace mmha;

// Head dim of 16-bit elements (-DPROBE_D=64 gives the byte pattern of an fp8 cache of head dim 128:
// 128-byte rows, 8 chunks of 16 bytes, 1 KB runs a 64-key tile).
#ifndef PROBE_D
#define PROBE_D 128
#endif
constexpr int D = PROBE_D;
constexpr int ROW = D * 2;         // bytes of a key's row
constexpr int CHUNKS = ROW / 16;
static_assert(ROW % 128 == 0, "V boxes are 128-byte pieces of a row");
constexpr int CONSUMERS = 128;     // four consumer warps, then one producer warp
constexpr int MAX_STAGES = 8;

enum Mode : int { kTmaX = 0, kTmaRows = 1, kCpAsyncX = 2, kPlain = 3, kPagedBulk = 4, kPagedCp = 5 };
const char* kModeNames[] = {"bulk copies, K x-layout (mmha)", "bulk copies, K rows [S, D]",
                            "cp.async by one warp, K x-layout", "vector loads, no ring",
                            "pages of 16: a bulk copy per block", "pages of 16: cp.async"};
constexpr int PAGE = 16;                    // slots per pool block (paged modes)
constexpr int PAGE_BYTES = PAGE * D * 2;    // K (or V) of one block: 4 KB

struct Args {
  const char* k;   // K: x-layout [items][CHUNKS][smax][16 B], or rows [items][smax][256 B]
  const char* v;   // V: rows [items][smax][256 B]
  int keys;        // keys each item reads
  int smax;        // slots per (row, kv head)
  int stages;
  int tile;        // keys per tile: 64 or 128
  int work;        // cycles each consumer spends on a tile before handing it back (the math's stand-in)
  unsigned* sink;  // keeps the consumers' reads alive
  const int* table;  // paged modes: pool block of (item, block of the item), [items][smax / PAGE]
  int readers;       // blocks walking each item (READERS)
};

// One block per item. Consumers: wait for a tile, read one 16-byte word of it, hand the stage back.
template <int MODE>
__global__ void __launch_bounds__(CONSUMERS + 32) stream_kernel(const __grid_constant__ CUtensorMap kmap,
                                                                const __grid_constant__ CUtensorMap vmap, Args a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // ptx.cuh's bulk copies: sm_90
  extern __shared__ __align__(1024) unsigned char dyn[];
  unsigned char* ring = dyn + (1024 - smem_addr(dyn) % 1024) % 1024;
  __shared__ uint64_t full[MAX_STAGES], empty[MAX_STAGES];
  const int item = blockIdx.x / a.readers;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int nt = a.keys / a.tile;
  const int rot = item * 37 % nt;  // the product's rotation of the walk
  const int k_bytes = a.tile * D * 2, stage_bytes = 2 * k_bytes;
  if (tid == 0) {
    for (int s = 0; s < a.stages; ++s) {
      mbar_init(&full[s], MODE == kCpAsyncX || MODE == kPagedCp ? 32 : 1);
      mbar_init(&empty[s], CONSUMERS);
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (warp == CONSUMERS / 32) {  // producer
    for (int i = 0; i < nt; ++i) {
      const int s = i % a.stages;
      if (i >= a.stages) mbar_wait(&empty[s], (i / a.stages - 1) & 1);
      int t = i + rot;
      t = t >= nt ? t - nt : t;
      const int k0 = t * a.tile;
      unsigned char* st = ring + s * stage_bytes;
      if constexpr (MODE == kCpAsyncX) {
        // K pieces: a warp copies 32 consecutive keys of one chunk at a time; V: rows.
        for (int j = lane; j < a.tile * CHUNKS; j += 32) {
          const int key = j % a.tile, c = j / a.tile;
          cp_async16(st + (c * a.tile + key) * 16,
                     a.k + ((static_cast<int64_t>(item) * CHUNKS + c) * a.smax + k0 + key) * 16, true);
        }
        for (int j = lane; j < a.tile * CHUNKS; j += 32) {
          const int r = j / CHUNKS, c = j % CHUNKS;
          cp_async16(st + k_bytes + r * ROW + c * 16,
                     a.v + (static_cast<int64_t>(item) * a.smax + k0 + r) * ROW + c * 16, true);
        }
        cp_async_arrive(&full[s]);
      } else if constexpr (MODE == kPagedBulk || MODE == kPagedCp) {
        // Pools: K [blocks][CHUNKS][PAGE][16 B] and V [blocks][PAGE][256 B], 4 KB each a block.
        const int* row = a.table + static_cast<int64_t>(item) * (a.smax / PAGE) + k0 / PAGE;
        if constexpr (MODE == kPagedBulk) {
          if (lane == 0) mbar_expect_tx(&full[s], stage_bytes);
          __syncwarp();
          if (lane < a.tile / PAGE) {
            const int64_t blk = row[lane];
            bulk_load(st + lane * PAGE_BYTES, a.k + blk * PAGE_BYTES, PAGE_BYTES, &full[s]);
            bulk_load(st + k_bytes + lane * PAGE_BYTES, a.v + blk * PAGE_BYTES, PAGE_BYTES, &full[s]);
          }
          __syncwarp();
          if (lane == 0) mbar_arrive(&full[s]);  // the copy engine completes the phase
        } else {
          for (int j = lane; j < a.tile * CHUNKS; j += 32) {  // 16 B pieces, a block's K then its V
            const int64_t blk = row[j / (PAGE * CHUNKS)];
            const int off = j % (PAGE * CHUNKS) * 16;
            cp_async16(st + j * 16, a.k + blk * PAGE_BYTES + off, true);
            cp_async16(st + k_bytes + j * 16, a.v + blk * PAGE_BYTES + off, true);
          }
          cp_async_arrive(&full[s]);
        }
      } else if (lane == 0) {
        mbar_expect_tx(&full[s], stage_bytes);
        if constexpr (MODE == kTmaX) {
          tma_load_3d(st, &kmap, 0, k0 / 32, item * CHUNKS, &full[s]);  // every chunk's run of tile * 16 B
        } else {
          for (int j = 0; j < ROW / 128; ++j) tma_load_3d(st + j * a.tile * 128, &kmap, 64 * j, k0, item, &full[s]);
        }
        for (int j = 0; j < ROW / 128; ++j) {
          tma_load_3d(st + k_bytes + j * a.tile * 128, &vmap, 64 * j, k0, item, &full[s]);
        }
        mbar_arrive(&full[s]);  // the copy engine completes the phase
      }
    }
    return;
  }
  unsigned acc = 0;
  for (int i = 0; i < nt; ++i) {
    const int s = i % a.stages;
    mbar_wait(&full[s], (i / a.stages) & 1);
    acc ^= reinterpret_cast<const unsigned*>(ring + s * stage_bytes)[tid * 4 % (stage_bytes / 4)];
    if (a.work > 0) {
      const long long t0 = clock64();
      while (clock64() - t0 < a.work) acc += 1;
    }
    mbar_arrive(&empty[s]);
  }
  if (acc == 0x12345678u) a.sink[tid] = acc;
#endif
}

// No ring: each block reads its item's K and V with 16-byte loads, 8 in flight per thread.
__global__ void __launch_bounds__(CONSUMERS + 32) plain_kernel(Args a) {
  const int64_t item_bytes = static_cast<int64_t>(a.smax) * ROW;
  const int64_t item = blockIdx.x / a.readers;
  const uint4* src[2] = {reinterpret_cast<const uint4*>(a.k + item * item_bytes),
                         reinterpret_cast<const uint4*>(a.v + item * item_bytes)};
  const int n = a.keys * CHUNKS;  // 16-byte words of K (or V) an item reads
  unsigned acc = 0;
  for (int h = 0; h < 2; ++h) {
    for (int i = threadIdx.x; i < n; i += blockDim.x * 8) {
      uint4 w[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int j = i + u * blockDim.x;
        w[u] = j < n ? __ldcs(src[h] + j) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) acc ^= w[u].x ^ w[u].w;
    }
  }
  if (acc == 0x12345678u) a.sink[threadIdx.x] = acc;
}

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult q{};
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess) {
    std::fprintf(stderr, "no cuTensorMapEncodeTiled\n");
    std::exit(1);
  }
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
}

// A 3-d map of 16-bit elements: dims (innermost first), byte strides of dims 1 and 2, box.
CUtensorMap make_map(const void* base, cuuint64_t d0, cuuint64_t d1, cuuint64_t d2, cuuint64_t s1, cuuint64_t s2,
                     cuuint32_t b0, cuuint32_t b1, cuuint32_t b2, CUtensorMapSwizzle swizzle) {
  CUtensorMap m{};
  const cuuint64_t dims[3] = {d0, d1, d2}, strides[2] = {s1, s2};
  const cuuint32_t box[3] = {b0, b1, b2}, ones[3] = {1, 1, 1};
  const CUresult r = encoder()(&m, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(base), dims, strides, box, ones,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled: %d\n", static_cast<int>(r));
    std::exit(1);
  }
  return m;
}

int main(int argc, char** argv) {
  const int batch = argc > 1 ? std::atoi(argv[1]) : 16;
  const int hkv = argc > 2 ? std::atoi(argv[2]) : 8;
  const int keys = argc > 3 ? std::atoi(argv[3]) : 2048;
  const int items = batch * hkv, smax = keys;
  const int readers = std::getenv("READERS") ? std::max(1, std::atoi(std::getenv("READERS"))) : 1;
  const int grid = items * readers;
  const size_t min_smem = std::getenv("SMEM") ? std::strtoul(std::getenv("SMEM"), nullptr, 10) : 0;
  const size_t bytes = static_cast<size_t>(items) * smax * ROW;  // K or V of one buffer
  char* buf[2][2];
  for (auto& b : buf)
    for (auto& p : b) {
      CHECK(cudaMalloc(&p, bytes));
      CHECK(cudaMemset(p, 1, bytes));
    }
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&sink, 4096));
  // Paged modes: the pool's blocks in a random order (a server that has run for a while); the
  // pool is the same bytes as the contiguous buffers.
  const int blocks = items * (smax / PAGE);
  std::vector<int> perm(blocks);
  for (int i = 0; i < blocks; ++i) perm[i] = i;
  uint64_t rng = 88172645463325252ull;
  for (int i = blocks - 1; i > 0; --i) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    std::swap(perm[i], perm[rng % (i + 1)]);
  }
  int* table = nullptr;
  CHECK(cudaMalloc(&table, blocks * sizeof(int)));
  CHECK(cudaMemcpy(table, perm.data(), blocks * sizeof(int), cudaMemcpyHostToDevice));
  int sms = 0, smem_max = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  std::printf("B=%d Hkv=%d keys=%d: %d blocks (%d a kv head) on %d SMs, %.1f MB of K/V a launch\n", batch, hkv,
              keys, grid, readers, sms, 2.0 * bytes / 1e6);
  // The opt-in limit counts static shared memory too (the kernels' barriers): leave it room.
  smem_max -= 1024;
  CHECK(cudaFuncSetAttribute(stream_kernel<kTmaX>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max));
  CHECK(cudaFuncSetAttribute(stream_kernel<kTmaRows>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max));
  CHECK(cudaFuncSetAttribute(stream_kernel<kCpAsyncX>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max));
  CHECK(cudaFuncSetAttribute(stream_kernel<kPagedBulk>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max));
  CHECK(cudaFuncSetAttribute(stream_kernel<kPagedCp>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));

  struct Variant {
    int mode, tile, stages, work;
  };
  std::vector<Variant> variants = {{kPlain, 64, 0, 0}};
  for (int mode : {kTmaX, kTmaRows})
    for (int tile : {64, 128})
      for (int stages : {2, 3, 4, 6}) variants.push_back({mode, tile, stages, 0});
  for (int stages : {3, 6}) variants.push_back({kCpAsyncX, 64, stages, 0});
  for (int mode : {kPagedBulk, kPagedCp})
    for (int stages : {3, 6}) variants.push_back({mode, 64, stages, 0});
  // Consumers that spend time on each tile, as the math does (cycles per tile).
  for (int stages : {3, 6})
    for (int work : {500, 1000, 2000, 3000}) variants.push_back({kTmaX, 64, stages, work});
  if (argc > 4) {  // one variant: MODE,TILE,STAGES[,WORK] (for a profiler)
    Variant one{0, 64, 3, 0};
    std::sscanf(argv[4], "%d,%d,%d,%d", &one.mode, &one.tile, &one.stages, &one.work);
    variants = {one};
  }

  for (const Variant& v : variants) {
    const size_t dyn = std::max(static_cast<size_t>(v.stages) * 2 * v.tile * D * 2 + 1024, min_smem);
    if (v.mode != kPlain && (dyn > static_cast<size_t>(smem_max) || keys % v.tile != 0)) continue;
    CUtensorMap kmap[2], vmap[2];
    for (int b = 0; b < 2; ++b) {
      if (v.mode == kTmaRows) {
        kmap[b] = make_map(buf[b][0], D, smax, items, ROW, smax * ROW * 1ull, 64, v.tile, 1, CU_TENSOR_MAP_SWIZZLE_128B);
      } else {  // x-layout: [items * CHUNKS rows][smax / 32 groups][32 keys * 8 elements]
        kmap[b] = make_map(buf[b][0], 256, smax / 32, static_cast<cuuint64_t>(items) * CHUNKS, 512, smax * 16ull, 256,
                           v.tile / 32, CHUNKS, CU_TENSOR_MAP_SWIZZLE_NONE);
      }
      vmap[b] = make_map(buf[b][1], D, smax, items, ROW, smax * ROW * 1ull, 64, v.tile, 1, CU_TENSOR_MAP_SWIZZLE_128B);
    }
    auto launch = [&](int b) {
      Args a{buf[b][0], buf[b][1], keys, smax, v.stages, v.tile, v.work, sink, table, readers};
      switch (v.mode) {
        case kTmaX: stream_kernel<kTmaX><<<grid, CONSUMERS + 32, dyn>>>(kmap[b], vmap[b], a); break;
        case kTmaRows: stream_kernel<kTmaRows><<<grid, CONSUMERS + 32, dyn>>>(kmap[b], vmap[b], a); break;
        case kCpAsyncX: stream_kernel<kCpAsyncX><<<grid, CONSUMERS + 32, dyn>>>(kmap[b], vmap[b], a); break;
        case kPagedBulk: stream_kernel<kPagedBulk><<<grid, CONSUMERS + 32, dyn>>>(kmap[b], vmap[b], a); break;
        case kPagedCp: stream_kernel<kPagedCp><<<grid, CONSUMERS + 32, dyn>>>(kmap[b], vmap[b], a); break;
        default: plain_kernel<<<grid, CONSUMERS + 32>>>(a);
      }
    };
    for (int i = 0; i < 4; ++i) launch(i & 1);
    CHECK(cudaDeviceSynchronize());
    // One launch between two events (launch overhead included), and BACK_TO_BACK launches in a
    // row (per launch: what a CUDA graph of layers sees).
    constexpr int BACK_TO_BACK = 10;
    std::vector<float> one, row;
    for (int i = 0; i < 20; ++i) {
      float t = 0;
      CHECK(cudaEventRecord(e0));
      launch(i & 1);
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      CHECK(cudaEventElapsedTime(&t, e0, e1));
      one.push_back(t);
      CHECK(cudaEventRecord(e0));
      for (int j = 0; j < BACK_TO_BACK; ++j) launch((i + j) & 1);
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      CHECK(cudaEventElapsedTime(&t, e0, e1));
      row.push_back(t / BACK_TO_BACK);
    }
    CHECK(cudaGetLastError());
    std::sort(one.begin(), one.end());
    std::sort(row.begin(), row.end());
    const double us = one[one.size() / 2] * 1e3, us_row = row[row.size() / 2] * 1e3;
    char what[64] = "";
    if (v.mode != kPlain) {
      std::snprintf(what, sizeof(what), "tile %3d keys, %d stages", v.tile, v.stages);
      if (v.work > 0) std::snprintf(what + std::strlen(what), sizeof(what) - std::strlen(what), ", %d cyc", v.work);
    }
    const double read = 2.0 * bytes * readers;  // what the SMs received
    std::printf("%-34s %-34s %8.2f us %7.0f GB/s | in a row %8.2f us %7.0f GB/s\n", kModeNames[v.mode], what, us,
                read / us / 1e3, us_row, read / us_row / 1e3);
  }
  return 0;
}
