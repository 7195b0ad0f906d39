// Where a cache slot lives: the seam between the kernels and the caches' storage. Contiguous
// caches hold a (row, kv head)'s slots in one run (k [B, Hkv, D/x, S_max, x], v [B, Hkv, S_max,
// D]); paged caches (mmha.paging) in blocks of bs slots of one pool (k [num_blocks, Hkv, D/x, bs,
// x], v [num_blocks, Hkv, bs, D]), row b's slot t in block block_tables[b][t / bs]. Everything
// that reads or writes a slot (tile sources, the CUDA-core loop, the append) goes through
// HeadSlots. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "mmha_params.h"
#include "lean_kernels.h"
#include "vec.cuh"

namespace mmha {

__device__ __forceinline__ bool paged(const CacheParams& c) { return !kLeanKernels && c.block_tables != nullptr; }

// Whether a block table entry names a block of the pool.
__device__ __forceinline__ bool block_ok(const CacheParams& c, int id) { return id >= 0 && id < c.num_blocks; }

// Row b's mode (row_active; kRowStep for every row without it).
__device__ __forceinline__ int32_t row_mode(const RowParams& r, int b) {
  if constexpr (kLeanKernels) return kRowStep;
  return r.modes == nullptr ? kRowStep : r.modes[b];
}

// Whether row b takes part in the step.
__device__ __forceinline__ bool row_takes_part(const RowParams& r, int b) { return row_mode(r, b) != kRowIdle; }

// One (row, kv head)'s slots in caches of C. For a paged cache, k and v point at the head's part
// of block 0 and a slot's block is added as id * block_stride; contiguous caches have no table
// (pitch S_max, every slot in "block" 0).
template <typename C, int HEAD_DIM>
struct HeadSlots {
  static constexpr int VEC = kVec<C>;
  C* k;
  C* v;
  const int32_t* table;  // the row's block table, or nullptr (contiguous)
  int pitch;             // slots of one K chunk run: S_max, or the block size
  int shift;             // log2 of the block size (paged)
  int64_t block_stride;  // elements between consecutive blocks (paged)

  // The block id of slot t (paged caches; the caller checks it with block_ok).
  __device__ __forceinline__ int block(int t) const { return __ldg(table + (t >> shift)); }
  // Elements from k to chunk c of slot t, and from v to slot t's row, with t in block blk (paged).
  __device__ __forceinline__ int64_t k_at(int blk, int t, int c) const {
    if (table == nullptr) return (static_cast<int64_t>(c) * pitch + t) * VEC;
    return static_cast<int64_t>(blk) * block_stride + (static_cast<int64_t>(c) * pitch + (t & (pitch - 1))) * VEC;
  }
  __device__ __forceinline__ int64_t v_at(int blk, int t) const {
    if (table == nullptr) return static_cast<int64_t>(t) * HEAD_DIM;
    return static_cast<int64_t>(blk) * block_stride + static_cast<int64_t>(t & (pitch - 1)) * HEAD_DIM;
  }
};

// Row b's kv head kvh of caches with num_kv_heads heads.
template <typename C, int HEAD_DIM>
__device__ __forceinline__ HeadSlots<C, HEAD_DIM> head_slots(const CacheParams& c, int num_kv_heads, int b, int kvh) {
  C* k = static_cast<C*>(c.k);
  C* v = static_cast<C*>(c.v);
  if (!paged(c)) {
    // Elements of a slot's K (and V): HEAD_DIM, or an int4 cache's HEAD_DIM / 2 bytes of codes.
    constexpr int64_t SLOT = std::is_same_v<C, u4> ? HEAD_DIM / 2 : HEAD_DIM;
    const int64_t head = (static_cast<int64_t>(b) * num_kv_heads + kvh) * SLOT * c.max_seq_len;
    return {k + head, v + head, nullptr, c.max_seq_len, 0, 0};
  }
  constexpr int64_t SLOT = std::is_same_v<C, u4> ? HEAD_DIM / 2 : HEAD_DIM;
  const int bs = 1 << c.block_shift;
  const int64_t head = static_cast<int64_t>(kvh) * SLOT * bs;  // K and V alike: D * bs per head
  return {k + head, v + head, c.block_tables + static_cast<int64_t>(b) * c.max_blocks, bs, c.block_shift,
          static_cast<int64_t>(num_kv_heads) * SLOT * bs};
}

// One (row, kv head)'s token scales of an int8 cache (CacheParams::k_token_scale /
// v_token_scale: [B, Hkv, S_max], paged [num_blocks, Hkv, bs]): slot t of block blk (0 for a
// contiguous cache) at k[at(blk, t)] and v[at(blk, t)].
struct TokenScales {
  float* k;
  float* v;
  int pitch;             // S_max, or the block size
  int64_t block_stride;  // paged: floats between consecutive blocks; 0: contiguous
  __device__ __forceinline__ int64_t at(int blk, int t) const {
    return block_stride == 0 ? t : static_cast<int64_t>(blk) * block_stride + (t & (pitch - 1));
  }
};

__device__ __forceinline__ TokenScales token_scales(const CacheParams& c, int num_kv_heads, int b, int kvh) {
  if (!paged(c)) {
    const int64_t head = (static_cast<int64_t>(b) * num_kv_heads + kvh) * c.max_seq_len;
    return {c.k_token_scale + head, c.v_token_scale + head, c.max_seq_len, 0};
  }
  const int bs = 1 << c.block_shift;
  const int64_t head = static_cast<int64_t>(kvh) * bs;
  return {c.k_token_scale + head, c.v_token_scale + head, bs, static_cast<int64_t>(num_kv_heads) * bs};
}

// Whether every block of slots [first, last] of a paged row is in the pool (threads tid <
// nthreads each check a share; combine their answers). True for contiguous caches.
template <typename C, int HEAD_DIM>
__device__ __forceinline__ bool blocks_ok(const CacheParams& c, const HeadSlots<C, HEAD_DIM>& s, int first, int last,
                                          int tid, int nthreads) {
  if (s.table == nullptr || last < first) return true;
  bool ok = true;
  for (int e = (first >> s.shift) + tid; e <= (last >> s.shift); e += nthreads) ok = ok && block_ok(c, __ldg(s.table + e));
  return ok;
}

}  // namespace mmha
