// Fused decode step: append the new token's K/V to the cache and attend over slots 0..lengths[b].
// The step is cut into work items, one per (row, kv head, query-head block, split); one kernel
// body serves both variants: num_splits == 1 walks a row in one item (single pass), num_splits >
// 1 cuts it into chunks whose partials the last item to finish merges. The tile loop runs a grid
// of resident blocks that walk the items (persistent: a block's producer streams the next item's
// tiles while its consumers finish the current one); the CUDA-core loop runs one block per item.
// Torch-free: raw pointers and MmhaParams only.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include <atomic>
#include <type_traits>

#include "attend_simt.cuh"
#include "attend_tiles.cuh"
#include "attend_wide.cuh"
#include "cache_slots.cuh"
#include "decode_launch.h"
#include "decode_traits.cuh"
#include "int4_step.cuh"
#include "item_query.cuh"
#include "item_store.cuh"
#include "mmha_params.h"
#include "new_token.cuh"
#include "output_epilogue.cuh"
#include "lean_kernels.h"
#include "score_mods.cuh"
#include "split_merge.cuh"
#include "tile_producer.cuh"
#include "tile_source.cuh"
#include "timeline.cuh"
#include "tree_step.cuh"
#include "vec.cuh"
#include "work_items.cuh"

namespace mmha {

// The tile loop: a persistent block (kConsumerWarps consumer warps, a producer warp and a stager
// warp) takes item blockIdx.x, then items from the step's work counter until none is left. The
// stager fetches and decides the items and stages each one's raw q a slot ahead; the producer
// issues the items' tiles and tags every tile with a header (item, first / last tile; its own
// barrier, so the consumers read it before the tile lands). The consumers follow the headers: at an item's first tile they
// build its q while the tile is in flight, at its last they combine, store and merge, with
// named barrier 1 among themselves only, so the producer never waits for an item's epilogue.
// Items are taken in any order, but each item's arithmetic and the merge order are fixed, so
// results are bit-identical run to run.
// FUSED (kFusedTrees): a small tree step checked and appended here (one launch; TreeNodes).
template <typename T, typename C, int HEAD_DIM, int QB, TileSource SRC, bool EPI, bool FUSED>
__device__ __forceinline__ void run_tile_items(const MmhaParams& p) {
  using Source = SourceOf<C, HEAD_DIM, SRC>;
  using L = TileLayout<C, HEAD_DIM>;
  constexpr int CONSUMERS = kConsumerWarps * 32;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int items = num_items(p);

  // The block combine goes through a buffer per warp: static ones for small items; for larger
  // ones the item's last stage, which the consumers hold until the store is done (kHeldStage;
  // H200, one-token rows of 8 columns at head dim 128: 0.94-0.96x warp by warp in s_q), the
  // fused twins' too (their former warp-by-warp combine in s_q took 1.86 us of a B=1 T=4 1K
  // tree step against the one-token step's 0.61).
  constexpr bool kWarpBuffers = QB * HEAD_DIM <= kWarpBufferValues;
  constexpr bool kHeldStage = !kWarpBuffers && !kInt4<C>;
  // Several columns: their combine numbers once per column (fold_warps), not at every value.
  constexpr bool kFold = QB > 1;
  // A single pass stores four values per thread (store_item's VEC) for several columns (not in a
  // fused tree's twin: at its register cap that spills 36-40 bytes at head dim 128).
  constexpr bool kStore4 = EPI ? QB >= kEpilogueGroupColumns : QB > 1 && !FUSED;
  // Two consecutive tiles of an item in one softmax update, where the ring is deep enough for a
  // consumer to hold two stages (p.sched.stages >= 4): one-byte caches (fp8, int8: consumer-bound;
  // 4 or more stages unless items are short) and 16-bit head dims <= 96 (6 stages on grids of one
  // item per SM; head dim 128 spills with it).
  constexpr bool kPairTiles = !kInt4<C> && (kFp8<C> || kInt8<C> || HEAD_DIM <= 96);
  // Lean kernels of several columns put their split merges off until the block's last item
  // (PendingMerges, split_merge.cuh), with the merge weights in s_q (free once an item is stored)
  // and the list in s_w's place.
  constexpr bool kDeferMerges = kLeanKernels && QB > 1 && HEAD_DIM >= kMaxSplits;
  __shared__ __align__(16) float s_q[QB][HEAD_DIM + kQRowPad];  // q of the item; then a twin's combine buffer
  __shared__ __align__(16) float s_acc[kWarpBuffers ? kConsumerWarps : 1][kWarpBuffers ? QB : 1]
                                      [kWarpBuffers ? HEAD_DIM : 1];
  __shared__ __align__(16) C s_new_k[HEAD_DIM];
  __shared__ __align__(16) C s_new_v[HEAD_DIM];
  __shared__ float s_new_scales[2];  // int8: the new token's k and v scales
  __shared__ float s_m[kConsumerWarps][QB];
  __shared__ float s_l[kConsumerWarps][QB];
  __shared__ float s_f[kConsumerWarps][QB];
  __shared__ float s_w[kDeferMerges ? 1 : QB][kMaxSplits];
  static_assert(!kDeferMerges || sizeof(PendingMerges) <= sizeof(s_w), "the list in s_w's place");
  PendingMerges* pending = kDeferMerges ? reinterpret_cast<PendingMerges*>(&s_w[0][0]) : nullptr;
  float(*weights)[kMaxSplits] = kDeferMerges ? reinterpret_cast<float(*)[kMaxSplits]>(&s_q[0][0]) : s_w;
  __shared__ bool s_last;
  __shared__ TileRing ring;
  __shared__ TileHeader s_hdr[kMaxStages];
  __shared__ __align__(16) ItemStage<T, HEAD_DIM, QB, !FUSED> s_item;  // a fused tree's twin: no raw q
  extern __shared__ __align__(16) unsigned char s_dyn[];
  unsigned char* stages = s_dyn + (1024 - smem_addr(s_dyn) % 1024) % 1024;
  // A fused tree step's node area, after the stages (launch_fused_tree sizes it: tree_node_bytes).
  TreeNodes<C, HEAD_DIM>* tn = nullptr;
  if constexpr (FUSED) tn = reinterpret_cast<TreeNodes<C, HEAD_DIM>*>(stages + p.sched.stages * L::STAGE_BYTES);
  // An int4 item's residual area (its row's last K group, fp16) and new token, after the stages.
  __half* s_res = nullptr;
  Int4Token<T, kInt4<C> ? HEAD_DIM : kInt4Channels>* s_tok4 = nullptr;
  if constexpr (kInt4<C>) {
    s_res = reinterpret_cast<__half*>(stages + p.sched.stages * L::STAGE_BYTES);
    s_tok4 = reinterpret_cast<Int4Token<T, HEAD_DIM>*>(s_res + kTileKeys * Int4Consumer<HEAD_DIM, QB>::RES_PITCH);
    static_assert(kTileKeys * Int4Consumer<HEAD_DIM, QB>::RES_PITCH * 2 + sizeof(Int4Token<T, HEAD_DIM>) <=
                      int4_residual_bytes(HEAD_DIM),
                  "the residual area holds the group and the new token");
  }
  if (tid == 0) timeline_mark(p, kTlEntered);
  if (tid == 0) {
    for (int s = 0; s < p.sched.stages; ++s) {
      mbar_init(&ring.full[s], Source::FULL_ARRIVALS);
      mbar_init(&ring.header[s], 32);
      mbar_init(&ring.empty[s], CONSUMERS);
    }
    init_item_stage(s_item);
    if constexpr (kDeferMerges) pending->n = 0;
    mbar_init_fence();
  }
  if (warp == kConsumerWarps && lane == 0) {
    Source::prefetch(TileArgs<C>{nullptr, nullptr, 0, 0, 0, 0, 0, &p.k_map, &p.v_map});
  }
  __syncthreads();
  grid_dependency_wait();  // a tree step's check and append (launch_kernel)
  if (tid == 0) timeline_mark(p, kTlStart);

  if (warp == kConsumerWarps) {
    produce_tiles<T, C, HEAD_DIM, QB, SRC, EPI, FUSED>(p, ring, s_hdr, s_item, stages, lane);
    return;
  }
  if (warp == kConsumerWarps + 1) {
    stage_items<T, C, HEAD_DIM, QB, EPI, FUSED>(p, s_item, items, lane, tn, s_new_k, s_new_v, s_new_scales);
    return;
  }

  // ------------------------------------------------------------------ consumers
  const float scale_log2 = p.scale * kLog2e;
  const auto sync = [] { named_barrier(1, CONSUMERS); };
  const int key0 = 16 * warp;
  // K's groups in a stage (TileLayout): lean kernels see contiguous caches only, whose tiles are
  // one group, known here (the fragments' addresses then fold into their loads' offsets).
  using KGroup = std::conditional_t<kLeanKernels && !kInt4<C>, WholeTile, int>;
  const KGroup kg = [&] {
    if constexpr (std::is_same_v<KGroup, int>) {
      return L::k_group(p.cache);
    } else {
      return WholeTile{};
    }
  }();
  RingCursor cur;
  using Consumer = std::conditional_t<kInt4<C>, Int4Consumer<HEAD_DIM, QB>, TileConsumer<C, HEAD_DIM, QB>>;
  Consumer c;
  WorkItem w;
  float value_scale = 1.f;
  // One-column items through the epilogue: its per-channel values, loaded at the first tile.
  constexpr int PRE_N = EPI && QB == 1 ? (HEAD_DIM + CONSUMERS - 1) / CONSUMERS : 0;
  __shared__ ItemChannels<PRE_N, HEAD_DIM> s_pre;
  int item_seq = 0;  // timeline_item: the block's items so far (the first two stamp their events)
  // A fused tree step: the block's first item (item blockIdx.x, placed by arithmetic alone) has its
  // q read from qkv and biased into s_q now, while the stager decides the item (its tree, depths
  // and root paths) and the header waits on that; a first header of another item (the first one
  // had nothing to read) reads its own.
  int q_ready_item = -1;
  if constexpr (FUSED) {
    if (static_cast<int>(blockIdx.x) < items) {
      const WorkItem first = work_item_head<QB>(p, blockIdx.x);
      // The last split's items own the nodes wherever the row has keys for every split: their
      // nodes' k / v rows are read after the header (build_tree_nodes), on the step's tail.
      if (first.split == p.sched.num_splits - 1) prefetch_tree_node_rows<T, HEAD_DIM>(p, first, tid, CONSUMERS);
      fused_query_biased<T, HEAD_DIM, QB>(p, first, s_q, tid, CONSUMERS);
      q_ready_item = static_cast<int>(blockIdx.x);
    }
  }
  for (;;) {
    mbar_wait(&ring.header[cur.s], cur.n & 1);  // the header: an item's q can start before its tile lands
    const TileHeader h = s_hdr[cur.s];
    if (h.item < 0) break;
    unsigned char* stage = stages + cur.s * L::STAGE_BYTES;
    if (h.flags & kFirstTile) {
      if (tid == 0) timeline_item(p, item_seq, kTlHeaderSeen);
      w.b = h.b, w.kvh = h.kvh, w.qg = h.qg, w.split = h.split, w.nh = h.nh;
      w.c0 = h.qg * QB, w.h0 = h.kvh * p.group + w.c0;
      w.pos = h.pos, w.nodes = h.nodes, w.newslot = !FUSED && tree_step<false>(p) ? -1 : h.pos;
      w.bad = false, w.idle = false, w.active = h.active, w.start = h.start, w.end = h.end, w.lo = h.lo;
      value_scale = h.v_scale;
      if constexpr (PRE_N > 0) {
        // Only a single pass stores through the epilogue here (a split's merge applies it).
        if (p.sched.num_splits == 1) s_pre.start(p, column_of(p, w, 0).head, tid, CONSUMERS);
      }
      mbar_wait(&s_item.full[h.slot], h.slot_parity);  // done: the producer waited on it before this header
      const TokenRows<T> rows{s_item.q[h.slot], s_item.k[h.slot], s_item.v[h.slot]};
      Int4Token<T, HEAD_DIM>* tok4 = nullptr;
      if constexpr (kInt4<C>) tok4 = s_tok4;
      load_query_and_new_token<T, C, HEAD_DIM, QB, FUSED>(p, w, rows.q, rows, h.k_scale, h.v_scale, s_q, s_new_k,
                                                          s_new_v, s_new_scales, tid, CONSUMERS, sync, tn, h.slot,
                                                          tok4, h.item == q_ready_item);
      q_ready_item = -1;
      if constexpr (FUSED) {
        if (w.owner()) {
          build_tree_nodes<T, C, HEAD_DIM>(p, w, *tn, h.slot, h.k_scale, h.v_scale, tid, CONSUMERS);
          if (tid == 0) timeline_item(p, item_seq, kTlNodesBuilt);
        }
      }
      sync();
      if (tid == 0) timeline_item(p, item_seq, kTlQueryBuilt);
      if constexpr (!FUSED) mbar_arrive(&s_item.empty[h.slot]);  // this thread is done with the staged q (it is in s_q now)
      c.init(s_q, w.nh, scale_log2 * h.k_scale, lane, p, [&](int g) { return column_of(p, w, g); },
             tree_step<FUSED>(p), w.pos, FUSED ? tn->anc[h.slot] : nullptr);
      if constexpr (FUSED) mbar_arrive(&s_item.empty[h.slot]);  // and with the slot's root paths
      if constexpr (kInt4<C>) {  // the row's last K group into the residual area (quantised where it completes)
        const int rk = int4_residual_tile(w);
        if (rk >= 0) {
          load_int4_residual<T, HEAD_DIM, QB>(p, w, rk, int4_commits(w), *s_tok4, s_res, tid, CONSUMERS, sync);
          c.residual(rk, s_res);
        }
      }
    }
    mbar_wait(&ring.full[cur.s], cur.n & 1);
    if (tid == 0) {
      if (h.flags & kFirstTile) timeline_item(p, item_seq, kTlFirstLanded);
      if (h.flags & kLastTile) timeline_item(p, item_seq, kTlLastLanded);
    }
    const int it = h.k0 + key0;
    // kStagedToken: the item's new token is the stager's (in s_new_*, token_ready); a warp waits for
    // it before it patches it in, every consumer before it is done with the item (token_free). The
    // tile that holds the new slot is not always the item's last (TileWalk starts mid-item).
    const auto token_wait = [&] {
      if constexpr (kStagedToken<C> && !FUSED) mbar_wait(&s_item.token_ready, item_seq & 1);
    };
    // The slots taken from shared memory: a one-token step's new token, a fused tree's nodes.
    const auto patch_if = [&](unsigned char* st, int t) {
      if constexpr (kInt4<C>) {
        if (w.owner() && t <= w.newslot && w.newslot < t + 16) {
          Int4Consumer<HEAD_DIM, QB>::patch(st, key0, t, w.newslot, s_tok4->v, s_tok4->v_range, lane);
        }
      } else if constexpr (FUSED) {
        if ((t < w.newslot + w.nodes && w.newslot < t + 16) || t + 16 > w.end || t < w.lo) {
          TileConsumer<C, HEAD_DIM, QB>::patch(st, key0, kg, t, w.lo, w.end, w.newslot, w.nodes, tn->k(0),
                                               tn->v(0, p.tree.nodes), lane, tn->scales(p.tree.nodes), p.tree.nodes);
        }
      } else if ((t <= w.newslot && w.newslot < t + 16) || t + 16 > w.end || t < w.lo) {
        if (t <= w.newslot && w.newslot < t + 16) token_wait();
        TileConsumer<C, HEAD_DIM, QB>::patch(st, key0, kg, t, w.lo, w.end, w.newslot, 1, s_new_k, s_new_v, lane,
                                             s_new_scales);
      }
    };
    int flags = h.flags;
    if (kPairTiles && p.sched.stages >= 4 && !(flags & kLastTile)) {
      // The item's next tile is in the next stage: both attended in one update.
      RingCursor nxt = cur;
      nxt.next(p.sched.stages);
      mbar_wait(&ring.header[nxt.s], nxt.n & 1);
      const TileHeader h2 = s_hdr[nxt.s];
      unsigned char* stage2 = stages + nxt.s * L::STAGE_BYTES;
      mbar_wait(&ring.full[nxt.s], nxt.n & 1);
      if (tid == 0 && (h2.flags & kLastTile)) timeline_item(p, item_seq, kTlLastLanded);
      const int it2 = h2.k0 + key0;
      if (it < w.end && it2 < w.end) {
        patch_if(stage, it);
        patch_if(stage2, it2);
        if (tid == 0 && (h2.flags & kLastTile)) timeline_item(p, item_seq, kTlPatched);
        const unsigned char* both[2] = {stage, stage2};
        const int its[2] = {it, it2};
        c.template steps<2>(both, key0, kg, its, w.lo, w.end, w.pos, lane);
      } else if (it < w.end || it2 < w.end) {
        unsigned char* one = it < w.end ? stage : stage2;
        const int t = it < w.end ? it : it2;
        patch_if(one, t);
        if (tid == 0 && (h2.flags & kLastTile)) timeline_item(p, item_seq, kTlPatched);
        c.step(one, key0, kg, t, w.lo, w.end, w.pos, lane);
      }
      mbar_arrive(&ring.empty[cur.s]);
      cur.next(p.sched.stages);
      flags = h2.flags;
    } else if (it < w.end) {
      patch_if(stage, it);
      if (tid == 0 && (h.flags & kLastTile)) timeline_item(p, item_seq, kTlPatched);
      c.step(stage, key0, kg, it, w.lo, w.end, w.pos, lane);
    }
    // kHeldStage: the item's last stage is the combine's, held until the store.
    const int held = cur.s;
    if (!kHeldStage || !(flags & kLastTile)) mbar_arrive(&ring.empty[cur.s]);  // done with the stage and its header
    cur.next(p.sched.stages);
    if (flags & kLastTile) {
      if constexpr (kStagedToken<C> && !FUSED) {  // done with s_new_* (each thread past this item's token first)
        token_wait();
        mbar_arrive(&s_item.token_free);
      }
      if (tid == 0) timeline_item(p, item_seq, kTlLastAttended);
      c.finish();
      float (*acc_w)[QB][HEAD_DIM] = nullptr;
      if constexpr (kWarpBuffers) {
        acc_w = s_acc;
        c.stash(s_m, s_l, acc_w, warp, lane);
      } else if constexpr (kHeldStage) {
        static_assert(kConsumerWarps * QB * HEAD_DIM * sizeof(float) <= L::STAGE_BYTES, "warp buffers in a stage");
        acc_w = reinterpret_cast<float (*)[QB][HEAD_DIM]>(stages + held * L::STAGE_BYTES);
        sync();  // every warp is done reading the stage's keys
        c.stash(s_m, s_l, acc_w, warp, lane);
      } else {  // int4 items: warp by warp into s_q
        sync();  // every consumer holds its q fragments: s_q becomes the combine buffer
        c.combine(s_m, s_l, &s_q[0][0], warp, lane);
      }
      if constexpr (kFold) {
        if (tid < w.nh) fold_warps<kConsumerWarps, QB, kWarpBuffers || kHeldStage>(s_m, s_l, s_f, tid);
        sync();
      }
      if (tid == 0) timeline_item(p, item_seq, kTlCombined);
      const auto release = [&] {  // the held stage: this thread's reads and writes before the copy engine's refill
        if constexpr (kHeldStage) {
          fence_proxy_async_smem();
          mbar_arrive(&ring.empty[held]);
        }
      };
      if (flags & kPagesRefused) {
        store_refused_item<T, HEAD_DIM, EPI>(p, w, tid, CONSUMERS);
        release();
      } else {
        const auto m = [&](int g) { return kFold ? s_m[0][g] : warps_max<kConsumerWarps, QB>(s_m, g); };
        const auto l = [&](int g) { return kFold ? s_l[0][g] : warps_sum<kConsumerWarps, QB>(s_m, s_l, g); };
        const auto acc = [&](int g, int d) {
          if constexpr (!kWarpBuffers && !kHeldStage) {
            return s_q[g][d];
          } else if constexpr (kFold) {
            return folded_acc<kConsumerWarps, QB, HEAD_DIM>(s_f, acc_w, g, d);
          } else {
            return warps_acc<kConsumerWarps, QB, HEAD_DIM>(s_m, acc_w, g, d);
          }
        };
        const auto acc4 = [&](int g, int d) {  // the warp buffers' four values in one read each
          if constexpr (kFold && (kWarpBuffers || kHeldStage)) {
            return folded_acc4<kConsumerWarps, QB, HEAD_DIM>(s_f, acc_w, g, d);
          } else {
            return make_float4(acc(g, d), acc(g, d + 1), acc(g, d + 2), acc(g, d + 3));
          }
        };
        store_item<T, HEAD_DIM, EPI, kStore4, PRE_N>(p, w, m, l, acc, value_scale, tid, CONSUMERS, &s_pre, acc4);
        release();
        if (tid == 0) timeline_item(p, item_seq, kTlOutStored);
        if constexpr (kInt4<C>) {
          append_int4_token<T, HEAD_DIM>(p, w, *s_tok4, tid, CONSUMERS);
        } else if constexpr (FUSED) {
          append_tree_nodes<C, HEAD_DIM>(p, w, *tn, tid, CONSUMERS);
        } else if constexpr (!kStagedToken<C>) {  // (else the stager appended it: stage_new_token)
          append_new_token<C, HEAD_DIM>(p, w, s_new_k, s_new_v, tid, CONSUMERS, s_new_scales);
        }
      }
      if (tid == 0) timeline_item(p, item_seq, kTlAppended);
      if (p.sched.num_splits > 1) {
        merge_if_last<T, HEAD_DIM, QB, EPI>(p, w, weights, s_last, value_scale, tid, CONSUMERS, sync, item_seq == 0,
                                            pending);
      }
      sync();  // s_q, s_acc, s_m, s_l, s_f and s_w are free for the next item
      if (tid == 0) timeline_item(p, item_seq, kTlItemDone);
      if (tid == 0 && item_seq == 0) {
        timeline_value(p, kTlRole, timeline_role(w.split, w.owner(), p.sched.num_splits > 1 && s_last,
                                                 (w.end - w.start + kTileKeys - 1) / kTileKeys));
      }
      ++item_seq;
    }
  }
  if constexpr (kDeferMerges) {
    if (tid == 0 && pending->n > 0) timeline_mark(p, kTlMergesBegin);
    merge_pending<T, HEAD_DIM, QB, EPI>(p, *pending, weights, tid, CONSUMERS, sync);
  }
  if (tid == 0) timeline_mark(p, kTlConsumersDone);
}

// A wide consumer's fragment row r (column col of the item), as store_value stores each value:
// out and lse (single pass), its split's partial, or zeros for a node the row does not use. The
// destination and the factor are decided once per row (WideConsumer::row_pairs).
template <typename T, int HEAD_DIM, class Wide>
__device__ __forceinline__ void store_wide_row(const MmhaParams& p, const WorkItem& w, const Column& col,
                                               const Wide& c, int r, int lane, float value_scale) {
  const int64_t h = col.flat(p.num_heads);
  const bool lead = lane % 4 == 0;  // holds head dim 0 of the row
  if (col.node >= w.nodes || p.sched.num_splits == 1) {
    if (col.node >= w.nodes && w.split != 0) return;
    uint32_t* out = reinterpret_cast<uint32_t*>(static_cast<T*>(p.output.out) + h * HEAD_DIM);
    if (col.node >= w.nodes) {
      c.row_pairs(r, lane, [&](int d, float, float) { out[d / 2] = 0u; });
      if (lead) p.output.lse[h] = -INFINITY;
      return;
    }
    float mx = c.m[r], sum = c.l[r];
    const float f = with_sink(p, col.head, mx, sum) / sum * value_scale;
    c.row_pairs(r, lane, [&](int d, float a0, float a1) { out[d / 2] = pack_rn<T>(a0 * f, a1 * f); });
    if (lead) p.output.lse[h] = (mx + log2f(sum)) * kLn2;
  } else {
    const SplitPartials<HEAD_DIM> part(p);
    const int64_t slot = h * p.sched.num_splits + w.split;
    float2* acc = reinterpret_cast<float2*>(part.acc + slot * HEAD_DIM);
    c.row_pairs(r, lane, [&](int d, float a0, float a1) { acc[d / 2] = make_float2(a0, a1); });
    if (lead) part.ml[slot] = make_float2(c.m[r], c.l[r]);
  }
}

// The tile loop for wide items (tree steps with many columns; attend_wide.cuh): the same
// producer and ring, consumers that each hold 16 columns over all keys of every tile. At an
// item's first tile each warp builds its q from qkv while the tile is in flight; tiles that end
// past the item's keys have their stray V rows zeroed by all consumers together (named barrier
// 1); widened int8 tiles (Wide::kWidened) are widened by all consumers together between two such
// barriers (the first: every warp's products of the last tile are done); at the last tile each
// warp stores its columns, and a split's last item merges.
// A paired launch (p.sched.pair = 2, pairs_wide_items) has two consumer warpgroups, then the
// producer and stager warps: each item is two column blocks of a (row, kv head) over the same
// keys, warpgroup g takes block g (none where the row's columns end first: it still hands back
// every stage), so each tile is brought once for both. The stray-V clear and the int8 widening are
// the block's (barrier 1, all consumers; int8 is never paired: pairs_wide_items); the q build,
// merges and stores are each warpgroup's own (barrier 2 + g). Its kernel (decode_attention_kernel_pairs:
// three warpgroups, the consumers' registers raised) has the warpgroups take turns on the tensor
// cores: in its turn a warpgroup issues the P V of its last tile and the S of this one, then
// weighs this tile's scores while the other's products run (each stage released after its P V).
template <typename T, typename C, int HEAD_DIM, TileSource SRC, bool PAIRED = false>
__device__ __forceinline__ void run_wide_items(const MmhaParams& p) {
  using Source = SourceOf<C, HEAD_DIM, SRC>;
  using L = TileLayout<C, HEAD_DIM>;
  using Wide = WideConsumer<C, HEAD_DIM>;
  constexpr int QB = kWideColumns;
  constexpr bool EPI = false;  // steps with an output epilogue take narrow items (columns_block)
  constexpr int GROUP = kConsumerWarps * 32;  // a warpgroup's threads
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  constexpr int PAIRS = PAIRED ? 2 : 1;  // consumer warpgroups (a paired launch: ScheduleParams::pair 2)
  constexpr int producer = kConsumerWarps * PAIRS;  // the producer's warp (the stager's after it)
  using M = typename Wide::M;
  // The warps' q staging areas (merge_wide, the split merge, reads no shared memory); a paired
  // block's second warpgroup's after the stages (and the widened tile).
  constexpr int BUF_BYTES = kConsumerWarps * Wide::Q_STAGE_BYTES;
  __shared__ __align__(16) unsigned char s_buf[BUF_BYTES];
  __shared__ bool s_last[2];
  __shared__ TileRing ring;
  __shared__ TileHeader s_hdr[kMaxStages];
  __shared__ __align__(16) ItemStage<T, HEAD_DIM, QB> s_item;  // the items only (no raw q)
  extern __shared__ __align__(16) unsigned char s_dyn[];
  unsigned char* stages;
  unsigned char* widened;  // the widened tile after the stages (stages_smem_bytes counts it; 1024-aligned)
  M* s_q;
  const auto place = [&] {
    stages = s_dyn + (1024 - smem_addr(s_dyn) % 1024) % 1024;
    widened = stages + p.sched.stages * L::STAGE_BYTES;
    // A paired block's second warpgroup stages its q after the stages (and the widened tile).
    unsigned char* q_area = !PAIRED || tid < GROUP ? s_buf : widened + wide_widened_bytes(HEAD_DIM, kInt8<C>, QB);
    s_q = reinterpret_cast<M*>(q_area + (Wide::kWg ? 0 : (PAIRED ? warp % kConsumerWarps : warp) * Wide::Q_STAGE_BYTES));
  };
  // The ring's and the item slots' barriers (one thread).
  const auto init_barriers = [&] {
    for (int s = 0; s < p.sched.stages; ++s) {
      mbar_init(&ring.full[s], Source::FULL_ARRIVALS);
      mbar_init(&ring.header[s], 32);
      mbar_init(&ring.empty[s], GROUP * PAIRS);
    }
    init_item_stage(s_item, (PAIRS - 1) * GROUP);  // a paired block's second warpgroup reads each slot too
    mbar_init_fence();
  };
  const auto prefetch_maps = [&] { Source::prefetch(TileArgs<C>{nullptr, nullptr, 0, 0, 0, 0, 0, &p.k_map, &p.v_map}); };
  // The producer's and the stager's work (other warps of the block have none).
  const auto serve = [&](int items) {
    if (warp == producer) {
      produce_tiles<T, C, HEAD_DIM, QB, SRC, EPI>(p, ring, s_hdr, s_item, stages, lane);
    } else if (warp == producer + 1) {
      stage_items<T, C, HEAD_DIM, QB, EPI>(p, s_item, items, lane);
    }
  };
  if constexpr (kWideRegisterSplit<C> || PAIRED) {
    // The registers move first, each warpgroup on its own path from here: ptxas bounds the code
    // after a setmaxnreg by it, and code both paths shared would be bound by the lower.
    if (warp >= producer) {  // the last warpgroup: producer, stager, two idle warps
      setmaxnreg<false, PAIRED ? kWidePairOtherRegs : kWideOtherRegs>();
      if (warp == producer && lane == 0) {
        init_barriers();
        prefetch_maps();
      }
      __syncthreads();
      grid_dependency_wait();  // a tree step's check and append (launch_kernel)
      place();
      serve(num_items(p));
      return;
    }
    setmaxnreg<true, PAIRED ? kWidePairConsumerRegs : kWideConsumerRegs>();
    if (tid == 0) timeline_mark(p, kTlEntered);
    __syncthreads();
    grid_dependency_wait();
    if (tid == 0) timeline_mark(p, kTlStart);
    place();
  } else {
    const int items = num_items(p);
    place();
    if (tid == 0) timeline_mark(p, kTlEntered);
    if (tid == 0) init_barriers();
    if (warp == producer && lane == 0) prefetch_maps();
    __syncthreads();
    grid_dependency_wait();  // a tree step's check and append (launch_kernel)
    if (tid == 0) timeline_mark(p, kTlStart);
    if (warp >= producer) {
      serve(items);
      return;
    }
  }

  // A consumer's warpgroup: recomputed where used (from tid), not held across the tile loop, whose
  // registers are at their cap.
  const auto wg = [tid] { return PAIRED ? tid / GROUP : 0; };
  const float scale_log2 = p.scale * kLog2e;
  const auto sync_all = [] { named_barrier(1, GROUP * PAIRS); };
  const auto sync = [wg] { named_barrier(2 + wg(), GROUP); };
  RingCursor cur;
  Wide c;
  WorkItem w;
  float value_scale = 1.f;
  int item_seq = 0;  // timeline_item: the block's items so far (the first two stamp their events; thread 0's warp)
  // A paired launch on wgmma (16-bit caches): the two warpgroups take turns on the tensor cores
  // (named barriers 4 and 5: a warpgroup waits on its own, then arrives on the other's; warpgroup
  // 0 first), each holding its last tile's P for its next turn.
  constexpr bool TURNS = PAIRED && Wide::kWg && !Wide::kBytes;
  int held_s = -1;  // TURNS: the stage of the tile whose P is held, or -1
  if (TURNS && wg() == 1) named_barrier_arrive(4, 2 * GROUP);
  for (;;) {
    mbar_wait(&ring.header[cur.s], cur.n & 1);
    const TileHeader h = s_hdr[cur.s];
    if (h.item < 0) break;
    unsigned char* stage = stages + cur.s * L::STAGE_BYTES;
    if (h.flags & kFirstTile) {
      if (tid == 0) timeline_item(p, item_seq, kTlHeaderSeen);
      // The item as the stager decided it (a tree step's: busy, attend-only), read from its slot
      // before the slot is handed back (the header holds the tile's fields only). A paired item is
      // two column blocks: warpgroup g takes block g (no columns where the row's end first).
      w = s_item.item[h.slot];
      value_scale = s_item.v_scale[h.slot];
      const float k_scale = s_item.k_scale[h.slot];
      mbar_arrive(&s_item.empty[h.slot]);  // wide items take nothing else from the slot
      if constexpr (PAIRED) {
        const int g = wg();
        w.qg = w.qg * 2 + g;
        w.nh = min(QB, w.nh - g * QB);
        w.c0 = w.qg * QB;
        w.h0 = w.kvh * p.group + w.c0;
      }
      c.template init<T>(p, w, scale_log2 * k_scale, s_q, PAIRED ? warp % kConsumerWarps : warp, lane,
                         tid == 0 ? item_seq : 2, warp);
      if constexpr (Wide::kWg) sync();  // the warpgroup's products read every warp's q
      if (tid == 0) timeline_item(p, item_seq, kTlQueryBuilt);
    }
    mbar_wait(&ring.full[cur.s], cur.n & 1);
    if (tid == 0) {
      if (h.flags & kFirstTile) timeline_item(p, item_seq, kTlFirstLanded);
      if (h.flags & kLastTile) timeline_item(p, item_seq, kTlLastLanded);
    }
    const int it = h.k0;
    if constexpr (Wide::kWidened) {  // never paired
      sync_all();  // every warp's products of the last tile have read the widened tile
      c.template widen<GROUP>(stage, widened, it, w.lo, w.end, tid, lane);
      fence_proxy_async_smem();  // read by wgmma
      sync_all();
    } else if (it + kTileKeys > w.end || it < w.lo) {
      Wide::clear_v(stage, it, w.lo, w.end, tid, GROUP * PAIRS);
      sync_all();
    }
    if constexpr (TURNS) {
      // The warpgroup's turn: P V of the held P (the last tile's; zero at an item's first tile,
      // over this tile's V) and this tile's S, issued; the turn handed over; then the tile weighed
      // while the other warpgroup's products run. The held tile's stage is released once its
      // product is done; an item's last P V runs outside the turns.
      const unsigned char* v_stage = held_s >= 0 ? stages + held_s * L::STAGE_BYTES : stage;
      named_barrier(4 + wg(), 2 * GROUP);
      if constexpr (kWideOverlapTurns) {
        c.issue_overlap_turn(stage, v_stage);
        named_barrier_arrive(5 - wg(), 2 * GROUP);
        c.finish_overlap_turn(stage, it, w.lo, w.end, lane);
      } else {
        c.issue_turn(stage, v_stage);
        named_barrier_arrive(5 - wg(), 2 * GROUP);
        c.finish_turn(stage, it, w.lo, w.end, lane);
      }
      if (held_s >= 0) mbar_arrive(&ring.empty[held_s]);
      held_s = cur.s;
      if (h.flags & kLastTile) {
        c.flush_turns(stage);
        mbar_arrive(&ring.empty[cur.s]);
        held_s = -1;
      }
    } else {
      if ((Wide::kWg && (!PAIRED || w.nh > 0)) || c.busy) c.step(stage, widened, it, w.lo, w.end, lane);  // wgmma: the warpgroup together
      mbar_arrive(&ring.empty[cur.s]);  // this lane is done with the stage and its header
    }
    cur.next(p.sched.stages);
    if (h.flags & kLastTile) {
      if (tid == 0) timeline_item(p, item_seq, kTlLastAttended);
      if (c.busy) {
        c.finish();
        if (tid == 0) timeline_item(p, item_seq, kTlCombined);  // a warp's results are complete
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int col = Wide::column(PAIRED ? warp % kConsumerWarps : warp, lane, r);
          if (col < w.nh) store_wide_row<T, HEAD_DIM>(p, w, column_of(p, w, col), c, r, lane, value_scale);
        }
      }
      c.clear_acc();
      if (tid == 0) {
        timeline_item(p, item_seq, kTlOutStored);
        timeline_item(p, item_seq, kTlAppended);  // wide items append nothing (the check-and-append launch did)
      }
      if (p.sched.num_splits > 1 && (!PAIRED || w.nh > 0)) {  // a warpgroup past the row's columns has nothing to merge
        merge_if_last<T, HEAD_DIM, QB, EPI>(p, w, nullptr, s_last[wg()], value_scale, PAIRED ? tid % GROUP : tid, GROUP,
                                            sync, (!PAIRED || tid == 0) && item_seq == 0);
        // merge_wide leaves nothing shared to wait for, but without this barrier the cp.async
        // kernel's registers are allocated otherwise and its tree masks spill (nvdisasm -g, head
        // dim 128: 10 more spill loads and stores in the tile loop); one named barrier a split item.
        sync();
      }
      if (tid == 0) timeline_item(p, item_seq, kTlItemDone);
      if (tid == 0 && item_seq == 0) {
        timeline_value(p, kTlRole, timeline_role(w.split, w.owner(), p.sched.num_splits > 1 && s_last[0],
                                                 (w.end - w.start + kTileKeys - 1) / kTileKeys));
      }
      ++item_seq;
    }
  }
  if (TURNS && wg() == 0) named_barrier(4, 2 * GROUP);  // warpgroup 1's last hand-over
  if (tid == 0) timeline_mark(p, kTlConsumersDone);
}

// The CUDA-core loop (fp32 caches): one block of kSimtWarps warps per item.
template <typename T, int HEAD_DIM, int QB, bool EPI>
__device__ __forceinline__ void run_simt_item(const MmhaParams& p) {
  using Simt = SimtAttend<T, HEAD_DIM, QB>;
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  grid_dependency_wait();  // a tree step's check and append (launch_kernel)
  WorkItem w = work_item_head<QB>(p, blockIdx.x);
  work_item_range(p, w, p.rows.lengths[w.b], row_nodes(p, w.b), Simt::KEYS);
  if (w.bad) {  // a refused tree row's flag was raised by tree_prepare_kernel
    poison_row<T, HEAD_DIM, EPI>(p, w, tree_step<false>(p) ? 0 : kStatusLength, tid, nthreads);
    return;
  }
  if (w.idle) poison_row<T, HEAD_DIM, EPI>(p, w, 0, tid, nthreads, true);
  if (!w.busy()) return;

  __shared__ __align__(16) float s_q[QB][HEAD_DIM + kQRowPad];
  __shared__ __align__(16) T s_new_k[HEAD_DIM];
  __shared__ __align__(16) T s_new_v[HEAD_DIM];
  __shared__ float s_m[kSimtWarps][QB];
  __shared__ float s_l[kSimtWarps][QB];
  __shared__ float s_w[QB][kMaxSplits];
  __shared__ bool s_last;

  const HeadSlots<T, HEAD_DIM> slots = head_slots<T, HEAD_DIM>(p.cache, p.num_kv_heads, w.b, w.kvh);
  load_query_and_new_token<T, T, HEAD_DIM, QB>(
      p, w, global_q<T, HEAD_DIM>(p, Column{w.b, 0, w.h0}), global_rows<T, HEAD_DIM>(p, w.b, w.kvh), 1.f, 1.f, s_q,
      s_new_k, s_new_v, nullptr, tid, nthreads, [] { __syncthreads(); });
  // A paged row: the blocks of the item's keys (and, for the item that appends, of the row's keys
  // before them) must be in the pool, or the item is refused (NaN, no append, kStatusPages).
  const int first = w.owner() ? w.lo : max(w.lo, w.start);
  if (!__syncthreads_and(blocks_ok(p.cache, slots, first, w.end - 1, tid, nthreads))) {
    if (tid == 0) atomicOr(p.rows.status + w.b, kStatusPages);
    store_refused_item<T, HEAD_DIM, EPI>(p, w, tid, nthreads);
    if (p.sched.num_splits > 1) {
      merge_if_last<T, HEAD_DIM, QB, EPI>(p, w, s_w, s_last, 1.f, tid, nthreads, [] { __syncthreads(); });
    }
    return;
  }
  append_new_token<T, HEAD_DIM>(p, w, s_new_k, s_new_v, tid, nthreads);
  const AttendArgs<T, HEAD_DIM> args{slots, w.start, w.lo, w.end, w.newslot, p.scale * kLog2e};
  int heads[QB];
  TreeMask<QB> tree;
  tree.on = tree_step<false>(p);
  tree.base = w.pos;
#pragma unroll
  for (int g = 0; g < QB; ++g) {
    const Column c = column_of(p, w, g < w.nh ? g : 0);
    heads[g] = g < w.nh ? c.head : -1;
    tree.anc[g] = tree.on && g < w.nh ? p.tree.anc[c.qrow] : 0;
  }
  ScoreTransform<QB> mods;
  mods.init(p.mods, heads);
  const float* s_acc = Simt::run(args, mods, tree, s_m, s_l, s_q, s_new_k, s_new_v);
  // Block combine: the loop warps' (max, sum, acc), rescaled to the block's max.
  const auto block_max = [&](int g) { return warps_max<kSimtWarps, QB>(s_m, g); };
  const auto block_sum = [&](int g) { return warps_sum<kSimtWarps, QB>(s_m, s_l, g); };
  const auto block_acc = [&](int g, int d) {
    const float mb = block_max(g);
    const float m_ref = mb == -INFINITY ? 0.f : mb;
    float a = 0.f;
#pragma unroll
    for (int wp = 0; wp < kSimtWarps; ++wp) {
      float aw = 0.f;
#pragma unroll
      for (int r = 0; r < Simt::ACC_ROWS; ++r) aw += s_acc[((wp * Simt::ACC_ROWS + r) * QB + g) * HEAD_DIM + d];
      a += aw * exp2f(s_m[wp][g] - m_ref);
    }
    return a;
  };
  store_item<T, HEAD_DIM, EPI>(p, w, block_max, block_sum, block_acc, 1.f, tid, nthreads);
  if (p.sched.num_splits > 1) {
    merge_if_last<T, HEAD_DIM, QB, EPI>(p, w, s_w, s_last, 1.f, tid, nthreads, [] { __syncthreads(); });
  }
}

// EPI: the output epilogue (output_epilogue.cuh) is compiled in; a kernel of its own, so that the
// other kernels' code and registers do not change (1 or kEpilogueColumns columns: columns_block).
// FUSED: the twin that checks and appends a small tree itself (kFusedTrees).
// LEAN: a lean unit's kernel (lean_kernels.h); the parameter keeps its symbol apart from the
// other units' kernel of the same shape, and every host function below that names a kernel
// carries it for the same reason (their default: the unit's kLeanKernels).
template <typename T, typename C, int HEAD_DIM, int QB, TileSource SRC, bool EPI, bool FUSED = false,
          bool LEAN = kLeanKernels>
__global__ void __launch_bounds__(kBlockThreads<T>, kMinBlocks<T, HEAD_DIM>)
    decode_attention_kernel(const __grid_constant__ MmhaParams p) {
  static_assert(LEAN == kLeanKernels, "a lean kernel is compiled in a lean unit, and only there");
  static_assert(!LEAN || (!EPI && QB != kWideColumns && kTiles<C>), "lean kernels: tile items (one-token, or a fused twin's tree)");
  static_assert(QB != kWideColumns || !kWideRegisterSplit<C>, "these wide items run decode_attention_kernel_wide");
  if constexpr (QB == kWideColumns) {
    run_wide_items<T, C, HEAD_DIM, SRC>(p);
  } else if constexpr (kTiles<C>) {
    run_tile_items<T, C, HEAD_DIM, QB, SRC, EPI, FUSED>(p);
  } else {
    run_simt_item<T, HEAD_DIM, QB, EPI>(p);
  }
}

// Wide items over int8 caches (tree steps): blocks of two warpgroups (kWideThreads), the
// consumers' registers raised at run time (run_wide_items, kWideRegisterSplit).
template <typename T, typename C, int HEAD_DIM, TileSource SRC>
__global__ void __launch_bounds__(kWideThreads, kWgmma ? 2 : 1)
    decode_attention_kernel_wide(const __grid_constant__ MmhaParams p) {
  static_assert(kTiles<T> && HEAD_DIM <= kWideMaxHeadDim && kWideRegisterSplit<C>,
                "wide items of the register split: tile-loop kernels of head dims <= kWideMaxHeadDim");
  run_wide_items<T, C, HEAD_DIM, SRC>(p);
}

// Paired wide items over 16-bit caches (ScheduleParams::pair 2, pairs_wide_items): blocks of three
// warpgroups, two consumer warpgroups taking turns on the tensor cores and the producer's (producer,
// stager, two idle warps), one an SM, the consumers' registers raised at run time (run_wide_items).
template <typename T, typename C, int HEAD_DIM, TileSource SRC>
__global__ void __launch_bounds__(kWidePairThreads, 1) decode_attention_kernel_pairs(const __grid_constant__ MmhaParams p) {
  static_assert(kPairedKernels<T, C, HEAD_DIM>, "paired wide items: 16-bit caches at head dims 64 and 128");
  run_wide_items<T, C, HEAD_DIM, SRC, true>(p);
}

// The kernel of a launch (its block: kKernelThreads): wide items of the register split run their own.
template <typename T, typename C, int HEAD_DIM, int QB, TileSource SRC, bool EPI, bool FUSED = false,
          bool LEAN = kLeanKernels>
constexpr auto kernel_of() {
  if constexpr (QB == kWideColumns && kWideRegisterSplit<C>) {
    static_assert(!EPI && !FUSED && !LEAN, "wide items: no epilogue, no fused twin, no lean unit");
    return decode_attention_kernel_wide<T, C, HEAD_DIM, SRC>;
  } else {
    return decode_attention_kernel<T, C, HEAD_DIM, QB, SRC, EPI, FUSED, LEAN>;
  }
}

// A fused tree step's node area (TreeNodes and its nodes' K/V rows, after the stages) for a step of
// `nodes` nodes; 0 for kernels other than the twins.
template <typename C, int HEAD_DIM, bool FUSED>
constexpr int tree_node_bytes(int nodes) {
  return FUSED ? static_cast<int>(sizeof(TreeNodes<C, HEAD_DIM>)) + 2 * nodes * HEAD_DIM * static_cast<int>(sizeof(C)) +
                     TreeNodes<C, HEAD_DIM>::kScaleFloats * nodes * static_cast<int>(sizeof(float))
               : 0;
}

// The tile loop's stages at `stages` and what follows them (int4: the residual area; int8 wide
// items: the widened tile), with the slack that aligns them.
template <typename C, int HEAD_DIM, int QB>
constexpr int stages_smem_bytes(int stages) {
  if constexpr (kInt4<C>) {
    return stages * int4_stage_bytes(HEAD_DIM) + 1024 + int4_residual_bytes(HEAD_DIM);
  } else {
    return tile_smem_bytes(HEAD_DIM, static_cast<int>(sizeof(C)), kInt8<C>, stages) +
           wide_widened_bytes(HEAD_DIM, kInt8<C>, QB);
  }
}

// Dynamic shared memory of one launch (the tile loop's stages, a fused tree's node area; the
// CUDA-core loop has static arrays only). Above the default 48 KB the kernel must opt in, once per
// device (the attribute is per device), for the largest launch it may see: kMaxStages, or what
// the device allows.
template <typename T, typename C, int HEAD_DIM, int QB, TileSource SRC, bool EPI, bool FUSED = false,
          bool LEAN = kLeanKernels>
cudaError_t prepare_decode_attention(int stages, int& smem_bytes, int tree_nodes = 0) {
  if constexpr (!kTiles<T>) {
    smem_bytes = 0;
    return cudaSuccess;
  } else {
    if (stages < kMinStages || stages > kMaxStages) return cudaErrorInvalidValue;
    smem_bytes = stages_smem_bytes<C, HEAD_DIM, QB>(stages) + tree_node_bytes<C, HEAD_DIM, FUSED>(tree_nodes);
    static std::atomic<uint64_t> opted_in{0};
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
    if (bit != 0 && (opted_in.load(std::memory_order_acquire) & bit)) return cudaSuccess;
    int optin = 0;
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err != cudaSuccess) return err;
    cudaFuncAttributes attr{};
    err = cudaFuncGetAttributes(&attr, kernel_of<T, C, HEAD_DIM, QB, SRC, EPI, FUSED, LEAN>());
    if (err != cudaSuccess) return err;
    const int most = stages_smem_bytes<C, HEAD_DIM, QB>(kMaxStages) + tree_node_bytes<C, HEAD_DIM, FUSED>(kFusedTreeNodes);
    const int allowed = optin - static_cast<int>(attr.sharedSizeBytes);
    err = cudaFuncSetAttribute(kernel_of<T, C, HEAD_DIM, QB, SRC, EPI, FUSED, LEAN>(),
                               cudaFuncAttributeMaxDynamicSharedMemorySize, most < allowed ? most : allowed);
    if (err == cudaSuccess) opted_in.fetch_or(bit, std::memory_order_acq_rel);
    return err;
  }
}

template <typename T, typename C, int HEAD_DIM, int QB, TileSource SRC, bool EPI, bool LEAN = kLeanKernels>
int blocks_per_sm_of(int stages) {
  int smem_bytes = 0;
  int blocks = 0;
  if (prepare_decode_attention<T, C, HEAD_DIM, QB, SRC, EPI, false, LEAN>(stages, smem_bytes) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel_of<T, C, HEAD_DIM, QB, SRC, EPI, false, LEAN>(),
                                                    kKernelThreads<T, C, QB>, smem_bytes) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return blocks;
}

// Blocks of the grid: one per item on the CUDA-core loop; on the tile loop, as many as are
// resident at once (its occupancy at p.sched.stages stages; `resident`: SMs times that, 0 where
// none fits), at most one per item.
template <typename T, typename C, int HEAD_DIM, int QB, TileSource SRC, bool EPI, bool FUSED = false,
          bool LEAN = kLeanKernels>
cudaError_t grid_blocks(const MmhaParams& p, int smem_bytes, int& blocks, int64_t* resident = nullptr) {
  const int64_t items = static_cast<int64_t>(p.rows.batch) * p.num_kv_heads * p.sched.item_groups * p.sched.num_splits;
  if (items > INT32_MAX) return cudaErrorInvalidValue;
  blocks = static_cast<int>(items);
  if constexpr (kTiles<T>) {
    int device = 0, sms = 0, per_sm = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess) {
      err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &per_sm, kernel_of<T, C, HEAD_DIM, QB, SRC, EPI, FUSED, LEAN>(), kKernelThreads<T, C, QB>, smem_bytes);
    }
    if (err != cudaSuccess) return err;
    if (resident != nullptr) *resident = static_cast<int64_t>(sms) * per_sm;
    const int64_t fits = static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1);
    blocks = static_cast<int>(items < fits ? items : fits);
  }
  return cudaSuccess;
}

// A small tree step in one launch (the FUSED twin), where it keeps the plan's grid: the node area
// after the stages must leave the blocks that run at once as they are. Returns cudaErrorNotReady
// (nothing launched) where it does not.
template <typename T, typename C, int HEAD_DIM, int QB, TileSource SRC, bool EPI, bool LEAN = kLeanKernels>
cudaError_t launch_fused_tree(const MmhaParams& p, int blocks, cudaStream_t stream) {
  if constexpr (!kFusedTrees<T, C, QB, EPI>) {
    return cudaErrorNotReady;
  } else {
    if (p.tree.nodes > kFusedTreeNodes) return cudaErrorNotReady;
    int smem_bytes = 0;
    cudaError_t err =
        prepare_decode_attention<T, C, HEAD_DIM, QB, SRC, EPI, true, LEAN>(p.sched.stages, smem_bytes, p.tree.nodes);
    if (err != cudaSuccess) return err;
    int fused_blocks = 0;
    int64_t resident = 0;
    err = grid_blocks<T, C, HEAD_DIM, QB, SRC, EPI, true, LEAN>(p, smem_bytes, fused_blocks, &resident);
    if (err != cudaSuccess) return err;
    if (resident == 0 || fused_blocks != blocks) return cudaErrorNotReady;
    decode_attention_kernel<T, C, HEAD_DIM, QB, SRC, EPI, true, LEAN><<<blocks, kBlockThreads<T>, smem_bytes, stream>>>(p);
    return cudaGetLastError();
  }
}

// A tree step's attention grid: the trees' check and append first (launch_tree_prepare). On sm_90
// the attention grid is launched as its programmatic dependent: its blocks start (barriers,
// descriptor prefetch) as the check's blocks finish and wait for its end (grid_dependency_wait)
// before they read anything.
template <typename T, typename C, int HEAD_DIM, typename Kernel>
cudaError_t launch_after_tree_prepare(Kernel kernel, const MmhaParams& p, int blocks, int threads, int smem_bytes,
                                      cudaStream_t stream) {
  cudaError_t err = launch_tree_prepare<T, C, HEAD_DIM>(p, stream);
  if (err != cudaSuccess) return err;
  int device = 0, major = 0;
  err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = major >= 9 ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

// A paired tree step (ScheduleParams::pair 2): the trees' check and append, then the paired kernel
// as its programmatic dependent (as launch_kernel's tree steps), with the second q area after the
// stages and at most one block an SM.
template <typename T, typename C, int HEAD_DIM, TileSource SRC>
cudaError_t launch_pairs(const MmhaParams& p, cudaStream_t stream) {
  constexpr int QB = kWideColumns;
  const auto kernel = decode_attention_kernel_pairs<T, C, HEAD_DIM, SRC>;
  const int smem_bytes = stages_smem_bytes<C, HEAD_DIM, QB>(p.sched.stages) + wide_pair_q_bytes(HEAD_DIM);
  static std::atomic<uint64_t> opted_in{0};
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit == 0 || !(opted_in.load(std::memory_order_acquire) & bit)) {
    int optin = 0;
    cudaFuncAttributes attr{};
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, kernel);
    if (err == cudaSuccess) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 optin - static_cast<int>(attr.sharedSizeBytes));
    }
    if (err != cudaSuccess) return err;
    opted_in.fetch_or(bit, std::memory_order_acq_rel);
  }
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWidePairThreads, smem_bytes);
  if (err != cudaSuccess) return err;
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  const int64_t items = static_cast<int64_t>(p.rows.batch) * p.num_kv_heads * p.sched.item_groups * p.sched.num_splits;
  const int64_t fits = static_cast<int64_t>(sms) * per_sm;
  const int blocks = static_cast<int>(items < fits ? items : fits);
  if (blocks == 0) return cudaSuccess;
  return launch_after_tree_prepare<T, C, HEAD_DIM>(kernel, p, blocks, kWidePairThreads, smem_bytes, stream);
}

template <typename T, typename C, int HEAD_DIM, int QB, TileSource SRC, bool EPI, bool LEAN = kLeanKernels>
cudaError_t launch_kernel(const MmhaParams& p, cudaStream_t stream) {
  if constexpr (QB == kWideColumns && !EPI && !LEAN && kPairedKernels<T, C, HEAD_DIM>) {
    if (p.sched.pair > 1) {
      if (p.tree.parents == nullptr) return cudaErrorInvalidValue;  // pairs are tree steps' (fill_schedule)
      return launch_pairs<T, C, HEAD_DIM, SRC>(p, stream);
    }
  }
  int smem_bytes = 0;
  cudaError_t err = prepare_decode_attention<T, C, HEAD_DIM, QB, SRC, EPI, false, LEAN>(
      kTiles<T> ? p.sched.stages : kMinStages, smem_bytes);
  if (err != cudaSuccess) return err;
  int blocks = 0;
  err = grid_blocks<T, C, HEAD_DIM, QB, SRC, EPI, false, LEAN>(p, smem_bytes, blocks);
  if (err != cudaSuccess) return err;
  if (blocks == 0) return cudaSuccess;
  if (p.tree.parents == nullptr) {
    const auto kernel = kernel_of<T, C, HEAD_DIM, QB, SRC, EPI, false, LEAN>();
    kernel<<<blocks, kKernelThreads<T, C, QB>, smem_bytes, stream>>>(p);
    return cudaGetLastError();
  }
  if constexpr (kInt4<C>) {
    return cudaErrorInvalidValue;  // int4 tree steps: the host refuses them
  } else if constexpr (LEAN) {
    // A lean unit has the fused twin only: where it does not keep the plan's grid,
    // cudaErrorNotReady (nothing launched) sends the dispatch to the other units' kernels.
    return launch_fused_tree<T, C, HEAD_DIM, QB, SRC, EPI, LEAN>(p, blocks, stream);
  } else {
    err = launch_fused_tree<T, C, HEAD_DIM, QB, SRC, EPI>(p, blocks, stream);
    if (err != cudaErrorNotReady) return err;
    return launch_after_tree_prepare<T, C, HEAD_DIM>(kernel_of<T, C, HEAD_DIM, QB, SRC, EPI>(), p, blocks,
                                                     kKernelThreads<T, C, QB>, smem_bytes, stream);
  }
}

// Bulk tensor copies exist for tile-loop caches whose V rows are whole 128-byte lines.
template <typename C, int HEAD_DIM>
constexpr bool kHasTma = kTiles<C> && !kInt4<C> && v_whole_lines(HEAD_DIM, static_cast<int>(sizeof(C)));

template <typename T, typename C, int HEAD_DIM, int QB, bool EPI, bool LEAN = kLeanKernels>
cudaError_t launch_source(const MmhaParams& params, cudaStream_t stream) {
  if (params.sched.tile_source == TileSource::kTma) {
    if constexpr (kHasTma<C, HEAD_DIM>) {
      return launch_kernel<T, C, HEAD_DIM, QB, TileSource::kTma, EPI, LEAN>(params, stream);
    } else {
      return cudaErrorInvalidValue;
    }
  }
  return launch_kernel<T, C, HEAD_DIM, QB, TileSource::kCpAsync, EPI, LEAN>(params, stream);
}

// Kernels with the output epilogue exist for QB kEpilogueColumns, and for one and
// kEpilogueGroupColumns columns on the tile loop (columns_block in mmha_params.h).
template <typename T, int QB>
constexpr bool kHasEpilogue = QB == kEpilogueColumns || (kTiles<T> && (QB == 1 || QB == kEpilogueGroupColumns));

template <typename T, typename C, int HEAD_DIM, int QB>
cudaError_t launch_decode_attention(const MmhaParams& params, cudaStream_t stream) {
  static_assert(!kLeanKernels || sizeof(T) == 0, "a lean unit instantiates launch_lean_decode_attention only");
  if (params.output.epilogue) {
    if constexpr (kHasEpilogue<T, QB> && !kInt4<C>) return launch_source<T, C, HEAD_DIM, QB, true>(params, stream);
    return cudaErrorInvalidValue;
  }
  return launch_source<T, C, HEAD_DIM, QB, false>(params, stream);
}

// A call lean_call accepts, in a lean unit's kernel (lean_kernels.h): no epilogue; a tree only in
// the fused twin (cudaErrorNotReady, nothing launched, where the twin does not take it).
template <typename T, typename C, int HEAD_DIM, int QB>
cudaError_t launch_lean_decode_attention(const MmhaParams& params, cudaStream_t stream) {
  static_assert(kLeanKernels || sizeof(T) == 0, "lean kernels are instantiated in the lean units only");
  return launch_source<T, C, HEAD_DIM, QB, false, true>(params, stream);
}

template <typename T, typename C, int HEAD_DIM, int QB>
int decode_attention_blocks_per_sm(int stages, TileSource source) {
  static_assert(!kLeanKernels || sizeof(T) == 0, "a lean unit instantiates launch_lean_decode_attention only");
  if (source == TileSource::kTma) {
    if constexpr (kHasTma<C, HEAD_DIM>) return blocks_per_sm_of<T, C, HEAD_DIM, QB, TileSource::kTma, false>(stages);
    return 0;
  }
  return blocks_per_sm_of<T, C, HEAD_DIM, QB, TileSource::kCpAsync, false>(stages);
}

}  // namespace mmha
