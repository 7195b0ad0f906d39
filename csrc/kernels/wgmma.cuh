// Warpgroup matrix multiply-accumulate (wgmma, sm_90a): the four consumer warps of a tile-loop
// block as one warpgroup (warps 0-3), operands in shared memory named by matrix descriptors.
// Compiled where the device pass targets sm_90a (MMHA_WGMMA); elsewhere the wrappers are empty and
// callers take their mma.sync path. Torch-free.
//
// Descriptor layouts used here (checked against a float64 product on an H100):
// - K-major, no swizzle: 8 x 16-byte core matrices of 128 contiguous bytes; lbo = bytes between
//   core matrices along K (the next 8 elements of K), sbo = along M / N (the next 8 rows). A tile's
//   K ([CHUNKS][KEYS][16 B]) is this with lbo = KEYS * 16, sbo = 128; so is a q staging area in
//   the same form.
// - MN-major, 128-byte swizzle (TRANS_B = 1): rows of 128 bytes (64 N elements) along K, 16-byte
//   chunk c of row r at c ^ (r % 8), atoms of 8 rows; sbo = bytes between atoms along K (1024),
//   lbo = between 64-element blocks of N. A tile's V ([V_LINES][KEYS][128 B], the copy engine's
//   swizzle) is this with lbo = KEYS * 128.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MMHA_WGMMA 1
#else
#define MMHA_WGMMA 0
#endif

namespace mmha {

constexpr bool kWgmma = MMHA_WGMMA;

// A shared-memory matrix descriptor: start address, lbo and sbo in bytes (multiples of 16),
// swizzle128: the 128-byte swizzle (the start then lies in a 1024-byte aligned atom).
__device__ __forceinline__ uint64_t wgmma_desc(const void* p, int lbo, int sbo, bool swizzle128) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return static_cast<uint64_t>((a & 0x3FFFF) >> 4) | static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16 |
         static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32 | (swizzle128 ? uint64_t{1} << 62 : 0);
}

// Descriptor d with its start moved by `bytes` (a multiple of 16, the moved start still inside
// shared memory): one add to the low word, which holds the start (bits 0-13) and lbo (16-29); a
// start under 256 KB carries nothing into lbo. A batch's descriptors made this way from one
// wgmma_desc cost an add each instead of a conversion and three bit operations.
__device__ __forceinline__ uint64_t wgmma_desc_plus(uint64_t d, int bytes) {
  const uint32_t lo = static_cast<uint32_t>(d) + static_cast<uint32_t>(bytes >> 4);
  return (d & 0xFFFFFFFF00000000ull) | lo;
}

// Before the first wgmma of a batch: orders the warpgroup's register writes (accumulators, A).
__device__ __forceinline__ void wgmma_fence() {
#if MMHA_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

// Ends a batch without waiting for it (wgmma_wait: the batches still in flight may be at most N).
__device__ __forceinline__ void wgmma_commit() {
#if MMHA_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if MMHA_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// Ends a batch and waits for it: its accumulators are then the registers' values.
__device__ __forceinline__ void wgmma_commit_and_wait() {
  wgmma_commit();
  wgmma_wait<0>();
}

// One asm statement per shape, TYPE the operands' type ("f16" or "bf16").
#define MMHA_WGMMA_M64N64K16_SS(TYPE)                                                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                      \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                    \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "     \
               "%32, %33, p, 1, 1, 0, %35;\n}\n"                                                  \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
               : "l"(a_desc), "l"(b_desc), "r"(scale_d), "n"(TRANS_B))

#define MMHA_WGMMA_M64N64K16_RS(TYPE)                                                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                      \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                    \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "     \
               "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                                                  \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d), "n"(TRANS_B))

#define MMHA_WGMMA_M64N128K16_RS(TYPE)                                                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                      \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " "                    \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "     \
               "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"                                                  \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d), "n"(TRANS_B))

// D (64 x 64, fp32) = A B + (scale_d ? D : 0); A (64 x 16) and B from shared memory (descriptors). TRANS_B: B is stored MN-major (N
// contiguous). M: __half or __nv_bfloat16.
template <typename M, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t a_desc, uint64_t b_desc, int scale_d) {
#if MMHA_WGMMA
  if constexpr (std::is_same_v<M, __half>) {
    MMHA_WGMMA_M64N64K16_SS("f16");
  } else {
    MMHA_WGMMA_M64N64K16_SS("bf16");
  }
#endif
}

// D (64 x 64, fp32) = A B + (scale_d ? D : 0); A from registers (each warp its 16 rows, as an mma.m16n8k16 A fragment), B from
// shared memory. TRANS_B: B is stored MN-major (N
// contiguous). M: __half or __nv_bfloat16.
template <typename M, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b_desc, int scale_d) {
#if MMHA_WGMMA
  if constexpr (std::is_same_v<M, __half>) {
    MMHA_WGMMA_M64N64K16_RS("f16");
  } else {
    MMHA_WGMMA_M64N64K16_RS("bf16");
  }
#endif
}

// D (64 x 128, fp32) = A B + (scale_d ? D : 0); A from registers (each warp its 16 rows, as an mma.m16n8k16 A fragment), B from
// shared memory. TRANS_B: B is stored MN-major (N
// contiguous). M: __half or __nv_bfloat16.
template <typename M, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b_desc, int scale_d) {
#if MMHA_WGMMA
  if constexpr (std::is_same_v<M, __half>) {
    MMHA_WGMMA_M64N128K16_RS("f16");
  } else {
    MMHA_WGMMA_M64N128K16_RS("bf16");
  }
#endif
}

// A warpgroup's registers per thread moved at run time (sm_90a; every thread of the warpgroup runs
// it, converged): RAISE waits until the SM's pool has them, else they go back to the pool.
// Elsewhere (no wgmma) nothing moves.
template <bool RAISE, int REGS>
__device__ __forceinline__ void setmaxnreg() {
  static_assert(REGS >= 24 && REGS <= 256 && REGS % 8 == 0, "setmaxnreg: 24-256 registers, in steps of 8");
#if MMHA_WGMMA
  if constexpr (RAISE) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
  }
#endif
}

#undef MMHA_WGMMA_M64N64K16_SS
#undef MMHA_WGMMA_M64N64K16_RS
#undef MMHA_WGMMA_M64N128K16_RS

}  // namespace mmha
