// Shared-memory layout of one stage of the tile ring: K and V of kTileKeys consecutive keys of
// one (row, kv head), in cache elements T (16-bit, or e4m3 bytes). Written by a tile source (tile_source.cuh), read by the consumer warps
// (attend_tiles.cuh). Torch-free.
#pragma once

#include <cstdint>

#include "mmha_params.h"
#include "vec.cuh"

namespace mmha {

template <typename T, int HEAD_DIM>
struct TileLayout {
  static constexpr int VEC = kVec<T>;            // elements per 16-byte chunk
  static constexpr int CHUNKS = HEAD_DIM / VEC;  // 16-byte chunks per key row
  static constexpr int KEYS = kTileKeys;
  // K: [CHUNKS][KEYS][VEC] as in the cache ([D/x, S, x]): the 8 keys an ldmatrix phase reads for
  // one chunk are 128 contiguous bytes (conflict-free), and each chunk of a tile is KEYS * 16
  // contiguous bytes of the cache, read in one go.
  static constexpr int K_BYTES = KEYS * HEAD_DIM * static_cast<int>(sizeof(T));
  // V: where a row is a whole number of 128-byte lines (v_whole_lines), [V_LINES][KEYS][128
  // bytes], with chunk c of key r at chunk c ^ (r % 8) of its line: the copy engine's 128-byte
  // swizzle, so the 8 keys an ldmatrix.trans phase reads for one chunk fall in 8 different bank
  // groups. Otherwise rows padded by 16 bytes (cp.async only), which spreads those 8 keys over
  // 8 bank groups as well (but for 80 fp8 dims: 96-byte rows, 2-way conflicts).
  static constexpr bool V_SWIZZLE = v_whole_lines(HEAD_DIM, static_cast<int>(sizeof(T)));
  static constexpr int V_LINE_BYTES = 128;
  static constexpr int V_LINES = HEAD_DIM * static_cast<int>(sizeof(T)) / V_LINE_BYTES;
  static constexpr int V_PITCH = V_SWIZZLE ? HEAD_DIM : HEAD_DIM + VEC;  // elements per V row
  static constexpr int V_BYTES = KEYS * V_PITCH * static_cast<int>(sizeof(T));
  static constexpr int STAGE_BYTES = tile_stage_bytes(HEAD_DIM, static_cast<int>(sizeof(T)));
  static_assert(STAGE_BYTES >= K_BYTES + V_BYTES, "stage too small");
  static_assert(K_BYTES % 1024 == 0, "V lines must start 1024-byte aligned (128-byte swizzle atom)");

  // Byte offset of chunk c of tile key k in the K part.
  __device__ __forceinline__ static int k_off(int k, int c) { return (c * KEYS + k) * 16; }
  // Byte offset of chunk c of tile key r in the stage (V follows K).
  __device__ __forceinline__ static int v_off(int r, int c) {
    if constexpr (V_SWIZZLE) {
      return K_BYTES + ((c / 8) * KEYS + r) * V_LINE_BYTES + ((c % 8) ^ (r % 8)) * 16;
    } else {
      return K_BYTES + r * V_PITCH * static_cast<int>(sizeof(T)) + c * 16;
    }
  }
};

}  // namespace mmha
