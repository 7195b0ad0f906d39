// The sequence shards' operators (mmha.distributed): a shard's (out, lse) packed into the buffer
// a collective carries, and the exact merge of every shard's buffer.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "check.h"
#include "kernels/shard_merge.h"
#include "mmha_ops.h"

namespace mmha {
namespace {

// An out tensor of the shard kernels: [B, heads * head_dim] of fp16, bf16 or fp32, contiguous.
void check_shard_out(const at::Tensor& out, const char* name, int64_t batch, int64_t heads, int64_t head_dim,
                     const c10::Device& device) {
  MMHA_CHECK(out.is_cuda() && out.device() == device, name, " must be on ", device, ", got ", out.device());
  MMHA_CHECK(out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat,
             name, " must have dtype float16, bfloat16 or float32, got ", out.scalar_type());
  MMHA_CHECK(out.dim() == 2 && out.size(0) == batch && out.size(1) == heads * head_dim, name,
             " must have shape [", batch, ", ", heads * head_dim, "], got shape ", shape_str(out));
  check_contiguous(out, name);
}

void check_shard_lse(const at::Tensor& lse, int64_t batch, int64_t heads, const c10::Device& device) {
  MMHA_CHECK(lse.is_cuda() && lse.device() == device, "lse must be on ", device, ", got ", lse.device());
  check_dtype(lse, "lse", at::kFloat);
  MMHA_CHECK(lse.dim() == 2 && lse.size(0) == batch && lse.size(1) == heads, "lse must have shape [", batch, ", ",
             heads, "], got shape ", shape_str(lse));
  check_contiguous(lse, "lse");
}

void check_parts(const at::Tensor& parts) {
  MMHA_CHECK(parts.is_cuda(), "parts must be a CUDA tensor, got a tensor on ", parts.device());
  check_dtype(parts, "parts", at::kFloat);
  MMHA_CHECK(parts.dim() == 4 && parts.size(3) >= 2, "parts must have shape [groups, B, heads, head_dim + 1], got shape ",
             shape_str(parts));
  check_contiguous(parts, "parts");
  MMHA_CHECK(parts.numel() < (int64_t{1} << 31), "parts must have fewer than 2^31 elements, got ", parts.numel());
}

void check_launch(cudaError_t err, const char* what) {
  MMHA_CHECK(err == cudaSuccess, "mmha ", what, " launch failed: ", cudaGetErrorString(err));
}

}  // namespace

void shard_pack(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& parts) {
  check_parts(parts);
  const c10::Device device = parts.device();
  const int64_t groups = parts.size(0), batch = parts.size(1), head_dim = parts.size(3) - 1;
  const int64_t heads = groups * parts.size(2);
  check_shard_out(out, "out", batch, heads, head_dim, device);
  check_shard_lse(lse, batch, heads, device);
  if (batch == 0 || heads == 0) return;
  const c10::cuda::CUDAGuard guard(device);
  ShardPackParams p{};
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.parts = parts.data_ptr<float>();
  p.batch = static_cast<int>(batch);
  p.heads = static_cast<int>(heads);
  p.head_dim = static_cast<int>(head_dim);
  p.groups = static_cast<int>(groups);
  p.out_dtype = to_dtype(out.scalar_type());
  refuse_build_check();
  check_launch(run_shard_pack(p, c10::cuda::getCurrentCUDAStream(device.index()).stream()), "shard_pack");
}

void shard_merge(const at::Tensor& parts, const std::optional<at::Tensor>& sinks, const at::Tensor& out,
                 const at::Tensor& lse) {
  check_parts(parts);
  const c10::Device device = parts.device();
  const int64_t shards = parts.size(0), batch = parts.size(1), heads = parts.size(2), head_dim = parts.size(3) - 1;
  check_shard_out(out, "out", batch, heads, head_dim, device);
  check_shard_lse(lse, batch, heads, device);
  if (sinks.has_value()) {
    MMHA_CHECK(sinks->is_cuda() && sinks->device() == device, "sinks must be on ", device, ", got ",
               sinks->device());
    check_dtype(*sinks, "sinks", at::kFloat);
    MMHA_CHECK(sinks->dim() == 1 && sinks->size(0) == heads, "sinks must have shape [", heads, "], got shape ",
               shape_str(*sinks));
    check_contiguous(*sinks, "sinks");
  }
  if (batch == 0 || heads == 0) return;
  MMHA_CHECK(shards > 0, "parts must hold at least one shard, got shape ", shape_str(parts));
  const c10::cuda::CUDAGuard guard(device);
  ShardMergeParams p{};
  p.parts = parts.data_ptr<float>();
  p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.shards = static_cast<int>(shards);
  p.batch = static_cast<int>(batch);
  p.heads = static_cast<int>(heads);
  p.head_dim = static_cast<int>(head_dim);
  p.out_dtype = to_dtype(out.scalar_type());
  refuse_build_check();
  check_launch(run_shard_merge(p, c10::cuda::getCurrentCUDAStream(device.index()).stream()), "shard_merge");
}

}  // namespace mmha
