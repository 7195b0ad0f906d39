// Shared-memory layout of one stage of the tile ring: K and V of kTileKeys consecutive keys of
// one (row, kv head), in cache elements T (16-bit, or e4m3 / int8 bytes; int8 with its keys' scales). Written by a tile source (tile_source.cuh), read by the consumer warps
// (attend_tiles.cuh). Torch-free.
#pragma once

#include <cstdint>
#include <type_traits>

#include "mmha_params.h"
#include "vec.cuh"

namespace mmha {

// K/V groups of a whole tile as a type (log2 kTileKeys): offsets taken with it fold to the plain
// [CHUNKS][KEYS] / [V_LINES][KEYS] forms, which the compiler cannot derive from the general
// ones (it does not know a tile key is < KEYS). Readers of whole-tile stages only pass it.
using WholeTile = std::integral_constant<int, 6>;
static_assert(kTileKeys == 1 << WholeTile::value, "WholeTile is log2 of the tile's keys");

template <typename T, int HEAD_DIM>
struct TileLayout {
  static constexpr int VEC = kVec<T>;            // elements per 16-byte chunk
  static constexpr int CHUNKS = HEAD_DIM / VEC;  // 16-byte chunks per key row
  static constexpr int KEYS = kTileKeys;
  // K: in groups of G = 2^kg consecutive keys, [KEYS / G][CHUNKS][G][VEC], each group as a run
  // of the cache holds it ([D/x, S, x], or a pool block's [D/x, bs, x]): kg = TILE_GROUP (the
  // whole tile as one group, [CHUNKS][KEYS][VEC]) for contiguous caches and blocks of >= KEYS
  // slots, one group per pool block for blocks of 16 or 32 (kg = block_shift: a block's K is one
  // contiguous run of the pool, read in one go). The 8 keys an ldmatrix phase reads for one chunk
  // are 128 contiguous bytes either way (conflict-free; groups hold >= 16 keys).
  static constexpr int TILE_GROUP = WholeTile::value;  // log2 KEYS
  static constexpr int K_BYTES = KEYS * HEAD_DIM * static_cast<int>(sizeof(T));
  // V: where a row is a whole number of 128-byte lines (v_whole_lines), in the K groups of 2^kg
  // keys, [KEYS / G][V_LINES][G][128 bytes] ([V_LINES][KEYS][128 bytes] for the whole tile), with
  // chunk c of key r at chunk c ^ (r % 8) of its line: the copy engine's 128-byte swizzle (a group
  // is one box of it), so the 8 keys an ldmatrix.trans phase reads for one chunk fall in 8
  // different bank groups. Otherwise rows padded by 16 bytes (cp.async only), which spreads those 8 keys over
  // 8 bank groups as well (but for 80 fp8 dims: 96-byte rows, 2-way conflicts).
  static constexpr bool V_SWIZZLE = v_whole_lines(HEAD_DIM, static_cast<int>(sizeof(T)));
  static constexpr int V_LINE_BYTES = 128;
  static constexpr int V_LINES = HEAD_DIM * static_cast<int>(sizeof(T)) / V_LINE_BYTES;
  static constexpr int V_PITCH = V_SWIZZLE ? HEAD_DIM : HEAD_DIM + VEC;  // elements per V row
  static constexpr int V_BYTES = KEYS * V_PITCH * static_cast<int>(sizeof(T));
  // An int8 cache's stage also holds its keys' scales (fp32): K's [KEYS] at SCALE_OFF, then V's.
  static constexpr bool TOKEN_SCALES = std::is_same_v<T, s8>;
  static constexpr int SCALE_OFF = K_BYTES + V_BYTES;
  static constexpr int STAGE_BYTES = tile_stage_bytes(HEAD_DIM, static_cast<int>(sizeof(T)), TOKEN_SCALES);
  static_assert(STAGE_BYTES >= SCALE_OFF + (TOKEN_SCALES ? kTokenScaleBytes : 0), "stage too small");
  static_assert(SCALE_OFF % 16 == 0, "scales 16-byte aligned");
  static_assert(K_BYTES % 1024 == 0, "V lines must start 1024-byte aligned (128-byte swizzle atom)");

  // Byte offset of chunk c of tile key k in the K part, in groups of 2^kg keys (G: int, or
  // WholeTile).
  template <typename G>
  __device__ __forceinline__ static int k_off(int k, int c, G kg) {
    if constexpr (std::is_same_v<G, WholeTile>) return (c * KEYS + k) * 16;
    const int in_group = k & ((1 << kg) - 1);
    return ((k - in_group) * CHUNKS + (c << kg) + in_group) * 16;
  }
  // The K group of a launch: one per pool block of < KEYS slots, else the whole tile.
  __device__ __forceinline__ static int k_group(const CacheParams& c) {
    return c.block_tables != nullptr && c.block_shift < TILE_GROUP ? c.block_shift : TILE_GROUP;
  }
  // Byte offset of chunk c of tile key r in the stage (V follows K), in groups of 2^kg keys.
  template <typename G>
  __device__ __forceinline__ static int v_off(int r, int c, G kg) {
    if constexpr (V_SWIZZLE) {
      if constexpr (std::is_same_v<G, WholeTile>) {
        return K_BYTES + ((c / 8) * KEYS + r) * V_LINE_BYTES + ((c % 8) ^ (r % 8)) * 16;
      }
      const int in_group = r & ((1 << kg) - 1);
      return K_BYTES + ((r - in_group) * V_LINES + ((c / 8) << kg) + in_group) * V_LINE_BYTES +
             ((c % 8) ^ (r % 8)) * 16;
    } else {
      return K_BYTES + r * V_PITCH * static_cast<int>(sizeof(T)) + c * 16;
    }
  }
};

}  // namespace mmha
