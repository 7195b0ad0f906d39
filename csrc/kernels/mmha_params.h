// Plain parameter block shared by the host launcher and the kernels. Torch-free.
#pragma once

#include <cstdint>

namespace mmha {

enum class DType : int32_t { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

// Supported configuration, mirrored in mmha/dispatch.py (tests/test_dispatch.py checks both agree).
constexpr int kSupportedHeadDims[] = {32, 64, 80, 96, 128, 256};
constexpr int kNumSupportedHeadDims = sizeof(kSupportedHeadDims) / sizeof(int);
// Query heads of one kv head handled by one block: a group of G heads is cut into blocks of
// kQGroupBlocks[i] >= G (or 8 when G > 8), so K/V is read once per group for G <= 8.
constexpr int kQGroupBlocks[] = {1, 2, 4, 8};
constexpr int kNumQGroupBlocks = sizeof(kQGroupBlocks) / sizeof(int);
// Upper bound on sequence splits: the merge keeps one weight per split in shared memory.
constexpr int kMaxSplits = 64;
// Warps per block. Each warp runs its own online softmax over its keys (no block barrier in the
// loop). The CUDA-core loop always runs kWarps; the tensor-core loop runs any of kWarpChoices
// (params.warps, picked by mmha/dispatch.py): bigger blocks put more of a (row, kv head)'s keys
// in flight at once on a small grid without cutting it into more splits.
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kWarpChoices[] = {4, 8, 16};
constexpr int kNumWarpChoices = sizeof(kWarpChoices) / sizeof(int);
constexpr int kMaxWarps = 16;

// Whether the kernel runs its tensor-core loop (fp16 / bf16 caches, head_dim <= 128) rather
// than the CUDA-core one; mirrored by uses_tensor_cores in mmha/dispatch.py.
constexpr bool uses_tensor_cores(DType dtype, int head_dim) {
  return dtype != DType::kFloat32 && head_dim <= 128;
}

// Whether blocks of `warps` warps can run for this dtype and head dim.
constexpr bool warps_supported(DType dtype, int head_dim, int warps) {
  if (!uses_tensor_cores(dtype, head_dim)) return warps == kWarps;
  for (int i = 0; i < kNumWarpChoices; ++i) {
    if (kWarpChoices[i] == warps) return true;
  }
  return false;
}

struct MmhaParams {
  const void* qkv;           // [B, (Hq + 2 * Hkv) * D], row stride qkv_row_stride elements
  const void* qkv_bias;      // [(Hq + 2 * Hkv) * D] or nullptr
  void* k_cache;             // [B, Hkv, D / x, S_max, x], x = 16 / sizeof(T)
  void* v_cache;             // [B, Hkv, S_max, D]
  const int32_t* lengths;    // [B]: tokens already cached; the new token goes to slot lengths[b]
  void* out;                 // [B, Hq * D]
  float* lse;                // [B, Hq], natural-log log-sum-exp of the scaled logits
  float* partials;           // [B, Hq, num_splits, D + 2]: (acc[D], max, sum); num_splits > 1 only
  int32_t* counters;         // [B, Hkv * q_groups]: zero on entry, left zero on exit

  int64_t qkv_row_stride;    // elements between rows of qkv
  int32_t batch;
  int32_t num_heads;         // Hq
  int32_t num_kv_heads;      // Hkv
  int32_t head_dim;          // D
  int32_t max_seq_len;       // S_max
  int32_t q_group_block;     // query heads per block (one of kQGroupBlocks)
  int32_t q_groups;          // ceil((Hq / Hkv) / q_group_block)
  int32_t num_splits;        // 1: single pass; > 1: split sequence with in-kernel merge
  int32_t warps;             // warps per block: kWarps, or any of kWarpChoices on tensor cores
  float scale;               // softmax scale, usually 1 / sqrt(D)
  int32_t rotary_dim;        // 0: no rotary embedding; else even, <= D
  float rotary_theta;
  bool rotary_interleaved;   // true: GPT-J pairs (2i, 2i + 1); false: GPT-NeoX halves (i, i + rd / 2)
  DType dtype;
};

}  // namespace mmha
