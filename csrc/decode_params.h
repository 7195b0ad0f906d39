// The decode operator's arguments, checked and turned into MmhaParams one concern at a time: the
// caches, the rows, the query (qkv and bias), tree steps, score modifiers, the output and its
// epilogue, rotary and scale, the schedule (splits, workspace, stages, tile source). Each part
// checks its arguments (ValueError-style messages naming them) and fills its MmhaParams
// sub-struct; nothing is read or written on the device. Host code.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "kernels/mmha_params.h"

namespace mmha {

using OptTensor = std::optional<at::Tensor>;

// The raw operator's arguments (mmha_ops.h documents them), by reference.
struct DecodeArgs {
  const at::Tensor& qkv;
  const at::Tensor& k_cache;
  const at::Tensor& v_cache;
  const at::Tensor& lengths;
  const OptTensor& qkv_bias;
  const at::Tensor& out;
  const at::Tensor& lse;
  const at::Tensor& partials;
  const at::Tensor& counters;
  const at::Tensor& status;
  int64_t num_heads, num_kv_heads;
  double scale;
  int64_t rotary_dim;
  double rotary_theta;
  bool rotary_interleaved;
  int64_t num_splits;
  bool check_lengths;
  int64_t stages, tile_source;
  const OptTensor& k_scale;
  const OptTensor& v_scale;
  int64_t window;
  double softcap;
  const OptTensor& alibi_slopes;
  const OptTensor& sinks;
  const OptTensor& parents;
  const OptTensor& node_counts;
  const OptTensor& block_tables;
  const OptTensor& row_active;
  const OptTensor& out_shift;
  const OptTensor& out_smooth;
  const OptTensor& out_scales;
  double out_scale;
  int64_t out_round, out_min;
  const OptTensor& positions;
  const OptTensor& rotary_inv_freq;
  double rotary_factor;
  int64_t rotary_table_start;
  const OptTensor& q_norm_weight;
  const OptTensor& k_norm_weight;
  double qk_norm_eps;
  bool qk_norm_cast_first;
  const OptTensor& k_zero;      // int4 caches (k_cache / v_cache uint8 codes): fp16 zero points beside
  const OptTensor& v_zero;      //   k_scale / v_scale, and the K residual of the groups not yet quantised
  const OptTensor& k_residual;
  bool wide_pairs;  // a tree step's wide items two to a block where the kernels can (pairs_wide_items)

  bool tree() const { return parents.has_value(); }
  bool paged() const { return block_tables.has_value(); }
  bool quantised() const;
  bool epilogue() const { return out_shift.has_value() || out_smooth.has_value() || quantised(); }
};

// Every tensor on qkv's device, and every dtype: qkv fp16 / bf16 / fp32, caches of its dtype or
// fp8 e4m3 with fp32 scales, the output qkv's dtype or int8 / e4m3 with a scale.
void check_devices_and_dtypes(const DecodeArgs& a);
// Heads, the caches (contiguous or pages through block tables) and their scales: p.cache, the
// head counts, p.head_dim and the step's batch p.rows.batch.
void fill_cache(const DecodeArgs& a, MmhaParams& p);
// lengths, row modes, rotary positions, status: p.rows (after fill_cache).
void fill_rows(const DecodeArgs& a, MmhaParams& p);
// parents and node counts: p.tree (the workspace's parts are placed by fill_schedule).
void fill_tree(const DecodeArgs& a, MmhaParams& p);
// qkv (strided rows) and its bias: p.qkv, p.qkv_bias, p.qkv_row_stride.
void fill_query(const DecodeArgs& a, MmhaParams& p);
// window, soft-cap, ALiBi slopes, sinks: p.mods.
void fill_mods(const DecodeArgs& a, MmhaParams& p);
// out, lse and the output epilogue: p.output.
void fill_output(const DecodeArgs& a, MmhaParams& p);
// Rotary embedding and the softmax scale: p.rotary, p.scale.
void fill_rotary(const DecodeArgs& a, MmhaParams& p);
// The per-head q/k RMSNorm before rotary: p.qk_norm.
void fill_qk_norm(const DecodeArgs& a, MmhaParams& p);
// Split workspace (partials, counters, a tree step's masks), stages, tile source, query-column
// blocks: p.sched and p.tree's workspace (after the other parts).
void fill_schedule(const DecodeArgs& a, MmhaParams& p);

}  // namespace mmha
