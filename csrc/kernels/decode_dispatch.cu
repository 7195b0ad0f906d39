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

// The kernel sets this build holds (setup.py's KERNEL_SETS; a diagnostic build with MMHA_KERNELS
// leaves some out and defines MMHA_WITHOUT_<SET>): a set left out dispatches to nothing, so its
// instantiations are not referenced.
template <typename T, typename C>
constexpr bool kCompiled = true;
#ifdef MMHA_WITHOUT_FP16
template <>
constexpr bool kCompiled<__half, __half> = false;
#endif
#ifdef MMHA_WITHOUT_BF16
template <>
constexpr bool kCompiled<__nv_bfloat16, __nv_bfloat16> = false;
#endif
#ifdef MMHA_WITHOUT_FP32
template <>
constexpr bool kCompiled<float, float> = false;
#endif
#ifdef MMHA_WITHOUT_FP16_E4M3
template <>
constexpr bool kCompiled<__half, e4m3> = false;
#endif
#ifdef MMHA_WITHOUT_BF16_E4M3
template <>
constexpr bool kCompiled<__nv_bfloat16, e4m3> = false;
#endif
#ifdef MMHA_WITHOUT_FP16_S8
template <>
constexpr bool kCompiled<__half, s8> = false;
#endif
#ifdef MMHA_WITHOUT_BF16_S8
template <>
constexpr bool kCompiled<__nv_bfloat16, s8> = false;
#endif

// Wide items (tree steps, attend_wide.cuh) exist on the tile loop up to kWideMaxHeadDim.
// (int8 caches: one-token steps only, so narrow items.)
template <typename C, int HEAD_DIM>
constexpr bool kHasWide = !std::is_same_v<C, float> && !std::is_same_v<C, s8> && HEAD_DIM <= kWideMaxHeadDim;

template <typename T, typename C, int HEAD_DIM>
cudaError_t dispatch_q_group_block(const MmhaParams& p, cudaStream_t stream) {
#define MMHA_CASE(QB) \
  case QB: return launch_decode_attention<T, C, HEAD_DIM, QB>(p, stream);
  switch (p.sched.q_group_block) {
    MMHA_FOR_EACH_Q_GROUP_BLOCK(MMHA_CASE)
#undef MMHA_CASE
    case kWideColumns:
      if constexpr (kHasWide<C, HEAD_DIM>) return launch_decode_attention<T, C, HEAD_DIM, kWideColumns>(p, stream);
      return cudaErrorInvalidValue;
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, typename C>
cudaError_t dispatch_head_dim(const MmhaParams& p, cudaStream_t stream) {
  if constexpr (!kCompiled<T, C>) {
    return cudaErrorNotSupported;
  } else {
#define MMHA_CASE(D) \
  case D: return dispatch_q_group_block<T, C, D>(p, stream);
    switch (p.head_dim) {
      MMHA_FOR_EACH_HEAD_DIM(MMHA_CASE)
#undef MMHA_CASE
      default: return cudaErrorInvalidValue;
    }
  }
}

template <typename T, typename C, int HEAD_DIM>
int occupancy_q_group_block(int q_group_block, int stages, TileSource source) {
#define MMHA_CASE(QB) \
  case QB: return decode_attention_blocks_per_sm<T, C, HEAD_DIM, QB>(stages, source);
  switch (q_group_block) {
    MMHA_FOR_EACH_Q_GROUP_BLOCK(MMHA_CASE)
#undef MMHA_CASE
    case kWideColumns:
      if constexpr (kHasWide<C, HEAD_DIM>) return decode_attention_blocks_per_sm<T, C, HEAD_DIM, kWideColumns>(stages, source);
      return 0;
    default: return 0;
  }
}

template <typename T, typename C>
int occupancy_head_dim(int head_dim, int q_group_block, int stages, TileSource source) {
  if constexpr (!kCompiled<T, C>) {
    return 0;
  } else {
#define MMHA_CASE(D) \
  case D: return occupancy_q_group_block<T, C, D>(q_group_block, stages, source);
    switch (head_dim) {
      MMHA_FOR_EACH_HEAD_DIM(MMHA_CASE)
#undef MMHA_CASE
      default: return 0;
    }
  }
}

// Whether this build holds the kernels of activations T over caches C.
template <typename T, typename C>
bool compiled_set() {
  return kCompiled<T, C>;
}

}  // namespace

int decode_blocks_per_sm(DType dtype, DType cache_dtype, int head_dim, int q_group_block, int stages,
                         TileSource source) {
  const bool fp8 = cache_dtype == DType::kFloat8E4M3;
  const bool int8 = cache_dtype == DType::kInt8;
  if (!fp8 && !int8 && cache_dtype != dtype) return 0;
  switch (dtype) {
    case DType::kFloat16:
      return fp8    ? occupancy_head_dim<__half, e4m3>(head_dim, q_group_block, stages, source)
             : int8 ? occupancy_head_dim<__half, s8>(head_dim, q_group_block, stages, source)
                    : occupancy_head_dim<__half, __half>(head_dim, q_group_block, stages, source);
    case DType::kBFloat16:
      return fp8    ? occupancy_head_dim<__nv_bfloat16, e4m3>(head_dim, q_group_block, stages, source)
             : int8 ? occupancy_head_dim<__nv_bfloat16, s8>(head_dim, q_group_block, stages, source)
                    : occupancy_head_dim<__nv_bfloat16, __nv_bfloat16>(head_dim, q_group_block, stages, source);
    case DType::kFloat32:
      return fp8 || int8 ? 0 : occupancy_head_dim<float, float>(head_dim, q_group_block, stages, source);
    default: return 0;
  }
}

bool decode_kernels_compiled(DType dtype, DType cache_dtype) {
  const bool fp8 = cache_dtype == DType::kFloat8E4M3;
  const bool int8 = cache_dtype == DType::kInt8;
  if (!fp8 && !int8 && cache_dtype != dtype) return false;
  switch (dtype) {
    case DType::kFloat16:
      return fp8 ? compiled_set<__half, e4m3>() : int8 ? compiled_set<__half, s8>() : compiled_set<__half, __half>();
    case DType::kBFloat16:
      return fp8    ? compiled_set<__nv_bfloat16, e4m3>()
             : int8 ? compiled_set<__nv_bfloat16, s8>()
                    : compiled_set<__nv_bfloat16, __nv_bfloat16>();
    case DType::kFloat32: return !fp8 && !int8 && compiled_set<float, float>();
    default: return false;
  }
}

cudaError_t run_decode_attention(const MmhaParams& p, cudaStream_t stream) {
  const bool fp8 = p.cache.dtype == DType::kFloat8E4M3;
  const bool int8 = p.cache.dtype == DType::kInt8;
  if (!fp8 && !int8 && p.cache.dtype != p.dtype) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat16:
      return fp8    ? dispatch_head_dim<__half, e4m3>(p, stream)
             : int8 ? dispatch_head_dim<__half, s8>(p, stream)
                    : dispatch_head_dim<__half, __half>(p, stream);
    case DType::kBFloat16:
      return fp8    ? dispatch_head_dim<__nv_bfloat16, e4m3>(p, stream)
             : int8 ? dispatch_head_dim<__nv_bfloat16, s8>(p, stream)
                    : dispatch_head_dim<__nv_bfloat16, __nv_bfloat16>(p, stream);
    case DType::kFloat32: return fp8 || int8 ? cudaErrorInvalidValue : dispatch_head_dim<float, float>(p, stream);
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
