// The decode operator: its arguments checked and turned into MmhaParams (decode_params.cpp), the
// lengths' host check when asked, the caches' tensor maps, the launch on the current stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <string>
#include <vector>

#include "check.h"
#include "decode_params.h"
#include "kernels/decode_launch.h"
#include "kernels/mmha_params.h"
#include "mmha_ops.h"
#include "tma_maps.h"

namespace mmha {
namespace {

// Host read of lengths (and a tree step's node counts and the row modes; after the work already
// queued on stream) and a range check per row: slots lengths[b] .. lengths[b] + n - 1 must lie in
// [0, S_max); an attend-only row's length in [0, S_max]; idle rows are not looked at.
void check_length_values(const at::Tensor& lengths, int64_t max_seq_len, int64_t nodes,
                         const std::optional<at::Tensor>& node_counts, const std::optional<at::Tensor>& row_active,
                         bool tree, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MMHA_CHECK(cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
                 capture == cudaStreamCaptureStatusNone,
             "check_lengths must be False during CUDA graph capture (it reads lengths on the host); "
             "out-of-range rows then write nothing and get NaN output");
  std::vector<int32_t> host(static_cast<size_t>(lengths.numel()));
  cudaError_t err = cudaMemcpyAsync(host.data(), lengths.data_ptr<int32_t>(),
                                    host.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
  std::vector<int32_t> counts(node_counts.has_value() ? host.size() : 0);
  if (err == cudaSuccess && !counts.empty()) {
    err = cudaMemcpyAsync(counts.data(), node_counts->data_ptr<int32_t>(), counts.size() * sizeof(int32_t),
                          cudaMemcpyDeviceToHost, stream);
  }
  std::vector<int32_t> modes(row_active.has_value() ? host.size() : 0, kRowStep);
  if (err == cudaSuccess && !modes.empty()) {
    err = cudaMemcpyAsync(modes.data(), row_active->data_ptr<int32_t>(), modes.size() * sizeof(int32_t),
                          cudaMemcpyDeviceToHost, stream);
  }
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  MMHA_CHECK(err == cudaSuccess, "lengths could not be read: ", cudaGetErrorString(err));
  for (size_t row = 0; row < modes.size(); ++row) {
    const int32_t m = modes[row];
    MMHA_CHECK(m == kRowIdle || m == kRowStep || (m == kRowAttend && !tree), "row_active[", row, "] must be ",
               tree ? "0 or 1 in a tree step" : "0, 1 or 2 (idle, step, attend only)", ", got ", m);
  }
  for (size_t row = 0; row < counts.size(); ++row) {
    MMHA_CHECK(counts[row] >= 1 && counts[row] <= nodes, "node_counts[", row, "] must be in [1, ", nodes,
               "], got ", counts[row]);
  }
  for (size_t row = 0; row < host.size(); ++row) {
    const int64_t n = counts.empty() ? nodes : counts[row];
    const int32_t mode = modes.empty() ? kRowStep : modes[row];
    if (mode == kRowIdle) continue;
    if (mode == kRowAttend) {
      MMHA_CHECK(host[row] >= 0 && host[row] <= max_seq_len, "lengths[", row, "] must be in [0, ", max_seq_len,
                 "] (an attend-only row reads slots before lengths[b]), got ", host[row]);
    } else if (nodes == 1 && counts.empty()) {
      MMHA_CHECK(host[row] >= 0 && host[row] < max_seq_len, "lengths[", row, "] must be in [0, ",
                 max_seq_len - 1, "] (the cache capacity is ", max_seq_len,
                 " and the new token goes to slot lengths[b]), got ", host[row]);
    } else {
      MMHA_CHECK(host[row] >= 0 && host[row] + n <= max_seq_len, "lengths[", row, "] must be in [0, ",
                 max_seq_len - n, "] (the cache capacity is ", max_seq_len, " and the row's ", n,
                 " nodes go to slots lengths[b] ..), got ", host[row]);
    }
  }
}

// The buffer of set_timeline (MMHA_TIMELINE builds), read at each launch's params.
at::Tensor g_timeline;

void set_timeline_params(MmhaParams& p) {
#ifdef MMHA_TIMELINE
  if (g_timeline.defined()) {
    p.timeline = reinterpret_cast<uint64_t*>(g_timeline.data_ptr<int64_t>());
    p.timeline_blocks = static_cast<int32_t>(g_timeline.size(0));
  }
#else
  (void)p;  // nothing to do per call in other builds
#endif
}

// Bulk tensor copies where the device, the head dim and the cache sizes allow (auto), or as asked
// (tile_source 2 refuses where they do not); an int4 cache's through its own maps on auto.
void choose_tile_source(MmhaParams& p, int64_t tile_source, const c10::Device& device) {
  p.sched.tile_source = TileSource::kCpAsync;
  if (p.cache.dtype == DType::kInt4) {  // the cp.async source's bulk tensor copies (int4_tiles.cuh), as maps allow
    p.int4.bulk = tile_source != 1 && device_has_tma(device.index()) && encode_int4_maps(p) == cudaSuccess;
    return;
  }
  if (!uses_tensor_cores(p.cache.dtype) || tile_source == 1 || !tma_head_dim(p.cache.dtype, p.head_dim)) return;
  const bool forced = tile_source == 2;
  const bool can = device_has_tma(device.index()) && cache_maps_fit(p);
  MMHA_CHECK(can || !forced, "tile_source 2 (tma) needs a GPU of compute capability 9.0 or newer and "
             "caches with S_max a multiple of 32, got S_max ", p.cache.max_seq_len);
  if (!can) return;
  const cudaError_t map_err = encode_cache_maps(p);
  MMHA_CHECK(map_err == cudaSuccess || !forced, "tile_source 2 (tma): the caches' tensor maps could not be "
             "encoded: ", cudaGetErrorString(map_err));
  if (map_err == cudaSuccess) p.sched.tile_source = TileSource::kTma;
}

// The name of a kernel set (setup.py's KERNEL_SETS): "fp16", "bf16_e4m3", ...
std::string kernel_set_name(DType dtype, DType cache_dtype) {
  const char* act = dtype == DType::kFloat16 ? "fp16" : dtype == DType::kBFloat16 ? "bf16" : "fp32";
  const char* cache = cache_dtype == DType::kFloat8E4M3 ? "_e4m3"
                      : cache_dtype == DType::kInt8     ? "_s8"
                      : cache_dtype == DType::kInt4     ? "_u4"
                                                        : "";
  return std::string(act) + cache;
}

cudaError_t launch(const MmhaParams& p, const c10::Device& device, cudaStream_t stream) {
  refuse_build_check();
  MMHA_CHECK(decode_kernels_compiled(p.dtype, p.cache.dtype), "this build of mmha leaves out the kernel set ",
             kernel_set_name(p.dtype, p.cache.dtype), " (a diagnostic build: MMHA_KERNELS); rebuild without "
             "MMHA_KERNELS for every set");
  const cudaError_t err = run_decode_attention(p, stream);
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device.index());
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device.index());
    MMHA_CHECK(false, "mmha has no kernel for this GPU (compute capability ", major, ".", minor,
               "); it was compiled for sm ", compiled_cuda_archs(), ". Rebuild with TORCH_CUDA_ARCH_LIST=\"",
               major, ".", minor, "\" pip install --no-build-isolation -e .");
  }
  return err;
}

}  // namespace

bool build_check() {
#ifdef MMHA_BUILD_CHECK
  return true;
#else
  return false;
#endif
}

std::vector<std::string> kernel_sets() {
  const DType acts[] = {DType::kFloat16, DType::kBFloat16, DType::kFloat32};
  std::vector<std::string> sets;
  for (const DType act : acts) {
    for (const DType cache : {act, DType::kFloat8E4M3, DType::kInt8, DType::kInt4}) {
      if (decode_kernels_compiled(act, cache)) sets.push_back(kernel_set_name(act, cache));
    }
  }
  return sets;
}

bool timeline_built() {
#ifdef MMHA_TIMELINE
  return true;
#else
  return false;
#endif
}

void set_timeline(const std::optional<at::Tensor>& buffer) {
  if (!buffer.has_value()) {
    g_timeline = at::Tensor();
    return;
  }
  MMHA_CHECK(timeline_built(), "timeline: this build has no timeline events; rebuild with MMHA_TIMELINE=1 "
             "(e.g. MMHA_TIMELINE=1 python setup.py build_ext --inplace)");
  const at::Tensor& b = *buffer;
  MMHA_CHECK(b.is_cuda() && b.scalar_type() == at::kLong && b.dim() == 2 && b.size(1) == kTimelineEvents &&
                 b.is_contiguous() && b.size(0) <= INT32_MAX,
             "timeline must be a contiguous int64 CUDA tensor [blocks, ", static_cast<int>(kTimelineEvents),
             "], got ", b.scalar_type(), " ", shape_str(b), b.is_cuda() ? "" : " on the CPU");
  g_timeline = b;
}

void decode_attention(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& lengths, const OptTensor& qkv_bias, const at::Tensor& out, const at::Tensor& lse,
                      const at::Tensor& partials, const at::Tensor& counters, const at::Tensor& status,
                      int64_t num_heads, int64_t num_kv_heads, double scale, int64_t rotary_dim, double rotary_theta,
                      bool rotary_interleaved, int64_t num_splits, bool check_lengths, int64_t stages,
                      int64_t tile_source, const OptTensor& k_scale, const OptTensor& v_scale, int64_t window,
                      double softcap, const OptTensor& alibi_slopes, const OptTensor& sinks, const OptTensor& parents,
                      const OptTensor& node_counts, const OptTensor& block_tables, const OptTensor& row_active,
                      const OptTensor& out_shift, const OptTensor& out_smooth, const OptTensor& out_scales,
                      double out_scale, int64_t out_round, int64_t out_min, const OptTensor& positions,
                      const OptTensor& rotary_inv_freq, double rotary_factor, int64_t rotary_table_start,
                      const OptTensor& q_norm_weight, const OptTensor& k_norm_weight, double qk_norm_eps,
                      bool qk_norm_cast_first, const OptTensor& k_zero, const OptTensor& v_zero,
                      const OptTensor& k_residual, bool wide_pairs) {
  const DecodeArgs a{qkv, k_cache, v_cache, lengths, qkv_bias, out, lse, partials, counters, status, num_heads,
                     num_kv_heads, scale, rotary_dim, rotary_theta, rotary_interleaved, num_splits, check_lengths,
                     stages, tile_source, k_scale, v_scale, window, softcap, alibi_slopes, sinks, parents,
                     node_counts, block_tables, row_active, out_shift, out_smooth, out_scales, out_scale, out_round,
                     out_min, positions, rotary_inv_freq, rotary_factor, rotary_table_start, q_norm_weight,
                     k_norm_weight, qk_norm_eps, qk_norm_cast_first, k_zero, v_zero, k_residual, wide_pairs};
  check_devices_and_dtypes(a);
  MmhaParams p{};
  fill_cache(a, p);
  fill_rows(a, p);
  fill_tree(a, p);
  fill_query(a, p);
  fill_mods(a, p);
  fill_output(a, p);
  fill_rotary(a, p);
  fill_qk_norm(a, p);
  fill_schedule(a, p);
  if (p.rows.batch == 0) return;

  const c10::Device device = qkv.device();
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  if (check_lengths) {
    check_length_values(lengths, p.cache.max_seq_len, p.tree.nodes, node_counts, row_active, a.tree(), stream);
  }
  set_timeline_params(p);
  choose_tile_source(p, tile_source, device);
  const cudaError_t err = launch(p, device, stream);
  MMHA_CHECK(err == cudaSuccess, "mmha decode_attention launch failed: ", cudaGetErrorString(err));
}

}  // namespace mmha
