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

#include "attend_mma.cuh"
#include "attend_simt.cuh"
#include "decode_launch.h"
#include "mmha_params.h"
#include "vec.cuh"

namespace mmha {

// The main loop. Tensor cores where each K/V element serves at least two query heads (GQA,
// MQA) of a 16-bit cache with head_dim <= 128; the CUDA-core loop everywhere else: fp32 caches,
// head_dim 256 (whose two-buffer pipeline would leave one block per SM), and one head per kv
// head, where it measured faster on the H200 (docs/design.md has the numbers).
template <typename T, int HEAD_DIM, int QB>
constexpr bool kUseTensorCores = !std::is_same_v<T, float> && QB >= 2 && HEAD_DIM <= 128;

template <typename T, int HEAD_DIM, int QB>
using AttendPath = std::conditional_t<kUseTensorCores<T, HEAD_DIM, QB>, MmaAttend<T, HEAD_DIM, QB>,
                                      SimtAttend<T, HEAD_DIM, QB>>;

// Element d of a q or k head after bias and rotary embedding at position pos, in fp32.
template <typename T>
__device__ __forceinline__ float load_biased(const T* row, const T* bias, int i) {
  float v = to_float(row[i]);
  if (bias != nullptr) v += to_float(bias[i]);
  return v;
}

template <typename T>
__device__ float load_rotated(const T* row, const T* bias, int offset, int d, int pos,
                              const MmhaParams& p) {
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

// Blocks per SM the compiler must leave registers for: 4 (128 registers) for the CUDA-core loop
// with one query head per block, which otherwise takes ~150 and drops to 3 blocks per SM.
template <typename T, int HEAD_DIM, int QB>
constexpr int kMinBlocksPerSm = (!kUseTensorCores<T, HEAD_DIM, QB> && QB == 1) ? 4 : 1;

template <typename T, int HEAD_DIM, int QB>
__global__ void __launch_bounds__(kThreads, (kMinBlocksPerSm<T, HEAD_DIM, QB>))
    decode_attention_kernel(const MmhaParams p) {
  constexpr int VEC = kVec<T>;
  constexpr int KEYS = AttendPath<T, HEAD_DIM, QB>::KEYS;
  constexpr int ACC_ROWS = AttendPath<T, HEAD_DIM, QB>::ACC_ROWS;
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
  const int pos = p.lengths[b];

  T* out = static_cast<T*>(p.out) + static_cast<int64_t>(b) * p.num_heads * HEAD_DIM;
  float* lse = p.lse + static_cast<int64_t>(b) * p.num_heads;
  if (pos < 0 || pos >= smax) {
    // Out-of-range length: write nothing to the cache, poison this row's output instead.
    if (split == 0) {
      for (int idx = tid; idx < nh * HEAD_DIM; idx += kThreads) {
        out[(h0 + idx / HEAD_DIM) * HEAD_DIM + idx % HEAD_DIM] = from_float<T>(NAN);
        if (idx % HEAD_DIM == 0) lse[h0 + idx / HEAD_DIM] = NAN;
      }
    }
    return;
  }

  // Keys [start, end) of this block. Chunks are rounded to whole warp steps; splits past the
  // row's length have nothing to do and do not take part in the merge.
  const int len = pos + 1;
  int chunk = (len + num_splits - 1) / num_splits;
  chunk = (chunk + KEYS - 1) / KEYS * KEYS;
  const int start = split * chunk;
  if (start >= len) return;
  const int end = min(len, start + chunk);
  const int active_splits = (len + chunk - 1) / chunk;

  __shared__ __align__(16) float s_q[QB][HEAD_DIM];
  __shared__ __align__(16) T s_new_k[HEAD_DIM];
  __shared__ __align__(16) T s_new_v[HEAD_DIM];
  __shared__ float s_m[kWarps][QB];
  __shared__ float s_l[kWarps][QB];
  __shared__ float s_w[QB][kMaxSplits];
  __shared__ bool s_last;

  const T* qkv_row = static_cast<const T*>(p.qkv) + static_cast<int64_t>(b) * p.qkv_row_stride;
  const T* bias = static_cast<const T*>(p.qkv_bias);
  const int64_t kv_head = static_cast<int64_t>(b) * p.num_kv_heads + kvh;
  T* k_head = static_cast<T*>(p.k_cache) + kv_head * HEAD_DIM * smax;  // [D/x, S_max, x]
  T* v_head = static_cast<T*>(p.v_cache) + kv_head * HEAD_DIM * smax;  // [S_max, D]

  for (int idx = tid; idx < QB * HEAD_DIM; idx += kThreads) {
    const int g = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    s_q[g][d] = g < nh ? load_rotated(qkv_row, bias, (h0 + g) * HEAD_DIM, d, pos, p) : 0.f;
  }
  const bool owner = pos < end;  // this block's chunk holds the new token's slot
  if (owner) {
    const int k_off = (p.num_heads + kvh) * HEAD_DIM;
    const int v_off = (p.num_heads + p.num_kv_heads + kvh) * HEAD_DIM;
    for (int d = tid; d < HEAD_DIM; d += kThreads) {
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
  __syncthreads();

  using Attend = AttendPath<T, HEAD_DIM, QB>;
  extern __shared__ __align__(16) unsigned char s_dyn[];
  AttendArgs<T> args;
  args.k_head = k_head;
  args.v_head = v_head;
  args.smax = smax;
  args.start = start;
  args.end = end;
  args.pos = pos;
  args.nh = nh;
  args.scale_log2 = p.scale * kLog2e;
  args.s_q = &s_q[0][0];
  args.s_new_k = s_new_k;
  args.s_new_v = s_new_v;
  const float* s_acc = Attend::run(args, s_m, s_l, s_dyn);

  const int64_t head_row = static_cast<int64_t>(b) * p.num_heads;
  for (int idx = tid; idx < nh * HEAD_DIM; idx += kThreads) {
    const int g = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    float mb = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mb = fmaxf(mb, s_m[w][g]);
    const float m_ref = mb == -INFINITY ? 0.f : mb;
    float sum = 0.f, a = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
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
      float* part = p.partials + ((head_row + h) * num_splits + split) * (HEAD_DIM + 2);
      part[d] = a;
      if (d == 0) {
        part[HEAD_DIM] = mb;
        part[HEAD_DIM + 1] = sum;
      }
    }
  }
  if (num_splits == 1) return;

  // Split sequence: the last block of this (row, query-head group) to finish merges the partials.
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

  for (int g = warp; g < nh; g += kWarps) {
    const float* part = p.partials + (head_row + h0 + g) * num_splits * (HEAD_DIM + 2);
    float ms[kMaxSplits / 32], ls[kMaxSplits / 32];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kMaxSplits / 32; ++i) {
      const int s = lane + 32 * i;
      ms[i] = s < active_splits ? __ldcg(part + s * (HEAD_DIM + 2) + HEAD_DIM) : -INFINITY;
      ls[i] = s < active_splits ? __ldcg(part + s * (HEAD_DIM + 2) + HEAD_DIM + 1) : 0.f;
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
  for (int idx = tid; idx < nh * HEAD_DIM; idx += kThreads) {
    const int g = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    const float* part = p.partials + (head_row + h0 + g) * num_splits * (HEAD_DIM + 2) + d;
    float a = 0.f;
    for (int s = 0; s < active_splits; ++s) a += s_w[g][s] * __ldcg(part + s * (HEAD_DIM + 2));
    out[(h0 + g) * HEAD_DIM + d] = from_float<T>(a);
  }
}

// Dynamic shared memory of one instantiation; above the default 48 KB limit the kernel must opt
// in, once per device (the attribute is per device).
template <typename T, int HEAD_DIM, int Q_GROUP_BLOCK>
cudaError_t prepare_decode_attention(int& smem_bytes) {
  smem_bytes = AttendPath<T, HEAD_DIM, Q_GROUP_BLOCK>::DYNAMIC_SMEM;
  if (smem_bytes <= 48 * 1024) return cudaSuccess;
  static std::atomic<uint64_t> opted_in{0};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (opted_in.load(std::memory_order_acquire) & bit)) return cudaSuccess;
  err = cudaFuncSetAttribute(decode_attention_kernel<T, HEAD_DIM, Q_GROUP_BLOCK>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err == cudaSuccess) opted_in.fetch_or(bit, std::memory_order_acq_rel);
  return err;
}

template <typename T, int HEAD_DIM, int Q_GROUP_BLOCK>
int decode_attention_blocks_per_sm() {
  int smem_bytes = 0;
  int blocks = 0;
  if (prepare_decode_attention<T, HEAD_DIM, Q_GROUP_BLOCK>(smem_bytes) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &blocks, decode_attention_kernel<T, HEAD_DIM, Q_GROUP_BLOCK>, kThreads, smem_bytes) !=
          cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return blocks;
}

template <typename T, int HEAD_DIM, int Q_GROUP_BLOCK>
cudaError_t launch_decode_attention(const MmhaParams& params, cudaStream_t stream) {
  int smem_bytes = 0;
  const cudaError_t err = prepare_decode_attention<T, HEAD_DIM, Q_GROUP_BLOCK>(smem_bytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(params.num_splits, params.num_kv_heads * params.q_groups, params.batch);
  decode_attention_kernel<T, HEAD_DIM, Q_GROUP_BLOCK><<<grid, kThreads, smem_bytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace mmha
