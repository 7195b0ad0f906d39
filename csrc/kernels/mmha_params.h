// Plain parameter block shared by the host launcher and the kernels. Torch-free.
#pragma once

#include <cuda.h>  // CUtensorMap (a 128-byte descriptor; no driver call is made from here)

#include <cstdint>

namespace mmha {

enum class DType : int32_t { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2, kFloat8E4M3 = 3 };

// Bytes of one cache element.
constexpr int elem_bytes(DType t) { return t == DType::kFloat32 ? 4 : t == DType::kFloat8E4M3 ? 1 : 2; }

// Where the tile loop's K/V tiles come from (csrc/kernels/tile_source.cuh).
enum class TileSource : int32_t {
  kAuto = 0,     // the host picks: bulk tensor copies where tma_supported(), else cp.async
  kCpAsync = 1,  // 16-byte cp.async by the producer warp (sm_80 and newer, every head dim)
  kTma = 2,      // Hopper bulk tensor copies (sm_90, head_dim a multiple of 64)
};

// Supported configuration, mirrored in mmha/dispatch.py (tests/test_dispatch.py checks both agree).
constexpr int kSupportedHeadDims[] = {32, 64, 80, 96, 128, 256};
constexpr int kNumSupportedHeadDims = sizeof(kSupportedHeadDims) / sizeof(int);
// Query heads of one kv head handled by one block: a group of G heads is cut into blocks of
// kQGroupBlocks[i] >= G (or 8 when G > 8), so K/V is read once per group for G <= 8.
constexpr int kQGroupBlocks[] = {1, 2, 4, 8};
constexpr int kNumQGroupBlocks = sizeof(kQGroupBlocks) / sizeof(int);
// Upper bound on sequence splits: the merge keeps one weight per split in shared memory.
constexpr int kMaxSplits = 64;

// The tile loop (fp16 / bf16 caches, every head dim): a block is kConsumerWarps warps that
// compute, one producer warp that fills a ring of `stages` shared-memory stages, each holding K
// and V of kTileKeys consecutive keys, and one stager warp that fetches the block's items. Each
// consumer warp takes 16 keys of a tile (the M of its m16n8k16 products), so a tile is
// 16 * kConsumerWarps keys.
constexpr int kConsumerWarps = 4;
constexpr int kTileKeys = 16 * kConsumerWarps;
constexpr int kTileThreads = (kConsumerWarps + 2) * 32;
constexpr int kMinStages = 2;
constexpr int kMaxStages = 8;
// Tree steps with many query columns per kv head (a node count times the group) run the tile
// loop's wide consumer (attend_wide.cuh): an item holds kWideColumns columns, 16 per consumer
// warp as the M of its m16n8k16 products, and every warp takes all keys of a tile, so a kv head's
// K/V is read once per kWideColumns columns. From kWideMinColumns columns on, at head dims up to
// kWideMaxHeadDim (its registers: q, O and a tile's scores of 16 columns per warp).
constexpr int kWideColumns = 16 * kConsumerWarps;
constexpr int kWideMinColumns = 32;
constexpr int kWideMaxHeadDim = 128;
// Below kWideAlwaysColumns, wide items only where the step has at least kWideMinItems of them
// (rows x kv heads x column blocks): a small grid of wide items needs many splits, whose merge
// (64 columns in one block) costs more than the narrow items' repeated reads (H100, decode
// timing, B=1 Hq=32 Hkv=8 T=16: 79 against 43 us at 1K, 114 against 62 at 4K; at B=16 wide
// items win, 114 against 134 and 179 against 310).
constexpr int kWideAlwaysColumns = 128;
constexpr int kWideMinItems = 64;
// An upper bound on the tile kernel's static shared memory for qb query heads per block, so that
// host and dispatcher can size stages without asking the compiled kernel (mirrored by
// tile_static_smem in mmha/dispatch.py; 22.1 KB against 21.8 compiled at 8 heads of head_dim 256).
// The two item slots' items, scales and barriers (ItemStage, without the raw q and new token).
constexpr int kItemSlotsBytes = 256;
// Items of at most this many values (query heads x head dim) combine their consumer warps'
// accumulators through a buffer per warp (one barrier) rather than warp by warp in the q buffer.
constexpr int kWarpBufferValues = 512;
constexpr int tile_static_smem(int head_dim, int elem_bytes, int qb) {
  if (qb == kWideColumns) {  // the wide consumer: q staging (or merge weights), barriers, headers
    const int staging = kConsumerWarps * 16 * (head_dim + 8) * 2;
    return (staging > qb * 64 * 4 ? staging : qb * 64 * 4) + 3 * 8 * 8 + 16 + 8 * 64 + kItemSlotsBytes + 256;
  }
  return qb * head_dim * 4                   // q in fp32, then the block combine's buffer
         + 2 * head_dim * elem_bytes         // the new token's k and v
         + 2 * (qb + 2) * head_dim * elem_bytes  // two staging slots of raw q, k and v
         + qb * 64 * 4                       // merge weights (kMaxSplits of them)
         + 2 * 4 * qb * 4                    // per-warp max and sum (kConsumerWarps warps)
         + 3 * 8 * 8 + 16                    // ring and staging barriers (kMaxStages stages)
         + 8 * 64                            // tile headers
         + kItemSlotsBytes                   // the two item slots' items and barriers
         + (qb * head_dim <= kWarpBufferValues ? kConsumerWarps * qb * head_dim * 4 : 0)  // warp buffers
         + 256;                              // alignment
}
// A step with an output epilogue runs kernels compiled with it (output_epilogue.cuh), so that the
// plain kernels stay as they are (the epilogue's code in them cost 4 % on short rows, H200). They
// exist for items of kEpilogueColumns columns, and of one and of four columns on the tile loop
// (one query head per kv head: 8 columns there cost 8-17 % on short rows; groups of 2-4 heads,
// as Llama's 4: 8 columns cost 2.5-5 % on the B=16 / 64 GQA rows): three more kernels per (dtype,
// cache dtype, head dim, tile source) rather than five.
constexpr int kEpilogueColumns = 8;
constexpr int kEpilogueGroupColumns = 4;
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
// The CUDA-core loop (fp32 caches): blocks of kSimtWarps warps, each walking its own keys.
constexpr int kSimtWarps = 4;
constexpr int kSimtThreads = kSimtWarps * 32;

// Whether the kernel runs the tile loop (tensor cores) rather than the CUDA-core one; mirrored
// by uses_tensor_cores in mmha/dispatch.py.
constexpr bool uses_tensor_cores(DType cache_dtype) { return cache_dtype != DType::kFloat32; }

// Whether a V row of the cache is a whole number of 128-byte lines (head_dim a multiple of 64 at
// 16 bits, of 128 at 8 bits): then bulk tensor copies bring V as boxes of one line per key with
// the 128-byte swizzle; otherwise V rows in shared memory are padded by 16 bytes.
constexpr bool v_whole_lines(int head_dim, int cache_elem_bytes) { return head_dim * cache_elem_bytes % 128 == 0; }

// Whether bulk tensor copies can bring this head dim's tiles (caches of cache_dtype on the tile loop).
constexpr bool tma_head_dim(DType cache_dtype, int head_dim) {
  return uses_tensor_cores(cache_dtype) && v_whole_lines(head_dim, elem_bytes(cache_dtype));
}

// Shared memory of one stage of the tile loop (K and V of kTileKeys keys of cache_elem_bytes
// each); tile_layout.cuh lays it out, mmha/dispatch.py mirrors it. Stages are 1024-byte aligned.
constexpr int tile_stage_bytes(int head_dim, int cache_elem_bytes) {
  const int k = kTileKeys * head_dim * cache_elem_bytes;
  const int pitch = v_whole_lines(head_dim, cache_elem_bytes) ? head_dim : head_dim + 16 / cache_elem_bytes;
  const int v = kTileKeys * pitch * cache_elem_bytes;
  return (k + v + 1023) / 1024 * 1024;
}
// Dynamic shared memory of a tile-loop block: its stages plus slack to align them to 1024 bytes.
constexpr int tile_smem_bytes(int head_dim, int elem_bytes, int stages) {
  return stages * tile_stage_bytes(head_dim, elem_bytes) + 1024;
}

// Flags the kernel raises in MmhaParams::status for a row it refused (nothing read or written in
// the caches for it, NaN output).
constexpr int32_t kStatusLength = 1;
constexpr int32_t kStatusScale = 2;
constexpr int32_t kStatusTree = 4;  // a tree step's parents or node count broke mmha.tree's rules
constexpr int32_t kStatusPages = 8;  // a paged cache's block table named a block outside the pool

// What the output tensor holds (output_epilogue.cuh): the activations' dtype, or the attention
// output quantised by the epilogue to int8 or e4m3.
enum class OutKind : int32_t { kActivations = 0, kInt8 = 1, kE4M3 = 2 };

// Nodes of a tree step at most (mmha.tree.MAX_NODES): a node's ancestors are one 64-bit mask.
constexpr int kMaxTreeNodes = 64;

// Row modes (MmhaParams::row_active).
constexpr int32_t kRowIdle = 0;
constexpr int32_t kRowStep = 1;
constexpr int32_t kRowAttend = 2;

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
