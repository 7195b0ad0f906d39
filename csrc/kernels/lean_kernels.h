// Lean kernels: the units instantiations/*_lean.cu are compiled with MMHA_LEAN_KERNELS=1, and
// their kernels serve one-token steps over contiguous caches with no score modifiers, row modes,
// q/k norms or output epilogue (lean_call). In them the features' predicates (tree_step, paged,
// row_mode, window_start, sink_log2, ScoreTransform::init, the q/k norm's weights) are constant,
// so none of that code is compiled in: at head dim 128, 1,760-2,576 SASS instructions fewer a
// kernel (sm_90a). Every other unit has kLeanKernels false and the kernels of every call.
// Torch-free.
#pragma once

#include "mmha_params.h"

#ifndef MMHA_LEAN_KERNELS
#define MMHA_LEAN_KERNELS 0
#endif

namespace mmha {

constexpr bool kLeanKernels = MMHA_LEAN_KERNELS != 0;

// Whether a call uses none of the features that lean kernels leave out (the dispatch's choice).
inline bool lean_call(const MmhaParams& p) {
  const ScoreModParams& m = p.mods;
  return p.tree.parents == nullptr && p.cache.block_tables == nullptr && p.rows.modes == nullptr &&
         m.alibi_slopes == nullptr && m.sinks == nullptr && m.window == 0 && m.softcap == 0.f &&
         p.qk_norm.q_weight == nullptr && p.qk_norm.k_weight == nullptr && !p.output.epilogue;
}

}  // namespace mmha
