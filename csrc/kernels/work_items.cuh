// Work items of a step and the query columns they hold. Torch-free.
//
// A step is cut into items, one per (row, kv head, column block, split). The columns of a (row,
// kv head) are its query heads of every query row: column c is head kvh * G + c % G (G = Hq /
// Hkv) of query row c / G, which is node c / G of a tree step (p.tree.nodes query rows per batch
// row) or the row's one token. An item holds QB consecutive columns (fewer in the last block),
// so a tree's nodes share an item's K/V reads where a group leaves columns free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cache_slots.cuh"
#include "mmha_params.h"
#include "lean_kernels.h"
#include "score_mods.cuh"

namespace mmha {

// One work item: a (row, kv head, column block, split) and its keys [start, end).
// Items are numbered split fastest, then column block, then kv head, then row.
struct WorkItem {
  int b, kvh, qg, split;
  int c0, nh;        // first column of the item, columns it holds (<= QB)
  int h0;            // one-token steps: the query head of column c0 (columns are consecutive heads)
  int pos;           // lengths[b]: the slot of the row's (first) new token
  int nodes;         // new tokens of the row: 1, or a tree's node count
  int newslot;       // the first slot whose K/V the consumers take from shared memory (pos: a one-token
                     // step's, a fused tree's nodes pos .. pos + nodes - 1), or -1 (a tree, attend-only)
  bool bad;          // a refused row: nothing is read or written for it
  bool idle;         // a row that takes no part (row_active): zero output, nothing read or written
  int active;        // splits of this row that hold keys
  int t0, t1;        // grains [t0, t1) of the row
  int start, end;    // keys [start, end)
  int lo;            // the row's first attended slot (a window's start; else 0)
  __device__ __forceinline__ bool busy() const { return !bad && !idle && split < active; }
  // Holds the new token's slot (one-token steps: its item appends it), or a fused tree's node
  // slots up to its end (its items with end > pos append the nodes in their keys).
  __device__ __forceinline__ bool owner() const { return newslot >= 0 && newslot < end; }
  __device__ __forceinline__ int64_t kv_head(int num_kv_heads) const {
    return static_cast<int64_t>(b) * num_kv_heads + kvh;
  }
};

__device__ __forceinline__ int num_items(const MmhaParams& p) {
  return p.rows.batch * p.num_kv_heads * p.sched.item_groups * p.sched.num_splits;
}

// Whether the step is a tree step. FUSED: the fused twin, which runs tree steps only (a lean unit's
// twin too); other kernels of a lean unit run none.
template <bool FUSED>
__device__ __forceinline__ bool tree_step(const MmhaParams& p) {
  return FUSED || (!kLeanKernels && p.tree.parents != nullptr);
}

// n / f.d for 0 <= n < 2^31 (FastDivisor).
__device__ __forceinline__ int fast_div(int n, const FastDivisor& f) {
  return static_cast<int>((__umulhi(static_cast<uint32_t>(n), f.mul) + static_cast<uint32_t>(n)) >> f.shift);
}

// Which (row, kv head, column block, split) item `index` is; no memory is read. A paired wide
// item (ScheduleParams::pair) is column blocks 2 qg and 2 qg + 1 together: its columns are both's,
// its consumers' warpgroups each take one (run_wide_items).
template <int QB>
__device__ __forceinline__ WorkItem work_item_head(const MmhaParams& p, int index) {
  WorkItem w;
  const ScheduleParams& s = p.sched;
  w.b = fast_div(index, s.per_row);
  const int r = index - w.b * static_cast<int>(s.per_row.d);
  const int head_block = fast_div(r, s.splits);
  w.split = r - head_block * s.num_splits;
  w.kvh = fast_div(head_block, s.groups);
  w.qg = head_block - w.kvh * s.item_groups;
  const int qb = QB * s.pair;  // a paired wide item: its pair of column blocks
  w.c0 = w.qg * qb;
  w.h0 = w.kvh * p.group + w.c0;
  w.nh = min(qb, p.group * p.tree.nodes - w.c0);
  return w;
}

// Column g of an item: its query row (b * nodes + node), node and query head.
struct Column {
  int qrow, node, head;
  // Index of the column in out / lse rows of Hq heads ([B * nodes, Hq]).
  __device__ __forceinline__ int64_t flat(int num_heads) const {
    return static_cast<int64_t>(qrow) * num_heads + head;
  }
};

__device__ __forceinline__ Column column_of(const MmhaParams& p, const WorkItem& w, int g) {
  if (p.tree.nodes == 1) return Column{w.b, 0, w.h0 + g};
  // node = c / group without an integer division: (c + 1/2) / group lies at least 1 / (2 group)
  // from an integer, and the float product errs by less than that while c + group < 2^22.
  const int c = w.c0 + g;
  const int node = __float2int_rz((static_cast<float>(c) + 0.5f) * p.inv_group);
  return Column{w.b * p.tree.nodes + node, node, w.kvh * p.group + c - node * p.group};
}

// The item's keys given its row's length pos and new tokens: the row attends to slots lo .. pos +
// nodes - 1 (lo = 0, or a window's start), which lie in ntiles grains (tiles, or warp steps of
// the CUDA-core loop) from the one holding lo; active splits take ntiles - ntiles * (active - s) /
// active .. ntiles - ntiles * (active - s - 1) / active of them: shares that differ by at most one
// grain, the larger ones first, so the last split, which holds the new slots and appends them (a
// fused tree's owner also builds its nodes), takes the smaller share. Splits past the row's grains
// have nothing to do and take no part in the merge. nodes < 1 (a tree refused by its check) or
// slots outside the capacity make the row bad; a row that takes no part (row_takes_part) is idle. An attend-only
// row (kRowAttend) reads slots lo .. pos - 1: its new slot pos lies past the keys, so no item
// owns (appends) it; with no slot in reach the row is idle.
// FUSED: a small tree checked and appended by the attention kernel (its twin, kFusedTrees): its
// items take the nodes' slots from shared memory (newslot pos).
template <bool FUSED = false>
__device__ __forceinline__ void work_item_range(const MmhaParams& p, WorkItem& w, int pos, int nodes, int grain) {
  const int32_t mode = row_mode(p.rows, w.b);
  w.idle = mode == kRowIdle;
  if (w.idle) pos = 0, nodes = 1;  // its length is not looked at
  const int added = mode == kRowAttend ? 0 : nodes;  // new slots the row attends to
  w.pos = pos;
  w.nodes = nodes;
  w.bad = pos < 0 || nodes < 1 || pos > p.cache.max_seq_len - added;
  w.newslot = (!FUSED && tree_step<false>(p)) || mode == kRowAttend ? -1 : pos;
  const int len = w.bad ? 1 : pos + added;
  w.lo = w.bad ? 0 : window_start(p.mods, pos);
  if (!w.bad && len <= w.lo) w.idle = true;  // an attend-only row with no slot in reach
  const int first = w.lo / grain;
  const int ntiles = (len + grain - 1) / grain - first;
  w.active = w.bad ? 0 : min(p.sched.num_splits, ntiles);
  const int act = max(w.active, 1);
  w.t0 = first + ntiles - (act - w.split) * ntiles / act;
  w.t1 = first + ntiles - (act - w.split - 1) * ntiles / act;
  w.start = w.t0 * grain;
  w.end = min(len, w.t1 * grain);
}

// The new tokens of row b: 1 for a one-token step, else the tree's node count (-1: refused).
__device__ __forceinline__ int row_nodes(const MmhaParams& p, int b) { return tree_step<false>(p) ? p.tree.rows[b] : 1; }

// The rotary position of column g's query: pos, or pos + its node's depth (a fused tree's from
// its item slot's depths, else from the workspace).
template <bool FUSED>
__device__ __forceinline__ int query_position(const MmhaParams& p, const WorkItem& w, const Column& c,
                                              const int* slot_depth = nullptr) {
  if (!tree_step<FUSED>(p)) return w.pos;
  return w.pos + (slot_depth != nullptr ? slot_depth[c.node] : p.tree.depth[c.qrow]);
}

}  // namespace mmha
