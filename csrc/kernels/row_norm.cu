// The row RMSNorm kernel (row_norm.h): one block per (row, head) of a segment, the sum of squares
// reduced in fp32 across the block, then each value scaled. Launch-bound at decode sizes
// ([B, hidden] or [B, heads, head_dim]): one launch in place of the five to eight elementwise
// kernels an eager RMSNorm runs is the point. Torch-free.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "row_norm.h"
#include "vec.cuh"

namespace mmha {
namespace {

constexpr int kMaxThreads = 1024;

int threads_for(int cols) {
  const int t = (cols / 4 + 31) / 32 * 32;  // about four values a thread
  return t < 32 ? 32 : t > kMaxThreads ? kMaxThreads : t;
}

// The sum of `v` over the block (every thread gets it); `shared` holds one float per warp.
__device__ __forceinline__ float block_sum(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = (blockDim.x + 31) / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : 0.f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T, typename W>
__global__ void row_norm_kernel(RowNormParams p, int max_heads) {
  __shared__ float shared[32];
  const NormSegment& s = p.segments[blockIdx.y];
  const int row = blockIdx.x / max_heads, head = blockIdx.x % max_heads;
  if (head >= s.heads) return;  // the whole block leaves together
  const int64_t col = s.col_offset + static_cast<int64_t>(head) * s.cols;
  const T* x = static_cast<const T*>(p.x) + row * p.x_row_stride + col;
  T* y = static_cast<T*>(p.out) + row * p.out_row_stride + col;
  const W* w = static_cast<const W*>(s.weight) + static_cast<int64_t>(head) * s.weight_head_stride;
  float squares = 0.f;
  for (int i = threadIdx.x; i < s.cols; i += blockDim.x) {
    const float v = to_float(x[i]);
    squares += v * v;
  }
  const float scale = rsqrtf(block_sum(squares, shared) / s.cols + s.eps);
  // Every read of x above happens before any write below (block_sum's barrier): out may be x.
  for (int i = threadIdx.x; i < s.cols; i += blockDim.x) {
    const float n = to_float(x[i]) * scale, weight = to_float(w[i]) + p.offset;
    y[i] = from_float<T>(p.cast_first ? to_float(from_float<T>(n)) * weight : n * weight);
  }
}

template <typename T, typename W>
cudaError_t launch(const RowNormParams& p, cudaStream_t stream) {
  int max_heads = 0, max_cols = 0;
  for (int s = 0; s < p.num_segments; ++s) {
    max_heads = p.segments[s].heads > max_heads ? p.segments[s].heads : max_heads;
    max_cols = p.segments[s].cols > max_cols ? p.segments[s].cols : max_cols;
  }
  const dim3 grid(static_cast<unsigned>(p.rows) * max_heads, p.num_segments);
  row_norm_kernel<T, W><<<grid, threads_for(max_cols), 0, stream>>>(p, max_heads);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_weight(const RowNormParams& p, cudaStream_t stream) {
  switch (p.weight_dtype) {
    case DType::kFloat16: return launch<T, __half>(p, stream);
    case DType::kBFloat16: return launch<T, __nv_bfloat16>(p, stream);
    case DType::kFloat32: return launch<T, float>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t run_row_norm(const RowNormParams& p, cudaStream_t stream) {
  if (p.rows <= 0 || p.num_segments <= 0 || p.num_segments > kMaxNormSegments) return cudaErrorInvalidValue;
  for (int s = 0; s < p.num_segments; ++s) {
    if (p.segments[s].heads <= 0 || p.segments[s].cols <= 0) return cudaErrorInvalidValue;
  }
  switch (p.dtype) {
    case DType::kFloat16: return launch_weight<__half>(p, stream);
    case DType::kBFloat16: return launch_weight<__nv_bfloat16>(p, stream);
    case DType::kFloat32: return launch_weight<float>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace mmha
