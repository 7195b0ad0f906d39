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

// The main loop. Tensor cores for fp16/bf16 caches with head_dim <= 128, whatever the query
// group (with one query head per kv head, 7 of the 8 mma columns are idle, but it measured
// faster than the CUDA-core loop once the ring let 4 blocks share an SM: docs/design.md); the
// CUDA-core loop for fp32 caches and head_dim 256 (whose two-buffer pipeline would leave one
// block per SM).
// Only float against 16-bit matters for the choice of loop.
template <typename T>
constexpr DType kLoopDType = std::is_same_v<T, float> ? DType::kFloat32 : DType::kFloat16;

template <typename T, int HEAD_DIM, int QB>
constexpr bool kUseTensorCores = uses_tensor_cores(kLoopDType<T>, HEAD_DIM);

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

// __launch_bounds__: the tensor-core kernel takes blocks of up to kMaxWarps warps, which caps
// it at 65536 / 512 = 128 registers per thread; at head_dim 128 that is also what 4 blocks of 4
// warps per SM (its shared-memory occupancy) allow, so registers cost no occupancy (128, no
// spill). The CUDA-core kernel runs kWarps warps and ptxas picks its registers.
template <typename T, int HEAD_DIM, int QB>
constexpr int kMaxThreads = kUseTensorCores<T, HEAD_DIM, QB> ? kMaxWarps * 32 : kThreads;
template <typename T, int HEAD_DIM, int QB>
constexpr int kMinBlocks = kUseTensorCores<T, HEAD_DIM, QB> ? 1 : 0;

#ifdef MMHA_EXP_TRACE
// Diagnostic (bench/trace.sh, bench/trace_blocks.py): thread 0 of each block stamps %globaltimer
// at events 0-4 and its SM id into p.partials past the split partials, 12 words per block (the
// caller allocates room for them). Off unless built with -DMMHA_EXP_TRACE.
__device__ __forceinline__ void trace_stamp(const MmhaParams& p, int head_dim, int event) {
  if (threadIdx.x != 0 || p.partials == nullptr) return;
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  const int64_t blk = blockIdx.x + static_cast<int64_t>(gridDim.x) * (blockIdx.y + static_cast<int64_t>(gridDim.y) * blockIdx.z);
  const int64_t base = static_cast<int64_t>(p.batch) * p.num_heads * p.num_splits * (head_dim + 2);
  uint32_t* rec = reinterpret_cast<uint32_t*>(p.partials + base) + blk * 12;
  rec[2 * event] = static_cast<uint32_t>(t);
  rec[2 * event + 1] = static_cast<uint32_t>(t >> 32);
  rec[11] = sm;
}
#define MMHA_TRACE(e) trace_stamp(p, HEAD_DIM, e)
#else
#define MMHA_TRACE(e)
#endif

template <typename T, int HEAD_DIM, int QB>
__global__ void __launch_bounds__((kMaxThreads<T, HEAD_DIM, QB>), (kMinBlocks<T, HEAD_DIM, QB>))
    decode_attention_kernel(const MmhaParams p) {
  constexpr int VEC = kVec<T>;
  constexpr bool TC = kUseTensorCores<T, HEAD_DIM, QB>;
  constexpr int KEYS = AttendPath<T, HEAD_DIM, QB>::KEYS;
  constexpr int ACC_ROWS = AttendPath<T, HEAD_DIM, QB>::ACC_ROWS;
  MMHA_TRACE(0);
  const int warps = TC ? p.warps : kWarps;  // == blockDim.x / 32
  const int nthreads = warps * 32;
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
      for (int idx = tid; idx < nh * HEAD_DIM; idx += nthreads) {
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
  __shared__ float s_m[kMaxWarps][QB];
  __shared__ float s_l[kMaxWarps][QB];
  __shared__ float s_w[QB][kMaxSplits];
  __shared__ bool s_last;

  const T* qkv_row = static_cast<const T*>(p.qkv) + static_cast<int64_t>(b) * p.qkv_row_stride;
  const T* bias = static_cast<const T*>(p.qkv_bias);
  const int64_t kv_head = static_cast<int64_t>(b) * p.num_kv_heads + kvh;
  T* k_head = static_cast<T*>(p.k_cache) + kv_head * HEAD_DIM * smax;  // [D/x, S_max, x]
  T* v_head = static_cast<T*>(p.v_cache) + kv_head * HEAD_DIM * smax;  // [S_max, D]

  const float scale_log2 = p.scale * kLog2e;
  const AttendArgs<T> args{k_head, v_head, smax, start, end, pos, nh, scale_log2, kv_head, warps};
  extern __shared__ __align__(16) unsigned char s_dyn[];
  if constexpr (TC) MmaAttend<T, HEAD_DIM, QB>::prefetch(args, s_dyn);

  for (int idx = tid; idx < QB * HEAD_DIM; idx += nthreads) {
    const int g = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    s_q[g][d] = g < nh ? load_rotated(qkv_row, bias, (h0 + g) * HEAD_DIM, d, pos, p) : 0.f;
  }
  const bool owner = pos < end;  // this block's chunk holds the new token's slot
  if (owner) {
    const int k_off = (p.num_heads + kvh) * HEAD_DIM;
    const int v_off = (p.num_heads + p.num_kv_heads + kvh) * HEAD_DIM;
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
  __syncthreads();
  MMHA_TRACE(1);

  // Main loop: each warp leaves its (max, sum, acc) in s_m, s_l and s_acc
  // ([warps * ACC_ROWS][QB][HEAD_DIM]), then the block meets at a barrier.
  const float* s_acc;
  if constexpr (TC) {
    s_acc = MmaAttend<T, HEAD_DIM, QB>::run(args, s_m, s_l, s_dyn, s_q, s_new_k, s_new_v);
    MMHA_TRACE(2);
  } else {
    // CUDA-core loop, written out here rather than behind a function: behind one (same code,
    // arguments in a struct) ptxas wanted 149 instead of 128 registers for one head per block;
    // bounded to 128 it spilled and the MHA rows ran up to 8 % slower on the H200.
    using W = WarpTiling<T, HEAD_DIM, QB>;
    __shared__ __align__(16) float s_p[kWarps][W::KEYS][QB];
    __shared__ __align__(16) float s_acc_simt[kWarps * W::ROWS][QB][HEAD_DIM];
    const int ti = lane / W::KPW;
    const int kj = lane % W::KPW;
    const int vr = lane / W::VLPR;
    const int vc = lane % W::VLPR;
    const bool v_lane = vr < W::ROWS;

    float m[QB], l[QB];
    float acc[QB][W::VCPL * VEC];
#pragma unroll
    for (int g = 0; g < QB; ++g) {
      m[g] = -INFINITY;
      l[g] = 0.f;
#pragma unroll
      for (int e = 0; e < W::VCPL * VEC; ++e) acc[g][e] = 0.f;
    }

    for (int it = start + warp * W::KEYS; it < end; it += kWarps * W::KEYS) {
      // Issue every K and V load of this step before any math: ~16 x 16 B in flight per lane.
      uint4 kraw[W::U][W::CPT];
      uint4 vraw[W::V_STEPS][W::VCPL];
#pragma unroll
      for (int u = 0; u < W::U; ++u) {
        const int t = it + u * W::KPW + kj;
#pragma unroll
        for (int c = 0; c < W::CPT; ++c) {
          const int ch = c * W::TPK + ti;
          if (t >= end) {
            kraw[u][c] = make_uint4(0, 0, 0, 0);
          } else if (t == pos) {
            kraw[u][c] = *reinterpret_cast<const uint4*>(&s_new_k[ch * VEC]);
          } else {
            kraw[u][c] = load16(k_head + (static_cast<int64_t>(ch) * smax + t) * VEC);
          }
        }
      }
#pragma unroll
      for (int st = 0; st < W::V_STEPS; ++st) {
        const int kk = st * W::ROWS + vr;
        const int t = it + kk;
        const bool valid = v_lane && kk < W::KEYS && t < end;
#pragma unroll
        for (int n = 0; n < W::VCPL; ++n) {
          const int ch = n * W::VLPR + vc;
          if (!valid) {
            vraw[st][n] = make_uint4(0, 0, 0, 0);
          } else if (t == pos) {
            vraw[st][n] = *reinterpret_cast<const uint4*>(&s_new_v[ch * VEC]);
          } else {
            vraw[st][n] = load16(v_head + static_cast<int64_t>(t) * HEAD_DIM + ch * VEC);
          }
        }
      }

      // Q.K: partial dots over this lane's chunks, then a reduction over the TPK lanes of a key.
      float logit[W::U][QB];
#pragma unroll
      for (int u = 0; u < W::U; ++u) {
#pragma unroll
        for (int g = 0; g < QB; ++g) logit[u][g] = 0.f;
#pragma unroll
        for (int c = 0; c < W::CPT; ++c) {
          const int ch = c * W::TPK + ti;
          float kf[VEC];
          convert16<T>(kraw[u][c], kf);
#pragma unroll
          for (int g = 0; g < QB; ++g) {
#pragma unroll
            for (int e = 0; e < VEC; e += 4) {
              const float4 q4 = *reinterpret_cast<const float4*>(&s_q[g][ch * VEC + e]);
              logit[u][g] += q4.x * kf[e] + q4.y * kf[e + 1] + q4.z * kf[e + 2] + q4.w * kf[e + 3];
            }
          }
        }
        const int t = it + u * W::KPW + kj;
#pragma unroll
        for (int g = 0; g < QB; ++g) {
#pragma unroll
          for (int off = W::KPW; off < 32; off *= 2) {
            logit[u][g] += __shfl_xor_sync(kFullMask, logit[u][g], off);
          }
          logit[u][g] = t < end ? logit[u][g] * scale_log2 : -INFINITY;
        }
      }

      // Online softmax over this warp's keys (log2 domain).
      float alpha[QB];
#pragma unroll
      for (int g = 0; g < QB; ++g) {
        float mx = logit[0][g];
#pragma unroll
        for (int u = 1; u < W::U; ++u) mx = fmaxf(mx, logit[u][g]);
#pragma unroll
        for (int off = 1; off < W::KPW; off *= 2) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, off));
        const float m_new = fmaxf(m[g], mx);
        const float m_ref = m_new == -INFINITY ? 0.f : m_new;
        alpha[g] = exp2f(m[g] - m_ref);
        float sum = 0.f;
#pragma unroll
        for (int u = 0; u < W::U; ++u) {
          logit[u][g] = exp2f(logit[u][g] - m_ref);
          sum += logit[u][g];
        }
        l[g] = l[g] * alpha[g] + sum;
        m[g] = m_new;
      }
      if (ti == 0) {
#pragma unroll
        for (int u = 0; u < W::U; ++u) {
#pragma unroll
          for (int g = 0; g < QB; ++g) s_p[warp][u * W::KPW + kj][g] = logit[u][g];
        }
      }
      __syncwarp();

      // P.V
#pragma unroll
      for (int g = 0; g < QB; ++g) {
#pragma unroll
        for (int e = 0; e < W::VCPL * VEC; ++e) acc[g][e] *= alpha[g];
      }
#pragma unroll
      for (int st = 0; st < W::V_STEPS; ++st) {
        const int kk = st * W::ROWS + vr;
        float pg[QB];
#pragma unroll
        for (int g = 0; g < QB; ++g) pg[g] = (v_lane && kk < W::KEYS) ? s_p[warp][kk][g] : 0.f;
#pragma unroll
        for (int n = 0; n < W::VCPL; ++n) {
          float vf[VEC];
          convert16<T>(vraw[st][n], vf);
#pragma unroll
          for (int g = 0; g < QB; ++g) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g][n * VEC + e] += pg[g] * vf[e];
          }
        }
      }
      __syncwarp();  // s_p is rewritten by the next step
    }

    // Per-warp (max, sum, acc) to shared memory for the block combine.
#pragma unroll
    for (int g = 0; g < QB; ++g) {
#pragma unroll
      for (int off = 1; off < W::KPW; off *= 2) l[g] += __shfl_xor_sync(kFullMask, l[g], off);
    }
    if (lane == 0) {
#pragma unroll
      for (int g = 0; g < QB; ++g) {
        s_m[warp][g] = m[g];
        s_l[warp][g] = l[g];
      }
    }
    if (v_lane) {
#pragma unroll
      for (int g = 0; g < QB; ++g) {
#pragma unroll
        for (int n = 0; n < W::VCPL; ++n) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            s_acc_simt[warp * W::ROWS + vr][g][(n * W::VLPR + vc) * VEC + e] = acc[g][n * VEC + e];
          }
        }
      }
    }
    __syncthreads();
    s_acc = &s_acc_simt[0][0][0];
  }


  const int64_t head_row = static_cast<int64_t>(b) * p.num_heads;
  for (int idx = tid; idx < nh * HEAD_DIM; idx += nthreads) {
    const int g = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    float mb = -INFINITY;
#pragma unroll 4
    for (int w = 0; w < warps; ++w) mb = fmaxf(mb, s_m[w][g]);
    const float m_ref = mb == -INFINITY ? 0.f : mb;
    float sum = 0.f, a = 0.f;
#pragma unroll 4
    for (int w = 0; w < warps; ++w) {
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
  MMHA_TRACE(3);
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

  for (int g = warp; g < nh; g += warps) {
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
  for (int idx = tid; idx < nh * HEAD_DIM; idx += nthreads) {
    const int g = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    const float* part = p.partials + (head_row + h0 + g) * num_splits * (HEAD_DIM + 2) + d;
    float a = 0.f;
    for (int s = 0; s < active_splits; ++s) a += s_w[g][s] * __ldcg(part + s * (HEAD_DIM + 2));
    out[(h0 + g) * HEAD_DIM + d] = from_float<T>(a);
  }
  MMHA_TRACE(4);
}

// Dynamic shared memory of one instantiation at `warps` warps per block; above the default
// 48 KB limit the kernel must opt in, once per device (the attribute is per device), for the
// largest block it may run.
template <typename T, int HEAD_DIM, int Q_GROUP_BLOCK>
cudaError_t prepare_decode_attention(int warps, int& smem_bytes) {
  using Path = AttendPath<T, HEAD_DIM, Q_GROUP_BLOCK>;
  if (!warps_supported(kLoopDType<T>, HEAD_DIM, warps)) return cudaErrorInvalidValue;
  smem_bytes = Path::smem_bytes(warps);
  const int max_smem = Path::smem_bytes(kUseTensorCores<T, HEAD_DIM, Q_GROUP_BLOCK> ? kMaxWarps : kWarps);
  if (max_smem <= 48 * 1024) return cudaSuccess;
  static std::atomic<uint64_t> opted_in{0};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (opted_in.load(std::memory_order_acquire) & bit)) return cudaSuccess;
  err = cudaFuncSetAttribute(decode_attention_kernel<T, HEAD_DIM, Q_GROUP_BLOCK>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem);
  if (err == cudaSuccess) opted_in.fetch_or(bit, std::memory_order_acq_rel);
  return err;
}

template <typename T, int HEAD_DIM, int Q_GROUP_BLOCK>
int decode_attention_blocks_per_sm(int warps) {
  int smem_bytes = 0;
  int blocks = 0;
  if (prepare_decode_attention<T, HEAD_DIM, Q_GROUP_BLOCK>(warps, smem_bytes) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &blocks, decode_attention_kernel<T, HEAD_DIM, Q_GROUP_BLOCK>, warps * 32, smem_bytes) !=
          cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return blocks;
}

template <typename T, int HEAD_DIM, int Q_GROUP_BLOCK>
cudaError_t launch_decode_attention(const MmhaParams& params, cudaStream_t stream) {
  int smem_bytes = 0;
  const cudaError_t err = prepare_decode_attention<T, HEAD_DIM, Q_GROUP_BLOCK>(params.warps, smem_bytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(params.num_splits, params.num_kv_heads * params.q_groups, params.batch);
  decode_attention_kernel<T, HEAD_DIM, Q_GROUP_BLOCK>
      <<<grid, params.warps * 32, smem_bytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace mmha
