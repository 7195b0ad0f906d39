// Host-side entry points of the decode kernels. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include "mmha_params.h"

namespace mmha {

// One instantiation per (element type, head dim, query heads per block); defined in
// decode_attention.cuh, instantiated in instantiations/*.cu.
template <typename T, int HEAD_DIM, int Q_GROUP_BLOCK>
cudaError_t launch_decode_attention(const MmhaParams& params, cudaStream_t stream);

// Resident blocks of `warps` warps per SM of one instantiation on the current device (0 if it
// cannot run, or does not run blocks of that size).
template <typename T, int HEAD_DIM, int Q_GROUP_BLOCK>
int decode_attention_blocks_per_sm(int warps);

// Same, dispatched at run time; 0 for an unsupported combination.
int decode_blocks_per_sm(DType dtype, int head_dim, int q_group_block, int warps);

// Dispatches on params.dtype, params.head_dim and params.q_group_block, then launches blocks of
// params.warps warps.
// Returns cudaErrorInvalidValue for an unsupported combination (the op validates before).
cudaError_t run_decode_attention(const MmhaParams& params, cudaStream_t stream);

// Space-separated list of the SM architectures this library holds device code for, e.g. "80 90".
const char* compiled_cuda_archs();

}  // namespace mmha
