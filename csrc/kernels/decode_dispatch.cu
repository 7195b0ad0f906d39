// Runtime dispatch from MmhaParams to a compiled instantiation. Torch-free.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "decode_launch.h"
#include "vec.cuh"

#define MMHA_STR_(...) #__VA_ARGS__
#define MMHA_STR(...) MMHA_STR_(__VA_ARGS__)

namespace mmha {
namespace {

// Wide items (tree steps, attend_wide.cuh) exist on the tile loop up to kWideMaxHeadDim.
template <typename C, int HEAD_DIM>
constexpr bool kHasWide = !std::is_same_v<C, float> && HEAD_DIM <= kWideMaxHeadDim;

template <typename T, typename C, int HEAD_DIM>
cudaError_t dispatch_q_group_block(const MmhaParams& p, cudaStream_t stream) {
  switch (p.q_group_block) {
    case 1: return launch_decode_attention<T, C, HEAD_DIM, 1>(p, stream);
    case 2: return launch_decode_attention<T, C, HEAD_DIM, 2>(p, stream);
    case 4: return launch_decode_attention<T, C, HEAD_DIM, 4>(p, stream);
    case 8: return launch_decode_attention<T, C, HEAD_DIM, 8>(p, stream);
    case kWideColumns:
      if constexpr (kHasWide<C, HEAD_DIM>) return launch_decode_attention<T, C, HEAD_DIM, kWideColumns>(p, stream);
      return cudaErrorInvalidValue;
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, typename C>
cudaError_t dispatch_head_dim(const MmhaParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 32: return dispatch_q_group_block<T, C, 32>(p, stream);
    case 64: return dispatch_q_group_block<T, C, 64>(p, stream);
    case 80: return dispatch_q_group_block<T, C, 80>(p, stream);
    case 96: return dispatch_q_group_block<T, C, 96>(p, stream);
    case 128: return dispatch_q_group_block<T, C, 128>(p, stream);
    case 256: return dispatch_q_group_block<T, C, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, typename C, int HEAD_DIM>
int occupancy_q_group_block(int q_group_block, int stages, TileSource source) {
  switch (q_group_block) {
    case 1: return decode_attention_blocks_per_sm<T, C, HEAD_DIM, 1>(stages, source);
    case 2: return decode_attention_blocks_per_sm<T, C, HEAD_DIM, 2>(stages, source);
    case 4: return decode_attention_blocks_per_sm<T, C, HEAD_DIM, 4>(stages, source);
    case 8: return decode_attention_blocks_per_sm<T, C, HEAD_DIM, 8>(stages, source);
    case kWideColumns:
      if constexpr (kHasWide<C, HEAD_DIM>) return decode_attention_blocks_per_sm<T, C, HEAD_DIM, kWideColumns>(stages, source);
      return 0;
    default: return 0;
  }
}

template <typename T, typename C>
int occupancy_head_dim(int head_dim, int q_group_block, int stages, TileSource source) {
  switch (head_dim) {
    case 32: return occupancy_q_group_block<T, C, 32>(q_group_block, stages, source);
    case 64: return occupancy_q_group_block<T, C, 64>(q_group_block, stages, source);
    case 80: return occupancy_q_group_block<T, C, 80>(q_group_block, stages, source);
    case 96: return occupancy_q_group_block<T, C, 96>(q_group_block, stages, source);
    case 128: return occupancy_q_group_block<T, C, 128>(q_group_block, stages, source);
    case 256: return occupancy_q_group_block<T, C, 256>(q_group_block, stages, source);
    default: return 0;
  }
}

}  // namespace

int decode_blocks_per_sm(DType dtype, DType cache_dtype, int head_dim, int q_group_block, int stages,
                         TileSource source) {
  const bool fp8 = cache_dtype == DType::kFloat8E4M3;
  if (!fp8 && cache_dtype != dtype) return 0;
  switch (dtype) {
    case DType::kFloat16:
      return fp8 ? occupancy_head_dim<__half, e4m3>(head_dim, q_group_block, stages, source)
                 : occupancy_head_dim<__half, __half>(head_dim, q_group_block, stages, source);
    case DType::kBFloat16:
      return fp8 ? occupancy_head_dim<__nv_bfloat16, e4m3>(head_dim, q_group_block, stages, source)
                 : occupancy_head_dim<__nv_bfloat16, __nv_bfloat16>(head_dim, q_group_block, stages, source);
    case DType::kFloat32: return fp8 ? 0 : occupancy_head_dim<float, float>(head_dim, q_group_block, stages, source);
    default: return 0;
  }
}

cudaError_t run_decode_attention(const MmhaParams& p, cudaStream_t stream) {
  const bool fp8 = p.cache_dtype == DType::kFloat8E4M3;
  if (!fp8 && p.cache_dtype != p.dtype) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat16: return fp8 ? dispatch_head_dim<__half, e4m3>(p, stream) : dispatch_head_dim<__half, __half>(p, stream);
    case DType::kBFloat16:
      return fp8 ? dispatch_head_dim<__nv_bfloat16, e4m3>(p, stream)
                 : dispatch_head_dim<__nv_bfloat16, __nv_bfloat16>(p, stream);
    case DType::kFloat32: return fp8 ? cudaErrorInvalidValue : dispatch_head_dim<float, float>(p, stream);
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
