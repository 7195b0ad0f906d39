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

}  // namespace mmha
