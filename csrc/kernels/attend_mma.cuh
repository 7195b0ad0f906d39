// Tensor-core main loop of the decode kernel (fp16 / bf16 caches). Torch-free.
//
// Each warp walks its own 16-key steps of the block's chunk, with its own cp.async pipeline in
// shared memory (no block barrier inside the loop). Per step, with up to 8 query
// heads of one kv head:
//   S^T = K Q^T   m16n8k16: A = 16 keys x 16 dims of K (ldmatrix), B = q (registers)
//   online softmax on the S^T fragment (each lane owns 2 heads x 2 keys)
//   O^T += V^T P^T m16n8k16: A = V^T (ldmatrix.trans), B = P^T (movmatrix of the S^T fragment)
// q and P are fp32 values split into hi + lo 16-bit parts (two mma each), so the products keep
// about fp32 precision; K and V are used exactly as cached.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attend_common.cuh"
#include "ptx.cuh"

namespace mmha {

template <typename T, int HEAD_DIM, int QB>
struct MmaAttend {
  static_assert(QB <= 8, "one m16n8k16 tile holds at most 8 query heads");
  static_assert(HEAD_DIM % 16 == 0, "head_dim must be a multiple of 16 on the tensor-core path");
  static constexpr int VEC = kVec<T>;            // elements per 16-byte chunk
  static constexpr int CHUNKS = HEAD_DIM / VEC;  // 16-byte chunks per key row
  static constexpr int KEYS = 16;                // keys per warp step (the mma M)
  static constexpr int KSTEPS = HEAD_DIM / 16;   // mma K steps over the head dim / M tiles of O^T
  // The online softmax's reference max trails the running max by up to this many log2 units.
  static constexpr float kRescaleSlack = 8.f;
  // K buffer: [CHUNKS][KEYS][VEC] as cached (8 keys of one chunk are 128 contiguous bytes, so an
  // ldmatrix phase is conflict-free). V buffer: [KEYS][HEAD_DIM] with chunk ch of row r stored at
  // chunk ch ^ (r % 8), so the 8 rows an ldmatrix.trans phase reads fall in 8 different bank
  // groups. Where a row is not a whole number of 8-chunk groups (head_dim 32, 80, 96 in 16 bits)
  // rows are padded by 16 bytes instead.
  //
  // Alignment matters for DRAM traffic, not only for banks: a cp.async whose 32-byte global
  // sector lands on a shared-memory address that is not 32-byte aligned is fetched from L2
  // twice (Nsight Compute on the H200: 2.0x the sectors for K, 1.5x for 16-byte padded V rows).
  // So buffers start 128-byte aligned (run() rounds its base up) and V rows are not padded
  // where the swizzle applies.
  static constexpr bool V_SWIZZLE = CHUNKS % 8 == 0;
  static constexpr int V_STRIDE = V_SWIZZLE ? HEAD_DIM : HEAD_DIM + VEC;
  // Element offset of chunk ch of key row r in a V buffer.
  __device__ __forceinline__ static int v_off(int r, int ch) {
    return V_SWIZZLE ? r * V_STRIDE + (ch ^ (r & 7)) * VEC : r * V_STRIDE + ch * VEC;
  }
  static constexpr int K_ELEMS = KEYS * HEAD_DIM;
  static constexpr int V_ELEMS = KEYS * V_STRIDE;
  // Per-warp partial outputs [warps][QB][HEAD_DIM] reuse the pipeline space after the loop.
  static constexpr int ACC_ROWS = 1;
  static constexpr int acc_bytes(int warps) {
    return warps * QB * HEAD_DIM * static_cast<int>(sizeof(float));
  }
  // Slack for rounding the dynamic shared-memory base up to 128 bytes (it follows the static
  // arrays, whose size is not a multiple of 128).
  static constexpr int ALIGN = 128;
  // Dynamic shared memory of a block of `warps` warps whose pipeline takes `pipe` bytes, and how
  // many 4-warp blocks of that pipeline an SM holds (227 KB, with 4 KB per block left for the
  // kernel's static arrays).
  static constexpr int dynamic_smem(int pipe, int warps) {
    return (pipe > acc_bytes(warps) ? pipe : acc_bytes(warps)) + ALIGN;
  }
  static constexpr int smem_blocks(int pipe) {
    return (227 * 1024) / (dynamic_smem(pipe, kWarps) + 4 * 1024);
  }
  // K and V of a step are separate pipeline slots: copy n of a warp is K of its step n / 2
  // (n even) or V (n odd) and goes to slot n % SLOTS of its ring; while one slot is used, the
  // other SLOTS - 1 are in flight. Four slots (3 in flight) where 4 blocks of 4 warps fit in an
  // SM's shared memory (head_dim <= 96); else three (2 in flight), which lets head_dim 128 run
  // 4 such blocks per SM (48 KB each) rather than 3 (64 KB): on the H200 the warps gained more
  // than the bytes in flight lost (B=64 Hkv=8 S=1024 86.2 -> 79.5 us, B=64 S=8192 516.3 -> 500.2,
  // level to 1 % elsewhere), while at head_dim 64, where 4 slots already fit 4 blocks, three
  // were 6 % slower. docs/design.md has the table. Blocks of 8 or 16 warps keep the same ring
  // per warp (2 or 1 blocks per SM).
  static constexpr int SLOTS =
      smem_blocks(kWarps * 2 * (K_ELEMS + V_ELEMS) * static_cast<int>(sizeof(T))) >= 4 ? 4 : 3;
  // With an even slot count, even slots only ever hold K and odd ones V, so each slot is as
  // large as its contents (V rows may be padded); with an odd count, a slot holds either.
  static constexpr int SLOT_ELEMS = K_ELEMS > V_ELEMS ? K_ELEMS : V_ELEMS;
  static constexpr int WARP_ELEMS =
      SLOTS % 2 == 0 ? SLOTS / 2 * (K_ELEMS + V_ELEMS) : SLOTS * SLOT_ELEMS;
  __device__ __forceinline__ static int slot_offset(int slot) {
    return SLOTS % 2 == 0 ? slot / 2 * (K_ELEMS + V_ELEMS) + slot % 2 * K_ELEMS : slot * SLOT_ELEMS;
  }
  static constexpr int pipe_bytes(int warps) { return warps * WARP_ELEMS * static_cast<int>(sizeof(T)); }
  // Dynamic shared memory of a block of `warps` warps.
  static constexpr int smem_bytes(int warps) { return dynamic_smem(pipe_bytes(warps), warps); }

  // Copy piece i of a lane is piece lane + 32 i of a step. K pieces are [chunk][key] with 16
  // keys per chunk, so a lane keeps its key (lane % 16) and moves 2 chunks per i. V pieces are
  // [row][chunk]: where a row is a whole number of pieces per 32 lanes (32 % CHUNKS == 0), a
  // lane keeps its chunk and moves V_ROWS rows per i.
  static constexpr bool V_REGULAR = 32 % CHUNKS == 0;
  static constexpr int V_ROWS = V_REGULAR ? 32 / CHUNKS : 1;
  static constexpr int PIECES = CHUNKS * KEYS / 32;

  // What a lane's copies of any step have in common, computed once per block: the per-step
  // address arithmetic is then one add per piece (the copy loop was two-thirds integer
  // instructions before: 64-bit products, divisions and predicates per piece).
  struct CopyLane {
    const T* k;        // K piece 0 at key 0: chunk lane / 16, key lane % 16
    const T* v;        // V piece 0 at key 0: row lane / CHUNKS, chunk lane % CHUNKS
    int64_t k_stride;  // elements from K piece i to i + 1 (2 chunks)
    uint32_t k_dst;    // byte offset of K piece 0 in a K buffer
    uint32_t v_dst;    // byte offset of V piece 0's row in a V buffer
    int v_col;         // chunk of V piece 0 with the lane's part of the swizzle applied
  };
  __device__ __forceinline__ static CopyLane copy_lane(const AttendArgs<T>& a, int lane) {
    CopyLane c;
    c.k = a.k_head + (static_cast<int64_t>(lane / KEYS) * a.smax + lane % KEYS) * VEC;
    c.v = a.v_head + (lane / CHUNKS) * HEAD_DIM + (lane % CHUNKS) * VEC;
    c.k_stride = static_cast<int64_t>(32 / KEYS) * a.smax * VEC;
    c.k_dst = lane * 16;
    const int row = lane / CHUNKS;
    c.v_dst = row * V_STRIDE * static_cast<int>(sizeof(T));
    c.v_col = V_SWIZZLE ? (lane % CHUNKS) ^ (row & 7) : lane % CHUNKS;
    return c;
  }
  // Queue K (or V) of keys [it, it + KEYS) into the buffer at shared byte address buf. A step
  // whose keys all lie before full_end = min(end, pos) needs no predicates (no key past the
  // end, not the new token's slot); the others take issue_k / issue_v.
  __device__ __forceinline__ static void copy_k(const AttendArgs<T>& a, const CopyLane& c, int full_end,
                                                T* buf, int it, int lane) {
    if (it + KEYS <= full_end) {
      const T* src = c.k + static_cast<int64_t>(it) * VEC;
      const uint32_t dst = smem_addr(buf) + c.k_dst;
#pragma unroll
      for (int i = 0; i < PIECES; ++i) cp_async16(dst + i * 32 * 16, src + i * c.k_stride);
    } else {
      issue_k(a, buf, it, lane);
    }
  }
  // V row lane / CHUNKS + V_ROWS i has swizzle (lane / CHUNKS) ^ ((V_ROWS i) & 7), since
  // lane / CHUNKS < V_ROWS and V_ROWS is a power of two.
  __device__ __forceinline__ static void copy_v(const AttendArgs<T>& a, const CopyLane& c, int full_end,
                                                T* buf, int it, int lane) {
    if (V_REGULAR && it + KEYS <= full_end) {
      const T* src = c.v + static_cast<int64_t>(it) * HEAD_DIM;
      const uint32_t dst = smem_addr(buf) + c.v_dst;
#pragma unroll
      for (int i = 0; i < PIECES; ++i) {
        const int col = V_SWIZZLE ? c.v_col ^ ((V_ROWS * i) & 7) : c.v_col;
        cp_async16(dst + i * V_ROWS * V_STRIDE * static_cast<int>(sizeof(T)) + col * 16,
                   src + i * V_ROWS * HEAD_DIM);
      }
    } else {
      issue_v(a, buf, it, lane);
    }
  }

  // Queue the async copies of K (or V) of keys [it, it + KEYS) into one buffer. Keys past the
  // end, and the new token's slot (taken from shared memory instead), are zero-filled unread.
  __device__ static void issue_k(const AttendArgs<T>& a, T* buf, int it, int lane) {
#pragma unroll
    for (int i = 0; i < CHUNKS * KEYS / 32; ++i) {
      const int piece = lane + 32 * i;
      const int ch = piece / KEYS;
      const int t = it + piece % KEYS;
      const bool ok = t < a.end && t != a.pos;
      const T* src = ok ? a.k_head + (static_cast<int64_t>(ch) * a.smax + t) * VEC : a.k_head;
      cp_async16(buf + piece * VEC, src, ok);
    }
  }
  __device__ static void issue_v(const AttendArgs<T>& a, T* buf, int it, int lane) {
#pragma unroll
    for (int i = 0; i < CHUNKS * KEYS / 32; ++i) {
      const int piece = lane + 32 * i;
      const int row = piece / CHUNKS;
      const int ch = piece % CHUNKS;
      const int t = it + row;
      const bool ok = t < a.end && t != a.pos;
      const T* src = ok ? a.v_head + static_cast<int64_t>(t) * HEAD_DIM + ch * VEC : a.v_head;
      cp_async16(buf + v_off(row, ch), src, ok);
    }
  }

  // A warp's walk over the block's chunk. Step j of the chunk covers keys [start + 16 j, +16);
  // warp w of W takes steps w, w + W, ..., counted from step rot and wrapping around. Blocks of
  // different (row, kv head) start 37 steps apart: with power-of-two cache strides, blocks at the
  // same offset of different heads contend for the same DRAM banks (H200, B=16 Hkv=8 S=32768:
  // 500.5 -> 490.6 us; a cache padded to S_max = S + 16 gave the same gain without the rotation).
  struct Walk {
    T* pipe;       // this warp's ring
    CopyLane cl;
    int nsteps;    // steps of the block's chunk
    int steps;     // steps of this warp
    int rot;
    int full_end;  // keys before it need no predicates
    int warps;     // warps of the block
  };
  __device__ __forceinline__ static Walk walk(const AttendArgs<T>& a, unsigned char* dyn_smem) {
    unsigned char* smem = dyn_smem + (ALIGN - smem_addr(dyn_smem) % ALIGN) % ALIGN;
    const int warp = threadIdx.x / 32;
    Walk w;
    w.pipe = reinterpret_cast<T*>(smem) + warp * WARP_ELEMS;
    w.cl = copy_lane(a, threadIdx.x % 32);
    w.nsteps = (a.end - a.start + KEYS - 1) / KEYS;
    w.warps = a.warps;
    w.steps = warp < w.nsteps ? (w.nsteps - warp + w.warps - 1) / w.warps : 0;
    w.rot = static_cast<int>(a.kv_head * 37 % w.nsteps);
    w.full_end = min(a.end, a.pos);
    return w;
  }
  // First key of the warp's step i.
  __device__ __forceinline__ static int key_of(const AttendArgs<T>& a, const Walk& w, int i) {
    int j = threadIdx.x / 32 + w.warps * i + w.rot;
    j = j >= w.nsteps ? j - w.nsteps : j;
    return a.start + KEYS * j;
  }
  // Copy n of the ring: K (n even) or V (n odd) of step n / 2, into slot n % SLOTS.
  __device__ __forceinline__ static void issue(const AttendArgs<T>& a, const Walk& w, int n) {
    const int lane = threadIdx.x % 32;
    if (n / 2 < w.steps) {
      T* buf = w.pipe + slot_offset(n % SLOTS);
      if (n % 2 == 0) {
        copy_k(a, w.cl, w.full_end, buf, key_of(a, w, n / 2), lane);
      } else {
        copy_v(a, w.cl, w.full_end, buf, key_of(a, w, n / 2), lane);
      }
    }
    cp_async_commit();  // one group per copy, empty or not, so the waits below count copies
  }

  // Queues the ring's first SLOTS - 1 copies. The kernel calls it before its prologue (q, the
  // new token's K/V), so the cache reads are in flight while the prologue's own loads are: the
  // copies need nothing from it (the new token's slot is never read from the cache).
  __device__ __forceinline__ static void prefetch(const AttendArgs<T>& a, unsigned char* dyn_smem) {
    const Walk w = walk(a, dyn_smem);
#pragma unroll
    for (int n = 0; n < SLOTS - 1; ++n) issue(a, w, n);
  }

  // Runs the warp loop (after prefetch()), then leaves per-warp (max, sum, acc) in s_m, s_l and
  // the returned [warps][QB][HEAD_DIM] array, followed by a block barrier. dyn_smem: the
  // kernel's dynamic shared memory, smem_bytes(warps) bytes.
  __device__ __forceinline__ static const float* run(const AttendArgs<T>& a, float (*s_m)[QB], float (*s_l)[QB],
                                     unsigned char* dyn_smem, const float (&s_q)[QB][HEAD_DIM],
                                     const T (&s_new_k)[HEAD_DIM], const T (&s_new_v)[HEAD_DIM]) {
    unsigned char* smem = dyn_smem + (ALIGN - smem_addr(dyn_smem) % ALIGN) % ALIGN;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4;  // fragment row group
    const int tq = lane % 4;  // fragment column pair
    const Walk w = walk(a, dyn_smem);

    // B fragments of q^T (16 dims x 8 heads per K step), pre-scaled into the log2 domain:
    // lane holds head g, dims 16j + 2tq + {0, 1} (b0) and + 8 (b1), as hi and lo parts.
    uint32_t qh[KSTEPS][2], ql[KSTEPS][2];
#pragma unroll
    for (int j = 0; j < KSTEPS; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int d = 16 * j + 2 * tq + 8 * h;
        const float x = g < a.nh ? s_q[g][d] * a.scale_log2 : 0.f;
        const float y = g < a.nh ? s_q[g][d + 1] * a.scale_log2 : 0.f;
        split_pack<T>(x, y, qh[j][h], ql[j][h]);
      }
    }

    // Running max and sum of heads 2tq and 2tq + 1 (the fragment columns this lane holds).
    float m[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.f, 0.f};
    float acc[KSTEPS][4];
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
    }

    for (int i = 0; i < w.steps; ++i) {
      const int it = key_of(a, w, i);
      T* kb = w.pipe + slot_offset(2 * i % SLOTS);
      T* vb = w.pipe + slot_offset((2 * i + 1) % SLOTS);
      cp_async_wait<SLOTS - 2>();  // K(i) has landed
      __syncwarp();
      // Every lane is past step i - 1: the slot of V(i - 1) can be refilled.
      issue(a, w, 2 * i + SLOTS - 1);
      const bool has_new = it <= a.pos && a.pos < it + KEYS;  // warp-uniform
      if (has_new) {
        const int kk = a.pos - it;
        for (int c = lane; c < CHUNKS; c += 32) {
          *reinterpret_cast<uint4*>(kb + (c * KEYS + kk) * VEC) =
              *reinterpret_cast<const uint4*>(&s_new_k[c * VEC]);
        }
        __syncwarp();
      }

      // S^T = K Q^T: s[0], s[1] = key g, heads 2tq, 2tq + 1; s[2], s[3] = key g + 8.
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < KSTEPS; ++j) {
        uint32_t k[4];
        ldmatrix_x4<false>(k, kb + ((2 * j + lane / 16) * KEYS + lane % 16) * VEC);
        mma_16816<T>(s, k, qh[j][0], qh[j][1]);
        mma_16816<T>(s, k, ql[j][0], ql[j][1]);
      }
      if (it + g >= a.end) s[0] = s[1] = -INFINITY;
      if (it + g + 8 >= a.end) s[2] = s[3] = -INFINITY;

      // Online softmax per head over the 16 keys (8 lanes share a column pair). The reference
      // max m is raised only when some head of the warp has outgrown it by more than
      // kRescaleSlack (log2 units): most steps then skip rescaling acc, and P = 2^(s - m) stays
      // below 2^kRescaleSlack (acc and l share m, so the result is the same in exact arithmetic).
      float mx[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(s[h], s[h + 2]);
#pragma unroll
        for (int off = 4; off < 32; off *= 2) mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFullMask, mx[h], off));
      }
      if (__any_sync(kFullMask, mx[0] > m[0] + kRescaleSlack || mx[1] > m[1] + kRescaleSlack)) {
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float m_new = fmaxf(m[h], mx[h]);
          alpha[h] = m_new == -INFINITY ? 1.f : exp2f(m[h] - m_new);
          l[h] *= alpha[h];
          m[h] = m_new;
        }
#pragma unroll
        for (int i = 0; i < KSTEPS; ++i) {
          acc[i][0] *= alpha[0];
          acc[i][1] *= alpha[1];
          acc[i][2] *= alpha[0];
          acc[i][3] *= alpha[1];
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float m_ref = m[h] == -INFINITY ? 0.f : m[h];
        s[h] = exp2f(s[h] - m_ref);
        s[h + 2] = exp2f(s[h + 2] - m_ref);
        l[h] += s[h] + s[h + 2];
      }

      // P^T as B fragments: transpose the (key, head) fragment into (head, key) order.
      uint32_t ph0, pl0, ph1, pl1;
      split_pack<T>(s[0], s[1], ph0, pl0);
      split_pack<T>(s[2], s[3], ph1, pl1);
      ph0 = movmatrix_trans(ph0);
      pl0 = movmatrix_trans(pl0);
      ph1 = movmatrix_trans(ph1);
      pl1 = movmatrix_trans(pl1);

      cp_async_wait<SLOTS - 2>();  // V(i) has landed
      __syncwarp();
      // Every lane is done with K(i): its slot can be refilled.
      issue(a, w, 2 * i + SLOTS);
      if (has_new) {
        const int kk = a.pos - it;
        for (int c = lane; c < CHUNKS; c += 32) {
          *reinterpret_cast<uint4*>(vb + v_off(kk, c)) =
              *reinterpret_cast<const uint4*>(&s_new_v[c * VEC]);
        }
        __syncwarp();
      }

      // O^T += V^T P^T over 16-dim tiles: acc[i] = dims 16i + g (+ 8), heads 2tq (+ 1).
      const int v_row = lane % 8 + (lane / 16) * 8;
      const int v_half = (lane / 8) % 2;
#pragma unroll
      for (int i = 0; i < KSTEPS; ++i) {
        uint32_t vt[4];
        ldmatrix_x4<true>(vt, vb + v_off(v_row, 2 * i + v_half));
        mma_16816<T>(acc[i], vt, ph0, ph1);
        mma_16816<T>(acc[i], vt, pl0, pl1);
      }
    }
    cp_async_wait<0>();

    // Lane sums over the 8 lanes of a column pair; then everything to shared memory.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int off = 4; off < 32; off *= 2) l[h] += __shfl_xor_sync(kFullMask, l[h], off);
    }
    __syncthreads();  // every warp is done with its pipeline: the space becomes s_acc
    float* s_acc = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int head = 2 * tq + h;
      if (head < QB) {
        if (g == 0) {
          s_m[warp][head] = m[h];
          s_l[warp][head] = l[h];
        }
        float* dst = s_acc + (warp * QB + head) * HEAD_DIM + g;
#pragma unroll
        for (int i = 0; i < KSTEPS; ++i) {
          dst[16 * i] = acc[i][h];
          dst[16 * i + 8] = acc[i][h + 2];
        }
      }
    }
    __syncthreads();
    return s_acc;
  }
};

}  // namespace mmha
