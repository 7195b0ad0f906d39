// The torch operators of mmha: argument checks, MmhaParams, launch on the current stream.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

namespace mmha {

// One decode step: append the new K/V of every row at slot lengths[b] and attend over
// slots 0..lengths[b]. Writes out [B, Hq * D] and lse [B, Hq]; caches are updated in place;
// lengths are read, never changed. partials / counters are the split-sequence workspace
// (partials [>= B * Hq * num_splits * (D + 2)] fp32, counters [>= B * Hq + 2] int32, all zero).
// check_lengths reads lengths on the host (one synchronisation) and rejects values outside
// [0, S_max - 1]; it is refused during CUDA graph capture. Without it an out-of-range row reads
// and writes nothing in the caches, gets NaN output and lse, and raises status[b] (int32 [>= B],
// never cleared by the kernel). stages: shared-memory stages of the tile loop (fp16 / bf16);
// tile_source: 0 auto (bulk tensor copies where the GPU and head dim allow), 1 cp.async, 2 bulk
// tensor copies (an error where impossible). Caches hold qkv's dtype, or float8_e4m3fn under
// fp16 / bf16 qkv with k_scale and v_scale (fp32 [Hkv]): the new k is stored as
// saturate(k / k_scale[h]) rounded to e4m3, scores use K * k_scale, the output V * v_scale. A
// scale that is not finite and positive refuses the whole step on the device (nothing written,
// NaN output, status bit kStatusScale of every row). Score modifiers (mmha.reference.ScoreMods),
// each off at its default: window (> 0: a row attends to its last `window` slots, its own
// included), softcap (> 0: score = softcap * tanh(score / softcap)), alibi_slopes (fp32 [Hq]:
// score += slope * (slot - pos)), sinks (fp32 [Hq]: a logit per head in the softmax sum).
// A tree step (mmha.tree): parents (int32 [B, T], T <= 64) and optional node_counts (int32 [B]);
// qkv [B, T, W], out [B, T, Hq * D], lse [B, T, Hq]; node t is appended at slot lengths[b] + t
// (rotary at lengths[b] + depth) and attends to the cache and its root path; counters also hold
// the tree's workspace (B * T * Hq + 2, then 3 * B * T + B int32 from an even offset). A row whose
// tree breaks the rules writes nothing, gets NaN output and status bit kStatusTree.
// Paged caches (mmha.paging): block_tables (int32 [B, max_blocks]) with k_cache / v_cache pools
// [num_blocks, Hkv, D/x, bs, x] / [num_blocks, Hkv, bs, D], bs in {16, 32, 64, 128}; tiles come
// from either source (on sm_90, bulk copies per pool block). A row whose table names a block
// outside the pool for one of its slots writes nothing, gets NaN output and status bit
// kStatusPages. row_active (int32 [B]) row modes: 0 takes no part (nothing read or written, zero
// output, lse -inf), 1 steps, 2 attends to slots before lengths[b] only (nothing written).
// positions (int32 [B], one-token steps): q and the new k are rotated at positions[b], not lengths[b].
// rotary_inv_freq (fp32 [rotary_dim / 2]): the rotation's frequencies (angle = position * inv_freq[i]
// in fp32) instead of 1 / rotary_theta^(2i / rotary_dim); rotary_factor multiplies cos and sin.
// A table of several rows (fp32 [rows, rotary_dim / 2], one-token steps only) is chosen per row by
// the sequence's length n = position + 1: row min(max(n - rotary_table_start, 0), rows - 1)
// (transformers' dynamic NTK and longrope, whose frequencies follow the length).
// q_norm_weight / k_norm_weight (fp32 [head_dim], the weight with any offset added): a per-head
// RMSNorm of q / of the new k after the bias and before rotary, n = x * rsqrt(mean(x^2) +
// qk_norm_eps) in fp32, then T(float(T(n)) * w) (qk_norm_cast_first) or T(n * w), T qkv's dtype.
// Output epilogue (mmha/epilogue.py defines it), per output channel c = head * D + d:
// y = (x + out_shift[c]) * out_smooth[c] (fp32 [Hq * D] each, optional); an out of dtype int8 or
// float8_e4m3fn holds y * scale quantised, scale = out_scales[c] (fp32 [Hq * D]) or out_scale (> 0;
// exactly one of them), int8 rounded half to even (out_round 0) or half away from zero (1) and
// saturated to [out_min, 127] (out_min -127 or -128). Values of the tensors are the caller's to check.
// wide_pairs: a tree step's wide items two to a block where the kernels can (pairs_wide_items in
// kernels/mmha_params.h; mmha.dispatch.pair_wide_items decides where it pays).
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
                      int64_t out_min, const std::optional<at::Tensor>& positions,
                      const std::optional<at::Tensor>& rotary_inv_freq, double rotary_factor,
                      int64_t rotary_table_start, const std::optional<at::Tensor>& q_norm_weight,
                      const std::optional<at::Tensor>& k_norm_weight, double qk_norm_eps, bool qk_norm_cast_first,
                      const std::optional<at::Tensor>& k_zero, const std::optional<at::Tensor>& v_zero,
                      const std::optional<at::Tensor>& k_residual, bool wide_pairs);

// Context-parallel steps (mmha/distributed, csrc/kernels/shard_merge.h): pack a shard's out
// [B, H * D] (fp16 / bf16 / fp32) and lse [B, H] into parts [G, B, H / G, D + 1] fp32, and merge
// parts [S, B, H, D + 1] of S shards into out and lse, with an optional sink per head (fp32 [H]).
void shard_pack(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& parts);
void shard_merge(const at::Tensor& parts, const std::optional<at::Tensor>& sinks, const at::Tensor& out,
                 const at::Tensor& lse);

// RMSNorm over segments of each row of x [rows, width] into out (x itself for in place): each
// segment (col_offset, heads, cols in layout; its weight [cols] or [heads, cols]; its eps)
// normalises each of its heads' cols values (csrc/kernels/row_norm.h says how, with offset and
// cast_first). Columns outside every segment are not written.
void rms_norm(const at::Tensor& x, const at::Tensor& out, at::TensorList weights, c10::IntArrayRef layout,
              c10::ArrayRef<double> eps, double offset, bool cast_first);

// Per-block event times of later decode_attention launches (MMHA_TIMELINE builds; timeline.cuh):
// buffer int64 [blocks, kTimelineEvents] on the GPU, or none to stop. Launches capture the buffer
// set at the time (a CUDA graph keeps it). Other builds refuse it with an error that says how to
// build one. timeline_built(): whether this build has the events.
void set_timeline(const std::optional<at::Tensor>& buffer);
bool timeline_built();
// Whether this build is a build check (MMHA_BUILD_CHECK=1: unoptimised PTX; its operators launch nothing).
bool build_check();
// The decode kernel sets this build holds ("fp16", "fp16_e4m3", ...; all of setup.py's KERNEL_SETS
// unless it was built with MMHA_KERNELS).
std::vector<std::string> kernel_sets();

}  // namespace mmha
