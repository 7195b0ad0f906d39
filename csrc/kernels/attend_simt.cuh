// Tiling of the CUDA-core main loop of the decode kernel (the loop itself is written out in
// decode_attention.cuh): each warp walks its own steps of the block's chunk with its own online
// softmax; K and V are loaded straight into registers, all loads of a step issued before any
// math. Used for fp32 caches and head_dim 256. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attend_common.cuh"

namespace mmha {

// Lanes that share one key in the Q.K step: as many as keep >= 4 chunks (64 bytes) per lane,
// so each lane has several 16-byte loads in flight and the dot-product reduction stays short.
constexpr int pick_threads_per_key(int chunks) {
  int tpk = 1;
  while (tpk < 32 && chunks % (tpk * 2) == 0 && chunks / (tpk * 2) >= 4) tpk *= 2;
  return tpk;
}

// How one warp walks the cache. A warp step covers KEYS keys:
//  - Q.K: lane = ti * KPW + kj holds chunks c * TPK + ti of key kj (K layout [D/x, S, x] makes the
//    KPW keys of one chunk contiguous: 16 * KPW coalesced bytes per lane group);
//  - P.V: lane = vr * VLPR + vc holds chunk vc (+ n * VLPR) of key row vr (V rows are contiguous).
template <typename T, int HEAD_DIM, int QB>
struct WarpTiling {
  static constexpr int VEC = kVec<T>;
  static_assert(HEAD_DIM % VEC == 0, "head_dim must be a multiple of 16 bytes");
  static constexpr int CHUNKS = HEAD_DIM / VEC;
  static constexpr int TPK = pick_threads_per_key(CHUNKS);
  static constexpr int CPT = CHUNKS / TPK;
  static constexpr int KPW = 32 / TPK;
  // About 4 KB of K per warp step (2 KB with >= 4 query heads, whose accumulators take the
  // registers): with 4 warps and >= 3 blocks per SM that keeps ~100 KB of K/V loads in flight
  // per SM, several times the ~30 KB that HBM3 latency x bandwidth needs.
  static constexpr int TARGET_KEYS =
      (QB >= 4 ? 2048 : 4096) / (HEAD_DIM * static_cast<int>(sizeof(T)));
  static constexpr int U = TARGET_KEYS > KPW ? TARGET_KEYS / KPW : 1;
  static constexpr int KEYS = KPW * U;
  static constexpr int VLPR = CHUNKS < 32 ? CHUNKS : 32;
  static_assert(CHUNKS % VLPR == 0, "V chunks must split evenly over lanes");
  static constexpr int VCPL = CHUNKS / VLPR;
  static constexpr int ROWS = 32 / VLPR;
  static constexpr int V_STEPS = (KEYS + ROWS - 1) / ROWS;
};

template <typename T, int HEAD_DIM, int QB>
struct SimtAttend {
  using W = WarpTiling<T, HEAD_DIM, QB>;
  static constexpr int KEYS = W::KEYS;
  static constexpr int ACC_ROWS = W::ROWS;
  // Its shared arrays are static (in the kernel); it runs kWarps warps only.
  static constexpr int smem_bytes(int /*warps*/) { return 0; }
};

}  // namespace mmha
