// Tile sources: where the tile loop's K/V tiles come from. The producer warp of a block calls
// Source::load for each tile of its walk; the tile lands in one stage (tile_layout.cuh) and its
// arrival completes the stage's "full" barrier. The consumers (attend_tiles.cuh), the softmax,
// the merge and the append never see how it got there. Torch-free.
//
// A source provides (all 32 producer lanes call issue and commit):
//   FULL_ARRIVALS                       arrivals that complete a stage's full barrier
//   prefetch(args)                      anything worth fetching at block entry (lane 0)
//   issue(args, pages, stage, k0, full, lane, kg)
//                                       start bringing keys [k0, k0 + kTileKeys) into the stage
//                                       in K/V groups of 2^kg keys (TileLayout; a paged cache's
//                                       from the pool blocks `pages` names)
//   commit(full, lane)                  arrive on the full barrier for the tile's copies (the
//                                       producer's own shared-memory writes, a tile header and a
//                                       staged q, are published by each writing lane's arrival on
//                                       the stage's header barrier)
// and leaves to the consumers only two patches of the tile: the new token's slot (always taken
// from shared memory) and V rows at or past the block's end (zeroed, so NaN or Inf in unused
// cache slots cannot reach the output; K rows there are masked by their scores).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cache_slots.cuh"
#include "ptx.cuh"
#include "tile_layout.cuh"

namespace mmha {

// One block's (row, kv head) of the caches (elements T: 16-bit, or e4m3 bytes); the fields of
// HeadSlots (cache_slots.cuh) that say where a slot lives.
template <typename T>
struct TileArgs {
  const T* k_head;  // contiguous: [D/x, S_max, x]; paged: the head's part of pool block 0
  const T* v_head;  // contiguous: [S_max, D]; paged: likewise
  int smax;         // slots of one K chunk run: S_max, or the block size (paged)
  int lo;           // keys before lo (a window's start) are never needed
  int end;          // keys at or past end are never needed
  int pos;          // the new token's slot (its K/V come from shared memory)
  int kv_head;      // row * Hkv + kv head: the tensor maps' head coordinate
  const CUtensorMap* k_map;
  const CUtensorMap* v_map;
  const int32_t* table;  // paged: the row's block table; nullptr: contiguous
  int shift;             // paged: log2 of the block size
  int64_t block_stride;  // paged: elements between pool blocks
  int block_rows;        // paged, bulk tensor copies: V map rows per pool block (Hkv * bs)
  int head_row;          // paged, bulk tensor copies: the kv head's first V map row in a block (kvh * bs)
};

// The pool blocks of one tile's keys (paged caches): 64 keys lie in at most 4 blocks of >= 16
// slots, sub-block s being table entry (k0 >> shift) + s. Entries of blocks that hold none of the
// tile's needed keys ([lo, end)) are not read and stay 0. A lookup is split in two so that the
// table's latency hides behind a tile's copies: load_pages starts the loads, checked (a tile
// later) reads them, turning an entry outside the pool into block 0 (its keys are read from there,
// and the item is refused) and raising `bad`.
struct TilePages {
  int id[4];
  __device__ __forceinline__ int of(int t, int k0, int shift) const {
    const int s = (t >> shift) - (k0 >> shift);
    return s == 0 ? id[0] : s == 1 ? id[1] : s == 2 ? id[2] : id[3];
  }
  __device__ __forceinline__ TilePages checked(int num_blocks, bool& bad) const {
    TilePages pg;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const bool ok = id[s] >= 0 && id[s] < num_blocks;
      bad = bad || !ok;
      pg.id[s] = ok ? id[s] : 0;
    }
    return pg;
  }
};

template <typename T>
__device__ __forceinline__ TilePages load_pages(const TileArgs<T>& a, int k0) {
  TilePages pg{{0, 0, 0, 0}};
  if (a.table == nullptr) return pg;
  const int lo = max(k0, a.lo);
  const int hi = min(k0 + kTileKeys, a.end);
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int blk = (k0 >> a.shift) + s;
    if (max(lo, blk << a.shift) < min(hi, (blk + 1) << a.shift)) pg.id[s] = __ldg(a.table + blk);
  }
  return pg;
}

// 16-byte cp.async by the 32 lanes of the producer warp (sm_80 and newer, every head dim). Keys
// before lo, at or past end and the new token's slot are zero-filled without being read; each
// lane's copies arrive on the full barrier when they land.
template <typename T, int HEAD_DIM>
struct CpAsyncTiles {
  using L = TileLayout<T, HEAD_DIM>;
  static constexpr int FULL_ARRIVALS = 32;
  __device__ __forceinline__ static void prefetch(const TileArgs<T>&) {}
  static constexpr int PIECES = L::KEYS * L::CHUNKS / 32;  // per lane, for K and for V

  __device__ __forceinline__ static void issue(const TileArgs<T>& a, const TilePages& pg, unsigned char* stage,
                                               int k0, uint64_t* /*full*/, int lane, int kg) {
    if (a.table != nullptr) {
      issue_paged(a, pg, stage, k0, lane, kg);
      return;
    }
    pieces(a, stage, k0, lane, L::TILE_GROUP,
           [&](int t, int c) { return a.k_head + (static_cast<int64_t>(c) * a.smax + t) * L::VEC; },
           [&](int t, int c) { return a.v_head + static_cast<int64_t>(t) * HEAD_DIM + c * L::VEC; });
  }

  // A paged cache's tile: the same pieces, each from the pool block of its key (bs = a.smax).
  __device__ __forceinline__ static void issue_paged(const TileArgs<T>& a, const TilePages& pg, unsigned char* stage,
                                                     int k0, int lane, int kg) {
    const int mask = a.smax - 1;
    const auto block = [&](int t) { return static_cast<int64_t>(pg.of(t, k0, a.shift)) * a.block_stride; };
    pieces(
        a, stage, k0, lane, kg,
        [&](int t, int c) { return a.k_head + block(t) + (static_cast<int64_t>(c) * a.smax + (t & mask)) * L::VEC; },
        [&](int t, int c) { return a.v_head + block(t) + static_cast<int64_t>(t & mask) * HEAD_DIM + c * L::VEC; });
  }

  // The tile's 16-byte pieces, K (in groups of 2^kg keys) then V; k_src(t, c) / v_src(t, c):
  // where chunk c of key t is. K: piece i is key i % KEYS of chunk i / KEYS, so a warp copies 32
  // consecutive keys of one chunk (512 contiguous bytes of a contiguous cache) at a time, chunk
  // after chunk. V: piece i is chunk i % CHUNKS of key i / CHUNKS (rows are contiguous in the cache).
  template <class KSrc, class VSrc>
  __device__ __forceinline__ static void pieces(const TileArgs<T>& a, unsigned char* stage, int k0, int lane, int kg,
                                                KSrc k_src, VSrc v_src) {
#pragma unroll 4
    for (int j = 0; j < PIECES; ++j) {
      const int i = lane + 32 * j;
      const int key = i % L::KEYS;
      const int c = i / L::KEYS;
      const int t = k0 + key;
      const bool ok = t >= a.lo && t < a.end && t != a.pos;
      cp_async16(stage + L::k_off(key, c, kg), ok ? k_src(t, c) : a.k_head, ok);
    }
#pragma unroll 4
    for (int j = 0; j < PIECES; ++j) {
      const int i = lane + 32 * j;
      const int r = i / L::CHUNKS;
      const int c = i % L::CHUNKS;
      const int t = k0 + r;
      const bool ok = t >= a.lo && t < a.end && t != a.pos;
      cp_async16(stage + L::v_off(r, c, kg), ok ? v_src(t, c) : a.v_head, ok);
    }
  }

  // Each lane's copies arrive when they land (noinc: counted in FULL_ARRIVALS).
  __device__ __forceinline__ static void commit(uint64_t* full, int /*lane*/) { cp_async_arrive(full); }
};

// Hopper bulk tensor copies (sm_90): lane 0 of the producer warp issues one K box (all chunks x
// KEYS keys: CHUNKS runs of KEYS * 16 contiguous bytes, chunk after chunk) and V_LINES V boxes
// (KEYS lines of 128 bytes, swizzled) per tile; the maps see every cache as 16-bit elements, and the copy engine completes the full
// barrier. Keys past S_max are zero-filled by the copy engine; the slot of the new token, keys in
// [end, S_max) and a window's keys before lo in its first tile are read and then patched by the
// consumers. Measured on the H200 (decode
// timing): K fetched as two 512-byte halves per chunk 16 requests apart ran B=16 Hkv=32 S=8192 at
// 517 us, 32 boxes of one half-chunk each slowed blocks of few tiles (B=64 S=256: 81 -> 89 us).
template <typename T, int HEAD_DIM>
struct TmaTiles {
  using L = TileLayout<T, HEAD_DIM>;
  static_assert(L::V_SWIZZLE, "bulk tensor copies need V rows of whole 128-byte lines");
  static constexpr int FULL_ARRIVALS = 1;
  static constexpr uint32_t TX_BYTES = L::K_BYTES + L::V_BYTES;

  // Lane 0 of the producer warp, at block entry: the descriptors into the copy engine's cache.
  __device__ __forceinline__ static void prefetch(const TileArgs<T>& a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    tma_prefetch_map(a.k_map);
    tma_prefetch_map(a.v_map);
#endif
  }

  // The copies count their bytes against the full barrier (expect_tx, no arrival yet), so the
  // producer may write the tile's header and staged q while they are in flight.
  __device__ __forceinline__ static void issue(const TileArgs<T>& a, const TilePages& pg, unsigned char* stage,
                                               int k0, uint64_t* full, int lane, int kg) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (a.table != nullptr) {
      issue_paged(a, pg, stage, k0, full, lane, kg);
      return;
    }
    if (lane == 0) {
      mbar_expect_tx(full, TX_BYTES);
      // K map: [B * Hkv * CHUNKS rows][S_max / 32 groups][32 keys * 16 bytes] (tma_maps.cpp).
      tma_load_3d(stage, a.k_map, 0, k0 / 32, a.kv_head * L::CHUNKS, full);
#pragma unroll
      for (int j = 0; j < L::V_LINES; ++j) {  // line j: 16-bit elements 64 j .. 64 j + 63 of the row
        tma_load_3d(stage + L::K_BYTES + j * L::KEYS * L::V_LINE_BYTES, a.v_map, 64 * j, k0, a.kv_head, full);
      }
    }
#else
    __trap();  // the host launches this source on sm_90 devices only
#endif
  }

  // A paged cache's tile: blocks of >= 64 slots hold it whole (a K box of the map over the pool,
  // and V boxes); smaller ones per sub-block of bs keys (one pool block each). In groups of one
  // block (kg = block_shift), a sub-block is one K/V group of the stage: K one bulk copy of the
  // block's whole K (CHUNKS * bs * 16 contiguous bytes of the pool) and V one box of the pool's V
  // map (all V_LINES lines of bs rows; rows: block * Hkv * bs + kv head * bs + slot, swizzled as
  // the contiguous boxes: the swizzle follows the shared-memory address). In whole-tile groups
  // (wide items), K goes as one bulk copy per chunk and V as one box per line (the line map, in
  // the K map's place: tma_maps.cpp). Sub-blocks the tile does not need are read from block 0 (the
  // byte count stays whole) and patched by the consumers, as keys past the end are in the
  // contiguous case. The lanes share the copies.
  __device__ __forceinline__ static void issue_paged(const TileArgs<T>& a, const TilePages& pg, unsigned char* stage,
                                                     int k0, uint64_t* full, int lane, int kg) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const int mask = a.smax - 1;
    if (a.shift >= 6) {  // the tile lies in one block: one K box and a V box per line, as contiguous
      if (lane == 0) {
        const int row = pg.id[0] * a.block_rows + a.head_row + (k0 & mask);
        mbar_expect_tx(full, TX_BYTES);
        tma_load_3d(stage, a.k_map, 0, (k0 & mask) / 32, (row >> a.shift) * L::CHUNKS, full);
#pragma unroll
        for (int j = 0; j < L::V_LINES; ++j) {
          tma_load_2d(stage + L::K_BYTES + j * L::KEYS * L::V_LINE_BYTES, a.v_map, 64 * j, row, full);
        }
      }
      return;
    }
    if (lane == 0) mbar_expect_tx(full, TX_BYTES);
    __syncwarp();
    const int sub_shift = a.shift;  // log2 of keys per sub-block (16 or 32)
    const int subs = L::KEYS >> sub_shift;
    if (kg == sub_shift) {
      if (lane < subs) {
        const int key = lane << sub_shift;
        const int id = pg.of(k0 + key, k0, a.shift);
        bulk_load(stage + L::k_off(key, 0, kg), a.k_head + static_cast<int64_t>(id) * a.block_stride,
                  (L::CHUNKS * 16u) << sub_shift, full);
        tma_load_3d(stage + L::v_off(key, 0, kg), a.v_map, 0, id * a.block_rows + a.head_row, 0, full);
      }
      return;
    }
    for (int q = lane; q < L::CHUNKS * subs; q += 32) {
      const int s = q / L::CHUNKS;
      const int c = q - s * L::CHUNKS;
      const int key = s << sub_shift;
      const T* src = a.k_head + static_cast<int64_t>(pg.of(k0 + key, k0, a.shift)) * a.block_stride +
                     (static_cast<int64_t>(c) << sub_shift) * L::VEC;
      bulk_load(stage + L::k_off(key, c, kg), src, 16u << sub_shift, full);
    }
    for (int q = lane; q < L::V_LINES * subs; q += 32) {
      const int s = q / L::V_LINES;
      const int j = q - s * L::V_LINES;
      const int key = s << sub_shift;
      const int row = pg.of(k0 + key, k0, a.shift) * a.block_rows + a.head_row;
      tma_load_3d(stage + L::v_off(key, 8 * j, kg), a.k_map, 0, row, j, full);
    }
#endif
  }

  // One arrival, by the lane that set the expected bytes; the copy engine completes the phase.
  __device__ __forceinline__ static void commit(uint64_t* full, int lane) {
    if (lane == 0) mbar_arrive(full);
  }
};

// An int8 cache's token scales of a tile (TileLayout::SCALE_OFF: its keys' K scales, then their
// V scales), whatever the tile's source. Where the row's scale planes are 16-byte aligned (a
// contiguous cache whose S_max is a multiple of 4, any paged one: its blocks hold a multiple of 4
// slots) a lane copies 4 keys' scales with one 16-byte cp.async (lanes 0-15 K's, 16-31 V's), a
// chunk without a key in [lo, end) zero-filled unread; else a 4-byte cp.async per scale, those of
// keys outside [lo, end) and of the new token's slot zero-filled. Either way the consumers zero
// the V scales of keys outside [lo, end) and patch the new token's in (a stray V row stays out of
// the output). The copies hold the stage's full barrier until they land (cp_async_hold: its count
// unchanged), and the warp reconverges before the tile's commit may complete it.
template <int HEAD_DIM>
__device__ __forceinline__ void stage_token_scales(const TileArgs<s8>& a, const TokenScales& ts, const TilePages& pg,
                                                   unsigned char* stage, int k0, uint64_t* full, int lane) {
  float* dst = reinterpret_cast<float*>(stage + TileLayout<s8, HEAD_DIM>::SCALE_OFF);
  // (A contiguous row's last chunk must end inside its S_max slots, not in the next row's or past
  // the tensor: S_max a multiple of 4, checked apart from the pointers' alignment.)
  const bool chunks = ((reinterpret_cast<uintptr_t>(ts.k) | reinterpret_cast<uintptr_t>(ts.v)) & 15) == 0 &&
                      (ts.block_stride != 0 || ts.pitch % 4 == 0);
  if (chunks) {  // uniform: the item's planes
    static_assert(2 * kTileKeys == 4 * 32, "one 16-byte chunk of scales per producer lane");
    const int i = 4 * (lane % 16);
    const int t = k0 + i;
    const bool ok = t < a.end && t + 4 > a.lo;
    const float* base = lane < 16 ? ts.k : ts.v;
    const int blk = a.table != nullptr ? pg.of(t, k0, a.shift) : 0;
    cp_async16(dst + (lane < 16 ? 0 : kTileKeys) + i, ok ? base + ts.at(blk, t) : base, ok);
  } else {
#pragma unroll
    for (int j = 0; j < 2 * kTileKeys / 32; ++j) {
      const int i = lane + 32 * j;  // K's scales, then V's
      const int t = k0 + i % kTileKeys;
      const bool ok = t >= a.lo && t < a.end && t != a.pos;
      const float* base = i < kTileKeys ? ts.k : ts.v;
      const int blk = a.table != nullptr ? pg.of(t, k0, a.shift) : 0;
      cp_async4(dst + i, ok ? base + ts.at(blk, t) : base, ok);
    }
  }
  cp_async_hold(full);
  __syncwarp();
}

}  // namespace mmha
