// The tile loop of the decode kernel (fp16 / bf16 / fp8 e4m3 caches, every head dim). Torch-free.
//
// A block is kConsumerWarps consumer warps and one producer warp around a ring of `stages`
// shared-memory stages (mbarriers "full" and "empty" per stage), and a stager warp that hands the
// producer its work items (decode_attention.cuh). The producer walks the tiles of kTileKeys keys
// of the block's items, one item after the other without a gap, and has a tile source
// (tile_source.cuh) bring each one into the next free stage. Consumer warp w takes
// keys [16 w, 16 w + 16) of every tile, with its own online softmax (no block barrier inside an
// item), for up to 8 query heads of one kv head:
//   S^T = K Q^T    m16n8k16: A = 16 keys x 16 dims of K (tile_operands.cuh), B = q (registers);
//                  int8 caches m16n8k32 over K's codes and q in two int8 parts (int32 sums)
//   online softmax on the S^T fragment (each lane owns 2 heads x 2 keys)
//   O^T += V^T P^T m16n8k16: A = V^T (tile_operands.cuh), B = P^T (movmatrix of the S^T fragment)
// With 16-bit caches q and P are fp32 values split into hi + lo 16-bit parts (two mma each), so
// the products keep about fp32 precision; with fp8 caches they are single fp16 values (e4m3's
// 2^-4 step dwarfs fp16's 2^-11), and the consumer is the bound there (twice the keys per byte).
// K and V are used exactly as cached (fp8 widened exactly to fp16, its scales folded into q and
// applied to the output). Exponentials flush results below 2^-126 to zero (ex2.approx.ftz): P is
// at least 1 for a tile's largest score, so the sums do not change, and fp16 has no such P.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attend_common.cuh"
#include "ptx.cuh"
#include "score_mods.cuh"
#include "tile_layout.cuh"
#include "tile_operands.cuh"
#include "tile_source.cuh"
#include "warp_combine.cuh"

namespace mmha {

// The barriers of a block's tile ring. Every thread that wrote (or read) shared memory handed
// across roles arrives itself, after its own accesses: the ordering is then carried by the
// barrier alone, which compute-sanitizer's racecheck follows (ordering passed through
// __syncwarp() to another lane's arrival is correct but invisible to it).
struct TileRing {
  uint64_t full[kMaxStages];    // completes when stage s holds its tile (Source::FULL_ARRIVALS)
  uint64_t header[kMaxStages];  // 32 producer lanes: stage s's header (and a staged q) is written
  uint64_t empty[kMaxStages];   // every consumer thread is done with stage s and its header
};

// Where a warp is in the ring: stage s, in its n-th use. Producer and consumers step through
// the same tiles in the same order, item after item, so their cursors agree.
struct RingCursor {
  int s = 0;
  int n = 0;
  __device__ __forceinline__ void next(int stages) {
    if (++s == stages) {
      s = 0;
      ++n;
    }
  }
};

// A block's tiles: t0 .. t0 + nt - 1 of its (row, kv head), walked from tile t0 + rot and
// wrapping around. Blocks of different (row, kv head) start at different offsets: with
// power-of-two cache strides, blocks reading the same offsets of different heads at the same
// time contend for the same DRAM banks (H200, per-warp loop: B=16 Hkv=8 S=32768 500.5 -> 490.6 us).
struct TileWalk {
  int t0;
  int nt;
  int rot;
  __device__ __forceinline__ int key(int i) const {
    int j = i + rot;
    j = j >= nt ? j - nt : j;
    return (t0 + j) * kTileKeys;
  }
};

// One consumer warp: its q fragments and running (max, sum, acc) over its keys, for a cache of C.
template <typename C, int HEAD_DIM, int QB>
struct TileConsumer {
  static_assert(QB <= 8, "one m16n8k16 tile holds at most 8 query heads");
  static_assert(HEAD_DIM % 16 == 0, "head_dim must be a multiple of 16 on tensor cores");
  using L = TileLayout<C, HEAD_DIM>;
  using Ops = TileOperands<C, HEAD_DIM>;
  using M = typename Ops::M;                    // the mma element type
  static constexpr bool kFp8 = std::is_same_v<C, e4m3>;
  // int8 caches: a scale per key for K (on its scores) and V (on its probabilities, in units of
  // v_unit: below).
  static constexpr bool kInt8 = std::is_same_v<C, s8>;
  static constexpr bool kBytes = kFp8 || kInt8;  // one-byte caches (tile_operands.cuh: widened to fp16, int8 K not)
  // q and P as hi + lo 16-bit parts (16-bit caches: about fp32 products), or as one fp16 value
  // (fp8 caches: e4m3's 2^-4 step dwarfs fp16's 2^-11, as in the wide consumer; int8's P
  // likewise, its V codes being 2^-8 of a token's largest value), which halves the products per
  // key. int8's q is two int8 parts against K's codes (q8, below).
  static constexpr bool kSplit = !kBytes;
  static constexpr int KSTEPS = HEAD_DIM / 16;  // mma K steps over the head dim / M tiles of O^T
  static constexpr int KPAIRS = (KSTEPS + 1) / 2;  // int8 K: m16n8k32 steps over the head dim
  // The online softmax's reference max trails the running max by up to this many log2 units.
  static constexpr float kRescaleSlack = 8.f;
  // The fragment columns a lane weighs: heads 2tq and 2tq + 1, only the first where an item has
  // one column (the second is never one: its P is 0).
  static constexpr int kLaneHeads = QB == 1 ? 1 : 2;

  uint32_t qh[KSTEPS][2], ql[KSTEPS][2];  // B fragments of q^T (hi and lo parts)
  float m[2], l[2];                        // heads 2tq, 2tq + 1 (the fragment columns of this lane)
  float acc[KSTEPS][4];                    // O^T: dims out_dim(i, g, 0 / 1), heads 2tq (+ 1)
  float s_unit;                            // one-byte caches: scores are the mma's times this power of two
  // int8: P^T goes to the V mma as P * v_scale[key] / v_unit, v_unit the largest V scale of the
  // warp's keys so far (so those products stay <= P, in fp16's range whatever the scales' size),
  // and acc is in units of v_unit: acc is rescaled when v_unit grows, and finish() multiplies it
  // back.
  float v_unit;
  float v_inv;  // int8: 1 / v_unit (0 while v_unit is 0), taken when v_unit grows, not every tile
  // int8 K: S^T = K Q^T on the codes as they lie (m16n8k32, int32 sums, exact), q as two int8
  // parts per head: q ~ unit (hi + lo / 254), hi = q / unit rounded, lo the rest in units of
  // unit / 254, unit = the head's largest |q| / 127. A score is (254 S_hi + S_lo) * unit / 254
  // * the key's K scale, and no widening of K's codes. q is within unit / 508 (the head's
  // largest |q| / 64,516) of each value, against fp16's 2^-12 of it: over random codes the
  // scores' error is an eighth of fp16 q's, within 2x of it where a few channels are 100x the
  // rest, and under 5 % of what K's own rounding may move a score either way (modelled:
  // tests/test_int8_math.py).
  // q8[js][part]: the B fragments of K steps 2js, 2js + 1; q8_unit: unit / 254 of heads 2tq, 2tq + 1.
  uint32_t q8[KPAIRS][2][2];
  float q8_unit[2];
  // int8 V: the V mma sees 1152 + code (kInt8Bias, tile_operands.cuh), so acc gains 1152 times
  // the sum of the fp16 P^T values fed to it: p_sum, this lane's part (heads 2tq, 2tq + 1, its keys
  // g and g + 8), rescaled with acc, summed over the lanes and taken off by flush_v_bias()
  // (about every step) and finish().
  float p_sum[2];
  ScoreTransform<2> mods;                  // soft-cap and ALiBi of this lane's two heads
  TreeMask<2> tree;                        // a tree step: this lane's two columns' root paths

  // q^T as B fragments (16 dims x 8 heads per K step), pre-scaled into the log2 domain: lane
  // holds head g, dims q_dim(j, tq, 0) + {0, 1} (b0) and q_dim(j, tq, 1) + {0, 1} (b1), as hi and
  // lo parts. scale_log2 holds the softmax scale (and an fp8 cache's k scale). With fp8 the
  // fp16 parts also get a power of two that brings the item's largest |q| to [2^7, 2^8): in
  // range whatever the activations' size (bf16 q may exceed fp16's), undone on the scores.
  // column(i) is column i's Column (query row and head; work_items.cuh); a tree step (tree_on)
  // masks the slots from tree_base on by each column's root path (a fused tree's from slot_anc,
  // by node; else the workspace's).
  template <class ColumnOf>
  __device__ __forceinline__ void init(const float (&s_q)[QB][HEAD_DIM + kQRowPad], int nh, float scale_log2, int lane,
                                       const MmhaParams& p, ColumnOf column, bool tree_on, int tree_base,
                                       const uint64_t* slot_anc = nullptr) {
    const int g = lane / 4;
    const int tq = lane % 4;
    int heads[2];
    tree.on = tree_on;
    tree.base = tree_base;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool used = 2 * tq + h < nh;
      const auto c = column(used ? 2 * tq + h : 0);
      heads[h] = used ? c.head : -1;
      tree.anc[h] = !tree_on || !used ? 0 : slot_anc != nullptr ? slot_anc[c.node] : p.tree.anc[c.qrow];
    }
    mods.init(p.mods, heads);
    float qv[KSTEPS][2][2];
    float qmax = 0.f;
#pragma unroll
    for (int j = 0; j < KSTEPS; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int d = Ops::q_dim(j, tq, h);  // even: (d, d + 1) one 8-byte load (rows padded: kQRowPad)
        const float2 q2 = *reinterpret_cast<const float2*>(&s_q[g < QB ? g : 0][d]);
        qv[j][h][0] = g < nh ? q2.x * scale_log2 : 0.f;
        qv[j][h][1] = g < nh ? q2.y * scale_log2 : 0.f;
        qmax = fmaxf(qmax, fmaxf(fabsf(qv[j][h][0]), fabsf(qv[j][h][1])));
      }
    }
    s_unit = 1.f;
    v_unit = 0.f;
    v_inv = 0.f;
    if constexpr (kInt8) {
      init_q8(qv, tq);
      p_sum[0] = p_sum[1] = 0.f;
    } else {
      float q_unit = 1.f;
      if constexpr (kFp8) q_unit = byte_q_unit(qmax, s_unit);
#pragma unroll
      for (int j = 0; j < KSTEPS; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) split_pack<M>(qv[j][h][0] * q_unit, qv[j][h][1] * q_unit, qh[j][h], ql[j][h]);
      }
    }
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
    }
  }

  // int8: q8 and q8_unit from head g's values of this lane (qv, as init has them): the head's
  // largest |q| over the lane's quad sets its unit. A head with a non-finite value gets a NaN
  // unit (its scores NaN, as the reference's); one whose largest |q| is below 2^-100 reads as
  // zero (scores 0: the same softmax within fp32).
  __device__ __forceinline__ void init_q8(const float (&qv)[KSTEPS][2][2], int tq) {
    float hmax = 0.f;
#pragma unroll
    for (int j = 0; j < KSTEPS; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float a = fabsf(qv[j][h][e]);
          hmax = a <= 3.4e38f ? fmaxf(hmax, a) : INFINITY;  // NaN and inf both to inf
        }
      }
    }
    hmax = fmaxf(hmax, __shfl_xor_sync(kFullMask, hmax, 1));
    hmax = fmaxf(hmax, __shfl_xor_sync(kFullMask, hmax, 2));
    const bool finite = hmax <= 3.4e38f;
    const bool used = finite && hmax >= 0x1p-100f;
    const float unit = used ? hmax * (1.f / 127.f) : 0.f;
    const float inv = used ? 127.f / hmax : 0.f;
    // Rounded to the nearest integer by adding 1.5 * 2^23: the integer (|n| < 2^22) is then the
    // low bits of the sum, its low byte the int8 code in two's complement.
    constexpr float kRound = 12582912.f;
#pragma unroll
    for (int js = 0; js < KPAIRS; ++js) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {  // b: K step 2js + b (dims 4tq .. 4tq + 3 of its 16)
        const int j = 2 * js + b;
        uint32_t hi[4], lo[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float x = j < KSTEPS ? qv[j < KSTEPS ? j : 0][e / 2][e % 2] : 0.f;
          const float th = fmaf(x, inv, kRound);
          const float r = fmaf(-(th - kRound), unit, x);
          const float tl = fmaf(r * inv, 254.f, kRound);
          hi[e] = __float_as_uint(th);
          lo[e] = __float_as_uint(tl);
        }
        q8[js][0][b] = __byte_perm(__byte_perm(hi[0], hi[1], 0x0040), __byte_perm(hi[2], hi[3], 0x0040), 0x5410);
        q8[js][1][b] = __byte_perm(__byte_perm(lo[0], lo[1], 0x0040), __byte_perm(lo[2], lo[3], 0x0040), 0x5410);
      }
    }
    const float head_unit = finite ? unit * (1.f / 254.f) : __int_as_float(0x7fffffff);
#pragma unroll
    for (int h = 0; h < 2; ++h) q8_unit[h] = __shfl_sync(kFullMask, head_unit, 4 * (2 * tq + h));
  }

  // Keys [key0, key0 + 16) of a stage (K in groups of 2^kg keys, TileLayout::k_off) are the
  // cache's keys [it, it + 16). The new slots pos .. pos + count - 1 (a one-token step's one, a
  // fused tree's nodes) take their K/V from shared memory (slot pos + r: row r of s_new_k /
  // s_new_v, HEAD_DIM apart; int8: its K scale at s_new_scales[r], its V scale at
  // s_new_scales[scale_stride + r]); V rows before lo (a window's start) or at or past end
  // (an attend-only row's pos included) are zeroed (whatever the source left there, e.g. NaN from unused slots). Only the warp's own
  // rows are touched; the fence orders these writes before the copy engine refills the stage.
  template <typename G>
  __device__ __forceinline__ static void patch(unsigned char* stage, int key0, G kg, int it, int lo, int end,
                                               int pos, int count, const C* s_new_k, const C* s_new_v, int lane,
                                               const float* s_new_scales = nullptr, int scale_stride = 1) {
    for (int idx = lane; idx < 16 * L::CHUNKS; idx += 32) {
      const int kk = idx / L::CHUNKS;
      const int c = idx % L::CHUNKS;
      const int t = it + kk;
      if (t >= end || t < lo) {  // first: an attend-only row's slot pos lies past its keys
        *reinterpret_cast<uint4*>(stage + L::v_off(key0 + kk, c, kg)) = make_uint4(0, 0, 0, 0);
      } else if (t >= pos && t < pos + count) {
        const int r = (t - pos) * HEAD_DIM;
        *reinterpret_cast<uint4*>(stage + L::k_off(key0 + kk, c, kg)) =
            *reinterpret_cast<const uint4*>(s_new_k + r + c * L::VEC);
        *reinterpret_cast<uint4*>(stage + L::v_off(key0 + kk, c, kg)) =
            *reinterpret_cast<const uint4*>(s_new_v + r + c * L::VEC);
      }
    }
    if constexpr (kInt8) {  // the new slots' scales (lanes 0-15 K's, 16-31 V's; a key a lane)
      const int t = it + lane % 16;
      if (t >= pos && t < pos + count) {
        reinterpret_cast<float*>(stage + L::SCALE_OFF)[lane / 16 * L::KEYS + key0 + lane % 16] =
            s_new_scales[lane / 16 * scale_stride + t - pos];
      }
    }
    fence_proxy_async_smem();
    __syncwarp();
  }

  // Attend over keys [key0, key0 + 16) of a stage (K in groups of 2^kg keys; the cache's keys
  // [it, it + 16), those before lo or at or past end masked), the query at slot pos.
  template <typename G>
  __device__ __forceinline__ void step(const unsigned char* stage, int key0, G kg, int it, int lo, int end,
                                       int pos, int lane) {
    const unsigned char* stages[1] = {stage};
    const int its[1] = {it};
    steps<1, G>(stages, key0, kg, its, lo, end, pos, lane);
  }

  // Attend over keys [key0, key0 + 16) of N stages at once (the cache's keys [its[n], its[n] +
  // 16) of stage n): one online-softmax update for the 16 N keys (one max reduction, one rescale
  // test), so a warp pays its per-update work once per 16 N keys.
  template <int N, typename G>
  __device__ __forceinline__ void steps(const unsigned char* const (&stage)[N], int key0, G kg,
                                        const int (&its)[N], int lo, int end, int pos, int lane) {
    const int g = lane / 4;
    // S^T = K Q^T: s[n][0], s[n][1] = key g, heads 2tq, 2tq + 1; s[n][2], s[n][3] = key g + 8.
    // The hi and lo parts of q accumulate in two independent chains (a consumer warp is often
    // alone on its scheduler, so the mma latency of one chain of 2 * KSTEPS would stand bare).
    float s[N][4];
#pragma unroll
    for (int n = 0; n < N; ++n) {
      float s_lo[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
      if constexpr (kInt8) {  // q's two parts in two chains over the codes as they lie
        int s_hi[4] = {0, 0, 0, 0}, s_lo8[4] = {0, 0, 0, 0};
#pragma unroll
        for (int js = 0; js < KPAIRS; ++js) {
          uint32_t k[4];
          Ops::k_bytes(k, stage[n], key0, 2 * js, lane, kg);
          mma_16832_s8(s_hi, k, q8[js][0][0], q8[js][0][1]);
          mma_16832_s8(s_lo8, k, q8[js][1][0], q8[js][1][1]);
        }
        // key g's and key g + 8's K scales. A non-finite token's scale is infinite and its codes
        // 0: 0 * inf = NaN, as the reference's 0 * inf.
        const float* k_scales = reinterpret_cast<const float*>(stage[n] + L::SCALE_OFF) + key0 + g;
        const float k0 = k_scales[0], k1 = k_scales[8];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[n][e] = __int2float_rn(254 * s_hi[e] + s_lo8[e]) * (q8_unit[e & 1] * (e & 2 ? k1 : k0));
        }
      } else {
#pragma unroll
        for (int j = 0; j < KSTEPS; j += 2) {
          uint32_t k[2][4];
          Ops::k_pair(k, stage[n], key0, j, lane, kg);
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            if (j + u < KSTEPS) {
              if constexpr (kSplit) {
                mma_16816<M>(s[n], k[u], qh[j + u][0], qh[j + u][1]);
                mma_16816<M>(s_lo, k[u], ql[j + u][0], ql[j + u][1]);
              } else {  // even and odd K steps in two chains
                mma_16816<M>(u == 0 ? s[n] : s_lo, k[u], qh[j + u][0], qh[j + u][1]);
              }
            }
          }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = kSplit ? s[n][e] + s_lo[e] : (s[n][e] + s_lo[e]) * s_unit;
      }
      const int it = its[n];
      if (mods.on) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = mods.apply<true>(s[n][e], e & 1, it + g + (e & 2 ? 8 : 0), pos);
      }
      if (it + g >= end || it + g < lo) s[n][0] = s[n][1] = -INFINITY;
      if (it + g + 8 >= end || it + g + 8 < lo) s[n][2] = s[n][3] = -INFINITY;
      if (tree.on) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (tree.hidden(e & 1, it + g + (e & 2 ? 8 : 0))) s[n][e] = -INFINITY;
        }
      }
    }

    // Online softmax per head over the 16 N keys (8 lanes share a column pair). The reference max
    // m is raised only when some head of the warp has outgrown it by more than kRescaleSlack
    // (log2 units): most steps then skip rescaling acc, and P = 2^(s - m) stays below
    // 2^kRescaleSlack (acc and l share m, so the result is the same in exact arithmetic).
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int h = 0; h < kLaneHeads; ++h) {
      mx[h] = fmaxf(s[0][h], s[0][h + 2]);
#pragma unroll
      for (int n = 1; n < N; ++n) mx[h] = fmaxf(mx[h], fmaxf(s[n][h], s[n][h + 2]));
    }  // the lane's maxima: raise_max reduces them only where m is raised
    float alpha[2];
    if (raise_max(m, l, acc, mx, kRescaleSlack, alpha)) {  // warp_combine.cuh
      if constexpr (kInt8) {
        p_sum[0] *= alpha[0];
        p_sum[1] *= alpha[1];
      }
    }
    // int8: the V scales of keys g and g + 8 of each stage, over v_unit (raised first, if one of
    // the warp's keys outgrew it: acc is rescaled to the new unit).
    float v_w[N][2];
    if constexpr (kInt8) {
      float vmax_lane = 0.f;
#pragma unroll
      for (int n = 0; n < N; ++n) {
        // Keys outside [lo, end) (masked above: P = 0) take no V scale: their copies may be
        // strays, which must reach neither v_unit nor P' (NaN * 0). By position, not by score: a
        // tree step's node may be hidden from one column of the lane and seen by the other.
        const float* v_scales = reinterpret_cast<const float*>(stage[n] + L::SCALE_OFF) + L::KEYS + key0 + g;
        const int t = its[n] + g;
        v_w[n][0] = t >= end || t < lo ? 0.f : v_scales[0];
        v_w[n][1] = t + 8 >= end || t + 8 < lo ? 0.f : v_scales[8];
        vmax_lane = fmaxf(vmax_lane, fmaxf(v_w[n][0], v_w[n][1]));
      }
      if (__any_sync(kFullMask, vmax_lane > v_unit)) {  // a key outgrew the unit: reduced only then
        const float vmax = lanes_max<4, 16>(vmax_lane);
        const float r = v_unit / vmax;
#pragma unroll
        for (int i = 0; i < KSTEPS; ++i) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][e] *= r;
        }
        p_sum[0] *= r;
        p_sum[1] *= r;
        v_unit = vmax;
        v_inv = 1.f / vmax;
      }
#pragma unroll
      for (int n = 0; n < N; ++n) {
        v_w[n][0] *= v_inv;
        v_w[n][1] *= v_inv;
      }
    }
#pragma unroll
    for (int n = 0; n < N; ++n) {
#pragma unroll
      for (int h = 0; h < kLaneHeads; ++h) {
        const float m_ref = m[h] == -INFINITY ? 0.f : m[h];
        s[n][h] = exp2_ftz(s[n][h] - m_ref);
        s[n][h + 2] = exp2_ftz(s[n][h + 2] - m_ref);
        l[h] += s[n][h] + s[n][h + 2];
        if constexpr (kInt8) {
          s[n][h] *= v_w[n][0];
          s[n][h + 2] *= v_w[n][1];
        }
      }
      if constexpr (kLaneHeads == 1) s[n][1] = s[n][3] = 0.f;

      // P^T as B fragments: transpose the (key, head) fragment into (head, key) order.
      uint32_t ph0, pl0, ph1, pl1;
      split_pack<M>(s[n][0], s[n][1], ph0, pl0);
      split_pack<M>(s[n][2], s[n][3], ph1, pl1);
      if constexpr (kInt8) {  // the fp16 values the V mma takes
        const float2 f0 = __half22float2(*reinterpret_cast<const __half2*>(&ph0));
        const float2 f1 = __half22float2(*reinterpret_cast<const __half2*>(&ph1));
        p_sum[0] += f0.x + f1.x;
        p_sum[1] += f0.y + f1.y;
      }
      ph0 = movmatrix_trans(ph0);
      ph1 = movmatrix_trans(ph1);
      if constexpr (kSplit) {
        pl0 = movmatrix_trans(pl0);
        pl1 = movmatrix_trans(pl1);
      }

      // O^T += V^T P^T over 16-dim tiles.
#pragma unroll
      for (int i = 0; i < KSTEPS; i += 2) {
        uint32_t vt[2][4];
        Ops::v_pair(vt, stage[n], key0, i, lane, kg);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          if (i + u < KSTEPS) {
            mma_16816<M>(acc[i + u], vt[u], ph0, ph1);
            if constexpr (kSplit) mma_16816<M>(acc[i + u], vt[u], pl0, pl1);
          }
        }
      }
    }
    if constexpr (kInt8) flush_v_bias();
  }

  // int8: the codes' bias (1152 x the P sums fed to the V mma) off acc, p_sum summed over the
  // lanes of each column pair first and left at 0.
  __device__ __forceinline__ void take_off_v_bias() {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int off = 4; off < 32; off *= 2) p_sum[h] += __shfl_xor_sync(kFullMask, p_sum[h], off);
    }
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][e] = fmaf(-kInt8Bias, p_sum[e & 1], acc[i][e]);
    }
    p_sum[0] = p_sum[1] = 0.f;
  }

  // int8, after a step: the bias off acc once some lane's P sum passed kInt8BiasFlush. The V mma's
  // fp32 chain loses low bits one-sidedly at acc's magnitude, so a bias carried through a long
  // item (1152 x the row's whole P sum) would leave acc an error that grows with the row
  // (docs/experiments.md, 2026-12-03: an offset of 64 on int4 V took one 32K-key chain's error
  // from 4.6e-5 to 1.1e-3; int8's own, 1.4e-3 over 32K keys, 5.5e-3 over 128K); taken off at
  // about every step it stays that of a 16-bit cache.
  __device__ __forceinline__ void flush_v_bias() {
    if (__any_sync(kFullMask, fmaxf(p_sum[0], p_sum[1]) > kInt8BiasFlush)) take_off_v_bias();
  }

  // At an item's end, before its combine: an int8 cache's acc without the codes' bias, back
  // from units of v_unit.
  __device__ __forceinline__ void finish() {
    if constexpr (kInt8) {
      take_off_v_bias();
#pragma unroll
      for (int i = 0; i < KSTEPS; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] *= v_unit;
      }
    }
  }

  // The block combine through a buffer per warp (stash_warp, warp_combine.cuh).
  __device__ __forceinline__ void stash(float (*s_m)[QB], float (*s_l)[QB], float (*acc_w)[QB][HEAD_DIM], int warp,
                                        int lane) {
    stash_warp<QB, HEAD_DIM, KSTEPS>(m, l, acc, s_m, s_l, acc_w, warp, lane,
                                     [](int i, int g, int h) { return Ops::out_dim(i, g, h); });
  }
};

// What the producer tells the consumers about the tile in stage s (written before the tile's
// full barrier completes, read after it): the tile's first key and the item it belongs to.
struct TileHeader {
  int item;       // < 0: the producer has no more items (nothing else in this header is set)
  int k0;         // first key of the tile
  int flags;      // kFirstTile: the item's q and new token are in item slot `slot`; kLastTile;
                  // kPagesRefused (last tile): a block of the item's paged row is outside the pool
  int slot;
  int slot_parity;  // the phase of the slot's full barrier that holds this item
  // The item's fields (narrow items; wide items' consumers read them from the item slot, so that
  // the producer does not hold them across its tile loop).
  int b, kvh, qg, split, nh, pos, active, start, end;
  int nodes;               // the row's new tokens (1, or a tree's node count)
  int lo;                  // the row's first attended slot (a window's start; else 0)
  float k_scale, v_scale;  // the kv head's fp8 scales (1 for 16-bit caches)
};
constexpr int kFirstTile = 1;
constexpr int kLastTile = 2;
constexpr int kPagesRefused = 4;

}  // namespace mmha
