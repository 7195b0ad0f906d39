// Would FlashAttention-3's block shape lift a wide tree item's tile rate past the ring of
// bench/probes/wgmma_overlap.cu? That ring is the decode kernel's shape: two blocks an SM, one
// consumer warpgroup of 64 query columns each, 64-key tiles, consumers at <= 168 registers; on
// random K / V its serial loop runs ~512-537 TFLOP/s in step (docs/data/wgmma_overlap_h200.txt).
// Here one block an SM of three warpgroups: a producer (one thread bringing each tile's K and V by
// bulk copies from the same kind of buffer, `setmaxnreg` down to 40) and two consumer warpgroups of
// 64 columns each (`setmaxnreg` up to 232) reading every stage, so a block holds a kv head's 128
// columns and two blocks read each tile group (as two of the ring's blocks pairs do). Per tile of
// KEYS keys each consumer multiplies S = q K^T (q and K from shared memory, m64nKEYSk16) and
// O += P V (P from registers, m64n128k16), with the probes' softmax stand-in between
// (probe_softmax.h). Forms of the consumers' loop:
//   serial    S, wait, softmax, P V, wait, release (the decode kernel's order)
//   turns     serial, each product issued in the warpgroup's turn (S, hand over; P V, hand over):
//             the stage is released as in serial, no P held across tiles
//   pingpong  the two warpgroups take turns on the tensor cores (named barriers, FlashAttention-3's
//             warp scheduler barriers): in its turn a warpgroup issues P V of tile t - 1 and S of
//             tile t, hands the turn over, waits, and runs tile t's softmax while the other's
//             products run
//   overlap   pingpong with the overlap within a warpgroup as well: S(t), then P V(t - 1), the
//             turn handed over, S's wait, tile t's softmax while P V runs, P V's wait, P packed
// at 64 and 128 keys a tile and the stages that fit 227 KB; the 64-key forms also with every
// warpgroup at the launch's 168 registers (no `setmaxnreg`: the decode kernel's 16-bit budget). Prints TFLOP/s over the whole GPU
// (2 x 2 x 64 x KEYS x 128 a warpgroup and tile) and the kernel's registers.
//
// Build and run on an sm_90 GPU:
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Xptxas -v -o /tmp/wgmma_pingpong \
//     bench/probes/wgmma_pingpong.cu && timeout 60 /tmp/wgmma_pingpong [KEYS64_TILES_A_WARPGROUP [zeros]]
//   (default 256: the same keys a warpgroup as the ring probe's 256 64-key tiles a block)
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "../../csrc/kernels/ptx.cuh"
#include "probe_check.h"
#include "probe_softmax.h"
#include "probe_wgmma.h"
#include "../../csrc/kernels/wgmma.cuh"

using namespace mmha;

constexpr int D = 128;               // head dim
constexpr int Q_BYTES = 64 * D * 2;  // a consumer warpgroup's q (64 columns)
constexpr int READERS = 2;           // blocks reading each tile group (a kv head's 256 columns)
enum Form { kSerial, kTurns, kPingPong, kOverlap };
const char* kFormNames[] = {"serial", "turns", "pingpong", "overlap"};

// An arrival on named barrier `id` without waiting (the waiting side: named_barrier, ptx.cuh).
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// A stage of KEYS keys: K as [D / 8][KEYS][8] (K-major, no swizzle), then V as [2][KEYS][64]
// (the two 64-dim halves, 128-byte swizzle).
template <int KEYS>
struct Tile {
  static constexpr int K_BYTES = KEYS * D * 2;
  static constexpr int BYTES = 2 * K_BYTES;
  static constexpr int SC = KEYS / 2;  // a thread's scores (m64nKEYS: 64 x KEYS / 128)

  __device__ static void issue_scores(float (&sc)[SC], const unsigned char* sq, const unsigned char* sk) {
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      const uint64_t qd = wgmma_desc(sq + j * 2 * 64 * 16, 64 * 16, 128, false);
      const uint64_t kd = wgmma_desc(sk + 2 * j * KEYS * 16, KEYS * 16, 128, false);
      if constexpr (KEYS == 128) {
        wgmma_n128_ss(sc, qd, kd, j > 0);
      } else {
        wgmma_m64n64k16_ss<__half, 0>(sc, qd, kd, j > 0);
      }
    }
  }

  __device__ static void issue_pv(float (&acc)[64], const uint32_t (&pa)[KEYS / 16][4], const unsigned char* sv) {
#pragma unroll
    for (int kb = 0; kb < KEYS / 16; ++kb) {
      wgmma_m64n128k16_rs<__half, 1>(acc, pa[kb], wgmma_desc(sv + 16 * kb * 128, KEYS * 128, 1024, true), 1);
    }
  }
};

// Block b reads the `tiles` tiles of group b / READERS. Warpgroup 0 is the producer (its first
// thread), 1 and 2 the consumers; named barriers 1 and 2 are the consumers' turns.
template <int KEYS, int STAGES, int FORM, bool RAISE>
__global__ void __launch_bounds__(384, 1)
    fa3_ring(const unsigned char* src, float* sink, int tiles) {
  using TL = Tile<KEYS>;
  extern __shared__ unsigned char raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
  unsigned char* st = smem + 2 * Q_BYTES;
  __shared__ uint64_t full[STAGES], empty[STAGES];
  const int tid = threadIdx.x;
  for (int i = tid; i < Q_BYTES; i += blockDim.x) {  // both warpgroups' q (2 x Q_BYTES / 2 halves)
    const uint32_t h = (i * 2654435761u) >> 22;
    reinterpret_cast<__half*>(smem)[i] = __float2half((static_cast<int>(h) - 512) * (1.f / 4096.f));
  }
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 256);
    }
    mbar_init_fence();
  }
  fence_proxy_async_smem();
  __syncthreads();
  const unsigned char* mine = src + static_cast<size_t>(blockIdx.x / READERS) * tiles * TL::BYTES;
  if (tid < 128) {
    if constexpr (RAISE) setmaxnreg<false, 40>();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (tid == 0) {
      for (int t = 0; t < tiles; ++t) {
        const int s = t % STAGES;
        if (t >= STAGES) mbar_wait(&empty[s], (t / STAGES - 1) & 1);
        mbar_expect_tx(&full[s], TL::BYTES);
        bulk_load(st + s * TL::BYTES, mine + static_cast<size_t>(t) * TL::BYTES, TL::K_BYTES, &full[s]);
        bulk_load(st + s * TL::BYTES + TL::K_BYTES, mine + static_cast<size_t>(t) * TL::BYTES + TL::K_BYTES,
                  TL::K_BYTES, &full[s]);
        mbar_arrive(&full[s]);
      }
    }
#endif
    return;
  }
  if constexpr (RAISE) setmaxnreg<true, 232>();
  const int wg = tid / 128 - 1;  // 0 or 1
  const unsigned char* sq = smem + wg * Q_BYTES;
  const auto stage = [&](int t) { return st + (t % STAGES) * TL::BYTES; };
  const auto wait_full = [&](int t) { mbar_wait(&full[t % STAGES], (t / STAGES) & 1); };
  const auto release = [&](int t) { mbar_arrive(&empty[t % STAGES]); };
  const auto my_turn = [&] { named_barrier(1 + wg, 256); };
  const auto hand_over = [&] { bar_arrive(2 - wg, 256); };
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  float m[2] = {-1e30f, -1e30f}, l[2] = {0.f, 0.f};
  float sc[TL::SC];
  uint32_t pa[KEYS / 16][4];
  if constexpr (FORM == kSerial || FORM == kTurns) {
    constexpr bool kTaking = FORM == kTurns;
    if (kTaking && wg == 1) hand_over();  // the first turn is warpgroup 0's
    for (int t = 0; t < tiles; ++t) {
      wait_full(t);
      if constexpr (kTaking) my_turn();
      wgmma_fence();
      TL::issue_scores(sc, sq, stage(t));
      commit_group();
      if constexpr (kTaking) hand_over();
      wait_group<0>();
      softmax(sc, m, l, pa);
      if constexpr (kTaking) my_turn();
      wgmma_fence();
      TL::issue_pv(acc, pa, stage(t) + TL::K_BYTES);
      commit_group();
      if constexpr (kTaking) hand_over();
      wait_group<0>();
      release(t);
    }
    if (kTaking && wg == 0) my_turn();  // warpgroup 1's last hand-over
  } else {
    // Every turn is handed over (warpgroup 0 takes one more turn, empty, at the end), and tile 0's
    // S is issued before the loop: no product or barrier under a branch (ptxas serialises the
    // products of a loop with one: C7520).
    if (wg == 1) hand_over();  // the first turn is warpgroup 0's
    wait_full(0);
    my_turn();
    wgmma_fence();
    TL::issue_scores(sc, sq, stage(0));
    commit_group();
    hand_over();
    wait_group<0>();
    pin_all(sc);
    softmax(sc, m, l, pa);
    for (int t = 1; t < tiles; ++t) {
      wait_full(t);
      pin_all(sc);
      pin_all(acc);
      pin_all(reinterpret_cast<uint32_t(&)[KEYS / 4]>(pa));
      my_turn();
      wgmma_fence();
      if constexpr (FORM == kPingPong) {
        TL::issue_pv(acc, pa, stage(t - 1) + TL::K_BYTES);
        TL::issue_scores(sc, sq, stage(t));
        commit_group();
        hand_over();
        wait_group<0>();
        pin_all(sc);
        pin_all(acc);
        release(t - 1);
        softmax(sc, m, l, pa);
      } else {
        TL::issue_scores(sc, sq, stage(t));
        commit_group();
        TL::issue_pv(acc, pa, stage(t - 1) + TL::K_BYTES);
        commit_group();
        hand_over();
        wait_group<1>();  // S(t) done; P V(t - 1) may still run
        pin_all(sc);
        exponentiate(sc, m, l);
        wait_group<0>();
        pin_all(acc);
        release(t - 1);
        pack_p(sc, pa);
      }
    }
    wgmma_fence();
    TL::issue_pv(acc, pa, stage(tiles - 1) + TL::K_BYTES);
    commit_group();
    wait_group<0>();
    release(tiles - 1);
    if (wg == 0) my_turn();  // warpgroup 1's last hand-over
  }
  float t = l[0] + l[1];
#pragma unroll
  for (int i = 0; i < 64; ++i) t += acc[i];
  if (t == 1.2345f) sink[blockIdx.x * 256 + tid - 128] = t;
}

template <int KEYS, int STAGES, int FORM, bool RAISE = true>
void run(int sms, int keys64, const unsigned char* src, float* sink) {
  using TL = Tile<KEYS>;
  const int tiles = keys64 * 64 / KEYS;
  const int smem = 1024 + 2 * Q_BYTES + STAGES * TL::BYTES;
  const auto kernel = fa3_ring<KEYS, STAGES, FORM, RAISE>;
  if (smem > 232448) {
    std::printf("  %3d keys, %d stages, %-8s: %d bytes of shared memory do not fit\n", KEYS, STAGES, kFormNames[FORM],
                smem);
    return;
  }
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaFuncAttributes attr{};
  CHECK(cudaFuncGetAttributes(&attr, kernel));
  const float best = best_of_runs([&](int r) {
    const unsigned char* base = src + (r % 2) * static_cast<size_t>(sms / READERS) * tiles * TL::BYTES;
    kernel<<<sms, 384, smem>>>(base, sink, tiles);
  });
  const double flop = 2.0 * 2 * 64 * KEYS * D * double(tiles) * 2 * sms;
  std::printf("  %3d keys, %d stages, %-8s consumers at %d registers: %.0f TFLOP/s, %.1f us\n", KEYS, STAGES,
              kFormNames[FORM], RAISE ? 232 : attr.numRegs, flop / (best * 1e-3) / 1e12, best * 1e3);
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const int keys64 = argc > 1 ? std::atoi(argv[1]) : 256;  // in 64-key tiles, a warpgroup's
  const bool zeros = argc > 2 && std::strcmp(argv[2], "zeros") == 0;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  unsigned char* big;
  float* sink;
  const size_t bytes = 2 * static_cast<size_t>(sms / READERS) * keys64 * 64 * D * 2 * 2;
  CHECK(cudaMalloc(&big, bytes));
  if (zeros) {
    CHECK(cudaMemset(big, 0, bytes));
  } else {
    fill_random(big, bytes);
  }
  CHECK(cudaMalloc(&sink, sms * 256 * sizeof(float)));
  std::printf("%s, %d SMs, one block an SM of a producer and two consumer warpgroups, %d x 64 keys a warpgroup, "
              "K and V %s\n",
              prop.name, sms, keys64, zeros ? "all zero" : "random in [-1, 1)");
  run<64, 4, kSerial>(sms, keys64, big, sink);
  run<64, 4, kTurns>(sms, keys64, big, sink);
  run<64, 4, kPingPong>(sms, keys64, big, sink);
  run<64, 4, kOverlap>(sms, keys64, big, sink);
  run<64, 6, kOverlap>(sms, keys64, big, sink);
  run<64, 4, kSerial, false>(sms, keys64, big, sink);
  run<64, 4, kTurns, false>(sms, keys64, big, sink);
  run<64, 4, kPingPong, false>(sms, keys64, big, sink);
  run<64, 4, kOverlap, false>(sms, keys64, big, sink);
  run<128, 2, kSerial>(sms, keys64, big, sink);
  run<128, 2, kPingPong>(sms, keys64, big, sink);
  run<128, 2, kOverlap>(sms, keys64, big, sink);
  run<128, 3, kSerial>(sms, keys64, big, sink);
  run<128, 3, kPingPong>(sms, keys64, big, sink);
  run<128, 3, kOverlap>(sms, keys64, big, sink);
  return 0;
}
