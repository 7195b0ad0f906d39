// Lean kernels: the units instantiations/*_lean.cu (16-bit activations over 16-bit or int8
// caches: table.py's LEAN_KINDS) are compiled with MMHA_LEAN_KERNELS=1, and their kernels serve
// steps over contiguous caches with no score modifiers, row modes, q/k norms or output epilogue
// (lean_call): one-token steps, and small trees in the fused twin. In them the features'
// predicates (paged, row_mode, window_start, sink_log2, ScoreTransform::init, the q/k norm's
// weights) are constant, and so is tree_step (false, the twin's true), so none of that code is
// compiled in: at head dim 128, 1,760-2,576 SASS instructions fewer a 16-bit kernel, 1,088-3,072
// fewer an int8 one (sm_90a).
// A tree the twin does not take (more than kFusedTreeNodes nodes, or a grid the node area would
// change) goes to the other units, whose kernels have every feature: every other unit has
// kLeanKernels false. Torch-free.
#pragma once

#include "mmha_params.h"

#ifndef MMHA_LEAN_KERNELS
#define MMHA_LEAN_KERNELS 0
#endif

namespace mmha {

constexpr bool kLeanKernels = MMHA_LEAN_KERNELS != 0;

// Whether a call uses none of the features that lean kernels leave out (the dispatch's choice; a
// tree of up to kFusedTreeNodes nodes may still go to the other units: launch_fused_tree).
inline bool lean_call(const MmhaParams& p) {
  const ScoreModParams& m = p.mods;
  return (p.tree.parents == nullptr || p.tree.nodes <= kFusedTreeNodes) && p.cache.block_tables == nullptr &&
         p.rows.modes == nullptr && m.alibi_slopes == nullptr && m.sinks == nullptr && m.window == 0 &&
         m.softcap == 0.f &&
         p.qk_norm.q_weight == nullptr && p.qk_norm.k_weight == nullptr && !p.output.epilogue;
}

}  // namespace mmha
