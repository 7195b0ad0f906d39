// The tile loop's stager and producer warps: the item slots between them and the consumers, the
// items decided (range, fp8 scales, a fused tree's check), their raw q staged, a paged row's
// blocks checked, and every item's tiles issued into the ring with their headers. Torch-free.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include "attend_tiles.cuh"
#include "cache_slots.cuh"
#include "decode_traits.cuh"
#include "int4_step.cuh"
#include "item_query.cuh"
#include "item_store.cuh"
#include "mmha_params.h"
#include "tile_source.cuh"
#include "timeline.cuh"
#include "tree_step.cuh"
#include "work_items.cuh"

namespace mmha {

// The item slots between a block's stager warp and the rest of the block: two of them, used by
// alternate items. The stager fills a slot with a decided item (range, fp8 scales) and, for
// one-token steps, its raw q and new token, then completes the slot's full barrier (32
// arrivals). The producer takes the item (taken: its 32 lanes) and the consumers the q; each of
// their threads releases the slot (empty). An item of index < 0 says the block has no more items.
// Wide items and fused trees' twins (tree steps) read q from qkv in the consumers: no raw q
// (STAGED false).
template <typename T, int HEAD_DIM, int QB, bool STAGED = QB != kWideColumns>
struct ItemStage {
  static constexpr bool kStaged = STAGED;
  static constexpr int QN = kStaged ? QB * HEAD_DIM : 1;
  static constexpr int KN = kStaged ? HEAD_DIM : 1;
  static constexpr int EMPTY_ARRIVALS = kConsumerWarps * 32 + 32;
  T q[2][QN];
  T k[2][KN];
  T v[2][KN];
  WorkItem item[2];
  int index[2];
  float k_scale[2], v_scale[2];  // the item's kv head's (fp8; 1 for 16-bit caches)
  int before_bad;                // checks_before items, in order: a block before the item's is bad
  uint64_t full[2];
  uint64_t taken[2];
  uint64_t empty[2];
  uint64_t token_ready;          // kStagedToken: 32 stager lanes, once an item's new token is built (stage_new_token)
  uint64_t token_free;           // kStagedToken: the consumers, once they are past an item's last tile
  uint64_t checked;              // 32 stager lanes: before_bad holds the next such item's verdict
};

// `more`: arrivals on each slot's release beyond the block's consumers and producer (a paired wide
// block's second consumer warpgroup).
template <class Stage>
__device__ __forceinline__ void init_item_stage(Stage& st, int more = 0) {
  for (int s = 0; s < 2; ++s) {
    mbar_init(&st.full[s], 32);
    mbar_init(&st.taken[s], 32);
    mbar_init(&st.empty[s], Stage::EMPTY_ARRIVALS + more);
  }
  mbar_init(&st.token_ready, 32);
  mbar_init(&st.token_free, kConsumerWarps * 32);
  mbar_init(&st.checked, 32);
}

// Whether item w of a paged row appends (it holds the new token's slot, or a fused tree's node
// slots) beside keys it does not read ([lo, start): the earlier splits'; [end, pos + nodes): a
// fused tree's nodes in the next split): the blocks of those keys are checked too, so that a row
// with any bad block writes nothing (the stager checks them, check_blocks_before).
template <bool FUSED>
__device__ __forceinline__ bool checks_before(const MmhaParams& p, const WorkItem& w) {
  return p.cache.block_tables != nullptr && w.owner() && (w.start > w.lo || (FUSED && w.end < w.pos + w.nodes));
}

// The stager's check of the blocks of a checks_before item's keys it does not read (before its
// start; a fused tree's nodes past its end), while the item's tiles stream: all
// lanes load kBeforeLoads entries at a time, then check them; the verdict goes to st.before_bad
// and st.checked, which the producer waits for at the item's last tile. (In the producer, a share
// a tile held it ~0.1 us a tile behind the stream: H100, the B = 1 paged rows' appending splits.)
constexpr int kBeforeLoads = 8;
template <typename C, int HEAD_DIM, bool FUSED, class Stage>
__device__ __forceinline__ void check_blocks_before(const MmhaParams& p, const WorkItem& w, Stage& st, int lane) {
  const HeadSlots<C, HEAD_DIM> hs = head_slots<C, HEAD_DIM>(p.cache, p.num_kv_heads, w.b, w.kvh);
  const int e0 = w.lo >> hs.shift;
  const int e1 = ((w.start - 1) >> hs.shift) + 1;
  bool bad = false;
  if constexpr (FUSED) {
    // Entries [e0, e1) (keys [lo, start)), then [e2, e3) (a fused tree's nodes in [end, pos +
    // nodes)), as one run.
    const int e2 = w.end >> hs.shift;
    const int e3 = w.end < w.pos + w.nodes ? ((w.pos + w.nodes - 1) >> hs.shift) + 1 : e2;
    const int n = max(e1 - e0, 0) + e3 - e2;
    const auto entry = [&](int i) { return i < e1 - e0 ? e0 + i : e2 + i - max(e1 - e0, 0); };
    for (int i = lane; i < n; i += 32 * kBeforeLoads) {
      int ids[kBeforeLoads];
#pragma unroll
      for (int u = 0; u < kBeforeLoads; ++u) ids[u] = i + 32 * u < n ? __ldg(hs.table + entry(i + 32 * u)) : 0;
#pragma unroll
      for (int u = 0; u < kBeforeLoads; ++u) bad = bad || !block_ok(p.cache, ids[u]);
    }
  } else {
    for (int e = e0 + lane; e < e1; e += 32 * kBeforeLoads) {
      int ids[kBeforeLoads];
#pragma unroll
      for (int u = 0; u < kBeforeLoads; ++u) ids[u] = e + 32 * u < e1 ? __ldg(hs.table + e + 32 * u) : 0;
#pragma unroll
      for (int u = 0; u < kBeforeLoads; ++u) bad = bad || !block_ok(p.cache, ids[u]);
    }
  }
  bad = __any_sync(kFullMask, bad);
  if (lane == 0) st.before_bad = bad;
  mbar_arrive(&st.checked);  // each lane, after its loads (lane 0 after its write)
}

// An item decided: its range (work_item_range) from its row's length, mode and node count, and
// its kv head's fp8 scales; scales_ok is false where any kv head's scales are bad (fp8 refuses
// the step). A fused tree step's row is derived here (derive_tree; its depths and root paths with
// `paths`, lane t's node t's): a refused row's items are bad, tree_flags says why.
struct DecidedItem {
  WorkItem w;
  float k_scale = 1.f, v_scale = 1.f;
  bool scales_ok = true;
  int tree_flags = 0;
  int depth = 0;
  uint64_t anc = 0;
};

template <typename C, int QB, bool FUSED>
__device__ __forceinline__ DecidedItem decide_item(const MmhaParams& p, int index, int lane, bool paths = false) {
  DecidedItem d;
  d.w = work_item_head<QB>(p, index);
  const int pos = p.rows.lengths[d.w.b];
  int nodes = 1;  // a fused tree's row that takes no part is idle (work_item_range)
  if constexpr (!FUSED) {
    nodes = row_nodes(p, d.w.b);
  } else if (row_takes_part(p.rows, d.w.b)) {
    const WarpTree t = derive_tree(p, d.w.b, pos, lane, paths);
    nodes = t.flags == 0 ? t.n : -1;
    d.tree_flags = t.flags;
    d.depth = t.depth;
    d.anc = t.anc;
  }
  if constexpr (kFp8<C>) {
    // A bad scale of any kv head refuses the whole step: every item checks all of them.
    bool ok = true;
    for (int h = lane; h < p.num_kv_heads; h += 32) ok = ok && scale_ok(p.cache.k_scale[h]) && scale_ok(p.cache.v_scale[h]);
    d.scales_ok = __all_sync(kFullMask, ok);
    d.k_scale = p.cache.k_scale[d.w.kvh];
    d.v_scale = p.cache.v_scale[d.w.kvh];
  }
  work_item_range<FUSED>(p, d.w, pos, nodes, kTileKeys);
  return d;
}

// A one-token item's raw q and new token in a stager lane's registers: loaded with the item's
// length, so that both latencies pass together.
template <typename T, int HEAD_DIM, int QB, bool STAGED = QB != kWideColumns>
struct RawRows {
  static constexpr bool kStaged = STAGED;
  static constexpr int Q_PER_LANE = kStaged ? (QB * HEAD_DIM + 31) / 32 : 1;
  static constexpr int T_PER_LANE = kStaged ? (HEAD_DIM + 31) / 32 : 1;
  T q[Q_PER_LANE];
  T k[T_PER_LANE];
  T v[T_PER_LANE];

  __device__ __forceinline__ void load(const MmhaParams& p, int index, int lane) {
    if constexpr (kStaged) {
      const WorkItem w = work_item_head<QB>(p, index);
      const TokenRows<T> rows = global_rows<T, HEAD_DIM>(p, w.b, w.kvh);
      // One-token steps: the item's columns are consecutive heads of the row. A tree step's
      // consumers read their columns from qkv themselves.
      const T* q_row = global_q<T, HEAD_DIM>(p, Column{w.b, 0, w.h0});
      const int staged = tree_step<false>(p) ? 0 : w.nh * HEAD_DIM;
#pragma unroll
      for (int j = 0; j < Q_PER_LANE; ++j) {
        const int idx = lane + 32 * j;
        q[j] = idx < staged ? q_row[idx] : from_float<T>(0.f);
      }
#pragma unroll
      for (int j = 0; j < T_PER_LANE; ++j) {
        const int d = lane + 32 * j;
        k[j] = d < HEAD_DIM ? rows.k[d] : from_float<T>(0.f);
        v[j] = d < HEAD_DIM ? rows.v[d] : from_float<T>(0.f);
      }
    }
  }

  template <class Stage>
  __device__ __forceinline__ void store(Stage& st, int slot, int lane) const {
    if constexpr (kStaged) {
#pragma unroll
      for (int j = 0; j < Q_PER_LANE; ++j) {
        const int idx = lane + 32 * j;
        if (idx < QB * HEAD_DIM) st.q[slot][idx] = q[j];
      }
#pragma unroll
      for (int j = 0; j < T_PER_LANE; ++j) {
        const int d = lane + 32 * j;
        if (d < HEAD_DIM) {
          st.k[slot][d] = k[j];
          st.v[slot][d] = v[j];
        }
      }
    }
  }
};

// With a qkv bias: the bias rows an item's consumers will read, prefetched into L1 by the stager
// lane by lane as it takes the item (no registers; the bias is never written during a step). A
// one-token item reads its heads h0 .. h0 + nh - 1, a tree item any head of its kv head's group,
// and the new tokens' k and v rows. The q build reads bias elements in a loop whose trips each
// wait for their global load (new_token.cuh's rotated()), an L2 round trip each without this:
// the bias rows' one-token step 9.2 -> 11.5 us at B=1 1K (H200).
template <typename T, int HEAD_DIM, int QB>
__device__ __forceinline__ void prefetch_item_bias(const MmhaParams& p, int index, int lane) {
  constexpr uintptr_t kLine = 128;  // bytes
  constexpr int64_t kRow = sizeof(T) * HEAD_DIM;
  const uintptr_t bias = reinterpret_cast<uintptr_t>(p.qkv_bias);
  const WorkItem w = work_item_head<QB>(p, index);
  const bool tree = p.tree.nodes > 1;
  // The lines of bytes [from, from + bytes) of the bias, lane by lane from line `first` on.
  const auto lines = [&](int64_t from, int64_t bytes, int first) {
    const uintptr_t lo = (bias + from) / kLine, hi = (bias + from + bytes - 1) / kLine;
#pragma unroll 1
    for (uintptr_t l = lo + (lane + 32 - first % 32) % 32; l <= hi; l += 32) {
      prefetch_l1(reinterpret_cast<const void*>(l * kLine));
    }
    return first + static_cast<int>(hi - lo + 1);
  };
  int n = lines((tree ? w.kvh * p.group : w.h0) * kRow, (tree ? p.group : w.nh) * kRow, 0);
  n = lines((p.num_heads + w.kvh) * kRow, kRow, n);
  lines((p.num_heads + p.num_kv_heads + w.kvh) * kRow, kRow, n);
}

// With q / k norms: their weights ([HEAD_DIM] fp32 each, the same for every item), prefetched into
// L1 as the stager takes an item; the q build reads them beside each element (normed()).
template <int HEAD_DIM>
__device__ __forceinline__ void prefetch_norm_weights(const MmhaParams& p, int lane) {
  constexpr int kTouch = HEAD_DIM / 32 + 1;  // 128-byte lines a weight may span
  const float* w = lane < kTouch ? p.qk_norm.q_weight : p.qk_norm.k_weight;
  const int j = lane < kTouch ? lane : lane - kTouch;
  if (w != nullptr && j < kTouch) prefetch_l1(w + min(32 * j, HEAD_DIM - 1));
}

// A tree item with a q norm: its columns' q rows (each node's run of its kv head's group of heads
// in its qkv row), prefetched into L1 by the stager as it takes the item. The consumers' norms
// read them column after column (head_inv_rms, a warp reduction each), one L2 round trip a column
// without this.
template <typename T, int HEAD_DIM, int QB>
__device__ __forceinline__ void prefetch_tree_q_rows(const MmhaParams& p, int index, int lane) {
  constexpr int64_t kLine = 128;  // bytes
  const WorkItem w = work_item_head<QB>(p, index);
  const int n0 = w.c0 / p.group;
  const int nodes = (w.c0 + w.nh - 1) / p.group - n0 + 1;
  const int64_t run = static_cast<int64_t>(p.group) * HEAD_DIM * sizeof(T);  // bytes a node
  const int touches = static_cast<int>(run / kLine) + 1;                    // lines a run may span
  const char* q = static_cast<const char*>(p.qkv) + static_cast<int64_t>(w.kvh) * p.group * HEAD_DIM * sizeof(T);
#pragma unroll 1
  for (int i = lane; i < nodes * touches; i += 32) {
    const int64_t row = static_cast<int64_t>(w.b) * p.tree.nodes + n0 + i / touches;
    prefetch_l1(q + row * p.qkv_row_stride * static_cast<int64_t>(sizeof(T)) + min((i % touches) * kLine, run - 1));
  }
}

// The stager warp of a tile-loop block: block j's first item is item j, later ones come from the
// step's work counter. It decides each item (decide_item): one with nothing to read (a bad,
// refused or idle row, a split past the row's keys) gets its output here and never reaches the
// ring; a busy one goes into the next item slot with its raw q and new token. It takes the next
// number from the counter once the producer has begun the item before (one item ahead, as a
// block's share of the items stays even to the end). Its loads and the counter's atomic stall
// this warp only, so the producer issues tiles without waiting on global memory (H100, B=64
// Hkv=32 S=256, ncu: the producer spent a quarter of its time on them when it did this itself).
template <typename T, typename C, int HEAD_DIM, int QB, bool EPI, bool FUSED = false>
__device__ __forceinline__ void stage_items(const MmhaParams& p, ItemStage<T, HEAD_DIM, QB, !FUSED && QB != kWideColumns>& st,
                                            int items, int lane, TreeNodes<C, HEAD_DIM>* tn = nullptr,
                                            C* new_k = nullptr, C* new_v = nullptr, float* new_scales = nullptr) {
  int index = blockIdx.x;
  int seq = 0;  // slots filled so far: item seq uses slot seq % 2
  while (index < items) {
    RawRows<T, HEAD_DIM, QB, !FUSED && QB != kWideColumns> raw;
    raw.load(p, index, lane);
    if (p.qkv_bias != nullptr) prefetch_item_bias<T, HEAD_DIM, QB>(p, index, lane);
    // Tree items with q / k norms only (lean kernels have none): a one-token item's norm reads
    // are few and the prefetch measured 1-2 % slower there.
    if (!kLeanKernels && p.tree.nodes > 1 && (p.qk_norm.q_weight != nullptr || p.qk_norm.k_weight != nullptr)) {
      prefetch_norm_weights<HEAD_DIM>(p, lane);
      if (p.qk_norm.q_weight != nullptr) prefetch_tree_q_rows<T, HEAD_DIM, QB>(p, index, lane);
    }
    DecidedItem d = decide_item<C, QB, FUSED>(p, index, lane, FUSED);
    WorkItem& w = d.w;
    if (w.bad) {  // a refused tree row's flag was raised by tree_prepare_kernel, a fused one's here
      poison_row<T, HEAD_DIM, EPI>(p, w, tree_step<FUSED>(p) ? d.tree_flags : kStatusLength, lane, 32);
    } else if (w.idle) {
      poison_row<T, HEAD_DIM, EPI>(p, w, 0, lane, 32, true);
    } else if (!d.scales_ok) {
      w.bad = true;
      poison_row<T, HEAD_DIM, EPI>(p, w, kStatusScale, lane, 32);
    }
    if (w.busy()) {
      const int slot = seq & 1;
      if (seq >= 2) mbar_wait(&st.empty[slot], ((seq >> 1) - 1) & 1);
      raw.store(st, slot, lane);
      if constexpr (FUSED) {  // lane t's node's depth and root path
        if (lane < kFusedTreeNodes) {
          tn->depth[slot][lane] = d.depth;
          tn->anc[slot][lane] = d.anc;
        }
      }
      if (lane == 0) {
        st.item[slot] = w;
        st.index[slot] = index;
        st.k_scale[slot] = d.k_scale;
        st.v_scale[slot] = d.v_scale;
      }
      mbar_arrive(&st.full[slot]);  // each lane's writes to the slot
      // The item's new token, built and appended here into the block's new-token arrays once the
      // consumers are done with the item before (token_free), while they attend to this item's
      // tiles; they wait for it (token_ready) at the tile that holds its slot.
      if constexpr (kStagedToken<C> && !FUSED && QB != kWideColumns) {
        if (seq > 0) mbar_wait(&st.token_free, (seq - 1) & 1);
        if (w.owner()) {
          stage_new_token<T, HEAD_DIM>(p, w, st.k[slot], st.v[slot], new_k, new_v, new_scales, lane);
        }
        mbar_arrive(&st.token_ready);
      }
      mbar_wait(&st.taken[slot], (seq >> 1) & 1);
      ++seq;
      if (checks_before<FUSED>(p, w)) check_blocks_before<C, HEAD_DIM, FUSED>(p, w, st, lane);
    }
    const int fetched = lane == 0 ? static_cast<int>(gridDim.x) + atomicAdd(p.sched.work, 1) : 0;
    index = __shfl_sync(kFullMask, fetched, 0);
  }
  const int slot = seq & 1;
  if (seq >= 2) mbar_wait(&st.empty[slot], ((seq >> 1) - 1) & 1);
  if (lane == 0) st.index[slot] = -1;
  mbar_arrive(&st.full[slot]);
}

// The producer warp of a tile-loop block: it takes the items the stager put into the item slots,
// one after the other, issues each one's tiles into the ring and tags every tile with a header;
// after the last item, a header that says so.
template <typename T, typename C, int HEAD_DIM, int QB, TileSource SRC, bool EPI, bool FUSED = false>
__device__ __forceinline__ void produce_tiles(const MmhaParams& p, TileRing& ring, TileHeader* s_hdr,
                                              ItemStage<T, HEAD_DIM, QB, !FUSED && QB != kWideColumns>& st,
                                              unsigned char* stages, int lane) {
  using Source = SourceOf<C, HEAD_DIM, SRC>;
  using L = TileLayout<C, HEAD_DIM>;
  RingCursor cur;
  // The block's first item, decided here too (as the stager decides it), so that its first tiles
  // go out before the stager has staged it; its header still waits for the slot (the q).
  const DecidedItem first = decide_item<C, QB, FUSED>(p, blockIdx.x, lane);
  const bool early = first.w.busy() && first.scales_ok;
  if (lane == 0) timeline_mark(p, kTlDecided);
  int checked_items = 0;  // checks_before items so far (st.checked's phases)
  for (int seq = 0;; ++seq) {  // item seq is in slot seq % 2
    const int slot = seq & 1;
    const bool first_early = seq == 0 && early;  // this item's slot is read at its first header
    int index = static_cast<int>(blockIdx.x);
    WorkItem w = first.w;
    float k_scale = first.k_scale, v_scale = first.v_scale;
    const auto take = [&] {
      mbar_wait(&st.full[slot], (seq >> 1) & 1);
      index = st.index[slot];
      w = st.item[slot];
      k_scale = st.k_scale[slot];
      v_scale = st.v_scale[slot];
      mbar_arrive(&st.taken[slot]);
      mbar_arrive(&st.empty[slot]);  // this lane has read the slot's item
    };
    if (!first_early) take();
    if (index < 0) break;
    const int64_t kv_head = w.kv_head(p.num_kv_heads);
    const HeadSlots<C, HEAD_DIM> hs = head_slots<C, HEAD_DIM>(p.cache, p.num_kv_heads, w.b, w.kvh);
    TileArgs<C> ta{hs.k, hs.v, hs.pitch, w.lo, w.end, w.newslot, static_cast<int>(kv_head), &p.k_map, &p.v_map,
                   hs.table, hs.shift, hs.block_stride, p.num_kv_heads * hs.pitch, w.kvh * hs.pitch};
    Int4Head<T, HEAD_DIM> ih{};  // an int4 item's planes, addressed once for its tiles
    if constexpr (kInt4<C>) {
      ta.skip_k0 = int4_residual_tile(w);
      ta.bulk = p.int4.bulk;
      ih = int4_head<T, HEAD_DIM>(p, w.b, w.kvh);
    }
    const int nt = w.t1 - w.t0;
    // The stage's K/V groups (TileLayout): wide items' consumers read whole-tile groups only.
    const int kg = QB == kWideColumns ? L::TILE_GROUP : L::k_group(p.cache);
    const TileWalk walk{w.t0, nt, static_cast<int>((kv_head * p.sched.num_splits + w.split) * 37 % nt)};
    // A paged row's blocks: each tile's table entries loaded two tiles ahead and checked one tile
    // ahead (the loads' latency behind a tile's copies, not in the producer's way); for the item
    // that appends, the blocks of the row's keys before its own ([lo, start)) are checked by the
    // stager while the item streams (check_blocks_before), its verdict taken at the last tile. A
    // block outside the pool refuses the item (header flag kPagesRefused, status kStatusPages): NaN
    // output (a split's NaN partial makes the merge NaN) and no append, so the row writes nothing.
    // Tree steps have appended before (tree_prepare_kernel, which refuses a row with a bad block:
    // its items are bad), so their items own no new slot and are never refused here.
    bool pages_bad = false;
    TilePages pages = load_pages(ta, walk.key(0)).checked(p.cache.num_blocks, pages_bad);
    TilePages ahead{{0, 0, 0, 0}};
    if (nt > 1) ahead = load_pages(ta, walk.key(1));
    const bool check_before = checks_before<FUSED>(p, w);
    for (int i = 0; i < nt; ++i) {
      if (cur.n > 0) mbar_wait(&ring.empty[cur.s], (cur.n - 1) & 1);
      if (i == 0 && lane == 0) timeline_item(p, seq, kTlFirstIssued);
      Source::issue(ta, pages, stages + cur.s * L::STAGE_BYTES, walk.key(i), &ring.full[cur.s], lane, kg);
      if constexpr (kInt8<C>) {
        stage_token_scales<HEAD_DIM>(ta, token_scales(p.cache, p.num_kv_heads, w.b, w.kvh), pages,
                                     stages + cur.s * L::STAGE_BYTES, walk.key(i), &ring.full[cur.s], lane);
      }
      if constexpr (kInt4<C>) {
        stage_int4_scales<T, HEAD_DIM>(ta, ih, pages,
                                       stages + cur.s * L::STAGE_BYTES, walk.key(i), &ring.full[cur.s], lane);
      }
      if (i + 1 < nt) pages = ahead.checked(p.cache.num_blocks, pages_bad);
      if (i + 2 < nt) ahead = load_pages(ta, walk.key(i + 2));
      if (first_early && i == 0) take();  // the same item (the stager decides it alike): its q is staged now
      if (check_before && i == nt - 1) {  // the stager's verdict on the blocks before the item's
        mbar_wait(&st.checked, checked_items & 1);
        ++checked_items;
        pages_bad = pages_bad || st.before_bad;
      }
      const bool refused = i == nt - 1 && ta.table != nullptr && __any_sync(kFullMask, pages_bad);
      if (lane == 0) {
        const int flags = (i == 0 ? kFirstTile : 0) | (i == nt - 1 ? kLastTile : 0) | (refused ? kPagesRefused : 0);
        if constexpr (QB == kWideColumns) {  // the item's fields stay in its slot (run_wide_items reads them there)
          TileHeader& h = s_hdr[cur.s];
          h.item = index, h.k0 = walk.key(i), h.flags = flags, h.slot = slot, h.slot_parity = (seq >> 1) & 1;
        } else {
          s_hdr[cur.s] = TileHeader{index, walk.key(i), flags, slot, (seq >> 1) & 1, w.b, w.kvh, w.qg, w.split, w.nh,
                                    w.pos, w.active, w.start, w.end, w.nodes, w.lo, k_scale, v_scale};
        }
        if (refused) atomicOr(p.rows.status + w.b, kStatusPages);
      }
      mbar_arrive(&ring.header[cur.s]);  // each lane's header writes: consumers may start on q now
      Source::commit(&ring.full[cur.s], lane);
      cur.next(p.sched.stages);
    }
  }
  // No more items: a header that says so, then this block's count toward resetting the
  // work counter (the last block to finish leaves it at zero for the next launch).
  if (cur.n > 0) mbar_wait(&ring.empty[cur.s], (cur.n - 1) & 1);
  if (lane == 0) s_hdr[cur.s].item = -1;
  mbar_arrive(&ring.header[cur.s]);
  if (lane == 0) {
    __threadfence();
    if (atomicAdd(p.sched.work + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      p.sched.work[0] = 0;
      p.sched.work[1] = 0;
    }
  }
  if (lane == 0) timeline_mark(p, kTlProducerDone);
}

}  // namespace mmha
