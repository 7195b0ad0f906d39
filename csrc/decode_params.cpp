#include "decode_params.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "check.h"

namespace mmha {
namespace {

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

// An fp8 cache's per-kv-head scale: fp32 [Hkv], contiguous, on qkv's device. Its values are
// checked by the kernel (a scale that is not finite and positive refuses the step: status flag).
void check_scale(const OptTensor& scale, const char* name, int64_t num_kv_heads, const c10::Device& device) {
  MMHA_CHECK(scale.has_value(), name, " must be given for a float8_e4m3fn cache (fp32 [num_kv_heads = ",
             num_kv_heads, "]: stored = value / scale)");
  check_cuda(*scale, name, device);
  check_dtype(*scale, name, at::kFloat);
  MMHA_CHECK(scale->dim() == 1 && scale->size(0) == num_kv_heads, name, " must have shape [", num_kv_heads,
             "] (one scale per kv head), got shape ", shape_str(*scale));
  check_contiguous(*scale, name);
}

// An int8 cache's token scales: fp32, contiguous, on qkv's device, one per slot and kv head of
// the caches (shape [B, Hkv, S_max], paged [num_blocks, Hkv, block_size]: v_cache's first three
// dims). Written by the step for its new token; a scale that is not finite flags the row.
void check_token_scales(const OptTensor& scale, const char* name, const at::Tensor& v_cache, bool paged,
                        const c10::Device& device) {
  const char* dims = paged ? "[num_blocks, Hkv, block_size]" : "[B, Hkv, S_max]";
  MMHA_CHECK(scale.has_value(), name, " must be given for an int8 cache (fp32 ", dims,
             ": a scale per token and kv head, value = code * scale)");
  check_cuda(*scale, name, device);
  check_dtype(*scale, name, at::kFloat);
  MMHA_CHECK(scale->dim() == 3 && scale->size(0) == v_cache.size(0) && scale->size(1) == v_cache.size(1) &&
                 scale->size(2) == v_cache.size(2),
             name, " must have shape [", v_cache.size(0), ", ", v_cache.size(1), ", ", v_cache.size(2), "] ", dims,
             " to match v_cache ", shape_str(v_cache), ", got shape ", shape_str(*scale));
  check_contiguous(*scale, name);
}

// One of an int4 cache's planes (mmha/int4.py): `dtype`, `shape`, contiguous, 16-byte aligned, on
// qkv's device.
void check_plane(const OptTensor& t, const char* name, at::ScalarType dtype, std::initializer_list<int64_t> shape,
                 const char* dims, const c10::Device& device) {
  MMHA_CHECK(t.has_value(), name, " must be given for an int4 cache (", dims, ")");
  check_cuda(*t, name, device);
  check_dtype(*t, name, dtype);
  const std::vector<int64_t> want(shape);
  MMHA_CHECK(t->sizes().vec() == want, name, " must have shape ", dims, " = ", list_str(want),
             " for this int4 cache, got shape ", shape_str(*t));
  check_contiguous(*t, name);
  MMHA_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, name, " must start 16-byte aligned");
}

// An int4 cache (k_cache / v_cache uint8 codes: mmha.int4.Int4Cache, or mmha.int4_pages.Int4Pages
// with block_tables): one-token steps, rows (or blocks) of a whole number of 64-token groups,
// head dim a whole number of 32-channel chunks, and its planes: fp16 k_scale / k_zero [n, Hkv,
// slots / 64, D], v_scale / v_zero [n, Hkv, slots] (n, slots: v_cache's first and third dims:
// rows and S_max, or pool blocks and the block size), k_residual [B, Hkv, 128, D] of qkv's dtype.
void check_int4(const DecodeArgs& a, int64_t n, int64_t heads, int64_t slots, int64_t head_dim, int64_t batch) {
  const c10::Device device = a.qkv.device();
  MMHA_CHECK(!a.tree(), "parents must be None for an int4 cache (its tree steps run on the reference path)");
  MMHA_CHECK(!a.epilogue(), "an int4 cache takes no output epilogue (out_shift, out_smooth, a quantised out)");
  MMHA_CHECK(head_dim % kInt4Channels == 0, "an int4 cache needs head_dim a multiple of ", kInt4Channels,
             ", got ", head_dim);
  MMHA_CHECK(slots % kInt4Group == 0, "v_cache must hold a multiple of ", kInt4Group, " slots ",
             a.paged() ? "per block" : "per row", " for an int4 cache (whole K groups), got shape ",
             shape_str(a.v_cache));
  const at::ScalarType half = at::kHalf;
  const char* k_dims = a.paged() ? "fp16 [num_blocks, Hkv, block_size / 64, D]" : "fp16 [B, Hkv, S_max / 64, D]";
  const char* v_dims = a.paged() ? "fp16 [num_blocks, Hkv, block_size]" : "fp16 [B, Hkv, S_max]";
  check_plane(a.k_scale, "k_scale", half, {n, heads, slots / kInt4Group, head_dim}, k_dims, device);
  check_plane(a.k_zero, "k_zero", half, {n, heads, slots / kInt4Group, head_dim}, k_dims, device);
  check_plane(a.v_scale, "v_scale", half, {n, heads, slots}, v_dims, device);
  check_plane(a.v_zero, "v_zero", half, {n, heads, slots}, v_dims, device);
  check_plane(a.k_residual, "k_residual", a.qkv.scalar_type(), {batch, heads, kInt4Residual, head_dim},
              "qkv's dtype, [B, Hkv, 128, D]", device);
}

// A per-query-head or per-channel fp32 tensor: on the device, [n], contiguous.
void check_vector(const at::Tensor& t, const char* name, int64_t n, const char* what, const c10::Device& device) {
  check_cuda(t, name, device);
  check_dtype(t, name, at::kFloat);
  MMHA_CHECK(t.dim() == 1 && t.size(0) == n, name, " must have shape [", n, "] (", what, "), got shape ",
             shape_str(t));
  check_contiguous(t, name);
}

// An optional int32 [batch] row vector (row modes, positions, node counts).
void check_row_vector(const OptTensor& t, const char* name, int64_t batch) {
  if (!t.has_value()) return;
  check_dtype(*t, name, at::kInt);
  MMHA_CHECK(t->dim() == 1 && t->size(0) == batch, name, " must have shape [", batch, "], got shape ", shape_str(*t));
  check_contiguous(*t, name);
}

const float* float_ptr(const OptTensor& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }
const int32_t* int_ptr(const OptTensor& t) { return t.has_value() ? t->data_ptr<int32_t>() : nullptr; }

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

bool DecodeArgs::quantised() const {
  return out.scalar_type() == at::kChar || out.scalar_type() == at::kFloat8_e4m3fn;
}

void check_devices_and_dtypes(const DecodeArgs& a) {
  MMHA_CHECK(a.qkv.is_cuda(), "qkv must be a CUDA tensor, got a tensor on ", a.qkv.device());
  const c10::Device device = a.qkv.device();
  for (const auto& [t, name] : {std::pair{&a.k_cache, "k_cache"}, std::pair{&a.v_cache, "v_cache"},
                                std::pair{&a.lengths, "lengths"}, std::pair{&a.out, "out"}, std::pair{&a.lse, "lse"},
                                std::pair{&a.partials, "partials"}, std::pair{&a.counters, "counters"},
                                std::pair{&a.status, "status"}}) {
    check_cuda(*t, name, device);
  }
  if (a.qkv_bias.has_value()) check_cuda(*a.qkv_bias, "qkv_bias", device);
  if (a.tree()) check_cuda(*a.parents, "parents", device);
  if (a.node_counts.has_value()) {
    MMHA_CHECK(a.tree(), "node_counts must be None without parents (it counts a tree step's nodes)");
    check_cuda(*a.node_counts, "node_counts", device);
  }
  for (const auto& [t, name] : {std::pair{&a.block_tables, "block_tables"}, std::pair{&a.row_active, "row_active"},
                                std::pair{&a.positions, "positions"}}) {
    if (t->has_value()) check_cuda(**t, name, device);
  }

  const at::ScalarType dtype = a.qkv.scalar_type();
  MMHA_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
             "qkv must have dtype float16, bfloat16 or float32, got ", dtype);
  // Caches of qkv's dtype, or fp8 e4m3 (with fp16 / bf16 qkv and a scale per kv head), or int8
  // (with fp16 / bf16 qkv and a scale per token and kv head; one-token steps).
  const at::ScalarType cache_dtype = a.k_cache.scalar_type();
  const bool fp8 = cache_dtype == at::kFloat8_e4m3fn;
  const bool int8 = cache_dtype == at::kChar;
  const bool int4 = cache_dtype == at::kByte;
  if (fp8 || int8 || int4) {
    MMHA_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "qkv must have dtype float16 or bfloat16 with a ",
               cache_dtype, " cache, got ", dtype);
  } else {
    check_dtype(a.k_cache, "k_cache", dtype);
  }
  check_dtype(a.v_cache, "v_cache", cache_dtype);
  if (fp8) {
    check_scale(a.k_scale, "k_scale", a.num_kv_heads, device);
    check_scale(a.v_scale, "v_scale", a.num_kv_heads, device);
  } else if (int8) {
    check_token_scales(a.k_scale, "k_scale", a.v_cache, a.paged(), device);
    check_token_scales(a.v_scale, "v_scale", a.v_cache, a.paged(), device);
  } else if (!int4) {  // (an int4 cache's planes: check_int4, with the caches' shapes)
    MMHA_CHECK(!a.k_scale.has_value() && !a.v_scale.has_value(),
               "k_scale and v_scale must be None unless the caches are float8_e4m3fn, int8 or uint8 (int4 codes), "
               "got caches of dtype ", cache_dtype);
  }
  MMHA_CHECK(int4 || (!a.k_zero.has_value() && !a.v_zero.has_value() && !a.k_residual.has_value()),
             "k_zero, v_zero and k_residual must be None unless the caches are uint8 (int4 codes), got caches of "
             "dtype ", cache_dtype);
  // The output: qkv's dtype, or int8 / float8_e4m3fn holding the epilogue's quantised values.
  if (a.quantised()) {
    MMHA_CHECK(a.out_scales.has_value() || a.out_scale != 0, "out must have dtype ", dtype, ", or int8 / "
               "float8_e4m3fn with out_scale (a float > 0) or out_scales (fp32 [Hq * D]) for a quantised output, got ",
               a.out.scalar_type(), " and no scale");
    MMHA_CHECK(!(a.out_scales.has_value() && a.out_scale != 0), "out_scale and out_scales must not both be given, "
               "got out_scale ", a.out_scale, " and out_scales");
  } else {
    check_dtype(a.out, "out", dtype);
    MMHA_CHECK(!a.out_scales.has_value() && a.out_scale == 0, "out_scale and out_scales must be unset unless out "
               "has dtype int8 or float8_e4m3fn (a quantised output), got out of dtype ", a.out.scalar_type());
  }
  if (a.qkv_bias.has_value()) check_dtype(*a.qkv_bias, "qkv_bias", dtype);
  check_dtype(a.lengths, "lengths", at::kInt);
  check_dtype(a.lse, "lse", at::kFloat);
  check_dtype(a.partials, "partials", at::kFloat);
  check_dtype(a.counters, "counters", at::kInt);
  check_dtype(a.status, "status", at::kInt);
}

void fill_cache(const DecodeArgs& a, MmhaParams& p) {
  MMHA_CHECK(a.num_heads > 0, "num_heads must be positive, got ", a.num_heads);
  MMHA_CHECK(a.num_kv_heads > 0, "num_kv_heads must be positive, got ", a.num_kv_heads);
  MMHA_CHECK(a.num_heads % a.num_kv_heads == 0, "num_heads (", a.num_heads, ") must be divisible by num_kv_heads (",
             a.num_kv_heads, ")");
  // Caches: k [B, Hkv, D/x, S_max, x], v [B, Hkv, S_max, D]; paged: pools k [num_blocks, Hkv,
  // D/x, bs, x], v [num_blocks, Hkv, bs, D] and block_tables [B, max_blocks] (S_max = max_blocks * bs).
  const at::Tensor& v_cache = a.v_cache;
  const char* v_dims = a.paged() ? "[num_blocks, Hkv, block_size, D]" : "[B, Hkv, S_max, D]";
  const char* k_dims = a.paged() ? "[num_blocks, Hkv, D/x, block_size, x]" : "[B, Hkv, D/x, S_max, x]";
  MMHA_CHECK(v_cache.dim() == 4, "v_cache must have 4 dims ", v_dims, ", got shape ", shape_str(v_cache));
  const bool int4 = a.k_cache.scalar_type() == at::kByte;  // codes two a byte: v rows of D / 2 bytes
  const int64_t head_dim = int4 ? 2 * v_cache.size(3) : v_cache.size(3);
  const int64_t slots_dim = v_cache.size(2);  // S_max, or the block size
  int64_t batch = v_cache.size(0), max_seq_len = slots_dim, block_shift = 0;
  if (a.paged()) {
    const at::Tensor& tables = *a.block_tables;
    check_dtype(tables, "block_tables", at::kInt);
    MMHA_CHECK(tables.dim() == 2 && tables.size(1) >= 1, "block_tables must have shape [B, max_blocks], got shape ",
               shape_str(tables));
    check_contiguous(tables, "block_tables");
    MMHA_CHECK(slots_dim == 16 || slots_dim == 32 || slots_dim == 64 || slots_dim == 128,
               "v_cache must have a block size of 16, 32, 64 or 128 slots in dim 2 (pages ", v_dims, "), got shape ",
               shape_str(v_cache));
    while ((int64_t{1} << block_shift) < slots_dim) ++block_shift;
    batch = tables.size(0);
    max_seq_len = tables.size(1) * slots_dim;
    MMHA_CHECK(max_seq_len <= INT32_MAX, "block_tables must have max_blocks * block_size <= 2^31 - 1, got shape ",
               shape_str(tables));
    MMHA_CHECK(v_cache.size(0) >= 1 && v_cache.size(0) <= INT32_MAX, "v_cache must have 1 to 2^31 - 1 blocks, got "
               "shape ", shape_str(v_cache));
  }
  MMHA_CHECK(head_dim_supported(head_dim), "Unsupported head_dim: ", head_dim, " (supported: ", supported_head_dims(),
             ")");
  const int64_t x = 16 / static_cast<int64_t>(a.k_cache.element_size());
  const int64_t x_channels = int4 ? kInt4Channels : x;  // channels of one 16-byte chunk
  const at::Tensor& k_cache = a.k_cache;
  MMHA_CHECK(k_cache.dim() == 5, "k_cache must have 5 dims ", k_dims, ", got shape ", shape_str(k_cache));
  MMHA_CHECK(k_cache.size(4) == x, "k_cache must have x = 16 / element_size = ", x, " in its last dim, got shape ",
             shape_str(k_cache));
  MMHA_CHECK(k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                 k_cache.size(2) * x_channels == head_dim && k_cache.size(3) == slots_dim,
             "k_cache must have shape [", v_cache.size(0), ", ", v_cache.size(1), ", ", head_dim / x_channels, ", ",
             slots_dim, ", ", x, "] to match v_cache ", shape_str(v_cache), ", got shape ", shape_str(k_cache));
  MMHA_CHECK(v_cache.size(1) == a.num_kv_heads, "v_cache must have num_kv_heads (", a.num_kv_heads,
             ") heads in dim 1, got shape ", shape_str(v_cache));
  check_contiguous(k_cache, "k_cache");
  check_contiguous(v_cache, "v_cache");
  MMHA_CHECK(aligned16(k_cache.data_ptr()), "k_cache must start 16-byte aligned (its tiles are copied in 16-byte "
             "pieces)");
  MMHA_CHECK(aligned16(v_cache.data_ptr()), "v_cache must start 16-byte aligned (its tiles are copied in 16-byte "
             "pieces)");
  MMHA_CHECK(max_seq_len > 0, "v_cache must have max_seq_len > 0, got shape ", shape_str(v_cache));
  if (int4) check_int4(a, v_cache.size(0), v_cache.size(1), slots_dim, head_dim, batch);

  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  p.num_heads = static_cast<int32_t>(a.num_heads);
  p.num_kv_heads = static_cast<int32_t>(a.num_kv_heads);
  p.head_dim = static_cast<int32_t>(head_dim);
  p.group = static_cast<int32_t>(a.num_heads / a.num_kv_heads);
  p.inv_group = 1.f / static_cast<float>(p.group);
  p.dtype = to_dtype(a.qkv.scalar_type());
  p.rows.batch = static_cast<int32_t>(std::min<int64_t>(batch, INT32_MAX));  // checked by fill_schedule
  CacheParams& c = p.cache;
  c.k = k_cache.data_ptr();
  c.v = v_cache.data_ptr();
  const bool int8 = k_cache.scalar_type() == at::kChar;
  c.k_scale = fp8 ? a.k_scale->data_ptr<float>() : nullptr;
  c.v_scale = fp8 ? a.v_scale->data_ptr<float>() : nullptr;
  c.k_token_scale = int8 ? a.k_scale->data_ptr<float>() : nullptr;
  c.v_token_scale = int8 ? a.v_scale->data_ptr<float>() : nullptr;
  const auto half_ptr = [&](const OptTensor& t) { return int4 ? static_cast<uint16_t*>(t->data_ptr()) : nullptr; };
  p.int4 = Int4Planes{half_ptr(a.k_scale), half_ptr(a.k_zero), half_ptr(a.v_scale), half_ptr(a.v_zero),
                      int4 ? a.k_residual->data_ptr() : nullptr};
  c.block_tables = int_ptr(a.block_tables);
  c.max_seq_len = static_cast<int32_t>(max_seq_len);
  c.max_blocks = a.paged() ? static_cast<int32_t>(a.block_tables->size(1)) : 0;
  c.num_blocks = a.paged() ? static_cast<int32_t>(v_cache.size(0)) : 0;
  c.block_shift = static_cast<int32_t>(block_shift);
  c.dtype = to_dtype(k_cache.scalar_type());
}

void fill_rows(const DecodeArgs& a, MmhaParams& p) {
  const int64_t batch = p.rows.batch;
  check_row_vector(a.row_active, "row_active", batch);
  MMHA_CHECK(!a.positions.has_value() || !a.tree(),
             "positions must be None in a tree step (nodes are rotated at lengths[b] + depth)");
  check_row_vector(a.positions, "positions", batch);
  MMHA_CHECK(a.lengths.dim() == 1 && a.lengths.size(0) == batch, "lengths must have shape [", batch, "], got shape ",
             shape_str(a.lengths));
  check_contiguous(a.lengths, "lengths");
  RowParams& r = p.rows;
  r.lengths = a.lengths.data_ptr<int32_t>();
  r.modes = int_ptr(a.row_active);
  r.positions = int_ptr(a.positions);
  r.status = a.status.data_ptr<int32_t>();
}

void fill_tree(const DecodeArgs& a, MmhaParams& p) {
  p.tree.nodes = 1;
  if (!a.tree()) return;
  // parents [B, T] int32, 1 <= T <= kMaxTreeNodes; node_counts [B] int32.
  const int64_t batch = p.rows.batch;
  const at::Tensor& parents = *a.parents;
  check_dtype(parents, "parents", at::kInt);
  MMHA_CHECK(parents.dim() == 2 && parents.size(0) == batch && parents.size(1) >= 1 &&
                 parents.size(1) <= kMaxTreeNodes,
             "parents must have shape [", batch, ", T] with 1 <= T <= ", kMaxTreeNodes, ", got shape ",
             shape_str(parents));
  check_contiguous(parents, "parents");
  check_row_vector(a.node_counts, "node_counts", batch);
  MMHA_CHECK(a.window == 0 && a.softcap == 0 && !a.alibi_slopes.has_value() && !a.sinks.has_value(),
             "window, softcap, alibi_slopes and sinks must be unset for a tree step (parents given): tree "
             "steps take no score modifiers yet");
  p.tree.nodes = static_cast<int32_t>(parents.size(1));
  p.tree.parents = parents.data_ptr<int32_t>();
  p.tree.node_counts = int_ptr(a.node_counts);
}

void fill_query(const DecodeArgs& a, MmhaParams& p) {
  // qkv [B, (Hq + 2 Hkv) D] (a tree step: [B, T, (Hq + 2 Hkv) D]): inner dim contiguous, any
  // row stride; a tree step's query row b * T + t lies at (b * T + t) * qkv_row_stride.
  const at::Tensor& qkv = a.qkv;
  const int64_t batch = p.rows.batch, nodes = p.tree.nodes;
  const int64_t width = (a.num_heads + 2 * a.num_kv_heads) * p.head_dim;
  const bool tree = a.tree();
  const int64_t qdims = tree ? 3 : 2;
  MMHA_CHECK(qkv.dim() == qdims, "qkv must have ", qdims, " dims ",
             tree ? "[B, T, (Hq + 2 * Hkv) * D]" : "[B, (Hq + 2 * Hkv) * D]", ", got shape ", shape_str(qkv));
  MMHA_CHECK(qkv.size(0) == batch, "qkv must have batch ", batch,
             a.paged() ? " (block_tables' rows)" : " (the caches' batch)", ", got shape ", shape_str(qkv));
  MMHA_CHECK(!tree || qkv.size(1) == nodes, "qkv must have T = ", nodes, " nodes (parents' width) in dim 1, got shape ",
             shape_str(qkv));
  MMHA_CHECK(qkv.size(qdims - 1) == width, "qkv must have width (num_heads + 2 * num_kv_heads) * head_dim = (",
             a.num_heads, " + 2 * ", a.num_kv_heads, ") * ", p.head_dim, " = ", width, ", got shape ", shape_str(qkv));
  const int64_t row_stride = tree && nodes > 1 ? qkv.stride(1) : qkv.stride(0);
  MMHA_CHECK(qkv.stride(qdims - 1) == 1 && row_stride >= width &&
                 (!tree || batch == 1 || qkv.stride(0) == nodes * row_stride),
             "qkv must have unit stride in its last dim and row stride >= its width",
             tree ? " (and batch stride T * row stride)" : "", ", got strides ", list_str(qkv.strides()));
  if (a.qkv_bias.has_value()) {
    MMHA_CHECK(a.qkv_bias->dim() == 1 && a.qkv_bias->size(0) == width, "qkv_bias must have shape [", width,
               "], got shape ", shape_str(*a.qkv_bias));
    check_contiguous(*a.qkv_bias, "qkv_bias");
  }
  p.qkv = qkv.data_ptr();
  p.qkv_bias = a.qkv_bias.has_value() ? a.qkv_bias->data_ptr() : nullptr;
  p.qkv_row_stride = row_stride;
}

void fill_mods(const DecodeArgs& a, MmhaParams& p) {
  // Values of the per-head tensors are the caller's to check (mmha.AttentionSpec reads them once).
  MMHA_CHECK(a.window >= 0, "window must be >= 0 (0: no window), got ", a.window);
  MMHA_CHECK(a.window <= INT32_MAX, "window must be at most 2^31 - 1, got ", a.window);
  MMHA_CHECK(std::isfinite(a.softcap) && a.softcap >= 0, "softcap must be finite and >= 0 (0: none), got ", a.softcap);
  for (const auto& [t, name] : {std::pair{&a.alibi_slopes, "alibi_slopes"}, std::pair{&a.sinks, "sinks"}}) {
    if (t->has_value()) check_vector(**t, name, a.num_heads, "one per query head", a.qkv.device());
  }
  p.mods.window = static_cast<int32_t>(a.window);
  p.mods.softcap = static_cast<float>(a.softcap);
  p.mods.alibi_slopes = float_ptr(a.alibi_slopes);
  p.mods.sinks = float_ptr(a.sinks);
}

void fill_output(const DecodeArgs& a, MmhaParams& p) {
  const int64_t batch = p.rows.batch, nodes = p.tree.nodes, channels = a.num_heads * p.head_dim;
  const bool tree = a.tree();
  const int64_t qdims = tree ? 3 : 2;
  const std::string rows_str = tree ? std::to_string(batch) + ", " + std::to_string(nodes) : std::to_string(batch);
  MMHA_CHECK(a.out.dim() == qdims && a.out.size(0) == batch && (!tree || a.out.size(1) == nodes) &&
                 a.out.size(qdims - 1) == channels,
             "out must have shape [", rows_str, ", ", channels, "], got shape ", shape_str(a.out));
  check_contiguous(a.out, "out");
  MMHA_CHECK(a.lse.dim() == qdims && a.lse.size(0) == batch && (!tree || a.lse.size(1) == nodes) &&
                 a.lse.size(qdims - 1) == a.num_heads,
             "lse must have shape [", rows_str, ", ", a.num_heads, "], got shape ", shape_str(a.lse));
  check_contiguous(a.lse, "lse");
  // Output epilogue: per-channel tensors fp32 [Hq * D], read in 16-byte vectors; a scale finite and positive.
  for (const auto& [t, name] : {std::pair{&a.out_shift, "out_shift"}, std::pair{&a.out_smooth, "out_smooth"},
                                std::pair{&a.out_scales, "out_scales"}}) {
    if (!t->has_value()) continue;
    check_vector(**t, name, channels, "num_heads * head_dim, one per output channel", a.qkv.device());
    MMHA_CHECK(!a.epilogue() || aligned16((*t)->data_ptr()), name,
               " must start 16-byte aligned (the epilogue reads it in 16-byte vectors)");
  }
  MMHA_CHECK(!a.epilogue() || aligned16(a.out.data_ptr()), "out must start 16-byte aligned with an output epilogue");
  const float scale32 = static_cast<float>(a.out_scale);
  MMHA_CHECK(a.out_scale == 0 || (std::isfinite(scale32) && scale32 > 0),
             "out_scale must be finite and > 0 in fp32 (0: none), got ", a.out_scale);
  MMHA_CHECK(a.out_round == 0 || a.out_round == 1,
             "out_round must be 0 (half to even) or 1 (half away from zero), got ", a.out_round);
  MMHA_CHECK(a.out_min == -127 || a.out_min == -128, "out_min must be -127 or -128, got ", a.out_min);
  const bool e4m3 = a.out.scalar_type() == at::kFloat8_e4m3fn;
  MMHA_CHECK(!e4m3 || (a.out_round == 0 && a.out_min == -127), "out_round and out_min must be 0 and -127 for a "
             "float8_e4m3fn out (it rounds to nearest even and saturates to +-448), got ", a.out_round, " and ",
             a.out_min);
  OutputParams& o = p.output;
  o.out = a.out.data_ptr();
  o.lse = a.lse.data_ptr<float>();
  o.shift = float_ptr(a.out_shift);
  o.smooth = float_ptr(a.out_smooth);
  o.scales = float_ptr(a.out_scales);
  o.scale = scale32;
  o.round = static_cast<int32_t>(a.out_round);
  o.min = static_cast<int32_t>(a.out_min);
  o.kind = a.out.scalar_type() == at::kChar ? OutKind::kInt8 : e4m3 ? OutKind::kE4M3 : OutKind::kActivations;
  o.epilogue = a.epilogue();
}

void fill_rotary(const DecodeArgs& a, MmhaParams& p) {
  MMHA_CHECK(a.rotary_dim >= 0 && a.rotary_dim <= p.head_dim && a.rotary_dim % 2 == 0,
             "rotary_dim must be even and in [0, head_dim = ", p.head_dim, "], got ", a.rotary_dim);
  MMHA_CHECK(a.rotary_dim == 0 || a.rotary_theta > 0, "rotary_theta must be positive, got ", a.rotary_theta);
  MMHA_CHECK(std::isfinite(a.scale), "scale must be finite, got ", a.scale);
  int64_t table_rows = 1;
  if (a.rotary_inv_freq.has_value()) {
    const at::Tensor& t = *a.rotary_inv_freq;
    if (t.dim() == 2) {  // rows by the sequence's length
      MMHA_CHECK(t.size(0) >= 1 && t.size(0) < (int64_t{1} << 31) && t.size(1) == a.rotary_dim / 2,
                 "rotary_inv_freq must have shape [rotary_dim / 2 = ", a.rotary_dim / 2,
                 "] or [rows, rotary_dim / 2], got shape ", shape_str(t));
      check_cuda(t, "rotary_inv_freq", a.qkv.device());
      check_dtype(t, "rotary_inv_freq", at::kFloat);
      check_contiguous(t, "rotary_inv_freq");
      table_rows = t.size(0);
      MMHA_CHECK(table_rows == 1 || !a.tree(), "rotary_inv_freq with rows by sequence length (shape ", shape_str(t),
                 ") applies to one-token steps, not tree steps");
    } else {
      check_vector(t, "rotary_inv_freq", a.rotary_dim / 2, "rotary_dim / 2 frequencies", a.qkv.device());
    }
  }
  MMHA_CHECK(a.rotary_table_start >= 0 && a.rotary_table_start < (int64_t{1} << 31),
             "rotary_table_start must be in [0, 2^31), got ", a.rotary_table_start);
  const float factor = static_cast<float>(a.rotary_factor);
  MMHA_CHECK(std::isfinite(factor) && factor > 0, "rotary_factor must be finite and > 0 in fp32, got ", a.rotary_factor);
  p.rotary.dim = static_cast<int32_t>(a.rotary_dim);
  p.rotary.theta = static_cast<float>(a.rotary_theta);
  p.rotary.interleaved = a.rotary_interleaved;
  p.rotary.inv_freq = float_ptr(a.rotary_inv_freq);
  p.rotary.factor = factor;
  p.rotary.table_rows = static_cast<int32_t>(table_rows);
  p.rotary.table_start = static_cast<int32_t>(a.rotary_table_start);
  p.scale = static_cast<float>(a.scale);
}

void fill_qk_norm(const DecodeArgs& a, MmhaParams& p) {
  for (const auto& [t, name] :
       {std::pair{&a.q_norm_weight, "q_norm_weight"}, std::pair{&a.k_norm_weight, "k_norm_weight"}}) {
    if (t->has_value()) check_vector(**t, name, p.head_dim, "head_dim, one for every head", a.qkv.device());
  }
  const float eps = static_cast<float>(a.qk_norm_eps);
  MMHA_CHECK(std::isfinite(eps) && eps >= 0, "qk_norm_eps must be finite and >= 0 in fp32, got ", a.qk_norm_eps);
  p.qk_norm.q_weight = float_ptr(a.q_norm_weight);
  p.qk_norm.k_weight = float_ptr(a.k_norm_weight);
  p.qk_norm.eps = eps;
  p.qk_norm.cast_first = a.qk_norm_cast_first;
}

void fill_schedule(const DecodeArgs& a, MmhaParams& p) {
  const int64_t batch = p.rows.batch, nodes = p.tree.nodes, heads = a.num_heads, head_dim = p.head_dim;
  const bool tree = a.tree();
  MMHA_CHECK(a.num_splits >= 1 && a.num_splits <= kMaxSplits, "num_splits must be in [1, ", kMaxSplits, "], got ",
             a.num_splits);
  // Counters: merge arrivals, the work counter, then a tree step's workspace (constants.h's layout).
  const int64_t need_counters = tree ? workspace_counters(batch, nodes, heads) : work_counter(batch, 1, heads) + 2;
  MMHA_CHECK(a.counters.numel() >= need_counters, "counters must hold at least ",
             tree ? "B * T * Hq + 2 (+ 1) + 3 * B * T + B = " : "B * Hq + 2 = ", need_counters, " int32, got ",
             a.counters.numel());
  check_contiguous(a.counters, "counters");
  MMHA_CHECK(!tree || reinterpret_cast<uintptr_t>(a.counters.data_ptr()) % 8 == 0,
             "counters must start 8-byte aligned for a tree step");
  if (a.num_splits > 1) {
    const int64_t need = workspace_partials(batch, nodes, heads, a.num_splits, head_dim);
    MMHA_CHECK(a.partials.numel() >= need, "partials must hold at least ",
               tree ? "B * T * Hq * num_splits * (D + 2) = " : "B * Hq * num_splits * (D + 2) = ", need,
               " floats, got ", a.partials.numel());
    check_contiguous(a.partials, "partials");
    MMHA_CHECK(aligned16(a.partials.data_ptr()), "partials must start 16-byte aligned (the merge reads it in 16-byte "
               "vectors)");
  }
  MMHA_CHECK(a.status.numel() >= batch, "status must hold at least B = ", batch, " int32, got ", a.status.numel());
  check_contiguous(a.status, "status");

  // Tile loop: stages and where tiles come from.
  const DType cache_dtype = p.cache.dtype;
  const bool tiles = uses_tensor_cores(cache_dtype);
  MMHA_CHECK(a.tile_source >= 0 && a.tile_source <= 2, "tile_source must be 0 (auto), 1 (cp.async) or 2 (tma), got ",
             a.tile_source);
  MMHA_CHECK(a.tile_source != 2 || tma_head_dim(cache_dtype, p.head_dim),
             "tile_source 2 (tma) needs float16 or bfloat16 caches with head_dim a multiple of 64, or "
             "float8_e4m3fn caches with head_dim a multiple of 128, got ", a.k_cache.scalar_type(), " and head_dim ",
             head_dim);
  // Columns of a (row, kv head): its group's heads of every query row, in blocks of q_group_block
  // (a tree step's many columns: wide items).
  const int64_t columns = heads / a.num_kv_heads * nodes;
  const int qb = columns_block(columns, tree && nodes > 1, tiles, p.head_dim, batch * a.num_kv_heads, a.epilogue());
  const int64_t q_groups = (columns + qb - 1) / qb;
  int max_stages = kMaxStages;
  int pair = 1, pair_stages = 0;
  if (tiles) {
    const int device = a.qkv.device().index();
    int optin = 0, major = 0;
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    const int stage = cache_stage_bytes(cache_dtype, p.head_dim);
    const int fixed = tile_static_smem(p.head_dim, static_cast<int>(a.qkv.element_size()), qb) + 1024 +
                      cache_extra_bytes(cache_dtype, p.head_dim, qb);
    max_stages = std::min(kMaxStages, (optin - fixed) / stage);
    // A paired launch's stages (its own: one block an SM).
    pair_stages = std::min(kWidePairStages, (optin - fixed - wide_pair_q_bytes(p.head_dim)) / stage);
    if (pairs_wide_items(qb, q_groups, p.dtype, cache_dtype, p.head_dim, major) && pair_stages >= kMinStages &&
        a.wide_pairs) {
      pair = 2;
    }
  }
  MMHA_CHECK(a.stages >= kMinStages && a.stages <= max_stages, "stages must be in [", kMinStages, ", ", max_stages,
             "] for head_dim ", head_dim, " (shared memory of this GPU), got ", a.stages);
  const int64_t item_groups = (q_groups + pair - 1) / pair;
  MMHA_CHECK(batch <= 65535, "qkv must have batch <= 65535, got ", batch);
  MMHA_CHECK(a.num_kv_heads * q_groups <= 65535, "num_kv_heads must be <= 65535, got ", a.num_kv_heads);

  ScheduleParams& s = p.sched;
  s.partials = a.num_splits > 1 ? a.partials.data_ptr<float>() : nullptr;
  s.counters = a.counters.data_ptr<int32_t>();
  s.work = s.counters + work_counter(batch, nodes, heads);
  s.num_splits = static_cast<int32_t>(a.num_splits);
  s.stages = static_cast<int32_t>(pair > 1 ? pair_stages : a.stages);
  s.q_group_block = qb;
  s.q_groups = static_cast<int32_t>(q_groups);
  s.pair = pair;
  s.item_groups = static_cast<int32_t>(item_groups);
  s.tile_source = TileSource::kCpAsync;  // bulk tensor copies decided at launch (decode_op.cpp)
  s.per_row = make_fast_divisor(static_cast<uint32_t>(a.num_kv_heads * item_groups * a.num_splits));
  s.splits = make_fast_divisor(static_cast<uint32_t>(a.num_splits));
  s.groups = make_fast_divisor(static_cast<uint32_t>(item_groups));
  if (tree) {
    p.tree.anc = reinterpret_cast<uint64_t*>(s.counters + tree_anc(batch, nodes, heads));
    p.tree.depth = s.counters + tree_depth(batch, nodes, heads);
    p.tree.rows = s.counters + tree_rows(batch, nodes, heads);
  }
}

}  // namespace mmha
