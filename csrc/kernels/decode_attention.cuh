// Fused decode step: append the new token's K/V to the cache and attend over slots 0..lengths[b].
// One kernel body serves both variants: num_splits == 1 walks the whole sequence in one block
// (single pass); num_splits > 1 cuts it into chunks whose partials the last block merges.
// Torch-free: raw pointers and MmhaParams only.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include <atomic>
#include <type_traits>

#include "attend_simt.cuh"
#include "attend_tiles.cuh"
#include "decode_launch.h"
#include "mmha_params.h"
#include "tile_source.cuh"
#include "vec.cuh"

namespace mmha {

// The main loop: the tile loop (tensor cores, attend_tiles.cuh) for fp16 / bf16 caches, the
// CUDA-core loop (attend_simt.cuh) for fp32 caches. Mirrored by uses_tensor_cores() in
// mmha/dispatch.py.
template <typename T>
constexpr bool kTiles = !std::is_same_v<T, float>;

template <typename T>
constexpr int kBlockThreads = kTiles<T> ? kTileThreads : kSimtThreads;
// Tile-loop blocks of head_dim <= 128 run two per SM (the dispatcher sizes their stages for
// it), so registers are capped at 65536 / (2 * 160) = 204; at head_dim 256 one block per SM.
template <typename T, int HEAD_DIM>
constexpr int kMinBlocks = kTiles<T> ? (HEAD_DIM <= 128 ? 2 : 1) : 0;

template <typename T, int HEAD_DIM, TileSource SRC>
using SourceOf = std::conditional_t<SRC == TileSource::kTma, TmaTiles<T, HEAD_DIM>, CpAsyncTiles<T, HEAD_DIM>>;

// Element d of a q or k head after bias and rotary embedding at position pos, in fp32.
template <typename T>
__device__ __forceinline__ float load_biased(const T* row, const T* bias, int i) {
  float v = to_float(row[i]);
  if (bias != nullptr) v += to_float(bias[i]);
  return v;
}

template <typename T>
__device__ float load_rotated(const T* row, const T* bias, int offset, int d, int pos, const MmhaParams& p) {
  const float x = load_biased(row, bias, offset + d);
  const int rd = p.rotary_dim;
  if (d >= rd) return x;
  int i, partner;
  float sign;
  if (p.rotary_interleaved) {
    i = d / 2;
    partner = d ^ 1;
    sign = (d & 1) ? 1.f : -1.f;
  } else {
    const int half = rd / 2;
    i = d < half ? d : d - half;
    partner = d < half ? d + half : d - half;
    sign = d < half ? -1.f : 1.f;
  }
  const float y = load_biased(row, bias, offset + partner);
  const float inv_freq = 1.f / powf(p.rotary_theta, static_cast<float>(2 * i) / static_cast<float>(rd));
  float s, c;
  sincosf(static_cast<float>(pos) * inv_freq, &s, &c);
  return x * c + sign * y * s;
}

// The block's query heads in fp32 (bias, rotary at position pos) into s_q; for the block whose
// chunk holds the new token, its k (bias, rotary, rounded to T) and v into s_new_k / s_new_v,
// and (query group 0 only, so exactly once per row and kv head) into slot pos of both caches.
// Threads tid < nthreads take part.
template <typename T, int HEAD_DIM, int QB>
__device__ __forceinline__ void load_query_and_new_token(const MmhaParams& p, const T* qkv_row, int h0, int nh,
                                                         int kvh, int qg, int pos, bool owner, T* k_head,
                                                         T* v_head, float (&s_q)[QB][HEAD_DIM],
                                                         T (&s_new_k)[HEAD_DIM], T (&s_new_v)[HEAD_DIM],
                                                         int tid, int nthreads) {
  constexpr int VEC = kVec<T>;
  const T* bias = static_cast<const T*>(p.qkv_bias);
  for (int idx = tid; idx < QB * HEAD_DIM; idx += nthreads) {
    const int g = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    s_q[g][d] = g < nh ? load_rotated(qkv_row, bias, (h0 + g) * HEAD_DIM, d, pos, p) : 0.f;
  }
  if (owner) {
    const int k_off = (p.num_heads + kvh) * HEAD_DIM;
    const int v_off = (p.num_heads + p.num_kv_heads + kvh) * HEAD_DIM;
    const int64_t smax = p.max_seq_len;
    for (int d = tid; d < HEAD_DIM; d += nthreads) {
      const T k = from_float<T>(load_rotated(qkv_row, bias, k_off, d, pos, p));
      const T v = from_float<T>(load_biased(qkv_row, bias, v_off + d));
      s_new_k[d] = k;
      s_new_v[d] = v;
      if (qg == 0) {  // blocks of other query groups of this kv head read the same slot
        k_head[(static_cast<int64_t>(d / VEC) * smax + pos) * VEC + d % VEC] = k;
        v_head[static_cast<int64_t>(pos) * HEAD_DIM + d] = v;
      }
    }
  }
}

template <typename T, int HEAD_DIM, int QB, TileSource SRC>
__global__ void __launch_bounds__(kBlockThreads<T>, kMinBlocks<T, HEAD_DIM>)
    decode_attention_kernel(const __grid_constant__ MmhaParams p) {
  constexpr bool TILES = kTiles<T>;
  // Chunks are whole tiles (tile loop) or whole warp steps (CUDA-core loop).
  constexpr int GRAIN = TILES ? kTileKeys : SimtAttend<T, HEAD_DIM, QB>::KEYS;
  constexpr int LOOP_WARPS = TILES ? kConsumerWarps : kSimtWarps;
  constexpr int ACC_ROWS = TILES ? 1 : SimtAttend<T, HEAD_DIM, QB>::ACC_ROWS;
  const int nthreads = blockDim.x;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;

  const int b = blockIdx.z;
  const int kvh = blockIdx.y / p.q_groups;
  const int qg = blockIdx.y % p.q_groups;
  const int group = p.num_heads / p.num_kv_heads;
  const int h0 = kvh * group + qg * QB;  // first query head of this block
  const int nh = min(QB, group - qg * QB);
  const int split = blockIdx.x;
  const int num_splits = gridDim.x;
  const int smax = p.max_seq_len;
  if constexpr (kTiles<T>) {
    if (warp == kConsumerWarps && lane == 0) {  // descriptors on their way while the length loads
      SourceOf<T, HEAD_DIM, SRC>::prefetch(TileArgs<T>{nullptr, nullptr, 0, 0, 0, 0, &p.k_map, &p.v_map});
    }
  }
  const int pos = p.lengths[b];

  T* out = static_cast<T*>(p.out) + static_cast<int64_t>(b) * p.num_heads * HEAD_DIM;
  float* lse = p.lse + static_cast<int64_t>(b) * p.num_heads;
  if (pos < 0 || pos >= smax) {
    // Out-of-range length (the host checks were bypassed or raced): nothing is read from or
    // written to the caches; the row's output is NaN and its status flag is raised.
    if (split == 0) {
      for (int idx = tid; idx < nh * HEAD_DIM; idx += nthreads) {
        out[(h0 + idx / HEAD_DIM) * HEAD_DIM + idx % HEAD_DIM] = from_float<T>(NAN);
        if (idx % HEAD_DIM == 0) lse[h0 + idx / HEAD_DIM] = NAN;
      }
      if (blockIdx.y == 0 && tid == 0) p.status[b] = 1;
    }
    return;
  }

  // Keys [start, end) of this block: the row's len = pos + 1 keys are ntiles grains; active
  // splits take ntiles * s / active .. ntiles * (s + 1) / active of them (equal to one grain).
  // Splits past the row's grains have nothing to do and take no part in the merge.
  const int len = pos + 1;
  const int ntiles = (len + GRAIN - 1) / GRAIN;
  const int active_splits = min(num_splits, ntiles);
  if (split >= active_splits) return;
  const int t0 = split * ntiles / active_splits;
  const int t1 = (split + 1) * ntiles / active_splits;
  const int start = t0 * GRAIN;
  const int end = min(len, t1 * GRAIN);
  const bool owner = pos < end;  // this block's chunk holds the new token's slot

  __shared__ __align__(16) float s_q[QB][HEAD_DIM];
  __shared__ __align__(16) T s_new_k[HEAD_DIM];
  __shared__ __align__(16) T s_new_v[HEAD_DIM];
  __shared__ float s_m[LOOP_WARPS][QB];
  __shared__ float s_l[LOOP_WARPS][QB];
  __shared__ float s_w[QB][kMaxSplits];
  __shared__ bool s_last;

  const T* qkv_row = static_cast<const T*>(p.qkv) + static_cast<int64_t>(b) * p.qkv_row_stride;
  const int64_t kv_head = static_cast<int64_t>(b) * p.num_kv_heads + kvh;
  T* k_head = static_cast<T*>(p.k_cache) + kv_head * HEAD_DIM * smax;  // [D/x, S_max, x]
  T* v_head = static_cast<T*>(p.v_cache) + kv_head * HEAD_DIM * smax;  // [S_max, D]
  const float scale_log2 = p.scale * kLog2e;

  // Main loop: each loop warp leaves its (max, sum) in s_m, s_l and its accumulators in s_acc
  // ([LOOP_WARPS * ACC_ROWS][QB][HEAD_DIM]); then the block meets at a barrier.
  const float* s_acc;
  if constexpr (TILES) {
    using Source = SourceOf<T, HEAD_DIM, SRC>;
    __shared__ TileRing ring;
    extern __shared__ __align__(16) unsigned char s_dyn[];
    unsigned char* stages = s_dyn + (1024 - smem_addr(s_dyn) % 1024) % 1024;
    if (tid == 0) {
      for (int s = 0; s < p.stages; ++s) {
        mbar_init(&ring.full[s], Source::FULL_ARRIVALS);
        mbar_init(&ring.empty[s], kConsumerWarps);
      }
      mbar_init_fence();
    }
    __syncthreads();
    const TileArgs<T> ta{k_head, v_head, smax, end, pos, static_cast<int>(kv_head), &p.k_map, &p.v_map};
    const int nt = t1 - t0;
    const TileWalk walk{t0, nt, static_cast<int>(kv_head * 37 % nt)};
    TileConsumer<T, HEAD_DIM, QB> consumer;
    if (warp == kConsumerWarps) {
      // The producer starts while the consumers build q: its first copies need only the walk.
      tile_produce<T, HEAD_DIM, Source>(ta, ring, stages, p.stages, walk, lane);
    } else {
      load_query_and_new_token<T, HEAD_DIM, QB>(p, qkv_row, h0, nh, kvh, qg, pos, owner, k_head, v_head, s_q,
                                                s_new_k, s_new_v, tid, kConsumerWarps * 32);
      named_barrier(1, kConsumerWarps * 32);
      consumer.init(s_q, nh, scale_log2, lane);
      tile_consume<T, HEAD_DIM, QB>(consumer, ring, stages, p.stages, walk, end, pos, s_new_k, s_new_v, warp,
                                    lane);
    }
    __syncthreads();  // every consumer is done with the stages: their space becomes s_acc
    float* acc_out = reinterpret_cast<float*>(stages);
    if (warp < kConsumerWarps) consumer.store(s_m, s_l, acc_out, warp, lane);
    __syncthreads();
    s_acc = acc_out;
  } else {
    load_query_and_new_token<T, HEAD_DIM, QB>(p, qkv_row, h0, nh, kvh, qg, pos, owner, k_head, v_head, s_q,
                                              s_new_k, s_new_v, tid, nthreads);
    __syncthreads();
    const AttendArgs<T> args{k_head, v_head, smax, start, end, pos, scale_log2};
    s_acc = SimtAttend<T, HEAD_DIM, QB>::run(args, s_m, s_l, s_q, s_new_k, s_new_v);
  }

  // Block combine: max, sum and accumulators of the loop warps, rescaled to the block's max.
  // Split partials: acc at [(row, head), split][D], then (max, sum) at [(row, head), split][2]
  // past all of them, so every acc row starts 16-byte aligned for the merge's vector loads.
  const int64_t head_row = static_cast<int64_t>(b) * p.num_heads;
  float* part_acc = p.partials;
  float* part_ml = p.partials + static_cast<int64_t>(p.batch) * p.num_heads * num_splits * HEAD_DIM;
  for (int idx = tid; idx < nh * HEAD_DIM; idx += nthreads) {
    const int g = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    float mb = -INFINITY;
#pragma unroll
    for (int w = 0; w < LOOP_WARPS; ++w) mb = fmaxf(mb, s_m[w][g]);
    const float m_ref = mb == -INFINITY ? 0.f : mb;
    float sum = 0.f, a = 0.f;
#pragma unroll
    for (int w = 0; w < LOOP_WARPS; ++w) {
      const float sc = exp2f(s_m[w][g] - m_ref);
      float aw = 0.f;
#pragma unroll
      for (int r = 0; r < ACC_ROWS; ++r) aw += s_acc[((w * ACC_ROWS + r) * QB + g) * HEAD_DIM + d];
      sum += s_l[w][g] * sc;
      a += aw * sc;
    }
    const int h = h0 + g;
    if (num_splits == 1) {
      out[h * HEAD_DIM + d] = from_float<T>(a / sum);
      if (d == 0) lse[h] = (mb + log2f(sum)) * kLn2;
    } else {
      const int64_t slot = (head_row + h) * num_splits + split;
      part_acc[slot * HEAD_DIM + d] = a;
      if (d == 0) *reinterpret_cast<float2*>(part_ml + slot * 2) = make_float2(mb, sum);
    }
  }
  if (num_splits == 1) return;

  // Split sequence: the last block of this (row, query-head group) to finish merges the partials
  // in split order (bit-identical run to run).
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int32_t* counter = p.counters + static_cast<int64_t>(b) * gridDim.y + blockIdx.y;
    const int arrived = atomicAdd(counter, 1);
    s_last = arrived == active_splits - 1;
    if (s_last) *counter = 0;  // every active block has arrived: ready for the next launch
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();

  // Weights exp2(m_s - M) / sum: one warp per head, lanes over splits.
  const int warps = nthreads / 32;
  for (int g = warp; g < nh; g += warps) {
    const float* ml = part_ml + (head_row + h0 + g) * num_splits * 2;
    float ms[kMaxSplits / 32], ls[kMaxSplits / 32];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kMaxSplits / 32; ++i) {
      const int s = lane + 32 * i;
      const float2 v = s < active_splits ? __ldcg(reinterpret_cast<const float2*>(ml) + s)
                                         : make_float2(-INFINITY, 0.f);
      ms[i] = v.x;
      ls[i] = v.y;
      mx = fmaxf(mx, ms[i]);
    }
#pragma unroll
    for (int off = 1; off < 32; off *= 2) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, off));
    const float m_ref = mx == -INFINITY ? 0.f : mx;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxSplits / 32; ++i) {
      ms[i] = exp2f(ms[i] - m_ref);
      sum += ls[i] * ms[i];
    }
#pragma unroll
    for (int off = 1; off < 32; off *= 2) sum += __shfl_xor_sync(kFullMask, sum, off);
#pragma unroll
    for (int i = 0; i < kMaxSplits / 32; ++i) {
      const int s = lane + 32 * i;
      if (s < active_splits) s_w[g][s] = ms[i] / sum;
    }
    if (lane == 0) lse[h0 + g] = (mx + log2f(sum)) * kLn2;
  }
  __syncthreads();
  // Weighted sum of the partial accumulators: a thread per (head, 4 dims), its loads of 8 splits
  // issued together (a loop of dependent L2 round trips cost ~0.3 us per split).
  constexpr int C4 = HEAD_DIM / 4;
  for (int idx = tid; idx < nh * C4; idx += nthreads) {
    const int g = idx / C4;
    const int c = idx % C4;
    const float4* acc4 =
        reinterpret_cast<const float4*>(part_acc + (head_row + h0 + g) * num_splits * HEAD_DIM) + c;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    int s = 0;
    for (; s + 8 <= active_splits; s += 8) {
      float4 v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = __ldcg(acc4 + (s + u) * C4);
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const float w = s_w[g][s + u];
        a.x += w * v[u].x;
        a.y += w * v[u].y;
        a.z += w * v[u].z;
        a.w += w * v[u].w;
      }
    }
    for (; s < active_splits; ++s) {
      const float4 v = __ldcg(acc4 + s * C4);
      const float w = s_w[g][s];
      a.x += w * v.x;
      a.y += w * v.y;
      a.z += w * v.z;
      a.w += w * v.w;
    }
    T* o = out + (h0 + g) * HEAD_DIM + 4 * c;
    o[0] = from_float<T>(a.x);
    o[1] = from_float<T>(a.y);
    o[2] = from_float<T>(a.z);
    o[3] = from_float<T>(a.w);
  }
}

// Dynamic shared memory of one launch (the tile loop's stages; the CUDA-core loop has static
// arrays only). Above the default 48 KB the kernel must opt in, once per device (the attribute
// is per device), for the largest launch it may see: kMaxStages, or what the device allows.
template <typename T, int HEAD_DIM, int QB, TileSource SRC>
cudaError_t prepare_decode_attention(int stages, int& smem_bytes) {
  if constexpr (!kTiles<T>) {
    smem_bytes = 0;
    return cudaSuccess;
  } else {
    if (stages < kMinStages || stages > kMaxStages) return cudaErrorInvalidValue;
    smem_bytes = tile_smem_bytes(HEAD_DIM, static_cast<int>(sizeof(T)), stages);
    static std::atomic<uint64_t> opted_in{0};
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
    if (bit != 0 && (opted_in.load(std::memory_order_acquire) & bit)) return cudaSuccess;
    int optin = 0;
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err != cudaSuccess) return err;
    cudaFuncAttributes attr{};
    err = cudaFuncGetAttributes(&attr, decode_attention_kernel<T, HEAD_DIM, QB, SRC>);
    if (err != cudaSuccess) return err;
    const int most = tile_smem_bytes(HEAD_DIM, static_cast<int>(sizeof(T)), kMaxStages);
    const int allowed = optin - static_cast<int>(attr.sharedSizeBytes);
    err = cudaFuncSetAttribute(decode_attention_kernel<T, HEAD_DIM, QB, SRC>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, most < allowed ? most : allowed);
    if (err == cudaSuccess) opted_in.fetch_or(bit, std::memory_order_acq_rel);
    return err;
  }
}

template <typename T, int HEAD_DIM, int QB, TileSource SRC>
int blocks_per_sm_of(int stages) {
  int smem_bytes = 0;
  int blocks = 0;
  if (prepare_decode_attention<T, HEAD_DIM, QB, SRC>(stages, smem_bytes) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, decode_attention_kernel<T, HEAD_DIM, QB, SRC>,
                                                    kBlockThreads<T>, smem_bytes) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return blocks;
}

template <typename T, int HEAD_DIM, int QB, TileSource SRC>
cudaError_t launch_kernel(const MmhaParams& p, cudaStream_t stream) {
  int smem_bytes = 0;
  const cudaError_t err = prepare_decode_attention<T, HEAD_DIM, QB, SRC>(kTiles<T> ? p.stages : kMinStages,
                                                                          smem_bytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(p.num_splits, p.num_kv_heads * p.q_groups, p.batch);
  decode_attention_kernel<T, HEAD_DIM, QB, SRC><<<grid, kBlockThreads<T>, smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

// Bulk tensor copies exist for 16-bit head dims that are a multiple of 64.
template <typename T, int HEAD_DIM>
constexpr bool kHasTma = kTiles<T> && HEAD_DIM % 64 == 0;

template <typename T, int HEAD_DIM, int QB>
cudaError_t launch_decode_attention(const MmhaParams& params, cudaStream_t stream) {
  if (params.tile_source == TileSource::kTma) {
    if constexpr (kHasTma<T, HEAD_DIM>) {
      return launch_kernel<T, HEAD_DIM, QB, TileSource::kTma>(params, stream);
    } else {
      return cudaErrorInvalidValue;
    }
  }
  return launch_kernel<T, HEAD_DIM, QB, TileSource::kCpAsync>(params, stream);
}

template <typename T, int HEAD_DIM, int QB>
int decode_attention_blocks_per_sm(int stages, TileSource source) {
  if (source == TileSource::kTma) {
    if constexpr (kHasTma<T, HEAD_DIM>) return blocks_per_sm_of<T, HEAD_DIM, QB, TileSource::kTma>(stages);
    return 0;
  }
  return blocks_per_sm_of<T, HEAD_DIM, QB, TileSource::kCpAsync>(stages);
}

}  // namespace mmha
