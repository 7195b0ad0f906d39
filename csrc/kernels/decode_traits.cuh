// What a decode kernel instance is, by its template parameters: which main loop it runs, its
// cache type's traits, its block size and occupancy, its tile source. Torch-free.
#pragma once

#include <cuda_runtime.h>
#include <type_traits>

#include "mmha_params.h"
#include "int4_tiles.cuh"
#include "tile_source.cuh"
#include "vec.cuh"

namespace mmha {

// The main loop: the tile loop (tensor cores, attend_tiles.cuh) for fp16 / bf16 / fp8 caches,
// the CUDA-core loop (attend_simt.cuh) for fp32 caches. Mirrored by uses_tensor_cores() in
// mmha/dispatch.py. T is the element of qkv and out, C the cache's (T, or e4m3 / s8 with 16-bit T).
template <typename T>
constexpr bool kTiles = !std::is_same_v<T, float>;
template <typename C>
constexpr bool kFp8 = std::is_same_v<C, e4m3>;
// int8 caches: codes with a scale per token and kv head (one-token steps on narrow items).
template <typename C>
constexpr bool kInt8 = std::is_same_v<C, s8>;
// int4 caches (mmha/int4.py): one-token steps on narrow items over contiguous caches, cp.async
// tiles (attend_int4.cuh).
template <typename C>
constexpr bool kInt4 = std::is_same_v<C, u4>;

// Which instances have a twin for fused small tree steps (the kernels' FUSED parameter; tree_step.cuh's
// TreeNodes): narrow tile-loop items of two or more columns over 16-bit, fp8 or int8 caches (int8
// nodes quantised per token in the node area, their scales beside them), without the output
// epilogue. (A tree of two or more nodes has two or more columns.) A twin of its own: the fused code inlined into the one-token
// kernels made them slower (H200, 2026-11-28: B=1 Hkv=8 1K 11.1 -> 12.1 us).
template <typename T, typename C, int QB, bool EPI>
constexpr bool kFusedTrees = kTiles<T> && QB > 1 && QB != kWideColumns && !kInt4<C> && !EPI;

// What a thread of a fused tree step reads from global memory before it uses any (one round trip
// for them all): its q columns' elements, its nodes' k / v rotation pairs.
constexpr int kPrefetchQ = 8;          // q elements (a pass before the rotation)
constexpr int kPrefetchNodePairs = 2;  // k and v pairs: four values each (four pairs spill)

template <typename T>
constexpr int kBlockThreads = kTiles<T> ? kTileThreads : kSimtThreads;
// Tile-loop blocks of head_dim <= 128 may run two per SM (stages permitting): 12 warps, 3 per
// SM sub-partition of 16384 registers, so registers are capped at 168 per thread (as with 10
// warps); at head_dim 256 one block per SM.
template <typename T, int HEAD_DIM>
constexpr int kMinBlocks = kTiles<T> ? (HEAD_DIM <= 128 ? 2 : 1) : 0;

// Wide items over int8 caches (tree steps, decode_attention_kernel_wide: kWideRegisterSplit): blocks
// of two warpgroups, the consumers and the rest (producer, stager, two idle warps), two an SM.
// Launched at 128 registers a thread (16 warps an SM: 4 a sub-partition of 16384), the rest give
// theirs back down to kWideOtherRegs and the consumers take kWideConsumerRegs (2 x 200 + 2 x 56 =
// 512 a sub-partition's thread slot; setmaxnreg, sm_90a). Without wgmma (sm_80-sm_89 builds) one
// block an SM at the launch's registers. Blocks of 12 warps (the others) hold 168 registers a
// thread at two an SM, where the int8 consumers, which widen each tile, spill (H200, 2026-12-01,
// docs/data/ab_wide_register_split_h200.md: int8 T=64 tree rows 0.92-0.99x; 16-bit T=64 rows at
// B=1 1.02-1.03x, their producer's start spilling at 56, so they keep 168).
template <typename C>
constexpr bool kWideRegisterSplit = kInt8<C>;
constexpr int kWideThreads = 2 * 128;
constexpr int kWideConsumerRegs = 200;
constexpr int kWideOtherRegs = 56;
static_assert(2 * kWideConsumerRegs + 2 * kWideOtherRegs <= 512, "wide blocks: two an SM's registers");

// Paired wide items (ScheduleParams::pair 2; 16-bit caches at head dims 64 and 128): blocks of three
// warpgroups, one an SM: two consumer warpgroups that take turns on the tensor cores, each holding
// the last tile's P for the next turn, and the producer's (producer, stager, two idle warps).
// Launched at 168 registers a thread, the producer's warpgroup gives them back down to 56 and the
// consumers take 224 (2 x 224 + 56 = 504 of a sub-partition's 512 a thread slot).
template <typename T, typename C, int HEAD_DIM>
constexpr bool kPairedKernels = std::is_same_v<T, C> && !std::is_same_v<T, float> && (HEAD_DIM == 64 || HEAD_DIM == 128);
constexpr int kWidePairThreads = 3 * 128;
// The paired consumers' turn: S and the held P's P V as two batches, the scores weighed while P V
// runs and O rescaled after it (true: B=16 T=64 4K / 16K 0.92-0.95x the one-batch form on an H200,
// docs/experiments.md), or as one batch with the scores weighed after both (false).
constexpr bool kWideOverlapTurns = true;
constexpr int kWidePairConsumerRegs = 224;
constexpr int kWidePairOtherRegs = 56;
static_assert(2 * kWidePairConsumerRegs + kWidePairOtherRegs <= 512, "paired wide blocks: one an SM's registers");

// The threads of a launch's block (decode_attention.cuh's kernel_of picks the kernel).
template <typename T, typename C, int QB>
constexpr int kKernelThreads = QB == kWideColumns && kWideRegisterSplit<C> ? kWideThreads : kBlockThreads<T>;

template <typename C, int HEAD_DIM, TileSource SRC>
using SourceOf = std::conditional_t<SRC == TileSource::kTma, TmaTiles<C, HEAD_DIM>, CpAsyncTiles<C, HEAD_DIM>>;

}  // namespace mmha
