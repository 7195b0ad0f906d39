// The pack and merge kernels of a context-parallel step (shard_merge.h). One block per (row,
// head), one thread per channel: the buffers are B * H * (D + 1) floats per shard, so these are
// launch-bound, and one launch each is the point. Torch-free.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "shard_merge.h"
#include "vec.cuh"

namespace mmha {
namespace {

constexpr int kMaxThreads = 256;

int threads_for(int head_dim) {
  const int t = (head_dim + 1 + 31) / 32 * 32;
  return t < kMaxThreads ? t : kMaxThreads;
}

template <typename T>
__global__ void shard_pack_kernel(ShardPackParams p) {
  const int row = blockIdx.x / p.heads, head = blockIdx.x % p.heads;
  const int per_group = p.heads / p.groups;
  const int group = head / per_group, local = head % per_group;
  const int64_t width = p.head_dim + 1;
  float* dst = p.parts + ((static_cast<int64_t>(group) * p.batch + row) * per_group + local) * width;
  const T* src = static_cast<const T*>(p.out) + static_cast<int64_t>(blockIdx.x) * p.head_dim;
  for (int d = threadIdx.x; d <= p.head_dim; d += blockDim.x) {
    dst[d] = d < p.head_dim ? to_float(src[d]) : p.lse[blockIdx.x];
  }
}

// NaN-propagating max: a NaN partial (a row the kernel refused) must not be dropped.
__device__ __forceinline__ float max_nan(float a, float b) { return (b > a || b != b) ? b : a; }

template <typename T>
__global__ void shard_merge_kernel(ShardMergeParams p) {
  const int head = blockIdx.x % p.heads;
  const int64_t width = p.head_dim + 1;
  const int64_t shard_stride = static_cast<int64_t>(p.batch) * p.heads * width;
  const float* base = p.parts + static_cast<int64_t>(blockIdx.x) * width;
  const float sink = p.sinks != nullptr ? p.sinks[head] : -INFINITY;
  float top = sink;
  for (int s = 0; s < p.shards; ++s) top = max_nan(top, base[s * shard_stride + p.head_dim]);
  const float ref = top == -INFINITY ? 0.f : top;  // nothing to weigh: zeros and -inf
  float total = p.sinks != nullptr ? expf(sink - ref) : 0.f;
  for (int s = 0; s < p.shards; ++s) total += expf(base[s * shard_stride + p.head_dim] - ref);
  const float inv = total > 0.f ? 1.f / total : 1.f;
  T* out = static_cast<T*>(p.out) + static_cast<int64_t>(blockIdx.x) * p.head_dim;
  for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < p.shards; ++s) {
      const float* part = base + s * shard_stride;
      const float w = expf(part[p.head_dim] - ref);
      acc += w == 0.f ? 0.f : w * part[d];  // an empty shard's values are never looked at
    }
    out[d] = from_float<T>(acc * inv);
  }
  if (threadIdx.x == 0) p.lse[blockIdx.x] = ref + logf(total);
}

template <typename T>
cudaError_t launch_pack(const ShardPackParams& p, cudaStream_t stream) {
  shard_pack_kernel<T><<<p.batch * p.heads, threads_for(p.head_dim), 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_merge(const ShardMergeParams& p, cudaStream_t stream) {
  shard_merge_kernel<T><<<p.batch * p.heads, threads_for(p.head_dim), 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t run_shard_pack(const ShardPackParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.heads <= 0 || p.head_dim <= 0 || p.groups <= 0 || p.heads % p.groups) {
    return cudaErrorInvalidValue;
  }
  switch (p.out_dtype) {
    case DType::kFloat16: return launch_pack<__half>(p, stream);
    case DType::kBFloat16: return launch_pack<__nv_bfloat16>(p, stream);
    case DType::kFloat32: return launch_pack<float>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t run_shard_merge(const ShardMergeParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.heads <= 0 || p.head_dim <= 0 || p.shards <= 0) return cudaErrorInvalidValue;
  switch (p.out_dtype) {
    case DType::kFloat16: return launch_merge<__half>(p, stream);
    case DType::kBFloat16: return launch_merge<__nv_bfloat16>(p, stream);
    case DType::kFloat32: return launch_merge<float>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace mmha
