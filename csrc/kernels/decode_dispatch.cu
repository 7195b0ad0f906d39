// Runtime dispatch from MmhaParams to a compiled instantiation. Torch-free.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "decode_launch.h"
#include "lean_kernels.h"
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
#ifdef MMHA_WITHOUT_FP16_U4
template <>
constexpr bool kCompiled<__half, u4> = false;
#endif
#ifdef MMHA_WITHOUT_BF16_U4
template <>
constexpr bool kCompiled<__nv_bfloat16, u4> = false;
#endif

// int4 caches have kernels for head dims of whole 32-channel chunks (the instantiations).
template <typename C, int HEAD_DIM>
constexpr bool kHasHeadDim = !std::is_same_v<C, u4> || HEAD_DIM % kInt4Channels == 0;

// Wide items (tree steps, attend_wide.cuh) exist on the tile loop up to kWideMaxHeadDim.
template <typename C, int HEAD_DIM>
constexpr bool kHasWide = !std::is_same_v<C, float> && !std::is_same_v<C, u4> && HEAD_DIM <= kWideMaxHeadDim;

// Lean kernels (lean_kernels.h) exist for 16-bit activations over 16-bit or int8 caches.
template <typename T, typename C>
constexpr bool kHasLean = !std::is_same_v<T, float> && (std::is_same_v<T, C> || std::is_same_v<C, s8>);

// A query-group block's kernels: the lean units' where lean_call accepts the call, else the others.
template <typename T, typename C, int HEAD_DIM, int QB>
cudaError_t launch_narrow(const MmhaParams& p, cudaStream_t stream) {
  if constexpr (kHasLean<T, C>) {
    if (lean_call(p)) {
      const cudaError_t err = launch_lean_decode_attention<T, C, HEAD_DIM, QB>(p, stream);
      if (err != cudaErrorNotReady) return err;  // (a tree the lean twin does not take: below)
    }
  }
  return launch_decode_attention<T, C, HEAD_DIM, QB>(p, stream);
}

template <typename T, typename C, int HEAD_DIM>
cudaError_t dispatch_q_group_block(const MmhaParams& p, cudaStream_t stream) {
  if constexpr (!kHasHeadDim<C, HEAD_DIM>) {
    return cudaErrorInvalidValue;
  } else {
#define MMHA_CASE(QB) \
  case QB: return launch_narrow<T, C, HEAD_DIM, QB>(p, stream);
    switch (p.sched.q_group_block) {
      MMHA_FOR_EACH_Q_GROUP_BLOCK(MMHA_CASE)
#undef MMHA_CASE
      case kWideColumns:
        if constexpr (kHasWide<C, HEAD_DIM>) return launch_decode_attention<T, C, HEAD_DIM, kWideColumns>(p, stream);
        return cudaErrorInvalidValue;
      default: return cudaErrorInvalidValue;
    }
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
  if constexpr (!kHasHeadDim<C, HEAD_DIM>) {
    return 0;
  } else {
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

template <typename X>
struct Type {
  using type = X;
};

// f(Type<T>{}, Type<C>{}) for the qkv element type T and cache element type C of `dtype` over
// `cache_dtype` (the one mapping of the three entry points below); `none` for a pair with no kernels.
template <typename R, typename F>
R with_types(DType dtype, DType cache_dtype, R none, F f) {
  const bool fp8 = cache_dtype == DType::kFloat8E4M3;
  const bool int8 = cache_dtype == DType::kInt8;
  const bool int4 = cache_dtype == DType::kInt4;
  if (!fp8 && !int8 && !int4 && cache_dtype != dtype) return none;
  switch (dtype) {
    case DType::kFloat16:
      return fp8    ? f(Type<__half>{}, Type<e4m3>{})
             : int8 ? f(Type<__half>{}, Type<s8>{})
             : int4 ? f(Type<__half>{}, Type<u4>{})
                    : f(Type<__half>{}, Type<__half>{});
    case DType::kBFloat16:
      return fp8    ? f(Type<__nv_bfloat16>{}, Type<e4m3>{})
             : int8 ? f(Type<__nv_bfloat16>{}, Type<s8>{})
             : int4 ? f(Type<__nv_bfloat16>{}, Type<u4>{})
                    : f(Type<__nv_bfloat16>{}, Type<__nv_bfloat16>{});
    case DType::kFloat32: return fp8 || int8 || int4 ? none : f(Type<float>{}, Type<float>{});
    default: return none;
  }
}

}  // namespace

int decode_blocks_per_sm(DType dtype, DType cache_dtype, int head_dim, int q_group_block, int stages,
                         TileSource source) {
  return with_types(dtype, cache_dtype, 0, [&](auto t, auto c) {
    return occupancy_head_dim<typename decltype(t)::type, typename decltype(c)::type>(head_dim, q_group_block,
                                                                                       stages, source);
  });
}

bool decode_kernels_compiled(DType dtype, DType cache_dtype) {
  return with_types(dtype, cache_dtype, false,
                    [](auto t, auto c) { return kCompiled<typename decltype(t)::type, typename decltype(c)::type>; });
}

cudaError_t run_decode_attention(const MmhaParams& p, cudaStream_t stream) {
  return with_types(p.dtype, p.cache.dtype, cudaErrorInvalidValue, [&](auto t, auto c) {
    return dispatch_head_dim<typename decltype(t)::type, typename decltype(c)::type>(p, stream);
  });
}

const char* compiled_cuda_archs() {
#ifdef __CUDA_ARCH_LIST__
  return MMHA_STR(__CUDA_ARCH_LIST__);
#else
  return "unknown";
#endif
}

}  // namespace mmha
