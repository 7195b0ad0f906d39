// What the decode kernel hands to its CUDA-core main loop (attend_simt.cuh). Torch-free.
#pragma once

#include <cstdint>

#include "cache_slots.cuh"
#include "mmha_params.h"
#include "vec.cuh"

namespace mmha {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFullMask = 0xffffffffu;

// One block's view of one (row, kv head): keys [start, end) of the cache to attend over (those
// before lo, a window's start, masked), with the new token at slot pos (its K/V are read from
// shared memory, not from the cache). The shared arrays (q, new K/V) and the score modifiers
// are passed alongside.
template <typename T, int HEAD_DIM>
struct AttendArgs {
  HeadSlots<T, HEAD_DIM> slots;  // where the (row, kv head)'s slots live
  int start;
  int lo;
  int end;
  int pos;
  float scale_log2;  // softmax scale * log2(e)
};

}  // namespace mmha
