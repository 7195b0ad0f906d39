// Host-side entry points of the shard kernels of mmha.distributed. Torch-free.
//
// A context-parallel step (mmha/distributed) attends over each rank's shard of the keys and
// carries (out, lse) between ranks in one fp32 buffer, "parts" [G, B, H / G, D + 1]: per (row,
// head) the shard's softmax-weighted values, then its log-sum-exp (-inf: the shard holds no key).
// G = 1 when every rank receives every head (all-gather), G = ranks when each rank receives its
// heads (all-to-all): group g holds heads g * H / G ... (g + 1) * H / G - 1.
#pragma once

#include <cuda_runtime.h>

#include "mmha_params.h"

namespace mmha {

// out [B, H * D] of out_dtype and lse [B, H] (fp32) -> parts [groups, B, H / groups, D + 1].
struct ShardPackParams {
  const void* out;
  const float* lse;
  float* parts;
  int batch, heads, head_dim, groups;
  DType out_dtype;  // fp16, bf16 or fp32
};

// parts [shards, B, H, D + 1] (shard-major) -> out [B, H * D] of out_dtype and lse [B, H]:
// FlashDecoding's exact rescale-and-merge, with m = max over shards (and the sink) of the lse,
//   out = sum_s exp(lse_s - m) o_s / (sum_s exp(lse_s - m) + exp(sink - m)),
//   lse = m + log(that denominator).
// A head with no key on any shard and no sink gets zeros and -inf; a NaN lse gives NaN.
struct ShardMergeParams {
  const float* parts;
  const float* sinks;  // fp32 [H] (the logit of each head's sink) or nullptr
  void* out;
  float* lse;
  int shards, batch, heads, head_dim;
  DType out_dtype;  // fp16, bf16 or fp32
};

cudaError_t run_shard_pack(const ShardPackParams& p, cudaStream_t stream);
cudaError_t run_shard_merge(const ShardMergeParams& p, cudaStream_t stream);

}  // namespace mmha
