// An int4 cache's tiles (mmha/int4.py; contiguous caches, cp.async): the stage layout, the
// producer's copies of codes, scales and zero points, and where a (row, kv head)'s planes are.
// A tile is 64 keys, so a tile of committed keys is exactly one K group: its codes, the group's
// per-channel scales and zero points, and its keys' V codes, V scales and zero points. The
// consumers (attend_int4.cuh) read them. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cache_slots.cuh"
#include "mmha_params.h"
#include "ptx.cuh"
#include "tile_layout.cuh"
#include "tile_source.cuh"
#include "vec.cuh"

namespace mmha {
// One stage: K codes [CHUNKS][KEYS][16 bytes] (chunk c of key k: 32 channels), V rows of D / 2
// bytes unpadded, their 16-byte units swizzled as a bulk tensor copy lands them (int4_v_swizzle:
// the 8 rows an ldmatrix.trans phase reads in 8 bank groups at every head dim), then fp16 K scales
// [D], K zero points [D], V scales [KEYS], V zero points [KEYS].
template <int HEAD_DIM>
struct TileLayout<u4, HEAD_DIM> {
  static_assert(HEAD_DIM % kInt4Channels == 0, "int4 head dims are whole chunks of 32 channels");
  static constexpr int KEYS = kTileKeys;
  static constexpr int CHUNKS = HEAD_DIM / kInt4Channels;
  static constexpr int TILE_GROUP = WholeTile::value;
  static constexpr int K_BYTES = KEYS * HEAD_DIM / 2;
  static constexpr int V_ROW_BYTES = HEAD_DIM / 2;
  static constexpr int V_SWIZZLE = int4_v_swizzle(HEAD_DIM);           // bytes: 0, 32, 64 or 128
  static constexpr int V_SWIZZLE_MASK = V_SWIZZLE ? V_SWIZZLE / 16 - 1 : 0;  // of address bits 7 on
  static constexpr int V_BYTES = KEYS * V_ROW_BYTES;
  static constexpr int SCALE_OFF = K_BYTES + V_BYTES;
  static constexpr int K_ZERO_OFF = SCALE_OFF + 2 * HEAD_DIM;
  static constexpr int V_SCALE_OFF = K_ZERO_OFF + 2 * HEAD_DIM;
  static constexpr int V_ZERO_OFF = V_SCALE_OFF + 2 * KEYS;
  static constexpr int STAGE_BYTES = int4_stage_bytes(HEAD_DIM);
  static_assert(V_ZERO_OFF + 2 * KEYS <= STAGE_BYTES, "stage too small");
  static_assert(SCALE_OFF % 16 == 0, "scales 16-byte aligned");
  static_assert(K_BYTES % 1024 == 0 && STAGE_BYTES % 1024 == 0, "V's swizzle follows address bits 7-9 of the stage");

  template <typename G>
  __host__ __device__ __forceinline__ static constexpr int k_off(int k, int c, G) {
    return (c * KEYS + k) * 16;
  }
  __device__ __forceinline__ static int k_group(const CacheParams&) { return TILE_GROUP; }
  // Unit c of V row r: at r * V_ROW_BYTES + 16 c, the unit index XORed with address bits 7 on
  // (V_SWIZZLE_MASK), as the copy engine's 32 / 64 / 128-byte swizzle places it.
  template <typename G>
  __host__ __device__ __forceinline__ static constexpr int v_off(int r, int c, G) {
    const int o = r * V_ROW_BYTES + c * 16;
    return K_BYTES + (o ^ (((o >> 7) & V_SWIZZLE_MASK) << 4));
  }
  // Whether every 8 rows r0 .. r0 + 7 (r0 a multiple of 8) of each 16-byte column lie in 8
  // distinct bank groups (the consumers' ldmatrix.trans phases over V).
  static constexpr bool v_phases_conflict_free() {
    for (int r0 = 0; r0 < KEYS; r0 += 8) {
      for (int c = 0; c < V_ROW_BYTES / 16; ++c) {
        unsigned seen = 0;
        for (int r = r0; r < r0 + 8; ++r) seen |= 1u << (v_off(r, c, 0) / 16 % 8);
        if (seen != 0xFFu) return false;
      }
    }
    return true;
  }
  static_assert(v_phases_conflict_free(), "V's ldmatrix.trans phases without bank conflicts");
};

// An int4 cache's TileArgs: TileArgs' fields, the tile whose K the consumers take from the
// residual area (not read: skip_k0, or -1), and whether the item's tiles come by bulk copies
// (Int4Planes::bulk: the host's maps in k_map / v_map; sm_90 builds only).
template <>
struct TileArgs<u4> {
  const u4* k_head;
  const u4* v_head;
  int smax, lo, end, pos, kv_head;
  const CUtensorMap* k_map;
  const CUtensorMap* v_map;
  const int32_t* table;
  int shift;
  int64_t block_stride;
  int block_rows, head_row;
  int skip_k0 = -1;
  bool bulk = false;
};

// One (row, kv head)'s int4 planes (MmhaParams::int4): contiguous, the row's [S_max / 64][D] K
// planes and [S_max] V planes; paged (blocks of 64 or 128 slots), the kv head's part of pool block
// 0, a slot t of block blk at k_at / v_at. The K residual is per row either way.
template <typename T, int HEAD_DIM>
struct Int4Head {
  uint16_t* k_scale;
  uint16_t* k_zero;
  uint16_t* v_scale;
  uint16_t* v_zero;
  T* residual;        // [128][D]
  int mask;           // a slot's place in its block: t & mask (contiguous: t)
  int64_t k_block;    // elements between pool blocks (0: contiguous)
  int64_t v_block;
  // The K planes' offset of slot t's group, and the V planes' offset of slot t (in block blk).
  __device__ __forceinline__ int64_t k_at(int blk, int t) const {
    return blk * k_block + static_cast<int64_t>((t & mask) / kInt4Group) * HEAD_DIM;
  }
  __device__ __forceinline__ int64_t v_at(int blk, int t) const { return blk * v_block + (t & mask); }
};

template <typename T, int HEAD_DIM>
__device__ __forceinline__ Int4Head<T, HEAD_DIM> int4_head(const MmhaParams& p, int b, int kvh) {
  T* residual = static_cast<T*>(p.int4.k_residual) +
                (static_cast<int64_t>(b) * p.num_kv_heads + kvh) * kInt4Residual * HEAD_DIM;
  if (p.cache.block_tables == nullptr) {
    const int64_t head = static_cast<int64_t>(b) * p.num_kv_heads + kvh;
    const int64_t smax = p.cache.max_seq_len;
    const int64_t groups = smax / kInt4Group;
    return {p.int4.k_scale + head * groups * HEAD_DIM, p.int4.k_zero + head * groups * HEAD_DIM,
            p.int4.v_scale + head * smax, p.int4.v_zero + head * smax, residual, -1, 0, 0};
  }
  const int bs = 1 << p.cache.block_shift;
  const int64_t k_head = static_cast<int64_t>(kvh) * (bs / kInt4Group) * HEAD_DIM;
  const int64_t v_head = static_cast<int64_t>(kvh) * bs;
  return {p.int4.k_scale + k_head, p.int4.k_zero + k_head, p.int4.v_scale + v_head, p.int4.v_zero + v_head,
          residual, bs - 1, static_cast<int64_t>(p.num_kv_heads) * (bs / kInt4Group) * HEAD_DIM,
          static_cast<int64_t>(p.num_kv_heads) * bs};
}

// The codes of a tile (a contiguous cache's k [D / 32][S_max][16 bytes] and v [S_max][D / 2] bytes
// of the (row, kv head); a paged one's the same of the tile's pool block, of 64 or 128 slots, so a
// tile lies in one block), in one of two ways (TileArgs<u4>::bulk):
// - bulk tensor copies (sm_90; the host's int4 maps, tma_maps.cpp): lane 0 issues one K box (all
//   chunks x KEYS keys, as the 16-bit source's) and one V box (KEYS rows, swizzled: TileLayout<u4>),
//   and stage_int4_scales four plain bulk copies; their bytes are counted against the full
//   barrier first. Every key of the tile is read but the residual's tile's K (skip_k0): keys
//   outside [lo, end) and the new token's slot are left to the consumers, which mask their scores,
//   weigh their V by 0 and patch the new token in (Int4Consumer; codes are finite whatever a slot
//   holds). Few copies a tile is the point: V as 32 plain bulk copies of 128 bytes (two rows each,
//   padded apart) ran B=16 Hkv=32 S=16384 at 1.47x the cp.async source on the H200, one 4 KB copy
//   (unswizzled, its ldmatrix phases 4-way conflicted) at 0.93x.
// - 16-byte cp.async (any other case): keys outside [lo, end), the new token's slot and the K of
//   the residual's tile zero-filled unread.
// Either way each lane's commit arrives when its cp.async copies (none for bulk items) have landed:
// the full barrier completes on 32 arrivals and, for bulk items, the copies' bytes.
template <int HEAD_DIM>
struct CpAsyncTiles<u4, HEAD_DIM> {
  using L = TileLayout<u4, HEAD_DIM>;
  static constexpr int FULL_ARRIVALS = 32;
  static constexpr int PIECES = L::KEYS * L::CHUNKS / 32;  // per lane, for K and for V
  // A bulk tile's bytes: the codes and planes of K (not for the residual's tile) and of V.
  static constexpr uint32_t K_TX_BYTES = L::K_BYTES + 4 * HEAD_DIM;
  static constexpr uint32_t V_TX_BYTES = L::KEYS * L::V_ROW_BYTES + 4 * L::KEYS;
  __device__ __forceinline__ static void prefetch(const TileArgs<u4>&) {}

  __device__ __forceinline__ static void issue(const TileArgs<u4>& a, const TilePages& pg, unsigned char* stage,
                                               int k0, uint64_t* full, int lane, int) {
    const int64_t blk = a.table != nullptr ? pg.id[0] * a.block_stride : 0;
    const int mask = a.table != nullptr ? a.smax - 1 : -1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (a.bulk) {
      if (lane == 0) {
        const bool k = k0 != a.skip_k0;
        const int slot = k0 & mask;  // the tile's first slot in its row or block
        // The maps' (row, kv head) or (pool block, kv head) index.
        const int head = a.table != nullptr ? (pg.id[0] * a.block_rows + a.head_row) >> a.shift : a.kv_head;
        mbar_expect_tx(full, (k ? K_TX_BYTES : 0) + V_TX_BYTES);
        if (k) tma_load_3d(stage, a.k_map, 0, slot / 32, head * L::CHUNKS, full);
        tma_load_2d(stage + L::K_BYTES, a.v_map, 0, head * a.smax + slot, full);
      }
      __syncwarp();  // the expected bytes before stage_int4_scales' copies
      return;
    }
#endif
#pragma unroll
    for (int j = 0; j < PIECES; ++j) {
      const int i = lane + 32 * j;
      const int key = i % L::KEYS;
      const int c = i / L::KEYS;
      const int t = k0 + key;
      const bool ok = t >= a.lo && t < a.end && t != a.pos && k0 != a.skip_k0;
      const u4* src = a.k_head + blk + (static_cast<int64_t>(c) * a.smax + (t & mask)) * 16;
      cp_async16(stage + L::k_off(key, c, 0), ok ? src : a.k_head, ok);
    }
#pragma unroll
    for (int j = 0; j < PIECES; ++j) {
      const int i = lane + 32 * j;
      const int r = i / L::CHUNKS;
      const int c = i % L::CHUNKS;
      const int t = k0 + r;
      const bool ok = t >= a.lo && t < a.end && t != a.pos;
      const u4* src = a.v_head + blk + static_cast<int64_t>(t & mask) * L::V_ROW_BYTES + c * 16;
      cp_async16(stage + L::v_off(r, c, 0), ok ? src : a.v_head, ok);
    }
  }

  __device__ __forceinline__ static void commit(uint64_t* full, int) { cp_async_arrive(full); }
};

// A tile's scales and zero points (TileLayout<u4>::SCALE_OFF on): its group's K planes (not for
// the residual's tile, skip_k0) and its keys' V planes. Bulk items: four bulk copies (lanes 0-3),
// their bytes counted by the tile's issue. Else 16 bytes a cp.async, V chunks of 8 keys without a
// key in [lo, end) zero-filled unread, the copies holding the stage's full barrier until they land
// (as int8's token scales). The consumers weigh the V of keys outside [lo, end) by 0 either way.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void stage_int4_scales(const TileArgs<u4>& a, const Int4Head<T, HEAD_DIM>& ih,
                                                  const TilePages& pg, unsigned char* stage, int k0, uint64_t* full,
                                                  int lane) {
  using L = TileLayout<u4, HEAD_DIM>;
  constexpr int K_PIECES = HEAD_DIM / 8;  // 8 fp16 values a piece, scales then zero points
  constexpr int V_PIECES = L::KEYS / 8;
  const int blk = a.table != nullptr ? pg.id[0] : 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (a.bulk) {
    if (lane < 2 && k0 != a.skip_k0) {
      bulk_load(stage + (lane == 0 ? L::SCALE_OFF : L::K_ZERO_OFF), (lane == 0 ? ih.k_scale : ih.k_zero) + ih.k_at(blk, k0),
                2 * HEAD_DIM, full);
    } else if (lane == 2 || lane == 3) {
      bulk_load(stage + (lane == 2 ? L::V_SCALE_OFF : L::V_ZERO_OFF), (lane == 2 ? ih.v_scale : ih.v_zero) + ih.v_at(blk, k0),
                2 * L::KEYS, full);
    }
    return;
  }
#endif
  for (int i = lane; i < 2 * K_PIECES + 2 * V_PIECES; i += 32) {
    if (i < 2 * K_PIECES) {
      const uint16_t* src = (i < K_PIECES ? ih.k_scale : ih.k_zero) + ih.k_at(blk, k0) + (i % K_PIECES) * 8;
      cp_async16(stage + L::SCALE_OFF + i * 16, k0 != a.skip_k0 ? src : ih.k_scale, k0 != a.skip_k0);
    } else {
      const int v = i - 2 * K_PIECES;
      const int t = k0 + (v % V_PIECES) * 8;
      const bool ok = t < a.end && t + 8 > a.lo;
      const uint16_t* base = v < V_PIECES ? ih.v_scale : ih.v_zero;
      cp_async16(stage + L::V_SCALE_OFF + v * 16, ok ? base + ih.v_at(blk, t) : base, ok);
    }
  }
  cp_async_hold(full);
  __syncwarp();
}

}  // namespace mmha
