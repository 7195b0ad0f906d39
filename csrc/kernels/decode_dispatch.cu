// Runtime dispatch from MmhaParams to a compiled instantiation. Torch-free.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "decode_launch.h"

#define MMHA_STR_(x) #x
#define MMHA_STR(x) MMHA_STR_(x)

namespace mmha {
namespace {

template <typename T, int HEAD_DIM>
cudaError_t dispatch_q_group_block(const MmhaParams& p, cudaStream_t stream) {
  switch (p.q_group_block) {
    case 1: return launch_decode_attention<T, HEAD_DIM, 1>(p, stream);
    case 2: return launch_decode_attention<T, HEAD_DIM, 2>(p, stream);
    case 4: return launch_decode_attention<T, HEAD_DIM, 4>(p, stream);
    case 8: return launch_decode_attention<T, HEAD_DIM, 8>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t dispatch_head_dim(const MmhaParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 32: return dispatch_q_group_block<T, 32>(p, stream);
    case 64: return dispatch_q_group_block<T, 64>(p, stream);
    case 80: return dispatch_q_group_block<T, 80>(p, stream);
    case 96: return dispatch_q_group_block<T, 96>(p, stream);
    case 128: return dispatch_q_group_block<T, 128>(p, stream);
    case 256: return dispatch_q_group_block<T, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t run_decode_attention(const MmhaParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kFloat16: return dispatch_head_dim<__half>(p, stream);
    case DType::kBFloat16: return dispatch_head_dim<__nv_bfloat16>(p, stream);
    case DType::kFloat32: return dispatch_head_dim<float>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

const char* compiled_cuda_archs() {
#ifdef __CUDA_ARCH_LIST__
  return MMHA_STR(__CUDA_ARCH_LIST__);
#else
  return "unknown";
#endif
}

}  // namespace mmha
