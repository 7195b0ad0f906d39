#include "mmha_ops.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/decode_launch.h"
#include "kernels/mmha_params.h"
#include "kernels/shard_merge.h"
#include "tma_maps.h"

namespace mmha {
namespace {

// Messages are assembled here, numbers through std::to_string: streaming an integer into a
// std::ostream from this library crashed (std::ostream::_M_insert<long>) with torch 2.11 + g++ 13
// on the device, while torch's own operator<< (Device, ScalarType) is fine.
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
template <typename T>
void append(std::string& s, const T& v) {
  if constexpr (std::is_arithmetic_v<T>) {
    s += std::to_string(v);
  } else {
    s += c10::str(v);
  }
}
template <typename... Args>
std::string msg(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

}  // namespace

// Every message reads "<arg> must <rule>, got <value>" (tests match them).
#define MMHA_CHECK(cond, ...) TORCH_CHECK(cond, ::mmha::msg(__VA_ARGS__))

namespace {

// Built by hand: streaming IntArrayRef into an ostream crashed under torch 2.11 on the device.
std::string list_str(c10::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

std::string shape_str(const at::Tensor& t) { return list_str(t.sizes()); }

// A build check (setup.py, MMHA_BUILD_CHECK=1) holds unoptimised PTX, compiled to be checked,
// not run: its operators stop before any launch.
void refuse_build_check() {
#ifdef MMHA_BUILD_CHECK
  MMHA_CHECK(false, "this mmha is a build check (MMHA_BUILD_CHECK=1: unoptimised PTX, not for running kernels); "
             "reinstall without it: pip install --no-build-isolation -e .");
#endif
}

void check_cuda(const at::Tensor& t, const char* name, const c10::Device& device) {
  MMHA_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got a tensor on ", t.device());
  MMHA_CHECK(t.device() == device, name, " must be on the same device as qkv (", device, "), got ",
             t.device());
}

void check_dtype(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  MMHA_CHECK(t.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ", t.scalar_type());
}

void check_contiguous(const at::Tensor& t, const char* name) {
  MMHA_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", list_str(t.strides()),
             " for shape ", shape_str(t));
}

std::string supported_head_dims() {
  std::string s;
  for (int i = 0; i < kNumSupportedHeadDims; ++i) s += (i ? ", " : "") + std::to_string(kSupportedHeadDims[i]);
  return s;
}

bool head_dim_supported(int64_t d) {
  for (int i = 0; i < kNumSupportedHeadDims; ++i) {
    if (kSupportedHeadDims[i] == d) return true;
  }
  return false;
}

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat8_e4m3fn: return DType::kFloat8E4M3;
    default: return DType::kFloat32;
  }
}

// An fp8 cache's per-kv-head scale: fp32 [Hkv], contiguous, on qkv's device. Its values are
// checked by the kernel (a scale that is not finite and positive refuses the step: status flag).
void check_scale(const std::optional<at::Tensor>& scale, const char* name, int64_t num_kv_heads,
                 const c10::Device& device) {
  MMHA_CHECK(scale.has_value(), name, " must be given for a float8_e4m3fn cache (fp32 [num_kv_heads = ",
             num_kv_heads, "]: stored = value / scale)");
  check_cuda(*scale, name, device);
  check_dtype(*scale, name, at::kFloat);
  MMHA_CHECK(scale->dim() == 1 && scale->size(0) == num_kv_heads, name, " must have shape [", num_kv_heads,
             "] (one scale per kv head), got shape ", shape_str(*scale));
  check_contiguous(*scale, name);
}

// Where a tree step's workspace lies in counters (int32 units): merge counters [B * T * Hq],
// the work counter [2], then the ancestor masks (8-byte aligned) [2 * B * T], depths [B * T] and
// row node counts [B]. Mirrored by mmha.ops.Workspace.
struct TreeWorkspace {
  int64_t anc, depth, rows, total;
};
TreeWorkspace tree_workspace(int64_t batch, int64_t nodes, int64_t num_heads) {
  TreeWorkspace w{};
  w.anc = (batch * nodes * num_heads + 2 + 1) / 2 * 2;
  w.depth = w.anc + 2 * batch * nodes;
  w.rows = w.depth + batch * nodes;
  w.total = w.rows + batch;
  return w;
}

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

}  // namespace

bool build_check() {
#ifdef MMHA_BUILD_CHECK
  return true;
#else
  return false;
#endif
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
                      const at::Tensor& lengths, const std::optional<at::Tensor>& qkv_bias,
                      const at::Tensor& out, const at::Tensor& lse, const at::Tensor& partials,
                      const at::Tensor& counters, const at::Tensor& status, int64_t num_heads,
                      int64_t num_kv_heads, double scale, int64_t rotary_dim, double rotary_theta,
                      bool rotary_interleaved, int64_t num_splits, bool check_lengths,
                      int64_t stages, int64_t tile_source, const std::optional<at::Tensor>& k_scale,
                      const std::optional<at::Tensor>& v_scale, int64_t window, double softcap,
                      const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
                      const std::optional<at::Tensor>& parents, const std::optional<at::Tensor>& node_counts,
                      const std::optional<at::Tensor>& block_tables, const std::optional<at::Tensor>& row_active,
                      const std::optional<at::Tensor>& out_shift, const std::optional<at::Tensor>& out_smooth,
                      const std::optional<at::Tensor>& out_scales, double out_scale, int64_t out_round,
                      int64_t out_min, const std::optional<at::Tensor>& positions) {
  // Devices.
  MMHA_CHECK(qkv.is_cuda(), "qkv must be a CUDA tensor, got a tensor on ", qkv.device());
  const c10::Device device = qkv.device();
  check_cuda(k_cache, "k_cache", device);
  check_cuda(v_cache, "v_cache", device);
  check_cuda(lengths, "lengths", device);
  check_cuda(out, "out", device);
  check_cuda(lse, "lse", device);
  check_cuda(partials, "partials", device);
  check_cuda(counters, "counters", device);
  check_cuda(status, "status", device);
  if (qkv_bias.has_value()) check_cuda(*qkv_bias, "qkv_bias", device);
  const bool tree = parents.has_value();
  if (tree) check_cuda(*parents, "parents", device);
  if (node_counts.has_value()) {
    MMHA_CHECK(tree, "node_counts must be None without parents (it counts a tree step's nodes)");
    check_cuda(*node_counts, "node_counts", device);
  }
  const bool pages = block_tables.has_value();
  if (pages) check_cuda(*block_tables, "block_tables", device);
  if (row_active.has_value()) check_cuda(*row_active, "row_active", device);
  if (positions.has_value()) check_cuda(*positions, "positions", device);

  // Dtypes.
  const at::ScalarType dtype = qkv.scalar_type();
  MMHA_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
             "qkv must have dtype float16, bfloat16 or float32, got ", dtype);
  // Caches of qkv's dtype, or fp8 e4m3 (with fp16 / bf16 qkv and a scale per kv head).
  const at::ScalarType cache_dtype = k_cache.scalar_type();
  const bool fp8 = cache_dtype == at::kFloat8_e4m3fn;
  if (fp8) {
    MMHA_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
               "qkv must have dtype float16 or bfloat16 with a float8_e4m3fn cache, got ", dtype);
  } else {
    check_dtype(k_cache, "k_cache", dtype);
  }
  check_dtype(v_cache, "v_cache", cache_dtype);
  if (fp8) {
    check_scale(k_scale, "k_scale", num_kv_heads, device);
    check_scale(v_scale, "v_scale", num_kv_heads, device);
  } else {
    MMHA_CHECK(!k_scale.has_value() && !v_scale.has_value(),
               "k_scale and v_scale must be None unless the caches are float8_e4m3fn, got caches of dtype ",
               cache_dtype);
  }
  // The output: qkv's dtype, or int8 / float8_e4m3fn holding the epilogue's quantised values.
  const bool quantised = out.scalar_type() == at::kChar || out.scalar_type() == at::kFloat8_e4m3fn;
  if (quantised) {
    MMHA_CHECK(out_scales.has_value() || out_scale != 0, "out must have dtype ", dtype, ", or int8 / "
               "float8_e4m3fn with out_scale (a float > 0) or out_scales (fp32 [Hq * D]) for a quantised output, got ",
               out.scalar_type(), " and no scale");
    MMHA_CHECK(!(out_scales.has_value() && out_scale != 0), "out_scale and out_scales must not both be given, got "
               "out_scale ", out_scale, " and out_scales");
  } else {
    check_dtype(out, "out", dtype);
    MMHA_CHECK(!out_scales.has_value() && out_scale == 0, "out_scale and out_scales must be unset unless out has "
               "dtype int8 or float8_e4m3fn (a quantised output), got out of dtype ", out.scalar_type());
  }
  if (qkv_bias.has_value()) check_dtype(*qkv_bias, "qkv_bias", dtype);
  check_dtype(lengths, "lengths", at::kInt);
  check_dtype(lse, "lse", at::kFloat);
  check_dtype(partials, "partials", at::kFloat);
  check_dtype(counters, "counters", at::kInt);
  check_dtype(status, "status", at::kInt);

  // Heads.
  MMHA_CHECK(num_heads > 0, "num_heads must be positive, got ", num_heads);
  MMHA_CHECK(num_kv_heads > 0, "num_kv_heads must be positive, got ", num_kv_heads);
  MMHA_CHECK(num_heads % num_kv_heads == 0, "num_heads (", num_heads,
             ") must be divisible by num_kv_heads (", num_kv_heads, ")");

  // Caches: k [B, Hkv, D/x, S_max, x], v [B, Hkv, S_max, D]; paged: pools k [num_blocks, Hkv,
  // D/x, bs, x], v [num_blocks, Hkv, bs, D] and block_tables [B, max_blocks] (S_max = max_blocks * bs).
  const char* v_dims = pages ? "[num_blocks, Hkv, block_size, D]" : "[B, Hkv, S_max, D]";
  const char* k_dims = pages ? "[num_blocks, Hkv, D/x, block_size, x]" : "[B, Hkv, D/x, S_max, x]";
  MMHA_CHECK(v_cache.dim() == 4, "v_cache must have 4 dims ", v_dims, ", got shape ", shape_str(v_cache));
  const int64_t head_dim = v_cache.size(3);
  const int64_t slots_dim = v_cache.size(2);  // S_max, or the block size
  int64_t batch = v_cache.size(0);
  int64_t max_seq_len = slots_dim;
  int64_t block_shift = 0;
  if (pages) {
    check_dtype(*block_tables, "block_tables", at::kInt);
    MMHA_CHECK(block_tables->dim() == 2 && block_tables->size(1) >= 1, "block_tables must have shape [B, max_blocks], "
               "got shape ", shape_str(*block_tables));
    check_contiguous(*block_tables, "block_tables");
    MMHA_CHECK(slots_dim == 16 || slots_dim == 32 || slots_dim == 64 || slots_dim == 128,
               "v_cache must have a block size of 16, 32, 64 or 128 slots in dim 2 (pages ", v_dims, "), got shape ",
               shape_str(v_cache));
    while ((int64_t{1} << block_shift) < slots_dim) ++block_shift;
    batch = block_tables->size(0);
    max_seq_len = block_tables->size(1) * slots_dim;
    MMHA_CHECK(max_seq_len <= INT32_MAX, "block_tables must have max_blocks * block_size <= 2^31 - 1, got shape ",
               shape_str(*block_tables));
    MMHA_CHECK(v_cache.size(0) >= 1 && v_cache.size(0) <= INT32_MAX, "v_cache must have 1 to 2^31 - 1 blocks, got shape ",
               shape_str(v_cache));
  }
  if (row_active.has_value()) {
    check_dtype(*row_active, "row_active", at::kInt);
    MMHA_CHECK(row_active->dim() == 1 && row_active->size(0) == batch, "row_active must have shape [", batch,
               "], got shape ", shape_str(*row_active));
    check_contiguous(*row_active, "row_active");
  }
  if (positions.has_value()) {
    MMHA_CHECK(!parents.has_value(), "positions must be None in a tree step (nodes are rotated at lengths[b] + depth)");
    check_dtype(*positions, "positions", at::kInt);
    MMHA_CHECK(positions->dim() == 1 && positions->size(0) == batch, "positions must have shape [", batch,
               "], got shape ", shape_str(*positions));
    check_contiguous(*positions, "positions");
  }
  MMHA_CHECK(head_dim_supported(head_dim), "Unsupported head_dim: ", head_dim,
             " (supported: ", supported_head_dims(), ")");
  const int64_t cache_elem = static_cast<int64_t>(k_cache.element_size());
  const int64_t x = 16 / cache_elem;
  MMHA_CHECK(k_cache.dim() == 5, "k_cache must have 5 dims ", k_dims, ", got shape ", shape_str(k_cache));
  MMHA_CHECK(k_cache.size(4) == x, "k_cache must have x = 16 / element_size = ", x,
             " in its last dim, got shape ", shape_str(k_cache));
  MMHA_CHECK(k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                 k_cache.size(2) * x == head_dim && k_cache.size(3) == slots_dim,
             "k_cache must have shape [", v_cache.size(0), ", ", v_cache.size(1), ", ", head_dim / x, ", ",
             slots_dim, ", ", x, "] to match v_cache ", shape_str(v_cache), ", got shape ",
             shape_str(k_cache));
  MMHA_CHECK(v_cache.size(1) == num_kv_heads, "v_cache must have num_kv_heads (", num_kv_heads,
             ") heads in dim 1, got shape ", shape_str(v_cache));
  check_contiguous(k_cache, "k_cache");
  check_contiguous(v_cache, "v_cache");
  MMHA_CHECK(max_seq_len > 0, "v_cache must have max_seq_len > 0, got shape ", shape_str(v_cache));

  // Tree steps: parents [B, T] int32, 1 <= T <= kMaxTreeNodes; node_counts [B] int32.
  int64_t nodes = 1;
  if (tree) {
    check_dtype(*parents, "parents", at::kInt);
    MMHA_CHECK(parents->dim() == 2 && parents->size(0) == batch && parents->size(1) >= 1 &&
                   parents->size(1) <= kMaxTreeNodes,
               "parents must have shape [", batch, ", T] with 1 <= T <= ", kMaxTreeNodes, ", got shape ",
               shape_str(*parents));
    check_contiguous(*parents, "parents");
    nodes = parents->size(1);
    if (node_counts.has_value()) {
      check_dtype(*node_counts, "node_counts", at::kInt);
      MMHA_CHECK(node_counts->dim() == 1 && node_counts->size(0) == batch, "node_counts must have shape [", batch,
                 "], got shape ", shape_str(*node_counts));
      check_contiguous(*node_counts, "node_counts");
    }
    MMHA_CHECK(window == 0 && softcap == 0 && !alibi_slopes.has_value() && !sinks.has_value(),
               "window, softcap, alibi_slopes and sinks must be unset for a tree step (parents given): tree "
               "steps take no score modifiers yet");
  }

  // qkv [B, (Hq + 2 Hkv) D] (a tree step: [B, T, (Hq + 2 Hkv) D]): inner dim contiguous, any
  // row stride; a tree step's query row b * T + t lies at (b * T + t) * qkv_row_stride.
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t qdims = tree ? 3 : 2;
  MMHA_CHECK(qkv.dim() == qdims, "qkv must have ", qdims, " dims ",
             tree ? "[B, T, (Hq + 2 * Hkv) * D]" : "[B, (Hq + 2 * Hkv) * D]", ", got shape ", shape_str(qkv));
  MMHA_CHECK(qkv.size(0) == batch, "qkv must have batch ", batch,
             pages ? " (block_tables' rows)" : " (the caches' batch)", ", got shape ", shape_str(qkv));
  MMHA_CHECK(!tree || qkv.size(1) == nodes, "qkv must have T = ", nodes,
             " nodes (parents' width) in dim 1, got shape ", shape_str(qkv));
  MMHA_CHECK(qkv.size(qdims - 1) == width, "qkv must have width (num_heads + 2 * num_kv_heads) * head_dim = (",
             num_heads, " + 2 * ", num_kv_heads, ") * ", head_dim, " = ", width, ", got shape ",
             shape_str(qkv));
  const int64_t qkv_row_stride = tree && nodes > 1 ? qkv.stride(1) : qkv.stride(0);
  MMHA_CHECK(qkv.stride(qdims - 1) == 1 && qkv_row_stride >= width &&
                 (!tree || batch == 1 || qkv.stride(0) == nodes * qkv_row_stride),
             "qkv must have unit stride in its last dim and row stride >= its width",
             tree ? " (and batch stride T * row stride)" : "", ", got strides ", list_str(qkv.strides()));
  if (qkv_bias.has_value()) {
    MMHA_CHECK(qkv_bias->dim() == 1 && qkv_bias->size(0) == width, "qkv_bias must have shape [",
               width, "], got shape ", shape_str(*qkv_bias));
    check_contiguous(*qkv_bias, "qkv_bias");
  }

  MMHA_CHECK(lengths.dim() == 1 && lengths.size(0) == batch, "lengths must have shape [", batch,
             "], got shape ", shape_str(lengths));
  check_contiguous(lengths, "lengths");
  const std::string rows_str = tree ? std::to_string(batch) + ", " + std::to_string(nodes) : std::to_string(batch);
  MMHA_CHECK(out.dim() == qdims && out.size(0) == batch && (!tree || out.size(1) == nodes) &&
                 out.size(qdims - 1) == num_heads * head_dim,
             "out must have shape [", rows_str, ", ", num_heads * head_dim, "], got shape ", shape_str(out));
  check_contiguous(out, "out");
  MMHA_CHECK(lse.dim() == qdims && lse.size(0) == batch && (!tree || lse.size(1) == nodes) &&
                 lse.size(qdims - 1) == num_heads,
             "lse must have shape [", rows_str, ", ", num_heads, "], got shape ", shape_str(lse));
  check_contiguous(lse, "lse");

  // Score modifiers: values of the per-head tensors are the caller's to check (mmha.reference.ScoreMods).
  MMHA_CHECK(window >= 0, "window must be >= 0 (0: no window), got ", window);
  MMHA_CHECK(window <= INT32_MAX, "window must be at most 2^31 - 1, got ", window);
  MMHA_CHECK(std::isfinite(softcap) && softcap >= 0, "softcap must be finite and >= 0 (0: none), got ", softcap);
  for (const auto& [t, name] : {std::pair{&alibi_slopes, "alibi_slopes"}, std::pair{&sinks, "sinks"}}) {
    if (!t->has_value()) continue;
    check_cuda(**t, name, device);
    check_dtype(**t, name, at::kFloat);
    MMHA_CHECK((*t)->dim() == 1 && (*t)->size(0) == num_heads, name, " must have shape [", num_heads,
               "] (one per query head), got shape ", shape_str(**t));
    check_contiguous(**t, name);
  }

  // Output epilogue: per-channel tensors fp32 [Hq * D]; a scale finite and positive.
  for (const auto& [t, name] : {std::pair{&out_shift, "out_shift"}, std::pair{&out_smooth, "out_smooth"},
                                std::pair{&out_scales, "out_scales"}}) {
    if (!t->has_value()) continue;
    check_cuda(**t, name, device);
    check_dtype(**t, name, at::kFloat);
    MMHA_CHECK((*t)->dim() == 1 && (*t)->size(0) == num_heads * head_dim, name, " must have shape [",
               num_heads * head_dim, "] (num_heads * head_dim, one per output channel), got shape ", shape_str(**t));
    check_contiguous(**t, name);
  }
  const bool epilogue = out_shift.has_value() || out_smooth.has_value() || quantised;
  if (epilogue) {
    // The epilogue reads the per-channel tensors and writes out four channels at a time.
    for (const auto& [t, name] : {std::pair{&out_shift, "out_shift"}, std::pair{&out_smooth, "out_smooth"},
                                  std::pair{&out_scales, "out_scales"}}) {
      MMHA_CHECK(!t->has_value() || reinterpret_cast<uintptr_t>((*t)->data_ptr()) % 16 == 0, name,
                 " must start 16-byte aligned (the epilogue reads it in 16-byte vectors)");
    }
    MMHA_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
               "out must start 16-byte aligned with an output epilogue");
  }
  MMHA_CHECK(out_scale == 0 || (std::isfinite(static_cast<float>(out_scale)) && static_cast<float>(out_scale) > 0),
             "out_scale must be finite and > 0 in fp32 (0: none), got ", out_scale);
  MMHA_CHECK(out_round == 0 || out_round == 1, "out_round must be 0 (half to even) or 1 (half away from zero), got ",
             out_round);
  MMHA_CHECK(out_min == -127 || out_min == -128, "out_min must be -127 or -128, got ", out_min);
  MMHA_CHECK(out.scalar_type() != at::kFloat8_e4m3fn || (out_round == 0 && out_min == -127),
             "out_round and out_min must be 0 and -127 for a float8_e4m3fn out (it rounds to nearest even and "
             "saturates to +-448), got ", out_round, " and ", out_min);

  // Rotary embedding and scale.
  MMHA_CHECK(rotary_dim >= 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0,
             "rotary_dim must be even and in [0, head_dim = ", head_dim, "], got ", rotary_dim);
  MMHA_CHECK(rotary_dim == 0 || rotary_theta > 0, "rotary_theta must be positive, got ",
             rotary_theta);
  MMHA_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);

  // Split-sequence workspace.
  MMHA_CHECK(num_splits >= 1 && num_splits <= kMaxSplits, "num_splits must be in [1, ", kMaxSplits,
             "], got ", num_splits);
  // Merge counters [B * T * Hq], the tile loop's work counter [2] after them, and a tree step's
  // workspace after that (tree_workspace).
  const TreeWorkspace tw = tree_workspace(batch, nodes, num_heads);
  const int64_t need_counters = tree ? tw.total : batch * num_heads + 2;
  MMHA_CHECK(counters.numel() >= need_counters, "counters must hold at least ",
             tree ? "B * T * Hq + 2 (+ 1) + 3 * B * T + B = " : "B * Hq + 2 = ", need_counters, " int32, got ",
             counters.numel());
  check_contiguous(counters, "counters");
  MMHA_CHECK(!tree || reinterpret_cast<uintptr_t>(counters.data_ptr()) % 8 == 0,
             "counters must start 8-byte aligned for a tree step");
  if (num_splits > 1) {
    const int64_t need = batch * nodes * num_heads * num_splits * (head_dim + 2);
    MMHA_CHECK(partials.numel() >= need, "partials must hold at least ",
               tree ? "B * T * Hq * num_splits * (D + 2) = " : "B * Hq * num_splits * (D + 2) = ", need,
               " floats, got ", partials.numel());
    check_contiguous(partials, "partials");
    MMHA_CHECK(reinterpret_cast<uintptr_t>(partials.data_ptr()) % 16 == 0,
               "partials must start 16-byte aligned (the merge reads it in 16-byte vectors)");
  }

  MMHA_CHECK(status.numel() >= batch, "status must hold at least B = ", batch, " int32, got ",
             status.numel());
  check_contiguous(status, "status");

  // Tile loop: stages and where tiles come from.
  const bool tiles = uses_tensor_cores(to_dtype(cache_dtype));
  MMHA_CHECK(tile_source >= 0 && tile_source <= 2,
             "tile_source must be 0 (auto), 1 (cp.async) or 2 (tma), got ", tile_source);
  MMHA_CHECK(tile_source != 2 || tma_head_dim(to_dtype(cache_dtype), static_cast<int>(head_dim)),
             "tile_source 2 (tma) needs float16 or bfloat16 caches with head_dim a multiple of 64, or "
             "float8_e4m3fn caches with head_dim a multiple of 128, got ", cache_dtype, " and head_dim ", head_dim);
  int max_stages = kMaxStages;
  if (tiles) {
    int optin = 0;
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device.index());
    const int stage = tile_stage_bytes(static_cast<int>(head_dim), static_cast<int>(cache_elem));
    const int fixed = tile_static_smem(static_cast<int>(head_dim), static_cast<int>(qkv.element_size()),
                                       columns_block(num_heads / num_kv_heads * nodes, tree && nodes > 1, tiles,
                                                     static_cast<int>(head_dim), batch * num_kv_heads, epilogue)) +
                      1024;
    max_stages = std::min(kMaxStages, (optin - fixed) / stage);
  }
  MMHA_CHECK(stages >= kMinStages && stages <= max_stages, "stages must be in [", kMinStages, ", ",
             max_stages, "] for head_dim ", head_dim, " (shared memory of this GPU), got ", stages);

  // Columns of a (row, kv head): its group's heads of every query row, in blocks of q_group_block
  // (a tree step's many columns: wide items).
  const int64_t columns = num_heads / num_kv_heads * nodes;
  const int q_group_block =
      columns_block(columns, tree && nodes > 1, tiles, static_cast<int>(head_dim), batch * num_kv_heads, epilogue);
  const int64_t q_groups = (columns + q_group_block - 1) / q_group_block;
  MMHA_CHECK(batch <= 65535, "qkv must have batch <= 65535, got ", batch);
  MMHA_CHECK(num_kv_heads * q_groups <= 65535, "num_kv_heads must be <= 65535, got ", num_kv_heads);
  if (batch == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  if (check_lengths) check_length_values(lengths, max_seq_len, nodes, node_counts, row_active, tree, stream);

  MmhaParams p{};
  p.qkv = qkv.data_ptr();
  p.qkv_bias = qkv_bias.has_value() ? qkv_bias->data_ptr() : nullptr;
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.k_scale = fp8 ? k_scale->data_ptr<float>() : nullptr;
  p.v_scale = fp8 ? v_scale->data_ptr<float>() : nullptr;
  p.lengths = lengths.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.partials = num_splits > 1 ? partials.data_ptr<float>() : nullptr;
  p.counters = counters.data_ptr<int32_t>();
  p.work = p.counters + batch * nodes * num_heads;
  p.status = status.data_ptr<int32_t>();
  p.qkv_row_stride = qkv_row_stride;
  p.batch = static_cast<int32_t>(batch);
  p.num_heads = static_cast<int32_t>(num_heads);
  p.num_kv_heads = static_cast<int32_t>(num_kv_heads);
  p.head_dim = static_cast<int32_t>(head_dim);
  p.max_seq_len = static_cast<int32_t>(max_seq_len);
  p.q_group_block = q_group_block;
  p.q_groups = static_cast<int32_t>(q_groups);
  p.group = static_cast<int32_t>(num_heads / num_kv_heads);
  p.inv_group = 1.f / static_cast<float>(p.group);
  p.num_splits = static_cast<int32_t>(num_splits);
  p.stages = static_cast<int32_t>(stages);
  p.scale = static_cast<float>(scale);
  p.rotary_dim = static_cast<int32_t>(rotary_dim);
  p.positions = positions.has_value() ? positions->data_ptr<int32_t>() : nullptr;
  p.rotary_theta = static_cast<float>(rotary_theta);
  p.rotary_interleaved = rotary_interleaved;
  p.dtype = to_dtype(dtype);
  p.cache_dtype = to_dtype(cache_dtype);
  p.window = static_cast<int32_t>(window);
  p.softcap = static_cast<float>(softcap);
  p.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  p.nodes = static_cast<int32_t>(nodes);
  if (tree) {
    p.parents = parents->data_ptr<int32_t>();
    p.node_counts = node_counts.has_value() ? node_counts->data_ptr<int32_t>() : nullptr;
    p.tree_anc = reinterpret_cast<uint64_t*>(p.counters + tw.anc);
    p.tree_depth = p.counters + tw.depth;
    p.tree_rows = p.counters + tw.rows;
  }
  if (pages) {
    p.block_tables = block_tables->data_ptr<int32_t>();
    p.max_blocks = static_cast<int32_t>(block_tables->size(1));
    p.num_blocks = static_cast<int32_t>(v_cache.size(0));
    p.block_shift = static_cast<int32_t>(block_shift);
  }
  p.row_active = row_active.has_value() ? row_active->data_ptr<int32_t>() : nullptr;
  p.out_kind = out.scalar_type() == at::kChar           ? OutKind::kInt8
               : out.scalar_type() == at::kFloat8_e4m3fn ? OutKind::kE4M3
                                                        : OutKind::kActivations;
  p.out_shift = out_shift.has_value() ? out_shift->data_ptr<float>() : nullptr;
  p.out_smooth = out_smooth.has_value() ? out_smooth->data_ptr<float>() : nullptr;
  p.out_scales = out_scales.has_value() ? out_scales->data_ptr<float>() : nullptr;
  p.out_scale = static_cast<float>(out_scale);
  p.out_round = static_cast<int32_t>(out_round);
  p.out_min = static_cast<int32_t>(out_min);
  p.out_epilogue = epilogue;
  set_timeline_params(p);
  // Bulk tensor copies where the device, the head dim and the cache sizes allow (auto), or as asked.
  p.tile_source = TileSource::kCpAsync;
  if (tiles && tile_source != 1 && tma_head_dim(p.cache_dtype, p.head_dim)) {
    const bool forced = tile_source == 2;
    const bool can = device_has_tma(device.index()) && cache_maps_fit(p);
    MMHA_CHECK(can || !forced, "tile_source 2 (tma) needs a GPU of compute capability 9.0 or newer and "
               "caches with S_max a multiple of 32, got S_max ", max_seq_len);
    if (can) {
      const cudaError_t map_err = encode_cache_maps(p);
      MMHA_CHECK(map_err == cudaSuccess || !forced, "tile_source 2 (tma): the caches' tensor maps could not "
                 "be encoded: ", cudaGetErrorString(map_err));
      if (map_err == cudaSuccess) p.tile_source = TileSource::kTma;
    }
  }

  refuse_build_check();
  const cudaError_t err = run_decode_attention(p, stream);
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device.index());
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device.index());
    MMHA_CHECK(false, "mmha has no kernel for this GPU (compute capability ", major, ".", minor,
                "); it was compiled for sm ", compiled_cuda_archs(), ". Rebuild with TORCH_CUDA_ARCH_LIST=\"",
                major, ".", minor, "\" pip install --no-build-isolation -e .");
  }
  MMHA_CHECK(err == cudaSuccess, "mmha decode_attention launch failed: ", cudaGetErrorString(err));
}

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
