// The tile loop's wide consumer: tree steps with many query columns per kv head. Torch-free.
//
// The narrow consumer (attend_tiles.cuh) puts up to 8 columns in the N of its m16n8k16 products
// and splits a tile's keys over the warps, so a kv head with T x G columns has its K/V read by
// ceil(T G / 8) items. Here an item holds kWideColumns columns, 16 per consumer warp as the M of
// the products, and every warp takes all kTileKeys keys of each tile (FlashAttention's layout):
//   S = Q K^T    A = 16 columns x 16 dims of q (registers), B = K^T (the narrow consumer's K
//                fragments, tile_operands.cuh: keys 0-7 of a 16-key block are its registers 0, 2)
//   online softmax per column over the tile's keys (4 lanes share a column)
//   O += P V     A = P (the S accumulators of two 8-key tiles, as they lie), B = V (the narrow
//                consumer's V^T fragments: dims 0-7 of an M tile are its registers 0, 2)
// q and P are single 16-bit values (the narrow consumer splits them into hi + lo): the products
// are those of FlashAttention in the cache's type, with fp32 accumulators. A warp's results are
// complete after its item's last tile: no block combine. fp8 caches as in the narrow consumer:
// K / V widened in registers, q brought to [2^7, 2^8) by a power of two undone on the scores, the
// k scale folded into q and the v scale into the output. int8 caches likewise widened (to the
// biased halves 1152 + code), with the narrow consumer's per-key scales: a score is (its product
// - 1152 x the column's q sum) x the key's K scale; P goes to the V mma as P x the key's V scale /
// v_unit (the warp's largest V scale so far); 1152 x the sum of those P values comes off O about
// every step (flush_v_bias) and at the end, where finish() multiplies O by v_unit. Their scales
// beside the scores halve the softmax step. On sm_90a at head dims 64 and 128 an int8 tile is
// widened once per block instead (widen: the four warps together, into a 16-bit tile's layout
// after the stages) and the warpgroup multiplies it as it does a 16-bit tile: K as 1152 + code,
// its scales and bias with the scores as above; V dequantised there (code x V scale / v_unit), so
// P goes to the V product as for a 16-bit cache and finish() only multiplies O by v_unit.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attend_common.cuh"
#include "new_token.cuh"
#include "ptx.cuh"
#include "score_mods.cuh"
#include "tile_layout.cuh"
#include "tile_operands.cuh"
#include "timeline.cuh"
#include "warp_combine.cuh"
#include "wgmma.cuh"
#include "work_items.cuh"

namespace mmha {

template <typename C, int HEAD_DIM>
struct WideConsumer {
  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= kWideMaxHeadDim, "wide consumer: head_dim 16k, <= 128");
  using L = TileLayout<C, HEAD_DIM>;
  using Ops = TileOperands<C, HEAD_DIM>;
  using M = typename Ops::M;
  static constexpr bool kFp8 = std::is_same_v<C, e4m3>;
  static constexpr bool kInt8 = std::is_same_v<C, s8>;
  static constexpr bool kBytes = kFp8 || kInt8;     // one-byte caches (ByteTileOperands)
  static constexpr int KSTEPS = HEAD_DIM / 16;      // K steps of S, M tiles of V^T
  static constexpr int KBLOCKS = kTileKeys / 16;    // 16-key blocks of a tile
  static constexpr float kRescaleSlack = 8.f;       // as in TileConsumer
  // sm_90a, int8 caches at head dims 64 and 128: each tile widened to fp16 in shared memory (WL's
  // layout, after the stages: wide_widened_bytes) for the warpgroup's products.
  static constexpr bool kWidened = kWgmma && kInt8 && (HEAD_DIM == 64 || HEAD_DIM == 128);
  using WL = TileLayout<__half, HEAD_DIM>;
  static_assert(!(kInt8 && (HEAD_DIM == 64 || HEAD_DIM == 128)) ||
                    WL::K_BYTES + WL::V_BYTES == wide_widened_bytes(HEAD_DIM, true, kWideColumns),
                "the widened tile fills what the host reserves");
  // sm_90a, 16-bit caches with swizzled V lines, and widened int8 tiles: the four warps multiply as
  // one warpgroup (wgmma), q and the tile's K and V read from shared memory where they lie; else
  // mma.sync per warp.
  static constexpr bool kWg =
      kWidened || (kWgmma && !kBytes && L::V_SWIZZLE && (HEAD_DIM == 64 || HEAD_DIM == 128));
  // The layout the warpgroup's descriptors name (the widened tile's, or the stage's).
  using GL = std::conditional_t<kWidened, WL, L>;
  // 16-key blocks per online-softmax step (int8 on mma.sync: 2, its scales and sums beside the
  // scores spilled 188-252 bytes at 4, docs/experiments.md; wgmma takes a whole tile).
  static constexpr int PART_BLOCKS = kInt8 && !kWg ? 2 : 4;

  const M* sq;             // the warp's q (staging area), read as A fragments at every tile
  float m[2], l[2];        // columns g, g + 8 of the warp's 16
  float acc[KSTEPS][2][4]; // O: M tile i of V^T, its dims 8 hh .. 8 hh + 7; [0, 1] column g, [2, 3] g + 8
  float s_unit;            // one-byte caches: scores are the mma's times this power of two
  float k_bias[2];         // int8: 1152 x the q sum of columns g, g + 8 (as the mma takes q)
  float p_sum[2];          // int8: this lane's sum of the P values fed to the V mma (columns g, g + 8)
  float v_unit;            // int8: the largest V scale of the warp's keys so far
  float v_inv;             // kWidened: 1 / v_unit (0 while v_unit is 0)
  bool busy;               // the warp holds columns of the item (warp-uniform)
  TreeMask<2> tree;
  uint32_t p_held[KBLOCKS][4];    // turns (issue_turn): the last tile's P, for its V product in the next turn
  float s_turn[KBLOCKS][2][4];    // turns: the tile's scores
  float alpha_pending[2];         // overlap turns: O's rescale once P V is done (weigh<true>)
  bool rescale_pending;

  // Column of fragment row h (0: g, 1: g + 8) of this warp.
  __device__ __forceinline__ static int column(int warp, int lane, int h) { return 16 * warp + lane / 4 + 8 * h; }

  // A warp's staging area for its q: 16 columns x HEAD_DIM in M, rows padded by 16 bytes so that
  // the ldmatrix phases (8 rows of 16 bytes) fall in distinct bank groups.
  static constexpr int Q_PITCH = HEAD_DIM + 8;
  static constexpr int Q_STAGE_BYTES = 16 * Q_PITCH * 2;
  // Element of q (the warp's fragment row r, fragment column col) in the staging area: the warp's
  // own padded rows, or (kWg) one area of the four warps' 64 rows in K's form, [HEAD_DIM / 8][64
  // rows][8] (a K-major wgmma operand without swizzle).
  __device__ __forceinline__ static int q_at(int warp, int r, int col) {
    if constexpr (kWg) return (col / 8) * 64 * 8 + (16 * warp + r) * 8 + col % 8;
    return r * Q_PITCH + col;
  }
  static_assert(!kWg || 64 * HEAD_DIM * 2 <= 4 * Q_STAGE_BYTES, "wgmma q area: the four warps' staging areas");
  static_assert(kConsumerWarps * Q_STAGE_BYTES == wide_pair_q_bytes(HEAD_DIM), "a paired block's second q area");

  // Where head dim d of q goes in a K step's 16 fragment columns: as is for 16-bit caches and
  // widened tiles; for one-byte caches, the inverse of TileOperands' q_dim (dims 4tq + 2h + e are
  // columns 2tq + 8h + e).
  __device__ __forceinline__ static int q_column(int d) {
    if constexpr (kBytes && !kWidened) {
      const int j = d / 16, r = d % 16;
      return 16 * j + 2 * (r / 4) + 8 * ((r / 2) % 2) + r % 2;
    } else {
      return d;
    }
  }

  // 16-bit caches and widened int8 tiles stage q in 16 bits, each dim where it lies in the row
  // (q_column is the identity): a warp's rows are copied there raw first (in the activations' type)
  // and init's passes rotate them in place (into M), so all of a lane's loads are in flight at once
  // where the general pass reads global memory a column at a time, one dependent round trip after
  // another (twice for one-byte caches: 25 of a B=1 T=64 1K int8 step's 57 us, H200 timeline).
  // fp8 caches and int8 ones on mma.sync permute the dims (q_column) and keep the general pass.
  template <typename T>
  static constexpr bool kRawStaged = sizeof(T) == 2 && (kWidened || (!kBytes && std::is_same_v<M, T>));

  // The (row, 16-byte chunk) of a warp's 16 q rows that index idx (0 .. 16 x HEAD_DIM / 8 - 1)
  // takes: each 8 consecutive indices are one chunk of 8 rows, so the 8 lanes of a shared-memory
  // phase reach 8 different bank groups in both of q_at's layouts (in kWg's, a row's chunks lie
  // 1,024 bytes apart, all in one bank group), and 32 lanes cover two adjacent chunks (32 bytes)
  // of each of the 16 rows.
  __device__ __forceinline__ static void row_chunk(int idx, int& row, int& chunk) {
    const int rest = idx / 8;
    row = idx % 8 + 8 * (rest % 2);
    chunk = rest / 2;
  }

  // The raw rows of the warp's columns [first, last) into its staging area: 16-byte async copies
  // where qkv's rows allow them (no registers held; the consumers issue no other cp.async), else
  // elements.
  template <typename T>
  __device__ __forceinline__ static void stage_raw_rows(const MmhaParams& p, const WorkItem& w, M* s_q, int warp,
                                                        int lane, int first, int last) {
    constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks of a row
    static_assert(16 * CHUNKS % 32 == 0, "whole chunks per lane");
    constexpr int PER = 16 * CHUNKS / 32;
    const T* qkv = static_cast<const T*>(p.qkv);
    T* s_t = reinterpret_cast<T*>(s_q);  // M's slots (both 16 bits), raw until rotated
    const auto row_of = [&](int r) {
      const Column c = column_of(p, w, first + r);
      return qkv + static_cast<int64_t>(c.qrow) * p.qkv_row_stride + c.head * HEAD_DIM;
    };
    if (reinterpret_cast<uintptr_t>(qkv) % 16 == 0 && p.qkv_row_stride % 8 == 0) {
#pragma unroll
      for (int k = 0; k < PER; ++k) {
        int r, c;
        row_chunk(lane + 32 * k, r, c);
        const bool on = first + r < last;
        cp_async16(s_t + q_at(warp, r, 8 * c), on ? row_of(r) + 8 * c : qkv, on);
      }
      cp_async_wait_all();
    } else {
      for (int idx = lane; idx < (last - first) * HEAD_DIM; idx += 32) {
        s_t[q_at(warp, idx / HEAD_DIM, idx % HEAD_DIM)] = row_of(idx / HEAD_DIM)[idx % HEAD_DIM];
      }
    }
    __syncwarp();
  }

  // One-byte caches' q_unit for plain raw-staged rows (no bias, no q norm), found before their
  // rotation: a rotation keeps a pair's norm, so no rotated value exceeds sqrt(2) x the rotary
  // factor (where above 1) x the rows' largest raw |value| (times |scale_log2|). The power of two
  // that brings that bound (with 1.5 for sqrt(2)) into [2^7, 2^8) leaves the rotated q's largest
  // in [2^4.9 / factor, 2^8), fp16's normal range, where scaling by a power of two is exact: the
  // scores (undone by s_unit) are byte_q_unit's bit for bit but for q's values that land in fp16's
  // subnormals (under 2^-14 once scaled: about 2^-19 of the largest and less).
  // One rotation instead of byte_q_unit's measure pass and store pass. Sets s_unit to its inverse;
  // where the rows are 0 or their largest not finite both stay 1 (as byte_q_unit leaves them). The
  // exponents are added rather than byte_q_unit given the product, which can overflow where q does not.
  template <typename T>
  __device__ __forceinline__ static float raw_rows_unit(const MmhaParams& p, const M* s_q, int warp, int lane,
                                                        int rows, float scale_log2, float& s_unit) {
    constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks of a row, as stage_raw_rows copies them
    const T* s_t = reinterpret_cast<const T*>(s_q);
    float mx = 0.f;
#pragma unroll 2
    for (int idx = lane; idx < 16 * CHUNKS; idx += 32) {
      int r, c;
      row_chunk(idx, r, c);
      if (r >= rows) continue;
      const uint4 v = *reinterpret_cast<const uint4*>(s_t + q_at(warp, r, 8 * c));
      const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int k = 0; k < 8; ++k) mx = fmaxf(mx, fabsf(to_float(e[k])));
    }
#pragma unroll
    for (int off = 1; off < 32; off *= 2) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, off));
    const float gain = 1.5f * fabsf(scale_log2) * fmaxf(1.f, fabsf(p.rotary.factor));
    if (!(mx > 0.f && mx <= 3.0e38f && gain > 0.f && gain <= 3.0e38f)) return 1.f;
    int e_raw = 0, e_gain = 0;
    frexpf(mx, &e_raw);  // mx in [2^(e_raw-1), 2^e_raw)
    frexpf(gain, &e_gain);
    const int shift = max(-100, min(100, 8 - e_raw - e_gain));
    s_unit = ldexpf(1.f, -shift);
    return ldexpf(1.f, shift);
  }

  // The node loop's head of init's q passes: per trip over the HEAD_DIM / 2 rotation pairs (warp-
  // uniform: the shuffle) the lane's pair, then per node n0 .. n1 of the warp's columns [first, last)
  // (node n0 + k's position in lane k's my_pos; c0 the item's first column) the node's columns
  // [c_lo, c_hi) (empty for a lane past the pairs) and the pair's angle at its position:
  // body(rp, node, c_lo, c_hi, sn, cs). UNROLL: the node loop's unroll count.
  template <int UNROLL, typename Body>
  __device__ __forceinline__ static void for_node_pairs(const MmhaParams& p, int c0, int lane, int first, int last,
                                                        int n0, int n1, int my_pos, Body&& body) {
    const int group = p.group;
    for (int i0 = 0; i0 < HEAD_DIM / 2; i0 += 32) {
      const int i = min(i0 + lane, HEAD_DIM / 2 - 1);
      const bool on = i0 + lane < HEAD_DIM / 2;
      const RotaryPair rp = rotary_pair(i, p.rotary);
#pragma unroll UNROLL
      for (int node = n0; node <= n1; ++node) {
        const int c_lo = max(first, node * group - c0);
        const int c_hi = on ? min(last, (node + 1) * group - c0) : c_lo;
        const int pos = __shfl_sync(kFullMask, my_pos, node - n0);
        float sn = 0.f, cs = 1.f;
        if (rp.rotated) sincosf(static_cast<float>(pos) * rp.inv_freq, &sn, &cs);
        body(rp, node, c_lo, c_hi, sn, cs);
      }
    }
  }

  // The rotation passes' k-th of a node's four columns for this lane (0-3): each 8 lanes their own
  // turn of the four, so that a pair's lanes, which read and write one 8-dim chunk of a row each,
  // reach four rows at once (in kWg's q layout a row's chunks lie 1,024 bytes apart, all in one
  // bank group: the same row for all 32 lanes was a four-way conflict on every access).
  __device__ __forceinline__ static int turned(int k, int lane) { return (k + lane / 8) % 4; }

  // The pass of init over raw-staged rows (kRawStaged) with neither bias nor q norm, the usual
  // case: per node one angle, then the node's columns four at a time, the four's loads issued
  // before any of their stores. The general pass, with every feature's test in each column and
  // each column's loads waiting for the last one's stores (the same array, for all the compiler
  // knows), ran about 90 instructions a column on one warp per scheduler: most of the 10 us
  // between an item's header and its q (B=1 T=64 1K). Same values as that pass, bit for bit.
  // Reads the rows as T (staged raw) and writes M; measure (one-byte caches' first pass): stores
  // nothing and returns the lane's largest |q| (then q_unit scales the stores, as in init).
  template <typename T>
  __device__ __forceinline__ static float rotate_plain_rows(const MmhaParams& p, const WorkItem& w, M* s_q, int warp,
                                                            int lane, int first, int last, int n0, int n1, int my_pos,
                                                            float scale_log2, float q_unit, bool measure) {
    const T* s_t = reinterpret_cast<const T*>(s_q);
    float qmax = 0.f;
    const auto columns = [&](const RotaryPair& rp, int, int c_lo, int c_hi, float sn, float cs) {
      if (rp.rotated && rp.factor != 1.f) {  // as rotate_prepared
        sn = __fmul_rn(sn, rp.factor);
        cs = __fmul_rn(cs, rp.factor);
      }
      for (int c = c_lo; c < c_hi; c += 4) {
        float a[4], b[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // past c_hi: the last column again, read and not stored
          const int r = min(c + turned(k, lane), c_hi - 1) - first;
          a[k] = to_float(s_t[q_at(warp, r, rp.d0)]);
          b[k] = to_float(s_t[q_at(warp, r, rp.d1)]);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int col = c + turned(k, lane);
          if (col < c_hi) {
            float x0 = a[k], x1 = b[k];
            if (rp.rotated) {  // rotate_prepared's roundings, its factor applied above
              x0 = __fmaf_rn(a[k], cs, __fmul_rn(-b[k], sn));
              x1 = __fmaf_rn(b[k], cs, __fmul_rn(a[k], sn));
            }
            store_or_measure(s_q, q_at(warp, col - first, rp.d0), q_at(warp, col - first, rp.d1),
                             x0 * scale_log2, x1 * scale_log2, q_unit, measure, qmax);
          }
        }
      }
    };
    for_node_pairs<2>(p, w.c0, lane, first, last, n0, n1, my_pos, columns);
    return qmax;
  }

  // A rotated pair's two values (q x scale_log2) into their slots times q_unit, or (measure: one-
  // byte caches' first pass) into the lane's largest |q| only: the general pass's two passes, in
  // the same roundings.
  __device__ __forceinline__ static void store_or_measure(M* s_q, int i0, int i1, float x0, float x1, float q_unit,
                                                          bool measure, float& qmax) {
    if (kBytes && measure) {
      qmax = fmaxf(qmax, fmaxf(fabsf(x0), fabsf(x1)));
    } else if constexpr (kBytes) {
      s_q[i0] = from_float<M>(x0 * q_unit);
      s_q[i1] = from_float<M>(x1 * q_unit);
    } else {
      s_q[i0] = from_float<M>(x0);
      s_q[i1] = from_float<M>(x1);
    }
  }

  // The pass of init over raw-staged rows (kRawStaged) with a bias or a q norm (Qwen's, Gemma's):
  // rotate_plain_rows's loop, each column's head's bias added and its norm applied as the general
  // pass did (rotate_values; the same bits). head_base: the head of the item's column 0 at node 0
  // (column c of node n is head head_base + c - n group). One body with the features tested at
  // run time, where the plain pass's else branch was: as four template instantiations the plain
  // rows' q build (fetched cold each item) stalled on instruction fetch, B=16 T=16 1K 46.1 -> 49.4
  // us at the same instruction count; out of line (noinline) the call spilled in the tile loop
  // (docs/experiments.md, 2026-11-29).
  template <typename T>
  __device__ __forceinline__ static float rotate_featured_rows(const MmhaParams& p, int c0, int head_base, M* s_q,
                                                              int warp, int lane, int first, int last, int n0, int n1,
                                                              int my_pos, float scale_log2, const float* inv,
                                                              float q_unit, bool measure) {
    const T* s_t = reinterpret_cast<const T*>(s_q);
    float qmax = 0.f;
    const T* bias = static_cast<const T*>(p.qkv_bias);
    const QKNormParams& qn = p.qk_norm;
    const int group = p.group;
    const auto columns = [&](const RotaryPair& rp, int node, int c_lo, int c_hi, float sn, float cs) {
      // column c's head's bias from node_bias + c HEAD_DIM
      const T* node_bias = bias ? bias + static_cast<int64_t>(head_base - node * group) * HEAD_DIM : nullptr;
      for (int c = c_lo; c < c_hi; c += 4) {
        float a[4], b[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // past c_hi: the last column again, read and not stored
          const int r = min(c + turned(k, lane), c_hi - 1);
          a[k] = to_float(s_t[q_at(warp, r - first, rp.d0)]);
          b[k] = to_float(s_t[q_at(warp, r - first, rp.d1)]);
          if (node_bias != nullptr) {  // as biased() adds it
            a[k] += to_float(node_bias[r * HEAD_DIM + rp.d0]);
            b[k] += to_float(node_bias[r * HEAD_DIM + rp.d1]);
          }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int col = c + turned(k, lane);
          if (col < c_hi) {
            const HeadNorm hn =
                qn.q_weight != nullptr ? HeadNorm{qn.q_weight, inv[col - first], qn.cast_first} : HeadNorm{};
            float x0, x1;
            rotate_values<T>(a[k], b[k], rp, sn, cs, x0, x1, hn);
            store_or_measure(s_q, q_at(warp, col - first, rp.d0), q_at(warp, col - first, rp.d1),
                             x0 * scale_log2, x1 * scale_log2, q_unit, measure, qmax);
          }
        }
      }
    };
    for_node_pairs<1>(p, c0, lane, first, last, n0, n1, my_pos, columns);
    return qmax;
  }

  // q of the warp's columns (bias, q norm, rotary at the node's position), times scale_log2 (the softmax
  // scale in the log2 domain, with an fp8 cache's k scale), rounded to M in the warp's staging
  // area s_q, where it stays for the item (q in registers beside O and the scores would spill).
  // One-byte caches: a first pass finds the warp's largest |q|. stamp: the block's item number
  // where this thread stamps the q build's events (timeline.cuh; an MMHA_TIMELINE build), else 2
  // or more. warp: within the warpgroup; norm_row: the warp's row of the block's q-norm scratch
  // (its warp in the block: a paired block's second warpgroup has rows of its own).
  template <typename T>
  __device__ __forceinline__ void init(const MmhaParams& p, const WorkItem& w, float scale_log2, M* s_q, int warp,
                                       int lane, int stamp, int norm_row) {
    busy = 16 * warp < w.nh;
    tree.on = tree_step<false>(p);
    tree.base = w.pos;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int cw = column(warp, lane, h);
      tree.anc[h] = tree.on && cw < w.nh ? p.tree.anc[column_of(p, w, cw).qrow] : 0;
    }
    s_unit = 1.f;
    v_unit = v_inv = 0.f;
    k_bias[0] = k_bias[1] = p_sum[0] = p_sum[1] = 0.f;
    sq = s_q;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
    if (!busy) {
      if constexpr (kWg) {  // its rows take part in the warpgroup's products: zeros
        for (int idx = lane; idx < 16 * HEAD_DIM; idx += 32) {
          s_q[q_at(warp, idx / HEAD_DIM, idx % HEAD_DIM)] = from_float<M>(0.f);
        }
        fence_proxy_async_smem();
      }
      return;
    }
    // The warp's columns [first, last) of the item are heads of nodes n0 .. n1; a lane takes
    // rotation pairs and, per node, computes the pair's angle once for the node's heads.
    const T* bias = static_cast<const T*>(p.qkv_bias);
    const int group = p.group;
    const int first = 16 * warp;
    const int last = min(w.nh, first + 16);
    // A q norm: the warp's columns' rsqrt(mean(x^2) + eps), a warp reduction each.
    __shared__ float s_norm[2 * kConsumerWarps][16];  // by the block's consumer warp (norm_row: two warpgroups)
    float* norm = s_norm[norm_row];
    const QKNormParams& qn = p.qk_norm;
    if (qn.q_weight != nullptr) {
      for (int cw = first; cw < last; ++cw) {  // warp-uniform: head_inv_rms shuffles
        const Column c = column_of(p, w, cw);
        const T* row = static_cast<const T*>(p.qkv) + static_cast<int64_t>(c.qrow) * p.qkv_row_stride + c.head * HEAD_DIM;
        const float inv = head_inv_rms<T, HEAD_DIM>(row, bias ? bias + c.head * HEAD_DIM : nullptr, qn.eps, lane);
        if (lane == 0) norm[cw - first] = inv;
      }
      __syncwarp();
    }
    if constexpr (kRawStaged<T>) {
      stage_raw_rows<T>(p, w, s_q, warp, lane, first, last);
      timeline_item(p, stamp, kTlQueryStaged);
    }
    const int n0 = (w.c0 + first) / group;
    const int n1 = (w.c0 + last - 1) / group;
    // pass 0 (one-byte caches only): the warp's largest |q|; pass 1: q * q_unit into the staging area.
    // Lane k holds node n0 + k's position (at most 16 nodes per warp): one load for all of them.
    const int my_col = max(first, (n0 + lane) * group - w.c0);
    const int my_pos = n0 + lane <= n1 ? query_position<false>(p, w, column_of(p, w, my_col)) : 0;
    timeline_item_after(p, stamp, kTlQueryPlaced, my_pos);
    float q_unit = 1.f;
    float qmax = 0.f;
    if constexpr (kRawStaged<T>) {  // the raw rows rotated in place (widened int8: their |q| first)
      const bool plain = bias == nullptr && qn.q_weight == nullptr;
      const int head_base = w.kvh * group + w.c0;
      if constexpr (kBytes) {
        // Plain rows: q_unit from the raw rows (raw_rows_unit), then one rotation; with a bias or a
        // q norm a first pass finds the rotated q's largest |q| (byte_q_unit).
        int pass = 0;
        if (plain) {
          q_unit = raw_rows_unit<T>(p, s_q, warp, lane, last - first, scale_log2, s_unit);
          pass = 1;
        }
#pragma unroll 1
        for (; pass < 2; ++pass) {  // one call site each: the code once
          const bool measure = pass == 0;
          if (plain) {
            qmax = rotate_plain_rows<T>(p, w, s_q, warp, lane, first, last, n0, n1, my_pos, scale_log2, q_unit, measure);
          } else {
            qmax = rotate_featured_rows<T>(p, w.c0, head_base, s_q, warp, lane, first, last, n0, n1, my_pos, scale_log2,
                                           norm, q_unit, measure);
          }
          if (measure) q_unit = byte_q_unit(qmax, s_unit);
        }
      } else if (plain) {
        rotate_plain_rows<T>(p, w, s_q, warp, lane, first, last, n0, n1, my_pos, scale_log2, 1.f, false);
      } else {
        rotate_featured_rows<T>(p, w.c0, head_base, s_q, warp, lane, first, last, n0, n1, my_pos, scale_log2,
                                norm, 1.f, false);
      }
    }
    for (int pass = kRawStaged<T> ? 2 : kBytes ? 0 : 1; pass < 2; ++pass) {  // the other caches' pass
      const auto columns = [&](const RotaryPair& rp, int, int c_lo, int c_hi, float sn, float cs) {
        const Column c0 = column_of(p, w, c_lo);
        for (int cw = c_lo; cw < c_hi; ++cw) {
          const int head = c0.head + cw - c_lo;
          const T* row =
              static_cast<const T*>(p.qkv) + static_cast<int64_t>(c0.qrow) * p.qkv_row_stride + head * HEAD_DIM;
          float x0, x1;
          const HeadNorm hn =
              qn.q_weight != nullptr ? HeadNorm{qn.q_weight, norm[cw - first], qn.cast_first} : HeadNorm{};
          rotate_pair(row, bias ? bias + head * HEAD_DIM : nullptr, rp, sn, cs, x0, x1, hn);
          x0 *= scale_log2;
          x1 *= scale_log2;
          if (pass == 0) {
            qmax = fmaxf(qmax, fmaxf(fabsf(x0), fabsf(x1)));
          } else {
            const int r = cw - first;
            s_q[q_at(warp, r, q_column(rp.d0))] = from_float<M>(x0 * q_unit);
            s_q[q_at(warp, r, q_column(rp.d1))] = from_float<M>(x1 * q_unit);
          }
        }
      };
      for_node_pairs<4>(p, w.c0, lane, first, last, n0, n1, my_pos, columns);
      if constexpr (kBytes) {
        if (pass == 0) q_unit = byte_q_unit(qmax, s_unit);
      }
    }
    timeline_item(p, stamp, kTlQueryRotated);
    // Rows of columns past the item's: zeros.
    for (int idx = lane; idx < (first + 16 - last) * HEAD_DIM; idx += 32) {
      s_q[q_at(warp, last - first + idx / HEAD_DIM, idx % HEAD_DIM)] = from_float<M>(0.f);
    }
    if constexpr (kWg) fence_proxy_async_smem();  // read by the copy engine's proxy (wgmma)
    __syncwarp();
    if constexpr (kInt8) {
      // Each row's sum by two lanes (row lane % 16, half lane / 16 of its 16-byte chunks: a phase's 8
      // lanes read one chunk of 8 rows, 8 bank groups), then to the lanes that hold the row's scores.
      constexpr int HALF = HEAD_DIM / 16;  // chunks of 8 values a lane
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < HALF; ++i) {
        const uint4 v = *reinterpret_cast<const uint4*>(s_q + q_at(warp, lane % 16, 8 * (lane / 16 * HALF + i)));
        const M* e = reinterpret_cast<const M*>(&v);
#pragma unroll
        for (int k = 0; k < 8; ++k) sum += to_float(e[k]);
      }
      sum += __shfl_xor_sync(kFullMask, sum, 16);
#pragma unroll
      for (int h = 0; h < 2; ++h) k_bias[h] = kInt8Bias * __shfl_sync(kFullMask, sum, lane / 4 + 8 * h);
    }
    clear_acc();
    clear_held();
  }

  // B fragments of K^T for K steps j and j + 1 (where it exists) over keys key0 .. key0 + 15:
  // b[u][n] = {b0, b1} of keys key0 + 8 n .. + 7. For 16-bit caches one ldmatrix per K step whose
  // matrices come out in that order (lanes 0-7: keys 0-7 of chunk 2 j, 8-15: keys 0-7 of chunk
  // 2 j + 1, 16-31: the same of keys 8-15), so each pair lies in adjacent registers as the mma
  // takes it; fp8 widens TileOperands' fragments into fresh registers anyway.
  __device__ __forceinline__ static void k_frags(uint32_t (&b)[2][2][2], const unsigned char* stage, int key0, int j,
                                                 int lane) {
    if constexpr (kBytes) {
      uint32_t a[2][4];
      Ops::k_pair(a, stage, key0, j, lane, WholeTile{});  // wide items' stages: whole-tile groups
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        b[u][0][0] = a[u][0], b[u][0][1] = a[u][2];
        b[u][1][0] = a[u][1], b[u][1][1] = a[u][3];
      }
    } else {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (j + u < KSTEPS) {
          uint32_t r[4];
          ldmatrix_x4<false>(
              r, stage + L::k_off(key0 + lane % 8 + (lane / 16) * 8, 2 * (j + u) + (lane / 8) % 2, WholeTile{}));
          b[u][0][0] = r[0], b[u][0][1] = r[1];
          b[u][1][0] = r[2], b[u][1][1] = r[3];
        }
      }
    }
  }

  // B fragments of V for M tiles i and i + 1 of V^T (16 dims each) over keys key0 .. key0 + 15:
  // b[u][hh] = {b0, b1} of dims 8 hh .. 8 hh + 7 of the tile (as out_dim numbers them). 16-bit:
  // ldmatrix.trans with lanes 0-15 on keys 0-15 of chunk 2 i, 16-31 of chunk 2 i + 1.
  __device__ __forceinline__ static void v_frags(uint32_t (&b)[2][2][2], const unsigned char* stage, int key0, int i,
                                                 int lane) {
    if constexpr (kBytes) {
      uint32_t a[2][4];
      Ops::v_pair(a, stage, key0, i, lane, WholeTile{});
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        b[u][0][0] = a[u][0], b[u][0][1] = a[u][2];
        b[u][1][0] = a[u][1], b[u][1][1] = a[u][3];
      }
    } else if constexpr (L::V_SWIZZLE) {
      // v_off(key0 + lane % 16, 2 m + lane / 16, WholeTile) with key0 a multiple of 16: the line
      // is m / 4 and the swizzled chunk ((2 m) % 8 + lane / 16) ^ (lane % 8) = ((2 m) % 8) ^ x, x
      // the lane's part, so every address is a per-lane base and a constant (the general form
      // costs ~5 integer instructions per ldmatrix: lane is opaque, see step).
      const int x = (lane / 16) ^ (lane % 8);
      const unsigned char* row = stage + L::K_BYTES + (key0 + lane % 16) * L::V_LINE_BYTES;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int m = i + u;
        if (m < KSTEPS) {
          uint32_t r[4];
          ldmatrix_x4<true>(r, row + (m / 4) * L::KEYS * L::V_LINE_BYTES + (((2 * m) % 8) ^ x) * 16);
          b[u][0][0] = r[0], b[u][0][1] = r[1];
          b[u][1][0] = r[2], b[u][1][1] = r[3];
        }
      }
    } else {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (i + u < KSTEPS) {
          uint32_t r[4];
          ldmatrix_x4<true>(r, stage + L::v_off(key0 + lane % 16, 2 * (i + u) + lane / 16, WholeTile{}));
          b[u][0][0] = r[0], b[u][0][1] = r[1];
          b[u][1][0] = r[2], b[u][1][1] = r[3];
        }
      }
    }
  }

  // Zeroes the V rows of a stage's keys outside [lo, end) (the cache's keys [it, it + kTileKeys)),
  // whatever the source left there (NaN from unused slots): every warp reads every row, so all
  // consumer threads share the work and the caller synchronises them before any reads.
  __device__ __forceinline__ static void clear_v(unsigned char* stage, int it, int lo, int end, int tid,
                                                 int nthreads) {
    for (int idx = tid; idx < kTileKeys * L::CHUNKS; idx += nthreads) {
      const int kk = idx / L::CHUNKS;
      const int c = idx % L::CHUNKS;
      const int t = it + kk;
      if (t >= end || t < lo) *reinterpret_cast<uint4*>(stage + L::v_off(kk, c, WholeTile{})) = make_uint4(0, 0, 0, 0);
    }
    fence_proxy_async_smem();
  }

  // kWidened: a stage's int8 K and V codes as the 16-bit tile of WL's layout that the warpgroup
  // multiplies, by all consumer threads together (the four warps; CONSUMERS of them). K as the
  // biased halves 1152 + code (exact; the keys' scales and the bias stay with the scores). V
  // dequantised: code x its key's V scale / v_unit, rounded once to fp16 (|value| <= 127), keys
  // outside [lo, end) zero (their stray scales never read), so P reaches the V product as it is,
  // as for a 16-bit cache. v_unit, the largest V scale of the item's keys so far, is raised first
  // where the tile's largest in-range scale outgrows it (acc rescaled: no product is in flight
  // between tiles); every warp finds the same maximum. Each thread's chunks keep one K key (or one
  // V 16-dim chunk) across its trips, so the offsets are a base plus a constant per trip. Reads are
  // 16 contiguous bytes a thread, all of a pass's trips loaded before its first store: the stage
  // and the widened tile are one array for all the compiler knows, so a load after a store waited
  // for it (B=16 T=64 int8 trees 0.96-0.977 of that form's time).
  template <int CONSUMERS>
  __device__ __forceinline__ void widen(const unsigned char* stage, unsigned char* wide, int it, int lo, int end,
                                        int tid, int lane) {
    constexpr int C8 = HEAD_DIM / 16;         // one-byte chunks of a key
    constexpr int DC = CONSUMERS / kTileKeys;  // K: a thread's chunks DC apart
    constexpr int DR = CONSUMERS / C8;         // V: a thread's keys DR apart
    static_assert(CONSUMERS % kTileKeys == 0 && CONSUMERS % C8 == 0 && kTileKeys * C8 % CONSUMERS == 0,
                  "widen: whole trips per thread");
    static_assert(DR % 8 == 0, "widen: a thread's V keys share their swizzle phase");
    constexpr int TRIPS = kTileKeys * C8 / CONSUMERS;
    unsigned t = static_cast<unsigned>(tid);
    asm volatile("" : "+r"(t));  // addresses derived here, not held across the tile loop (as step)
    const float* v_scales = reinterpret_cast<const float*>(stage + L::SCALE_OFF) + L::KEYS;
    const auto in_range = [&](int key) { return it + key >= lo && it + key < end; };
    float vmax_lane = 0.f;
#pragma unroll
    for (int k = lane; k < kTileKeys; k += 32) vmax_lane = fmaxf(vmax_lane, in_range(k) ? v_scales[k] : 0.f);
    // Block-uniform (every warp reads all the tile's scales), and rare past an item's first
    // tiles: the warp's max only then.
    if (__any_sync(kFullMask, vmax_lane > v_unit)) {
      const float vmax = lanes_max<1, 16>(vmax_lane);
      v_inv = 1.f / vmax;
      const float r = v_unit * v_inv;
      scale_acc(r);
      v_unit = vmax;
    }
    // K: thread t takes key t % kTileKeys, chunks t / kTileKeys + DC x trip.
    {
      const int k = static_cast<int>(t % kTileKeys), c0 = static_cast<int>(t / kTileKeys);
      uint4 xs[TRIPS];  // every trip's codes loaded before the first store (no store between loads)
#pragma unroll
      for (int trip = 0; trip < TRIPS; ++trip)
        xs[trip] = *reinterpret_cast<const uint4*>(stage + L::k_off(k, c0 + DC * trip, WholeTile{}));
#pragma unroll
      for (int trip = 0; trip < TRIPS; ++trip) {
        const int c = c0 + DC * trip;
        const uint4 x = xs[trip];
        uint4 a, b;
        s8x4_to_biased_half2x2(x.x, a.x, a.y);
        s8x4_to_biased_half2x2(x.y, a.z, a.w);
        s8x4_to_biased_half2x2(x.z, b.x, b.y);
        s8x4_to_biased_half2x2(x.w, b.z, b.w);
        *reinterpret_cast<uint4*>(wide + WL::k_off(k, 2 * c, WholeTile{})) = a;
        *reinterpret_cast<uint4*>(wide + WL::k_off(k, 2 * c + 1, WholeTile{})) = b;
      }
    }
    // V: thread t takes chunk t % C8 of keys t / C8 + DR x trip (DR a multiple of 8: each trip's
    // offsets are the first's plus a constant, in the stage and in the widened tile alike).
    {
      const int c = static_cast<int>(t % C8), r0 = static_cast<int>(t / C8);
      const unsigned char* src = stage + L::v_off(r0, c, WholeTile{});
      unsigned char* lo_dst = wide + WL::v_off(r0, 2 * c, WholeTile{});
      unsigned char* hi_dst = wide + WL::v_off(r0, 2 * c + 1, WholeTile{});
      const int src_step = L::v_off(DR, 0, WholeTile{}) - L::v_off(0, 0, WholeTile{});
      const int dst_step = WL::v_off(DR, 0, WholeTile{}) - WL::v_off(0, 0, WholeTile{});
      const __half2 bias = __float2half2_rn(kInt8Bias);
      uint4 xs[TRIPS];  // as K's: every trip's codes and scales loaded before the first store
      float ratios[TRIPS];
#pragma unroll
      for (int trip = 0; trip < TRIPS; ++trip) {
        const int r = r0 + DR * trip;
        xs[trip] = *reinterpret_cast<const uint4*>(src + trip * src_step);
        ratios[trip] = in_range(r) ? v_scales[r] * v_inv : 0.f;
      }
#pragma unroll
      for (int trip = 0; trip < TRIPS; ++trip) {
        const uint4 x = xs[trip];
        const __half2 ratio = __float2half2_rn(ratios[trip]);
        uint32_t w[8];
        s8x4_to_biased_half2x2(x.x, w[0], w[1]);
        s8x4_to_biased_half2x2(x.y, w[2], w[3]);
        s8x4_to_biased_half2x2(x.z, w[4], w[5]);
        s8x4_to_biased_half2x2(x.w, w[6], w[7]);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          __half2 h = __hsub2(*reinterpret_cast<const __half2*>(&w[j]), bias);  // the code, exact
          h = __hmul2(h, ratio);
          w[j] = *reinterpret_cast<const uint32_t*>(&h);
        }
        *reinterpret_cast<uint4*>(lo_dst + trip * dst_step) = make_uint4(w[0], w[1], w[2], w[3]);
        *reinterpret_cast<uint4*>(hi_dst + trip * dst_step) = make_uint4(w[4], w[5], w[6], w[7]);
      }
    }
  }

  // Attend over the keys of a stage (the cache's keys [it, it + kTileKeys); those before lo or at
  // or past end are masked), PART_BLOCKS 16-key blocks at a time (the scores of a whole tile
  // would not fit the registers beside q and O). kWidened: K and V from the widened tile `wide`,
  // the scales from the stage.
  __device__ __forceinline__ void step(const unsigned char* stage, const unsigned char* wide, int it, int lo, int end,
                                       int lane) {
    // The fragments' shared-memory addresses depend on the lane only (and on constants): made
    // opaque here, the compiler derives them inside each tile instead of hoisting ~40 of them out
    // of the tile loop, where they spilled to local memory (reloaded every tile).
    asm volatile("" : "+r"(lane));
#pragma unroll
    for (int part = 0; part < KBLOCKS / PART_BLOCKS; ++part) {
      attend(stage, wide, 16 * PART_BLOCKS * part, it + 16 * PART_BLOCKS * part, lo, end, lane);
    }
  }

  // The scores s of keys [key0, key0 + 16 PART_BLOCKS) of a stage (it: the first's position)
  // weighed in place: the one-byte caches' scales, the masks, the online softmax (O rescaled where
  // the reference max rises), P in place of the scores.
  // DEFER: O's rescale left to the caller (rescale_pending / alpha_pending: its product may still run).
  template <bool DEFER = false>
  __device__ __forceinline__ void weigh(float (&s)[PART_BLOCKS][2][4], const unsigned char* stage, int key0, int it,
                                        int lo, int end, int lane) {
    const int tq = lane % 4;
    const bool edge = it + 16 * PART_BLOCKS > end || it < lo;
    const bool in_tree = tree.on && it + 16 * PART_BLOCKS > tree.base;
    if constexpr (kFp8) {
#pragma unroll
      for (int kb = 0; kb < PART_BLOCKS; ++kb) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[kb][n][e] *= s_unit;
        }
      }
    } else if constexpr (kInt8) {
      // Keys 2tq, 2tq + 1 of each 8-key half: their K scales. sum * u - bias * u, as the narrow
      // consumer: an infinite scale (a non-finite token, codes 0) gives NaN, as the reference.
      const float* k_scales = reinterpret_cast<const float*>(stage + L::SCALE_OFF) + key0 + 2 * tq;
#pragma unroll
      for (int kb = 0; kb < PART_BLOCKS; ++kb) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const float2 ks = *reinterpret_cast<const float2*>(k_scales + 16 * kb + 8 * n);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float u = s_unit * (e & 1 ? ks.y : ks.x);
            s[kb][n][e] = fmaf(s[kb][n][e], u, -k_bias[e >> 1] * u);
          }
        }
      }
    }
    if (edge || in_tree) {  // warp-uniform: most tiles skip the masks
#pragma unroll
      for (int kb = 0; kb < PART_BLOCKS; ++kb) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = it + 16 * kb + 8 * n + 2 * tq + (e & 1);
            const bool out = key >= end || key < lo || tree.hidden(e >> 1, key);
            s[kb][n][e] = out ? -INFINITY : s[kb][n][e];
          }
        }
      }
    }

    // Online softmax per column (the 4 lanes of a quad hold its keys), the reference max raised
    // only past kRescaleSlack as in TileConsumer.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int kb = 0; kb < PART_BLOCKS; ++kb) {
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        mx[0] = fmaxf(mx[0], fmaxf(s[kb][n][0], s[kb][n][1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[kb][n][2], s[kb][n][3]));
      }
    }
    float alpha[2];  // mx: the lane's maxima, reduced over the quad only where m is raised
    if constexpr (DEFER) {
      rescale_pending = raise_max_stats<1, 2>(m, l, mx, kRescaleSlack, alpha_pending);  // warp_combine.cuh
    } else if (raise_max_stats<1, 2>(m, l, mx, kRescaleSlack, alpha)) {  // warp_combine.cuh
      scale_acc_rows(alpha);
      if constexpr (kInt8 && !kWidened) {
        p_sum[0] *= alpha[0];
        p_sum[1] *= alpha[1];
      }
    }
    const float m_ref[2] = {m[0] == -INFINITY ? 0.f : m[0], m[1] == -INFINITY ? 0.f : m[1]};
#pragma unroll
    for (int kb = 0; kb < PART_BLOCKS; ++kb) {
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[kb][n][e] = exp2_ftz(s[kb][n][e] - m_ref[e >> 1]);
          l[e >> 1] += s[kb][n][e];
        }
      }
    }
    if constexpr (kInt8 && !kWidened) weigh_by_v_scales(s, stage, key0, it, lo, end, lane);  // widen: V dequantised
  }

  // The turns of a paired launch's two warpgroups (run_wide_items; 16-bit caches on wgmma): a
  // tile's P is held (p_held) and multiplied by the tile's V in the warpgroup's next turn, beside the
  // next tile's S, so that one warpgroup's products run while the other weighs its scores.
  // S of the tile at `stage` and P V of the held P over the V at `v_stage` (a tile whose P is held;
  // any landed tile while P is zero), issued, not waited for.
  __device__ __forceinline__ void issue_turn(const unsigned char* stage, const unsigned char* v_stage) {
    static_assert(kWg && !kBytes, "turns: 16-bit caches on wgmma");
    const uint64_t q_desc = wgmma_desc(sq, 64 * 16, 128, false);
    const uint64_t k_desc = wgmma_desc(stage, GL::KEYS * 16, 128, false);
    wgmma_fence();
    issue_held_pv(v_stage);
    issue_s(s_turn, q_desc, k_desc);
    wgmma_commit();
  }

  // The turn's products done: the tile's scores weighed, its P held.
  __device__ __forceinline__ void finish_turn(const unsigned char* stage, int it, int lo, int end, int lane) {
    wgmma_wait<0>();
    weigh(s_turn, stage, 0, it, lo, end, lane);
    hold_p();
  }

  // The overlap within a warpgroup as well (FlashAttention-3's): S of the tile, then P V of the held
  // P, as two batches; the scores weighed once S is done, while P V runs; O rescaled and P packed
  // once P V is done (finish_overlap_turn).
  __device__ __forceinline__ void issue_overlap_turn(const unsigned char* stage, const unsigned char* v_stage) {
    static_assert(kWg && !kBytes, "turns: 16-bit caches on wgmma");
    const uint64_t q_desc = wgmma_desc(sq, 64 * 16, 128, false);
    const uint64_t k_desc = wgmma_desc(stage, GL::KEYS * 16, 128, false);
    wgmma_fence();
    issue_s(s_turn, q_desc, k_desc);
    wgmma_commit();
    issue_held_pv(v_stage);
    wgmma_commit();
  }

  __device__ __forceinline__ void finish_overlap_turn(const unsigned char* stage, int it, int lo, int end, int lane) {
    wgmma_wait<1>();  // S is done; P V may still run
    weigh<true>(s_turn, stage, 0, it, lo, end, lane);
    wgmma_wait<0>();
    if (rescale_pending) scale_acc_rows(alpha_pending);
    hold_p();
  }

  // O's rows (columns g, g + 8) times alpha[0], alpha[1].
  __device__ __forceinline__ void scale_acc_rows(const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        acc[i][hh][0] *= alpha[0];
        acc[i][hh][1] *= alpha[0];
        acc[i][hh][2] *= alpha[1];
        acc[i][hh][3] *= alpha[1];
      }
    }
  }

  // S of the warpgroup's 64 columns over a tile's 64 keys, issued into s (descriptors of q and of
  // the tile's K chunk 0; the K steps' moved along them): its accumulators lie as the scores do
  // (8-key block 2 kb + n: registers 4 (2 kb + n) + e).
  __device__ __forceinline__ void issue_s(float (&s)[KBLOCKS][2][4], uint64_t q_desc, uint64_t k_desc) {
#pragma unroll
    for (int j = 0; j < KSTEPS; ++j) {
      wgmma_m64n64k16_ss<M, 0>(reinterpret_cast<float(&)[32]>(s), wgmma_desc_plus(q_desc, j * 2 * 64 * 16),
                               wgmma_desc_plus(k_desc, GL::k_off(0, 2 * j, WholeTile{})), j > 0);
    }
  }

  // The weighed scores of s_turn as the P held for the next turn's P V (the register operand).
  __device__ __forceinline__ void hold_p() { pack_p(s_turn, p_held); }

  // Weighed scores s as P V's A fragments per 16-key block (the block's two S tiles as they lie).
  __device__ __forceinline__ static void pack_p(const float (&s)[KBLOCKS][2][4], uint32_t (&p)[KBLOCKS][4]) {
#pragma unroll
    for (int kb = 0; kb < KBLOCKS; ++kb) {
      p[kb][0] = pack_rn<M>(s[kb][0][0], s[kb][0][1]);
      p[kb][1] = pack_rn<M>(s[kb][0][2], s[kb][0][3]);
      p[kb][2] = pack_rn<M>(s[kb][1][0], s[kb][1][1]);
      p[kb][3] = pack_rn<M>(s[kb][1][2], s[kb][1][3]);
    }
  }

  // The held P's product over the V at `stage` (an item's last tile), waited for; P zeroed.
  __device__ __forceinline__ void flush_turns(const unsigned char* stage) {
    wgmma_fence();
    issue_held_pv(stage);
    wgmma_commit();
    wgmma_wait<0>();
    clear_held();
  }

  __device__ __forceinline__ void issue_held_pv(const unsigned char* v_stage) {
    issue_pv(p_held, wgmma_desc(v_stage + GL::K_BYTES, GL::KEYS * GL::V_LINE_BYTES, 1024, true));
  }

  // O += P V over a tile's 64 keys, issued: P's A fragments per 16-key block (the block's two S
  // tiles as they lie), V the MN-major operand from the descriptor of its first line (16 keys a
  // step). O's accumulators lie as acc does (8-dim block 2 i + hh: registers 4 (2 i + hh) + e).
  __device__ __forceinline__ void issue_pv(const uint32_t (&p)[KBLOCKS][4], uint64_t v_desc0) {
#pragma unroll
    for (int kb = 0; kb < KBLOCKS; ++kb) {
      const uint64_t v_desc = wgmma_desc_plus(v_desc0, 16 * kb * GL::V_LINE_BYTES);
      if constexpr (HEAD_DIM == 128) {
        wgmma_m64n128k16_rs<M, 1>(reinterpret_cast<float(&)[64]>(acc), p[kb], v_desc, 1);
      } else {
        wgmma_m64n64k16_rs<M, 1>(reinterpret_cast<float(&)[32]>(acc), p[kb], v_desc, 1);
      }
    }
  }

  __device__ __forceinline__ void clear_held() {
#pragma unroll
    for (int kb = 0; kb < KBLOCKS; ++kb) {
#pragma unroll
      for (int r = 0; r < 4; ++r) p_held[kb][r] = 0u;
    }
  }

  // Keys [key0, key0 + 16 PART_BLOCKS) of a stage, the cache's keys from it (kWg: K and V where
  // GL lays them out, the stage's own or the widened tile).
  __device__ __forceinline__ void attend(const unsigned char* stage, const unsigned char* wide, int key0, int it, int lo,
                                         int end, int lane) {
    const unsigned char* ops = kWidened ? wide : stage;
    float s[PART_BLOCKS][2][4];  // [16-key block][8-key half]: columns g (0, 1), g + 8 (2, 3); keys 2tq, 2tq + 1
#pragma unroll
    for (int kb = 0; kb < PART_BLOCKS; ++kb) {
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[kb][n][e] = 0.f;
      }
    }
    if constexpr (kWg) {
      static_assert(PART_BLOCKS == KBLOCKS, "wgmma: a whole tile per attend");
      const uint64_t q_desc = wgmma_desc(sq, 64 * 16, 128, false);
      const uint64_t k_desc = wgmma_desc(ops, GL::KEYS * 16, 128, false);  // K's chunk 0 starts the stage
      wgmma_fence();
      issue_s(s, q_desc, k_desc);
      wgmma_commit_and_wait();
    } else {
#pragma unroll
      for (int j = 0; j < KSTEPS; j += 2) {
        // A fragments of q for K steps j, j + 1: lanes 0-15 address rows 0-15 at column 16 j, 16-31 at 16 j + 8.
        uint32_t q[2][4];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          if (j + u < KSTEPS) ldmatrix_x4<false>(q[u], sq + (lane % 16) * Q_PITCH + 16 * (j + u) + 8 * (lane / 16));
        }
#pragma unroll
        for (int kb = 0; kb < PART_BLOCKS; ++kb) {
          uint32_t k[2][2][2];
          k_frags(k, stage, key0 + 16 * kb, j, lane);
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            if (j + u < KSTEPS) {
              mma_16816<M>(s[kb][0], q[u], k[u][0][0], k[u][0][1]);
              mma_16816<M>(s[kb][1], q[u], k[u][1][0], k[u][1][1]);
            }
          }
        }
      }
    }
    weigh(s, stage, key0, it, lo, end, lane);

    // O += P V per 16-key block: P's A fragment is the block's two S tiles as they lie.
    if constexpr (kWg) {
      static_assert(!kInt8 || kWidened, "wgmma over int8: the widened tile (V dequantised, no P sums)");
      uint32_t pa[PART_BLOCKS][4];
      pack_p(s, pa);
      const uint64_t v_desc0 =
          wgmma_desc(ops + GL::K_BYTES + key0 * GL::V_LINE_BYTES, GL::KEYS * GL::V_LINE_BYTES, 1024, true);
      wgmma_fence();
      issue_pv(pa, v_desc0);
      wgmma_commit_and_wait();
    } else {
#pragma unroll
      for (int kb = 0; kb < PART_BLOCKS; ++kb) {
        const uint32_t pa[4] = {pack_rn<M>(s[kb][0][0], s[kb][0][1]), pack_rn<M>(s[kb][0][2], s[kb][0][3]),
                                pack_rn<M>(s[kb][1][0], s[kb][1][1]), pack_rn<M>(s[kb][1][2], s[kb][1][3])};
        if constexpr (kInt8) add_p_sums(pa);
#pragma unroll
        for (int i = 0; i < KSTEPS; i += 2) {
          uint32_t v[2][2][2];
          v_frags(v, stage, key0 + 16 * kb, i, lane);
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            if (i + u < KSTEPS) {
              mma_16816<M>(acc[i + u][0], pa, v[u][0][0], v[u][0][1]);
              mma_16816<M>(acc[i + u][1], pa, v[u][1][0], v[u][1][1]);
            }
          }
        }
      }
      if constexpr (kInt8) flush_v_bias();
    }
  }

  // int8 on mma.sync: the codes' bias (1152 x the P sums fed to the V mma) off acc, p_sum summed
  // over the quad first and left at 0.
  __device__ __forceinline__ void take_off_v_bias() {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      p_sum[h] += __shfl_xor_sync(kFullMask, p_sum[h], 1);
      p_sum[h] += __shfl_xor_sync(kFullMask, p_sum[h], 2);
    }
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][hh][e] = fmaf(-kInt8Bias, p_sum[e >> 1], acc[i][hh][e]);
      }
    }
    p_sum[0] = p_sum[1] = 0.f;
  }

  // int8 on mma.sync, after a step: the bias off acc once some lane's P sum passed
  // kInt8BiasFlush, as the narrow consumer's flush_v_bias (attend_tiles.cuh).
  __device__ __forceinline__ void flush_v_bias() {
    if (__any_sync(kFullMask, fmaxf(p_sum[0], p_sum[1]) > kInt8BiasFlush)) take_off_v_bias();
  }

  // int8: the fp16 values of P the V product takes (a 16-key block's A fragment: rows g in words 0,
  // 2 and g + 8 in 1, 3) into the lane's sums.
  __device__ __forceinline__ void add_p_sums(const uint32_t (&pa)[4]) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&pa[r]));
      p_sum[r & 1] += f.x + f.y;
    }
  }

  // int8: P of keys 2tq, 2tq + 1 of each 8-key half times the key's V scale over v_unit (raised
  // first, if one of the warp's keys outgrew it: acc and p_sum rescaled to the new unit). Keys
  // outside [lo, end) take no V scale (their copies may be strays: NaN x 0). The scales are read
  // from shared memory twice (for the maximum, then for P) rather than held beside the scores.
  __device__ __forceinline__ void weigh_by_v_scales(float (&s)[PART_BLOCKS][2][4], const unsigned char* stage, int key0,
                                                    int it, int lo, int end, int lane) {
    const int tq = lane % 4;
    const float* v_scales = reinterpret_cast<const float*>(stage + L::SCALE_OFF) + L::KEYS + key0 + 2 * tq;
    const auto scale_of = [&](int kb, int n, int k) {
      const int key = it + 16 * kb + 8 * n + 2 * tq + k;
      return key >= end || key < lo ? 0.f : v_scales[16 * kb + 8 * n + k];
    };
    float vmax_lane = 0.f;
#pragma unroll
    for (int kb = 0; kb < PART_BLOCKS; ++kb) {
#pragma unroll
      for (int n = 0; n < 2; ++n) vmax_lane = fmaxf(vmax_lane, fmaxf(scale_of(kb, n, 0), scale_of(kb, n, 1)));
    }
    if (__any_sync(kFullMask, vmax_lane > v_unit)) {  // a key outgrew the unit: the warp's max only then
      const float vmax = lanes_max<1, 16>(vmax_lane);
      const float r = v_unit / vmax;
      scale_acc(r);
      p_sum[0] *= r;
      p_sum[1] *= r;
      v_unit = vmax;
    }
    const float inv = v_unit > 0.f ? 1.f / v_unit : 0.f;
#pragma unroll
    for (int kb = 0; kb < PART_BLOCKS; ++kb) {
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[kb][n][e] *= scale_of(kb, n, e & 1) * inv;
      }
    }
  }

  // O times f (every accumulator of the lane).
  __device__ __forceinline__ void scale_acc(float f) {
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][hh][e] *= f;
      }
    }
  }

  // O zeroed once stored: its registers are then free for the split merge that may follow (the
  // compiler otherwise carries O across it to the next item's products, and spills the loop).
  __device__ __forceinline__ void clear_acc() {
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][hh][e] = 0.f;
      }
    }
  }

  // The item's sums over the quad (every lane of a quad then holds its columns' l); int8: O
  // without the codes' bias, back from units of v_unit.
  __device__ __forceinline__ void finish() {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] += __shfl_xor_sync(kFullMask, l[h], 1);
      l[h] += __shfl_xor_sync(kFullMask, l[h], 2);
    }
    if constexpr (kWidened) {  // V came dequantised in units of v_unit (widen)
      scale_acc(v_unit);
    } else if constexpr (kInt8) {
      take_off_v_bias();
      scale_acc(v_unit);
    }
  }

  // pair(d, a0, a1) for every two adjacent head dims d, d + 1 this lane holds of fragment row r
  // (accumulators rescaled to m[r]); the quad's lane tq == 0 holds dim 0. Row by row, so the
  // caller decides once per row where the values go and the stores are a short run of code (one
  // store_value per value, 64 times unrolled, was 7K instructions run once per item: fetched cold,
  // they were a quarter of a B=1 T=64 1K step).
  template <class Pair>
  __device__ __forceinline__ void row_pairs(int r, int lane, Pair pair) const {
    const int tq = lane % 4;
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        if constexpr (kBytes && !kWidened) {  // out_dim(i, g, h) = 16 i + 2 g + h: the pair is h = 0, 1
          pair(Ops::out_dim(i, 2 * tq + k, 0), acc[i][0][2 * r + k], acc[i][1][2 * r + k]);
        } else {  // 16-bit tiles' out_dim(i, g, h) = 16 i + g + 8 h: the pair is g = 2 tq, 2 tq + 1
          pair(TileOperands<__half, HEAD_DIM>::out_dim(i, 2 * tq, k), acc[i][k][2 * r], acc[i][k][2 * r + 1]);
        }
      }
    }
  }
};

}  // namespace mmha
