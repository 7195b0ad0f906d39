// Bulk-tensor-copy descriptors of the caches for the tile loop's TMA source. Host code,
// torch-free.
#pragma once

#include <cuda_runtime.h>

#include "kernels/mmha_params.h"

namespace mmha {

// Whether the device can run the TMA source (compute capability 9.0 or newer), asked once per
// device.
bool device_has_tma(int device);

// Whether the caches of p fit the tensor maps: head_dim a multiple of 64, S_max a multiple of 32
// (K is seen as groups of 32 keys), coordinates the kernel passes as 32-bit ints.
bool cache_maps_fit(const MmhaParams& p);

// Fills p.k_map (K as 3-d [B * Hkv * D/x chunks][S_max / 32][32 * x], boxes of a whole tile)
// and p.v_map (V as 3-d [B * Hkv][S_max][D], boxes of 64 elements x kTileKeys keys, 128-byte
// swizzle) from p's cache pointers and sizes. cudaErrorNotSupported when the driver has
// no cuTensorMapEncodeTiled, cudaErrorInvalidValue when it rejects the maps.
cudaError_t encode_cache_maps(MmhaParams& p);

// An int4 cache's maps (the cp.async source's bulk tensor copies, int4_tiles.cuh), heads and slots
// being B * Hkv and S_max, or num_blocks * Hkv and the block size: p.k_map (K codes as 3-d [heads *
// D / 32 chunks][slots / 32][32 keys * 16 bytes], boxes of a whole tile) and p.v_map (V codes as
// 2-d [heads * slots][D / 2 bytes], boxes of kTileKeys rows, swizzled by int4_v_swizzle).
// cudaErrorInvalidValue where the coordinates would pass 32-bit ints or the driver rejects the
// maps, cudaErrorNotSupported without cuTensorMapEncodeTiled.
cudaError_t encode_int4_maps(MmhaParams& p);

}  // namespace mmha
