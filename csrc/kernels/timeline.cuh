// Where a launch's time goes, block by block: an MMHA_TIMELINE build (setup.py, MMHA_TIMELINE=1)
// stamps each tile-loop block's events (TimelineEvent, mmha_params.h) into MmhaParams::timeline;
// mmha/bench/timeline.py (bench/timeline.sh) reads and summarises them. In every other build
// timeline_mark is empty and the kernels are what they are without it. Torch-free.
#pragma once

#include <cstdint>

#include "mmha_params.h"

namespace mmha {

// Event e of this block at the current time (called by one thread of the block per event).
__device__ __forceinline__ void timeline_mark(const MmhaParams& p, int e) {
#ifdef MMHA_TIMELINE
  if (p.timeline != nullptr && static_cast<int>(blockIdx.x) < p.timeline_blocks) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    p.timeline[static_cast<int64_t>(blockIdx.x) * kTimelineEvents + e] = t;
  }
#else
  (void)p;
  (void)e;
#endif
}

// Event e of the block's item seq (counted from 0) at the current time: the first item's at e,
// the second's at kTlSecond + e, later items' not at all.
__device__ __forceinline__ void timeline_item(const MmhaParams& p, int seq, int e) {
#ifdef MMHA_TIMELINE
  if (seq < 2) timeline_mark(p, seq == 0 ? e : kTlSecond + e);
#else
  (void)p;
  (void)seq;
  (void)e;
#endif
}

// As timeline_item, the time read once `dep` (a value loaded from memory) has arrived: the timer
// read is predicated on a test of dep, so it waits for the load as a use of dep would.
__device__ __forceinline__ void timeline_item_after(const MmhaParams& p, int seq, int e, int dep) {
#ifdef MMHA_TIMELINE
  if (seq < 2 && p.timeline != nullptr && static_cast<int>(blockIdx.x) < p.timeline_blocks) {
    uint64_t t;
    asm volatile(
        "{\n\t.reg .pred q;\n\tsetp.ne.s32 q, %1, -1;\n\t@q mov.u64 %0, %%globaltimer;\n\t"
        "@!q mov.u64 %0, %%globaltimer;\n\t}"
        : "=l"(t)
        : "r"(dep)
        : "memory");
    p.timeline[static_cast<int64_t>(blockIdx.x) * kTimelineEvents + (seq == 0 ? e : kTlSecond + e)] = t;
  }
#else
  (void)p;
  (void)seq;
  (void)e;
  (void)dep;
#endif
}

// Event e of this block set to a value, not a time (kTlRole).
__device__ __forceinline__ void timeline_value(const MmhaParams& p, int e, uint64_t v) {
#ifdef MMHA_TIMELINE
  if (p.timeline != nullptr && static_cast<int>(blockIdx.x) < p.timeline_blocks) {
    p.timeline[static_cast<int64_t>(blockIdx.x) * kTimelineEvents + e] = v;
  }
#else
  (void)p;
  (void)e;
  (void)v;
#endif
}

// kTlRole's value for an item: 1 | split << 1 | owner << 8 | merged << 9 | grains << 10
// (mmha/bench/timeline.py reads it).
__device__ __forceinline__ uint64_t timeline_role(int split, bool owner, bool merged, int grains) {
  return 1u | static_cast<uint64_t>(split & 0x7f) << 1 | static_cast<uint64_t>(owner) << 8 |
         static_cast<uint64_t>(merged) << 9 | static_cast<uint64_t>(grains) << 10;
}

}  // namespace mmha
