#include "tma_maps.h"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <atomic>
#include <climits>
#include <cstdint>

namespace mmha {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  // The driver entry point through the runtime: no link against libcuda.
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      ptr = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

}  // namespace

bool device_has_tma(int device) {
  // 0: not asked yet, 1: no, 2: yes (one entry per device index below 64).
  static std::atomic<uint8_t> known[64] = {};
  if (device < 0 || device >= 64) return false;
  uint8_t v = known[device].load(std::memory_order_acquire);
  if (v == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    v = major >= 9 ? 2 : 1;
    known[device].store(v, std::memory_order_release);
  }
  return v == 2;
}

bool cache_maps_fit(const MmhaParams& p) {
  if (p.cache.block_tables != nullptr) {  // pages: the V map's rows (num_blocks * Hkv * bs) in an int
    const int64_t rows = static_cast<int64_t>(p.cache.num_blocks) * p.num_kv_heads << p.cache.block_shift;
    const int64_t k_rows = static_cast<int64_t>(p.cache.num_blocks) * p.num_kv_heads * p.head_dim * elem_bytes(p.cache.dtype) / 16;
    return tma_head_dim(p.cache.dtype, p.head_dim) && rows < INT_MAX && k_rows < INT_MAX;
  }
  const int64_t x = 8;  // 16-bit elements per 16-byte chunk
  const int64_t heads = static_cast<int64_t>(p.rows.batch) * p.num_kv_heads;
  const int64_t row_bytes = static_cast<int64_t>(p.head_dim) * elem_bytes(p.cache.dtype);
  return tma_head_dim(p.cache.dtype, p.head_dim) && p.cache.max_seq_len % 32 == 0 &&
         static_cast<int64_t>(p.cache.max_seq_len) * x < INT_MAX && heads * (row_bytes / 16) < INT_MAX;
}

cudaError_t encode_cache_maps(MmhaParams& p) {
  // L2 promotion of 128 bytes (none measured the same): 256 ran B=16 Hkv=32 S=8192 at 517 us
  // against 490 on the H200 (decode timing), the lines it pulls in ahead are not the next ones read.
  constexpr CUtensorMapL2promotion promo = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  // Every cache is seen as 16-bit elements (the copies move bytes): x = 8 of them per 16-byte
  // chunk, d of them per V row (head_dim for 16-bit caches, head_dim / 2 for fp8).
  const cuuint64_t x = 8, elem = 2;
  const cuuint64_t d = static_cast<cuuint64_t>(p.head_dim) * elem_bytes(p.cache.dtype) / elem;
  const cuuint64_t smax = static_cast<cuuint64_t>(p.cache.max_seq_len);
  const cuuint64_t heads = static_cast<cuuint64_t>(p.rows.batch) * static_cast<cuuint64_t>(p.num_kv_heads);
  const cuuint32_t ones[3] = {1, 1, 1};

  if (p.cache.block_tables != nullptr) {
    // Pages: V [num_blocks, Hkv, bs, D] as rows of d elements (tile_source.cuh). Blocks of >= 64
    // slots: a box of one 128-byte line by 64 rows. Smaller blocks: the lines as a third
    // dimension (stride 128 bytes, under the rows' stride), so that one box of all lines of bs
    // rows lands line after line, a stage's V group; their K goes by plain bulk copies, and the
    // K map's place holds the same view with one line per box (wide items' whole-tile groups).
    const cuuint64_t rows = static_cast<cuuint64_t>(p.cache.num_blocks) * p.num_kv_heads << p.cache.block_shift;
    const bool small = p.cache.block_shift < 6;
    const cuuint64_t v_dims[3] = {64, rows, d / 64};
    const cuuint64_t v_strides[2] = {d * elem, 64 * elem};
    const cuuint32_t v_box[3] = {64, static_cast<cuuint32_t>(small ? 1 << p.cache.block_shift : 64),
                                 static_cast<cuuint32_t>(d / 64)};
    const cuuint64_t v_dims2[2] = {d, rows};
    CUresult r = encode(&p.v_map, CU_TENSOR_MAP_DATA_TYPE_UINT16, small ? 3 : 2, p.cache.v, small ? v_dims : v_dims2,
                        v_strides, v_box, ones, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promo,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r == CUDA_SUCCESS && small) {
      const cuuint32_t line_box[3] = {64, v_box[1], 1};
      r = encode(&p.k_map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, p.cache.v, v_dims, v_strides, line_box, ones,
                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promo, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    }
    if (r != CUDA_SUCCESS || small) return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
    // Blocks of >= 64 slots: K [num_blocks, Hkv, D/x, bs, x] as the contiguous map with bs for
    // S_max, so a tile (64 keys of one block) is one box, as in the contiguous case.
    const cuuint64_t bs = cuuint64_t{1} << p.cache.block_shift;
    const cuuint64_t k_rows = static_cast<cuuint64_t>(p.cache.num_blocks) * p.num_kv_heads * (d / x);
    const cuuint64_t k_dims[3] = {32 * x, bs / 32, k_rows};
    const cuuint64_t k_strides[2] = {32 * x * elem, bs * x * elem};
    const cuuint32_t k_box[3] = {32 * static_cast<cuuint32_t>(x), static_cast<cuuint32_t>(kTileKeys / 32),
                                 static_cast<cuuint32_t>(d / x)};
    r = encode(&p.k_map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, p.cache.k, k_dims, k_strides, k_box, ones,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, promo, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
  }

  // K [B, Hkv, D/x, S_max, x]: each (row, kv head, chunk) is S_max * x contiguous elements, seen
  // as S_max / 32 groups of 32 keys (S_max % 32 == 0: cache_maps_fit), so one box of 2 groups x
  // all chunks is a whole tile, each chunk's 1 KB contiguous. Groups past S_max are zero-filled.
  const cuuint64_t k_dims[3] = {32 * x, smax / 32, heads * (d / x)};
  const cuuint64_t k_strides[2] = {32 * x * elem, smax * x * elem};
  const cuuint32_t k_box[3] = {32 * static_cast<cuuint32_t>(x), static_cast<cuuint32_t>(kTileKeys / 32),
                               static_cast<cuuint32_t>(d / x)};
  CUresult r = encode(&p.k_map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, p.cache.k, k_dims, k_strides, k_box, ones,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, promo,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return cudaErrorInvalidValue;

  // V [B, Hkv, S_max, D]: keys past S_max fall outside dim 1 and are zero-filled.
  const cuuint64_t v_dims[3] = {d, smax, heads};
  const cuuint64_t v_strides[2] = {d * elem, smax * d * elem};
  const cuuint32_t v_box[3] = {64, static_cast<cuuint32_t>(kTileKeys), 1};
  r = encode(&p.v_map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, p.cache.v, v_dims, v_strides, v_box, ones,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promo,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t encode_int4_maps(MmhaParams& p) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const bool paged = p.cache.block_tables != nullptr;
  const cuuint64_t heads = static_cast<cuuint64_t>(paged ? p.cache.num_blocks : p.rows.batch) * p.num_kv_heads;
  const cuuint64_t slots = paged ? cuuint64_t{1} << p.cache.block_shift : static_cast<cuuint64_t>(p.cache.max_seq_len);
  const cuuint64_t chunks = static_cast<cuuint64_t>(p.head_dim) / kInt4Channels;
  const cuuint64_t row = static_cast<cuuint64_t>(p.head_dim) / 2;  // bytes of a V row
  if (heads * slots >= INT_MAX || heads * chunks >= INT_MAX) return cudaErrorInvalidValue;
  // The codes as 16-bit elements (the copies move bytes), as encode_cache_maps sees every cache.
  const cuuint64_t elem = 2;
  const cuuint32_t ones[3] = {1, 1, 1};
  constexpr CUtensorMapL2promotion promo = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
  const cuuint64_t k_dims[3] = {32 * 16 / elem, slots / 32, heads * chunks};
  const cuuint64_t k_strides[2] = {32 * 16, slots * 16};
  const cuuint32_t k_box[3] = {32 * 16 / elem, kTileKeys / 32, static_cast<cuuint32_t>(chunks)};
  CUresult r = encode(&p.k_map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, p.cache.k, k_dims, k_strides, k_box, ones,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, promo, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return cudaErrorInvalidValue;
  const int swizzle = int4_v_swizzle(p.head_dim);
  const CUtensorMapSwizzle mode = swizzle == 128 ? CU_TENSOR_MAP_SWIZZLE_128B
                                  : swizzle == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                  : swizzle == 32 ? CU_TENSOR_MAP_SWIZZLE_32B
                                                  : CU_TENSOR_MAP_SWIZZLE_NONE;
  const cuuint64_t v_dims[2] = {row / elem, heads * slots};
  const cuuint64_t v_strides[1] = {row};
  const cuuint32_t v_box[2] = {static_cast<cuuint32_t>(row / elem), kTileKeys};
  r = encode(&p.v_map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, p.cache.v, v_dims, v_strides, v_box, ones,
             CU_TENSOR_MAP_INTERLEAVE_NONE, mode, promo, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace mmha
