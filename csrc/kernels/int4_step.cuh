// An int4 cache's step around the tile loop (mmha/int4.py; one-token steps): the new token
// quantised with the item's q, the row's last K group into the item's residual area (quantised
// and committed on the step that completes it), and the append. Torch-free.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attend_common.cuh"
#include "attend_int4.cuh"
#include "int4_tiles.cuh"
#include "mmha_params.h"
#include "vec.cuh"
#include "work_items.cuh"

namespace mmha {

// Whether item w holds a stepping row's new token (its keys end at slot pos + 1). Told by its
// range, not by newslot, which the consumers set for attend-only rows too.
__device__ __forceinline__ bool int4_appends(const WorkItem& w) { return w.end == w.pos + 1; }

// The first key of the tile an int4 item reads from its residual area, or -1: the row's last
// group (a stepping row's: the new token's), unless every attended slot is committed (an
// attend-only row, keys [lo, pos), whose length is a whole number of groups). Only the item that
// holds the row's last key has it (other items' keys end at a whole tile before pos).
__device__ __forceinline__ int int4_residual_tile(const WorkItem& w) {
  if (int4_appends(w) || (w.end == w.pos && w.pos % kInt4Group != 0)) return w.end - 1 - (w.end - 1) % kInt4Group;
  return -1;
}

// Whether item w's step completes its row's last group (the new token at its last slot).
__device__ __forceinline__ bool int4_commits(const WorkItem& w) {
  return int4_appends(w) && w.pos % kInt4Group == kInt4Group - 1;
}

// An int4 item's new token (built with its q): K rounded to the activations' dtype (its residual
// entry), V quantised per token (codes two a byte, scale and zero point as stored).
template <typename T, int HEAD_DIM>
struct Int4Token {
  T k[HEAD_DIM];
  alignas(16) uint8_t v[HEAD_DIM / 2];
  float v_range[2];             // scale, zero point (fp16 values)
  float k_range[2][HEAD_DIM];   // a committing step's group: each channel's scale and zero point
};

// The new token of an int4 item (one-token steps): k_at(d) / v_at(d) its values in fp32 (after
// bias, norm, rotary), threads tid < nthreads, sync a barrier of them. A V range that is not
// finite, or a K value that is not finite or is past fp16's range, flags the row (kStatusScale):
// what mmha.int4 reads back for it is not finite.
template <typename T, int HEAD_DIM, typename KAt, typename VAt, typename Sync>
__device__ __forceinline__ void quantize_new_token_u4(const MmhaParams& p, const WorkItem& w, KAt k_at, VAt v_at,
                                                      Int4Token<T, HEAD_DIM>& tok, int tid, int nthreads, Sync sync) {
  __shared__ float s_red[3][kTileThreads / 32];  // each warp's V min, max, |V| max
  __shared__ int s_bad;
  float lo = INFINITY, hi = -INFINITY, am = 0.f;
  bool bad = false;
  for (int d = tid; d < HEAD_DIM; d += nthreads) {
    const float v = v_at(d);
    lo = min_nan(lo, v);
    hi = max_nan(hi, v);
    am = max_nan(am, fabsf(v));
    const T k = from_float<T>(k_at(d));
    tok.k[d] = k;
    const float kf = to_float(k);
    bad = bad || !(fabsf(kf) <= kFp16Max);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    lo = min_nan(lo, __shfl_xor_sync(kFullMask, lo, off));
    hi = max_nan(hi, __shfl_xor_sync(kFullMask, hi, off));
    am = max_nan(am, __shfl_xor_sync(kFullMask, am, off));
  }
  bad = __any_sync(kFullMask, bad);
  if (tid == 0) s_bad = 0;
  if (tid % 32 == 0) {
    s_red[0][tid / 32] = lo;
    s_red[1][tid / 32] = hi;
    s_red[2][tid / 32] = am;
  }
  sync();
  if (bad && tid % 32 == 0) atomicOr(&s_bad, 1);
  for (int i = 0; i < nthreads / 32; ++i) {
    lo = min_nan(lo, s_red[0][i]);
    hi = max_nan(hi, s_red[1][i]);
    am = max_nan(am, s_red[2][i]);
  }
  const Int4Range r = int4_range(lo, hi, am);
  for (int i = tid; i < HEAD_DIM / 2; i += nthreads) {
    tok.v[i] = static_cast<uint8_t>(int4_code(v_at(2 * i), r) | int4_code(v_at(2 * i + 1), r) << 4);
  }
  sync();
  if (tid == 0) {
    tok.v_range[0] = r.scale;
    tok.v_range[1] = r.zero;
    if (s_bad || !isfinite(r.scale) || !isfinite(r.zero)) atomicOr(p.rows.status + w.b, kStatusScale);
  }
}

// Slot k0 + r's channel d as the K residual holds it (a stepping row's new token: from tok).
template <typename T, int HEAD_DIM>
__device__ __forceinline__ T int4_residual_value(const Int4Head<T, HEAD_DIM>& ih, const WorkItem& w,
                                                 const Int4Token<T, HEAD_DIM>& tok, int k0, int r, int d) {
  const int t = k0 + r;
  if (int4_appends(w) && t == w.pos) return tok.k[d];
  return ih.residual[(t % kInt4Residual) * HEAD_DIM + d];
}

// The row's last K group into an int4 item's residual area (the item that holds it, at its first
// tile; threads tid < nthreads, then a barrier of them): keys k0 .. k0 + 63, those in [lo, end)
// from the residual (the new token's from tok), the rest 0, as fp16 at res_col. On the step that
// completes the group (commit: slot pos is its last), the group is quantised per channel from
// those values as mmha.int4 commits it (a thread per channel pair; the ranges kept in
// tok.k_range for append_int4_token's commit), and the area holds code * scale + zero.
template <typename T, int HEAD_DIM, int QB, typename Sync>
__device__ __forceinline__ void load_int4_residual(const MmhaParams& p, const WorkItem& w, int k0, bool commit,
                                                   Int4Token<T, HEAD_DIM>& tok, __half* area, int tid,
                                                   int nthreads, Sync sync) {
  using Consumer = Int4Consumer<HEAD_DIM, QB>;
  const Int4Head<T, HEAD_DIM> ih = int4_head<T, HEAD_DIM>(p, w.b, w.kvh);
  const bool appends = int4_appends(w);
  const auto key_value = [&](int r, int d) { return int4_residual_value(ih, w, tok, k0, r, d); };
  if (!commit) {
    // 16 bytes (8 channels of one key) a load, kBatch of them in flight per thread; channels
    // 8j .. 8j + 7 land at res_col's places: (c, c + 1) pairs side by side, pairs 8 apart in
    // the order 0, 2, 1, 3 (q_dim's: pair j % 2 + 2h of K step j).
    constexpr int CHUNKS = HEAD_DIM / 8;
    constexpr int kBatch = 8;
    static_assert(sizeof(T) == 2, "int4 caches hold 16-bit activations");
    for (int base = tid; base < kTileKeys * CHUNKS; base += kBatch * nthreads) {
      uint4 raw[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int idx = base + u * nthreads;
        const int r = idx / CHUNKS, t = k0 + r;
        raw[u] = make_uint4(0, 0, 0, 0);
        if (idx < kTileKeys * CHUNKS && t >= w.lo && t < w.end) {
          const T* src = appends && t == w.pos ? tok.k : ih.residual + (t % kInt4Residual) * HEAD_DIM;
          raw[u] = *reinterpret_cast<const uint4*>(src + (idx % CHUNKS) * 8);
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int idx = base + u * nthreads;
        if (idx >= kTileKeys * CHUNKS) break;
        const int r = idx / CHUNKS, d0 = (idx % CHUNKS) * 8;
        float x[8];
        convert16<T>(raw[u], x);
        __half* row = area + r * Consumer::RES_PITCH + Consumer::res_col(d0);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int i = 2 * (j % 2) + j / 2;
          *reinterpret_cast<__half2*>(row + 8 * j) = __floats2half2_rn(x[2 * i], x[2 * i + 1]);
        }
      }
    }
    sync();
    return;
  }
  // Commit: the whole group is in [0, pos] (a window's keys before lo are still quantised: the
  // cache holds them).
  for (int pair = tid; pair < HEAD_DIM / 2; pair += nthreads) {
    Int4Range rg[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int d = 2 * pair + u;
      float lo = INFINITY, hi = -INFINITY, am = 0.f;
#pragma unroll 8
      for (int r = 0; r < kTileKeys; ++r) {
        const float x = to_float(key_value(r, d));
        lo = min_nan(lo, x);
        hi = max_nan(hi, x);
        am = max_nan(am, fabsf(x));
      }
      rg[u] = int4_range(lo, hi, am);
      tok.k_range[0][d] = rg[u].scale;
      tok.k_range[1][d] = rg[u].zero;
    }
#pragma unroll 4
    for (int r = 0; r < kTileKeys; ++r) {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int d = 2 * pair + u;
        const uint32_t code = int4_code(to_float(key_value(r, d)), rg[u]);
        const float x = __fadd_rn(__fmul_rn(static_cast<float>(code), rg[u].scale), rg[u].zero);
        area[r * Consumer::RES_PITCH + Consumer::res_col(d)] = __float2half_rn(x);
      }
    }
  }
  sync();
}

// The append of an int4 one-token step (column block 0 of the item holding slot pos, after its
// tiles, so a paged row refused by the guard writes nothing): on a committing step the group's
// codes, scales and zero points (the ranges load_int4_residual chose, the codes chosen again
// from the same values: the new token's K from tok, not from its residual entry), then the new
// token's V codes, V scale and zero point at slot pos and its K at residual entry pos % 128.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void append_int4_token(const MmhaParams& p, const WorkItem& w,
                                                  const Int4Token<T, HEAD_DIM>& tok, int tid, int nthreads) {
  if (!w.owner() || w.qg != 0) return;
  const Int4Head<T, HEAD_DIM> ih = int4_head<T, HEAD_DIM>(p, w.b, w.kvh);
  const HeadSlots<u4, HEAD_DIM> hs = head_slots<u4, HEAD_DIM>(p.cache, p.num_kv_heads, w.b, w.kvh);
  uint8_t* codes_k = reinterpret_cast<uint8_t*>(hs.k);
  const int blk = hs.table != nullptr ? hs.block(w.pos) : 0;  // the group's and the slot's block
  if (int4_commits(w)) {
    const int k0 = w.pos - (kInt4Group - 1);
    // A thread per byte of a key's chunks: its two channels (K_NIBBLES' order, int4_k_channel).
    for (int i = tid; i < HEAD_DIM / 2; i += nthreads) {
      const int chunk = i / (kInt4Channels / 2);
      const int byte = i % (kInt4Channels / 2);
      int d[2];
      Int4Range rg[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        d[u] = kInt4Channels * chunk + int4_k_channel(byte, u);
        rg[u] = Int4Range{tok.k_range[0][d[u]], tok.k_range[1][d[u]]};
        ih.k_scale[ih.k_at(blk, k0) + d[u]] = __half_as_ushort(__float2half_rn(rg[u].scale));
        ih.k_zero[ih.k_at(blk, k0) + d[u]] = __half_as_ushort(__float2half_rn(rg[u].zero));
      }
#pragma unroll 4
      for (int r = 0; r < kTileKeys; ++r) {
        uint32_t code[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) code[u] = int4_code(to_float(int4_residual_value(ih, w, tok, k0, r, d[u])), rg[u]);
        codes_k[hs.k_at(blk, k0 + r, chunk) + byte] = static_cast<uint8_t>(code[0] | code[1] << 4);
      }
    }
  }
  const int64_t v_at = hs.table != nullptr ? blk * hs.block_stride + static_cast<int64_t>(w.pos & (hs.pitch - 1)) * (HEAD_DIM / 2)
                                           : static_cast<int64_t>(w.pos) * (HEAD_DIM / 2);
  uint8_t* v_codes = reinterpret_cast<uint8_t*>(hs.v) + v_at;
  for (int i = tid; i < HEAD_DIM / 2; i += nthreads) v_codes[i] = tok.v[i];
  T* entry = ih.residual + (w.pos % kInt4Residual) * HEAD_DIM;
  for (int d = tid; d < HEAD_DIM; d += nthreads) entry[d] = tok.k[d];
  if (tid == 0) {
    ih.v_scale[ih.v_at(blk, w.pos)] = __half_as_ushort(__float2half_rn(tok.v_range[0]));
    ih.v_zero[ih.v_at(blk, w.pos)] = __half_as_ushort(__float2half_rn(tok.v_range[1]));
  }
}

}  // namespace mmha
