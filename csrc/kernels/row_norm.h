// Host-side entry point of the row RMSNorm kernel (row_norm.cu). Torch-free.
//
// For each row r of x [rows, width] (the unit stride along width) and each segment s, the
// segment's heads h = 0 .. heads - 1 each normalise the `cols` values at column
// col_offset + h * cols over themselves:
//   n = v * rsqrt(mean(v^2) + eps)                                     (fp32)
//   y = T(float(T(n)) * (w + offset))   cast_first (Llama's RMSNorm: weight * n.to(dtype))
//   y = T(n * (w + offset))             otherwise   (Gemma's: n * (1 + weight), then .to(dtype))
// with w = weight[h * weight_head_stride + i] in fp32 and T the dtype of x and out. A transformer
// layer's norm is one segment of one head over the whole row; the per-head q/k norms of a fused
// qkv row are two segments (q's heads, k's heads), written in place (out == x).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mmha_params.h"

namespace mmha {

constexpr int kMaxNormSegments = 2;

struct NormSegment {
  const void* weight;          // [cols] (weight_head_stride 0) or [heads, cols] (weight_head_stride cols)
  int col_offset, heads, cols;
  int weight_head_stride;
  float eps;
};

struct RowNormParams {
  const void* x;
  void* out;                   // may be x
  int64_t x_row_stride, out_row_stride;  // in elements
  int rows;
  NormSegment segments[kMaxNormSegments];
  int num_segments;
  float offset;
  bool cast_first;
  DType dtype;                 // of x and out: fp16, bf16 or fp32
  DType weight_dtype;          // of every segment's weight: fp16, bf16 or fp32
};

cudaError_t run_row_norm(const RowNormParams& p, cudaStream_t stream);

}  // namespace mmha
