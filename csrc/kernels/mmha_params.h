// Plain parameter block shared by the host launcher and the kernels. Torch-free.
#pragma once

#include <cuda.h>  // CUtensorMap (a 128-byte descriptor; no driver call is made from here)

#include <cstdint>

#include "constants.h"  // generated from table.py: sizes, status bits, row modes, shared-memory model

namespace mmha {

enum class DType : int32_t { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2, kFloat8E4M3 = 3, kInt8 = 4, kInt4 = 5 };

// Bytes of one cache element (an int4 cache's: a byte of two codes).
constexpr int elem_bytes(DType t) {
  return t == DType::kFloat32 ? 4 : t == DType::kFloat8E4M3 || t == DType::kInt8 || t == DType::kInt4 ? 1 : 2;
}

// Shared memory of one tile-loop stage for caches of cache_dtype (int4: its own layout).
constexpr int cache_stage_bytes(DType cache_dtype, int head_dim) {
  return cache_dtype == DType::kInt4 ? int4_stage_bytes(head_dim)
                                     : tile_stage_bytes(head_dim, elem_bytes(cache_dtype), cache_dtype == DType::kInt8);
}
// Dynamic shared memory of a tile-loop block past its stages at qb columns per item (int4: the
// row's last K group; int8 wide items: a tile widened to fp16).
constexpr int cache_extra_bytes(DType cache_dtype, int head_dim, int qb) {
  return cache_dtype == DType::kInt4 ? int4_residual_bytes(head_dim)
                                     : wide_widened_bytes(head_dim, cache_dtype == DType::kInt8, qb);
}

// Division of a non-negative int32 n by a divisor d >= 1 fixed for the launch, as a multiply-high, an
// add and a shift: n / d = (umulhi(n, mul) + n) >> shift, with shift = ceil(log2 d) and
// mul = floor(2^32 (2^shift - d) / d) + 1 (exact for n < 2^31; d = 1: mul 1, shift 0). The item
// index's decomposition (work_item_head) runs it where a division took about 20 instructions.
struct FastDivisor {
  uint32_t d = 1;
  uint32_t mul = 1;
  uint32_t shift = 0;
};

inline FastDivisor make_fast_divisor(uint32_t d) {
  FastDivisor f;
  f.d = d;
  while ((uint64_t{1} << f.shift) < d) ++f.shift;
  f.mul = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << f.shift) - d)) / d + 1);
  return f;
}

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

// Wide items two to a block (ScheduleParams::pair): where a (row, kv head) holds two or more
// column blocks, over 16-bit caches at head dims 64 and 128 on sm_90 (the wgmma consumer, whose
// products read each tile where it lies: the two warpgroups share it). A kv head's four blocks of
// a 64-node tree then read each tile twice instead of four times, and two readers drift apart
// less than L2 holds (bench/probes/wgmma_rates.cu, "pairs").
constexpr bool pairs_wide_items(int qb, int64_t q_groups, DType dtype, DType cache_dtype, int head_dim, int cc_major) {
  return qb == kWideColumns && q_groups >= 2 && cache_dtype == dtype &&
         (dtype == DType::kFloat16 || dtype == DType::kBFloat16) && (head_dim == 64 || head_dim == 128) && cc_major >= 9;
}
// Shared memory of the second warpgroup's q staging area (dynamic, after the stages): the wide
// consumer's four warps' areas (WideConsumer::Q_STAGE_BYTES each), as the first one's static one.
constexpr int wide_pair_q_bytes(int head_dim) { return kConsumerWarps * 16 * (head_dim + 8) * 2; }
// Stages of a paired launch (one block an SM): as deep as the probe's pairs needed to keep their
// rate with the two blocks of a kv head 16-64 tiles apart (4 against 2: 563 / 505 TFLOP/s); a fifth
// measured level in the kernel (H200, 2026-12-01: docs/data/ab_wide_pair_five_stages_h200.md).
constexpr int kWidePairStages = 4;
// Whether the kernel runs the tile loop (tensor cores) rather than the CUDA-core one; mirrored
// by uses_tensor_cores in mmha/dispatch.py.
constexpr bool uses_tensor_cores(DType cache_dtype) { return cache_dtype != DType::kFloat32; }

// Whether bulk tensor copies can bring this head dim's tiles (caches of cache_dtype on the tile loop).
constexpr bool tma_head_dim(DType cache_dtype, int head_dim) {
  return uses_tensor_cores(cache_dtype) && cache_dtype != DType::kInt4 && v_whole_lines(head_dim, elem_bytes(cache_dtype));
}

// What the output tensor holds (output_epilogue.cuh): the activations' dtype, or the attention
// output quantised by the epilogue to int8 or e4m3.
enum class OutKind : int32_t { kActivations = 0, kInt8 = 1, kE4M3 = 2 };

// An int4 cache's planes beside its codes (mmha/int4.py; contiguous caches, one-token steps; MmhaParams::int4): K's
// scale and zero point per 64-token group and channel, V's per token, fp16 (as raw bits); the
// residual holds each row's K slots s of the group not yet quantised at entry s % 128, in the
// activations' dtype. All nullptr for other caches.
struct Int4Planes {
  uint16_t* k_scale;  // [B, Hkv, S_max / 64, D]
  uint16_t* k_zero;   // [B, Hkv, S_max / 64, D]
  uint16_t* v_scale;  // [B, Hkv, S_max]
  uint16_t* v_zero;   // [B, Hkv, S_max]
  void* k_residual;   // [B, Hkv, 128, D]
  bool bulk;          // tiles by bulk tensor copies (sm_90, tile_source not cp.async; k_map / v_map the int4 maps)
};

// The caches (the seam between the kernels and the caches' storage: cache_slots.cuh,
// tile_layout.cuh, tile_source.cuh, the append). Contiguous: k [B, Hkv, D/x, S_max, x] and
// v [B, Hkv, S_max, D]. Paged (mmha.paging; block_tables not null): pools of num_blocks blocks,
// k [num_blocks, Hkv, D/x, bs, x] and v [num_blocks, Hkv, bs, D] with bs = 1 << block_shift; slot
// t of row b lives in block block_tables[b * max_blocks + t / bs] (max_seq_len = max_blocks * bs).
struct CacheParams {
  void* k;                      // [B, Hkv, D / x, S_max, x], x = 16 / sizeof(cache element)
  void* v;                      // [B, Hkv, S_max, D]
  const float* k_scale;         // fp8 caches: [Hkv], stored k = quantise(k / k_scale[h]); else nullptr
  const float* v_scale;         // fp8 caches: [Hkv], likewise for v
  float* k_token_scale;         // int8 caches: [B, Hkv, S_max] (paged [num_blocks, Hkv, bs]): a scale
  float* v_token_scale;         //   per token, k = code * scale (written with the token); else nullptr
  const int32_t* block_tables;  // paged: [B, max_blocks]; nullptr: contiguous
  int32_t max_seq_len;          // S_max
  int32_t max_blocks;
  int32_t num_blocks;
  int32_t block_shift;
  DType dtype;                  // the caches' elements: qkv's dtype, or kFloat8E4M3 / kInt8 / kInt4 (fp16 / bf16 qkv)
};

// The rows of a step, and the flags the device-side guard raises for rows it refuses (nothing read
// or written in the caches for them, NaN output).
struct RowParams {
  const int32_t* lengths;    // [B]: tokens already cached; the new token goes to slot lengths[b]
  const int32_t* modes;      // [B] or nullptr (every row kRowStep). kRowIdle: the row takes no part
                             // (nothing read or written, zero output, lse -inf). kRowStep: appended at
                             // slot lengths[b], slots up to it attended. kRowAttend (one-token steps):
                             // slots before lengths[b] only, nothing written, lengths[b] may be S_max
  const int32_t* positions;  // [B] or nullptr: one-token steps rotate q and the new k at positions[b]
  int32_t* status;           // [B]: kStatusLength, kStatusScale, kStatusTree, kStatusPages
  int32_t batch;
};

// Rotary embedding of q and the new k (new_token.cuh): pair i turns by position * inv_freq[i] (fp32),
// inv_freq the table or 1 / theta^(2i / dim); cos and sin times factor.
struct RotaryParams {
  const float* inv_freq;  // [table_rows, dim / 2] or nullptr (from theta)
  int32_t dim;            // 0: none; else even, <= D
  float theta;
  float factor;           // 1: none (YaRN's and longrope's attention factor)
  bool interleaved;       // true: GPT-J pairs (2i, 2i + 1); false: GPT-NeoX halves (i, i + dim / 2)
  int32_t table_rows;     // 1 (or 0): one table; else a sequence of n tokens uses row
  int32_t table_start;    //   min(max(n - table_start, 0), table_rows - 1) (one-token steps)
};

// Per-head RMSNorm of q and of the new k after the bias and before rotary (Qwen 3's, Gemma 3's
// q_norm / k_norm; new_token.cuh): each head's D values x become n = x * rsqrt(mean(x^2) + eps)
// (fp32), then T(float(T(n)) * w[d]) (cast_first: Llama-style `weight * n.to(dtype)`) or
// T(n * w[d]) (Gemma-style), T the activations' dtype; w is the weight with any offset added.
struct QKNormParams {
  const float* q_weight;  // [D] or nullptr: q as it is
  const float* k_weight;  // [D] or nullptr: k as it is
  float eps;
  bool cast_first;
};

// Score modifiers (score_mods.cuh), each off at its zero.
struct ScoreModParams {
  const float* alibi_slopes;  // [Hq] or nullptr: score += slope[h] * (slot - pos), after the soft-cap
  const float* sinks;         // [Hq] or nullptr: a logit per head in the softmax sum, with no value
  int32_t window;             // 0: none; else a row attends to its last `window` slots (its own included)
  float softcap;              // 0: none; else score = softcap * tanh(score / softcap)
};

// Tree steps (mmha.tree; tree_step.cuh): `nodes` query rows per batch row (qkv, out and lse rows
// b * nodes + t; 1 for a one-token step). A tree step's tree_prepare_kernel checks parents, writes
// rows / anc / depth and appends every node's K/V before the attention kernel runs; the attention
// kernel then appends nothing and masks the tree's slots.
struct TreeParams {
  const int32_t* parents;      // [B, nodes]: -1 (a root) or an earlier node; nullptr: one-token step
  const int32_t* node_counts;  // [B] nodes each row uses (1..nodes), or nullptr: all
  int32_t* rows;               // [B] (workspace): the row's node count, or -1 where it was refused
  int32_t* depth;              // [B * nodes] (workspace): node depth (rotary position length + depth)
  uint64_t* anc;               // [B * nodes] (workspace): bit j set: node j is on node t's root path
  int32_t nodes;
};

// Where the results go (output_epilogue.cuh; mmha.epilogue defines the epilogue), per output
// channel c = head * D + d: y = (x + shift[c]) * smooth[c], then for a quantised kind
// q = saturate(round(y * scale)), scale = scales[c] or scale. Off (epilogue false): out = x in the
// activations' dtype.
struct OutputParams {
  void* out;             // [B, Hq * D] (tree steps [B, nodes, Hq * D])
  float* lse;            // [B, Hq], natural-log log-sum-exp of the scaled logits
  const float* shift;    // [Hq * D] or nullptr
  const float* smooth;   // [Hq * D] or nullptr
  const float* scales;   // [Hq * D] or nullptr (then scale)
  float scale;
  int32_t round;         // int8: 0 half to even, 1 half away from zero
  int32_t min;           // int8: -127 or -128 (the upper bound is 127)
  OutKind kind;
  bool epilogue;
};

// How the step is cut into work and where the split workspace lies (work_items.cuh,
// split_merge.cuh).
struct ScheduleParams {
  float* partials;        // num_splits > 1: acc [B, Hq, num_splits, D], then (max, sum) [B, Hq, num_splits, 2]
  int32_t* counters;      // merge arrivals; zero on entry, left zero on exit
  int32_t* work;          // [2]: tile loop's next item and finished blocks; zero on entry and exit
  int32_t num_splits;     // 1: single pass; > 1: split sequence with in-kernel merge
  int32_t stages;         // tile loop: shared-memory stages (kMinStages..kMaxStages)
  int32_t q_group_block;  // query columns per item (one of kQGroupBlocks, or kWideColumns)
  int32_t q_groups;       // ceil(columns / q_group_block)
  // Wide items: 2 where a block's two consumer warpgroups take a (row, kv head)'s column blocks two
  // at a time over the same tiles (pairs_wide_items), else 1; an item then holds pair column blocks.
  int32_t pair;
  int32_t item_groups;    // items per (row, kv head, split): ceil(q_groups / pair)
  TileSource tile_source; // tile loop: kCpAsync or kTma (never kAuto at launch)
  // work_item_head's divisors: items per row (num_kv_heads * item_groups * num_splits), num_splits, item_groups
  FastDivisor per_row, splits, groups;
};

struct MmhaParams {
  const void* qkv;         // [B, (Hq + 2 * Hkv) * D], row stride qkv_row_stride elements
  const void* qkv_bias;    // [(Hq + 2 * Hkv) * D] or nullptr
  int64_t qkv_row_stride;  // elements between rows of qkv
  int32_t num_heads;       // Hq
  int32_t num_kv_heads;    // Hkv
  int32_t head_dim;        // D
  int32_t group;           // Hq / Hkv: query heads per kv head (a tree node's columns)
  float inv_group;         // 1 / group, rounded to nearest (column_of's division)
  float scale;             // softmax scale, usually 1 / sqrt(D)
  DType dtype;             // qkv and out

  CacheParams cache;
  RowParams rows;
  RotaryParams rotary;
  QKNormParams qk_norm;
  ScoreModParams mods;
  TreeParams tree;
  OutputParams output;
  ScheduleParams sched;

  // Builds with MMHA_TIMELINE only (timeline.cuh; mmha/bench/timeline.py): block j's event times
  // in ns at timeline[j * kTimelineEvents + e] for blocks j < timeline_blocks. Else unused (nullptr).
  uint64_t* timeline;
  int32_t timeline_blocks;

  // Bulk-tensor-copy descriptors of the caches (sched.tile_source == kTma only; tma_maps.h fills them).
  CUtensorMap k_map;
  CUtensorMap v_map;

  // An int4 cache's planes beside its codes (cache.k / cache.v; cache.dtype kInt4), last so that
  // the other kernels' parameter offsets do not move.
  Int4Planes int4;
};

// Events of a tile-loop block that an MMHA_TIMELINE build stamps (globaltimer, ns), for the
// block's first item unless said: the block's first instruction, its start (barriers set up),
// the producer's first item decided (its row's length read), the first tile's copies issued,
// that tile landed, the item's last tile landed, its last tile attended, the consumers' combine
// done, out (or the split's partial) stored, the new token appended, the split merge done (the
// item finished), the consumers' last item finished, the producer's last header written. The
// block's second item stamps its own item events (issued to done) at kTlSecond + e: a block's
// steady state, where its first item also pays the cold start (timeline_item, timeline.cuh).
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
  kTlHeaderSeen,  // consumers: the first item's header (its q build begins)
  kTlQueryBuilt,  // consumers: the first item's q (and a fused tree's nodes) built
  kTlCounted,     // a split's arrival counted (the merge's atomic returned)
  kTlRole,        // not a time: the first item's role (timeline_role, timeline.cuh)
  kTlWeighed,     // the merging block: the splits' weights in shared memory
  kTlSummed,      // the merging block: thread 0's first sums of the splits' values
  kTlQueryStaged,   // wide items, warp 0: its q rows staged raw (their copies landed)
  kTlQueryPlaced,   // wide items, warp 0: its nodes' positions read
  kTlQueryRotated,  // wide items, warp 0: its q rotated (then the barrier: kTlQueryBuilt)
  kTlNodesBuilt,    // a fused tree's owner, thread 0: its share of the nodes built (then kTlQueryBuilt)
  kTlPatched,       // thread 0: the last tile's new slots (a token, a fused tree's nodes) patched, if any
  kTlMergesBegin,   // a lean kernel's block: the merges it put off begin (after its last item)
  kTlSecond         // the events above: the second item's event e is at kTlSecond + e
};
constexpr int kTimelineEvents = 2 * kTlSecond;

}  // namespace mmha
