// Plain parameter block shared by the host launcher and the kernels. Torch-free.
#pragma once

#include <cuda.h>  // CUtensorMap (a 128-byte descriptor; no driver call is made from here)

#include <cstdint>

#include "constants.h"  // generated from table.py: sizes, status bits, row modes, shared-memory model

namespace mmha {

enum class DType : int32_t { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2, kFloat8E4M3 = 3 };

// Bytes of one cache element.
constexpr int elem_bytes(DType t) { return t == DType::kFloat32 ? 4 : t == DType::kFloat8E4M3 ? 1 : 2; }

// Where the tile loop's K/V tiles come from (csrc/kernels/tile_source.cuh).
enum class TileSource : int32_t {
  kAuto = kTileSourceAuto,        // the host picks: bulk tensor copies where tma_supported(), else cp.async
  kCpAsync = kTileSourceCpAsync,  // 16-byte cp.async by the producer warp (sm_80 and newer, every head dim)
  kTma = kTileSourceTma,          // Hopper bulk tensor copies (sm_90, head_dim a multiple of 64)
};

// Query columns per item for `columns` columns per (row, kv head): the smallest of
// kQGroupBlocks that holds them (8 past 8), or kWideColumns for a tree step of two or more nodes
// on the tile loop (see kWideMinColumns; a tree of one node is a one-token step and is computed
// as one), or with an output epilogue 1, kEpilogueGroupColumns (tile loop) or kEpilogueColumns; kv_rows = batch x kv heads. Mirrored by
// columns_block in mmha/dispatch.py.
constexpr int columns_block(int64_t columns, bool tree, bool tiles, int head_dim, int64_t kv_rows,
                            bool epilogue = false) {
  if (epilogue) {
    if (tiles && columns == 1) return 1;
    return tiles && columns <= kEpilogueGroupColumns ? kEpilogueGroupColumns : kEpilogueColumns;
  }
  if (tree && tiles && head_dim <= kWideMaxHeadDim && columns >= kWideMinColumns &&
      (columns >= kWideAlwaysColumns || kv_rows * ((columns + kWideColumns - 1) / kWideColumns) >= kWideMinItems)) {
    return kWideColumns;
  }
  for (int i = 0; i < kNumQGroupBlocks; ++i) {
    if (kQGroupBlocks[i] >= columns) return kQGroupBlocks[i];
  }
  return kQGroupBlocks[kNumQGroupBlocks - 1];
}
// Whether the kernel runs the tile loop (tensor cores) rather than the CUDA-core one; mirrored
// by uses_tensor_cores in mmha/dispatch.py.
constexpr bool uses_tensor_cores(DType cache_dtype) { return cache_dtype != DType::kFloat32; }

// Whether bulk tensor copies can bring this head dim's tiles (caches of cache_dtype on the tile loop).
constexpr bool tma_head_dim(DType cache_dtype, int head_dim) {
  return uses_tensor_cores(cache_dtype) && v_whole_lines(head_dim, elem_bytes(cache_dtype));
}

// What the output tensor holds (output_epilogue.cuh): the activations' dtype, or the attention
// output quantised by the epilogue to int8 or e4m3.
enum class OutKind : int32_t { kActivations = 0, kInt8 = 1, kE4M3 = 2 };

struct MmhaParams {
  const void* qkv;           // [B, (Hq + 2 * Hkv) * D], row stride qkv_row_stride elements
  const void* qkv_bias;      // [(Hq + 2 * Hkv) * D] or nullptr
  void* k_cache;             // [B, Hkv, D / x, S_max, x], x = 16 / sizeof(cache element)
  void* v_cache;             // [B, Hkv, S_max, D]
  const float* k_scale;      // fp8 caches: [Hkv], stored k = quantise(k / k_scale[h]); else nullptr
  const float* v_scale;      // fp8 caches: [Hkv], likewise for v
  const int32_t* lengths;    // [B]: tokens already cached; the new token goes to slot lengths[b]
  void* out;                 // [B, Hq * D]
  float* lse;                // [B, Hq], natural-log log-sum-exp of the scaled logits
  float* partials;           // num_splits > 1: acc [B, Hq, num_splits, D], then (max, sum) [B, Hq, num_splits, 2]
  int32_t* counters;         // [B, Hkv * q_groups]: merge arrivals; zero on entry, left zero on exit
  int32_t* work;             // [2]: tile loop's next item and finished blocks; zero on entry and exit
  int32_t* status;           // [B]: bit 0 (kStatusLength): a length outside [0, S_max - 1];
                             // bit 1 (kStatusScale): a k_scale / v_scale not finite and positive

  int64_t qkv_row_stride;    // elements between rows of qkv
  int32_t batch;
  int32_t num_heads;         // Hq
  int32_t num_kv_heads;      // Hkv
  int32_t head_dim;          // D
  int32_t max_seq_len;       // S_max
  int32_t q_group_block;     // query heads per block (one of kQGroupBlocks)
  int32_t q_groups;          // ceil((Hq / Hkv) / q_group_block)
  int32_t group;             // Hq / Hkv: query heads per kv head (a tree node's columns)
  float inv_group;           // 1 / group, rounded to nearest (column_of's division)
  int32_t num_splits;        // 1: single pass; > 1: split sequence with in-kernel merge
  int32_t stages;            // tile loop: shared-memory stages (kMinStages..kMaxStages)
  TileSource tile_source;    // tile loop: kCpAsync or kTma (never kAuto at launch)
  float scale;               // softmax scale, usually 1 / sqrt(D)
  int32_t rotary_dim;        // 0: no rotary embedding; else even, <= D
  const int32_t* positions;  // [B] or nullptr: one-token steps rotate q and the new k at positions[b]
                             // (a shard of a longer context), not at lengths[b]
  float rotary_theta;
  bool rotary_interleaved;   // true: GPT-J pairs (2i, 2i + 1); false: GPT-NeoX halves (i, i + rd / 2)
  DType dtype;               // qkv and out
  DType cache_dtype;         // the caches: dtype, or kFloat8E4M3 (with dtype fp16 or bf16)

  // Score modifiers (score_mods.cuh): each off at its zero.
  int32_t window;              // 0: none; else a row attends to its last `window` slots (its own included)
  float softcap;               // 0: none; else score = softcap * tanh(score / softcap)
  const float* alibi_slopes;   // [Hq] or nullptr: score += slope[h] * (slot - pos), after the soft-cap
  const float* sinks;          // [Hq] or nullptr: a logit per head in the softmax sum, with no value

  // Tree steps (mmha.tree): `nodes` query rows per batch row (qkv, out and lse rows b * nodes + t;
  // 1 for a one-token step). A tree step's tree_prepare_kernel (tree_step.cuh) checks parents,
  // writes tree_rows / tree_anc / tree_depth and appends every node's K/V before the attention
  // kernel runs; the attention kernel then appends nothing and masks the tree's slots.
  int32_t nodes;
  const int32_t* parents;      // [B, nodes]: -1 (a root) or an earlier node; nullptr: one-token step
  const int32_t* node_counts;  // [B] nodes each row uses (1..nodes), or nullptr: all
  int32_t* tree_rows;          // [B] (workspace): the row's node count, or -1 where it was refused
  int32_t* tree_depth;         // [B * nodes] (workspace): node depth (rotary position length + depth)
  uint64_t* tree_anc;          // [B * nodes] (workspace): bit j set: node j is on node t's root path

  // Paged caches (mmha.paging; cache_slots.cuh): k_cache and v_cache are pools of num_blocks
  // blocks, k [num_blocks, Hkv, D/x, bs, x] and v [num_blocks, Hkv, bs, D] with bs = 1 << block_shift;
  // slot t of row b lives in block block_tables[b * max_blocks + t / bs] (max_seq_len = max_blocks
  // * bs). nullptr: contiguous caches [B, Hkv, D/x, S_max, x] / [B, Hkv, S_max, D].
  const int32_t* block_tables;
  int32_t max_blocks;
  int32_t num_blocks;
  int32_t block_shift;
  // [B] or nullptr (every row kRowStep): each row's mode. kRowIdle: the row takes no part
  // (nothing read or written, zero output, lse -inf), as a released row of a paged cache that
  // owns no blocks. kRowStep: the new token is appended at slot lengths[b] and slots up to it are
  // attended. kRowAttend (one-token steps): slots before lengths[b] only; nothing is written and
  // lengths[b] may equal S_max (one shard of a context spread over several caches); a row left
  // with no slot in reach is idle.
  const int32_t* row_active;

  // Output epilogue (output_epilogue.cuh; mmha.epilogue defines it), per output channel c =
  // head * D + d: y = (x + out_shift[c]) * out_smooth[c], then for a quantised out_kind
  // q = saturate(round(y * scale)), scale = out_scales[c] or out_scale. Off (out_epilogue false):
  // out = x in the activations' dtype.
  bool out_epilogue;
  OutKind out_kind;
  const float* out_shift;    // [Hq * D] or nullptr
  const float* out_smooth;   // [Hq * D] or nullptr
  const float* out_scales;   // [Hq * D] or nullptr (then out_scale)
  float out_scale;
  int32_t out_round;         // int8: 0 half to even, 1 half away from zero
  int32_t out_min;           // int8: -127 or -128 (the upper bound is 127)

  // Builds with MMHA_TIMELINE only (timeline.cuh; mmha/bench/timeline.py): block j's event times
  // in ns at timeline[j * kTimelineEvents + e] for blocks j < timeline_blocks. Else unused (nullptr).
  // (Here, in the padding before the descriptors: the struct keeps its size.)
  uint64_t* timeline;
  int32_t timeline_blocks;

  // Bulk-tensor-copy descriptors of the caches (tile_source == kTma only; tma_maps.h fills them).
  CUtensorMap k_map;
  CUtensorMap v_map;
};

// Events of a tile-loop block that an MMHA_TIMELINE build stamps (globaltimer, ns), for the
// block's first item unless said: the block's first instruction, its start (barriers set up),
// the producer's first item decided (its row's length read), the first tile's copies issued,
// that tile landed, the item's last tile landed, its last tile attended, the consumers' combine
// done, out (or the split's partial) stored, the new token appended, the split merge done (the
// item finished), the consumers' last item finished, the producer's last header written.
enum TimelineEvent : int {
  kTlEntered = 0,
  kTlStart,
  kTlDecided,
  kTlFirstIssued,
  kTlFirstLanded,
  kTlLastLanded,
  kTlLastAttended,
  kTlCombined,
  kTlOutStored,
  kTlAppended,
  kTlItemDone,
  kTlConsumersDone,
  kTlProducerDone,
  kTimelineEvents
};

}  // namespace mmha
