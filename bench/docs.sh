#!/usr/bin/env bash
# Regenerates docs/benchmarks.md from the runs kept in docs/data (bench/make_docs.py, every section).
# A new run: copy its JSON over the kept one (or add an --ab line below), then run this.
set -euo pipefail
cd "$(dirname "$0")/.."
D=docs/data
ab=()
for f in barriers_h200 mods_h200 tree_columns_h200 softcap_tanh_h200 paged_check_h100 two_stages_h100 \
  k_chunk_copies_h100 q_ahead_h100 restructure_h200 restructure_paged_h200 rotary_table_h200 \
  rotary_by_length_h100 qk_norm_h200 qk_norm_small_rows_h100 norm_out_of_line_h100 int8_v_scales_by_position_h200 \
  int4_nibble_pairs_h200 lean_kernels_h200 lean_twins_h200 lean_merges_put_off_h200 wide_halves_and_merges_h200 \
  wide_q_raw_staged_h200 tree_append_and_wide_merges_h200 wide_q_plain_pass_h200 wide_q_featured_pass_h200 \
  stager_bias_prefetch_h200 norm_prefetch_h200 wide_node_pairs_h200 \
  q_angle_reuse_h200 int8_fused_trees_h200 fused_q_before_header_h200 int8_lean_kernels_h200 int8_wide_wgmma_h200 int8_widen_offsets_short_stages_h200 \
  wide_merge_forms_h200 wide_merge_online_h200 wide_int8_q_staged_h200 wide_q_positions_first_h200 tree_q_prepared_h200 \
  tree_q_third_form_h200 wide_int8_raw_unit_h200 twin_held_stage_h200 producer_first_stages_h200 owner_node_prefetch_h200 merge_partials_staged_h200 \
  merge_reads_h200 patch_fence_at_release_h200 wide_tile_halves_h200 wide_desc_plus_h200 wide_sums_after_pv_h200 \
  lean_k_whole_tile_h200 wide_next_tile_waits_under_pv_h200 wide_cluster_lockstep_h200 int8_stager_token_h200 \
  wide_pair_five_stages_h200 wide_pair_exp2_under_pv_h200 wide_weigh_trees_h200 int8_k_integer_products_h200 \
  int4_v_plain_bulk_copies_h200 int4_bulk_tiles_h200 int4_three_blocks_h200 int4_folded_k_scales_h200 \
  one_column_lanes_h200 lane_votes_h200 lane_votes_trees_h200 int4_v_offset_and_pairs_h200 \
  int8_flush_int4_centred_h200 int8_v_bias_flush_every_h200 fused_tree_16_nodes_h200 tree_prepare_prefetch_h200 \
  tree_prepare_rounds_h200; do
  ab+=(--ab "$D/ab_$f.md")
done
per_gpu() {  # --flag docs/data/<name>_<gpu>.json for each GPU that has one
  for gpu in h200 h100; do [ -f "$D/$2_$gpu.json" ] && echo "$1 $D/$2_$gpu.json"; done
}
# shellcheck disable=SC2046
python bench/make_docs.py \
  $(per_gpu --bench bench) --before "$D/before_h200.json" --step "$D/step_bench_h200.md" \
  --sweep "$D/sweep_h200.json" --sweep "$D/sweep_h100.json" --sweep "$D/sweep_tree_h100.json" \
  $(per_gpu --fp8 bench_fp8) --fp8-accuracy "$D/fp8_accuracy_h200.json" $(per_gpu --int8 bench_int8) $(per_gpu --int4 bench_int4) \
  $(per_gpu --hf bench_hf) \
  $(per_gpu --mods bench_mods) $(per_gpu --tree bench_tree) $(per_gpu --paged bench_paged) \
  $(per_gpu --epilogue bench_epilogue) $(per_gpu --models models) --kv-accuracy "$D/kv_formats_synthetic_cpu.json" \
  --kv-accuracy "$D/kv_accuracy_h100.json" \
  --distributed "$D/bench_distributed_w2_h100.json" --distributed "$D/bench_distributed_w1_h200.json" \
  --distributed-demo "$D/demo_distributed_w2_h100.log" "${ab[@]}"
