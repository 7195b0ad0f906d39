// What the decode kernel hands to its tensor-core main loop (attend_mma.cuh). Torch-free.
#pragma once

#include <cstdint>

#include "mmha_params.h"
#include "vec.cuh"

namespace mmha {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFullMask = 0xffffffffu;

// One block's view of one (row, kv head): keys [start, end) of the cache to attend over, with
// the new token at slot pos (its K/V are read from shared memory, not from the cache).
// The shared arrays (q, new K/V) are passed alongside as array references.
template <typename T>
struct AttendArgs {
  const T* k_head;   // [D/x, S_max, x]
  const T* v_head;   // [S_max, D]
  int smax;
  int start;
  int end;
  int pos;
  int nh;            // query heads of this block that exist (<= QB)
  float scale_log2;  // softmax scale * log2(e)
  int64_t kv_head;   // row * Hkv + kv head: where the tensor-core loop starts its walk
  int warps;         // warps of the block (blockDim.x / 32)
};

}  // namespace mmha
