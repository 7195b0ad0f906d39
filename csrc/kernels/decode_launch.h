// Host-side entry points of the decode kernels. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include "mmha_params.h"

namespace mmha {

// One instantiation per (qkv element type T, cache element type C, head dim, query heads per
// block); defined in decode_attention.cuh, instantiated in instantiations/*.cu. Launches
// params.tile_source's kernel (fp16 / bf16 / fp8 caches) with params.stages stages, or the
// CUDA-core kernel (fp32).
template <typename T, typename C, int HEAD_DIM, int Q_GROUP_BLOCK>
cudaError_t launch_decode_attention(const MmhaParams& params, cudaStream_t stream);

// The same for a call lean_call accepts (lean_kernels.h), in the lean units' kernels
// (instantiations/*_lean.cu: 16-bit caches, query-group blocks up to 8).
template <typename T, typename C, int HEAD_DIM, int Q_GROUP_BLOCK>
cudaError_t launch_lean_decode_attention(const MmhaParams& params, cudaStream_t stream);

// Resident blocks per SM of one instantiation with `stages` stages on the current device (0 if it
// cannot run there, or has no kernel for that tile source).
template <typename T, typename C, int HEAD_DIM, int Q_GROUP_BLOCK>
int decode_attention_blocks_per_sm(int stages, TileSource source);

// Same, dispatched at run time; 0 for an unsupported combination.
int decode_blocks_per_sm(DType dtype, DType cache_dtype, int head_dim, int q_group_block, int stages,
                         TileSource source);

// Whether this build holds the kernels of `dtype` activations over `cache_dtype` caches (a
// diagnostic build with MMHA_KERNELS holds some sets only; setup.py).
bool decode_kernels_compiled(DType dtype, DType cache_dtype);

// Dispatches on params.dtype, params.cache_dtype, params.head_dim and params.q_group_block.
// Returns cudaErrorInvalidValue for an unsupported combination (the op validates before),
// cudaErrorNotSupported for a kernel set this build left out.
cudaError_t run_decode_attention(const MmhaParams& params, cudaStream_t stream);

// Space-separated list of the SM architectures this library holds device code for, e.g. "80 90".
const char* compiled_cuda_archs();

}  // namespace mmha
