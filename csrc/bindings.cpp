// Every operator schema of mmha, and the Python module that carries them.
#include <torch/extension.h>
#include <torch/library.h>

#include "kernels/decode_launch.h"
#include "kernels/mmha_params.h"
#include "mmha_ops.h"

TORCH_LIBRARY(mmha, m) {
  // Caches, outputs, the split workspace and the status flags are mutated in place; lengths are
  // only read (check_lengths: range-checked on the host first, one synchronisation).
  m.def(
      "decode_attention(Tensor qkv, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor lengths, "
      "Tensor? qkv_bias, Tensor(c!) out, Tensor(d!) lse, Tensor(e!) partials, "
      "Tensor(f!) counters, Tensor(g!) status, int num_heads, int num_kv_heads, float scale, "
      "int rotary_dim, float rotary_theta, bool rotary_interleaved, int num_splits, "
      "bool check_lengths=True, int stages=2, int tile_source=0, Tensor? k_scale=None, "
      "Tensor? v_scale=None, int window=0, float softcap=0.0, Tensor? alibi_slopes=None, "
      "Tensor? sinks=None, Tensor? parents=None, Tensor? node_counts=None, Tensor? block_tables=None, "
      "Tensor? row_active=None, Tensor? out_shift=None, Tensor? out_smooth=None, Tensor? out_scales=None, "
      "float out_scale=0.0, int out_round=0, int out_min=-127, Tensor? positions=None, "
      "Tensor? rotary_inv_freq=None, float rotary_factor=1.0, int rotary_table_start=0, "
      "Tensor? q_norm_weight=None, Tensor? k_norm_weight=None, float qk_norm_eps=0.0, "
      "bool qk_norm_cast_first=True, Tensor? k_zero=None, Tensor? v_zero=None, Tensor(h!)? k_residual=None, bool wide_pairs=False) -> ()");
  // mmha.distributed's sequence steps: a shard's (out, lse) into the fp32 buffer the collective
  // carries, and the exact merge of every shard's buffer (csrc/kernels/shard_merge.h).
  m.def("shard_pack(Tensor out, Tensor lse, Tensor(a!) parts) -> ()");
  m.def("shard_merge(Tensor parts, Tensor? sinks, Tensor(a!) out, Tensor(b!) lse) -> ()");
  // A transformer layer's RMSNorm, or a fused qkv row's per-head q/k norms in place (out = x), in
  // one launch (csrc/kernels/row_norm.h).
  m.def("rms_norm(Tensor x, Tensor(a!) out, Tensor[] weights, int[] layout, float[] eps, float offset, "
        "bool cast_first) -> ()");
}

// The CUDA kernel; the CPU entry exists only to reject CPU tensors with a message naming them.
TORCH_LIBRARY_IMPL(mmha, CUDA, m) {
  m.impl("decode_attention", &mmha::decode_attention);
  m.impl("shard_pack", &mmha::shard_pack);
  m.impl("shard_merge", &mmha::shard_merge);
  m.impl("rms_norm", &mmha::rms_norm);
}
TORCH_LIBRARY_IMPL(mmha, CPU, m) {
  m.impl("decode_attention", &mmha::decode_attention);
  m.impl("shard_pack", &mmha::shard_pack);
  m.impl("shard_merge", &mmha::shard_merge);
  m.impl("rms_norm", &mmha::rms_norm);
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "mmha CUDA extension: registers torch.ops.mmha.* and reports what was compiled";
  m.def("compiled_cuda_archs", &mmha::compiled_cuda_archs,
        "SM architectures this build holds device code for, e.g. '80 86 89 90'");
  m.def(
      "blocks_per_sm",
      [](int dtype, int head_dim, int q_group_block, int stages, int tile_source, int cache_dtype) {
        return mmha::decode_blocks_per_sm(static_cast<mmha::DType>(dtype),
                                          static_cast<mmha::DType>(cache_dtype < 0 ? dtype : cache_dtype), head_dim,
                                          q_group_block, stages, static_cast<mmha::TileSource>(tile_source));
      },
      pybind11::arg("dtype"), pybind11::arg("head_dim"), pybind11::arg("q_group_block"),
      pybind11::arg("stages"), pybind11::arg("tile_source") = 1, pybind11::arg("cache_dtype") = -1,
      "Resident blocks per SM of the decode kernel with `stages` stages on the current device "
      "(dtype: 0 fp16, 1 bf16, 2 fp32; cache_dtype: the same, 3 fp8 e4m3, -1 = dtype; tile_source: "
      "1 cp.async, 2 tma); 0 when it cannot run there");
  m.def(
      "columns_block",
      [](int64_t columns, bool tree, bool tiles, int head_dim, int64_t kv_rows, bool epilogue) {
        return mmha::columns_block(columns, tree, tiles, head_dim, kv_rows, epilogue);
      },
      pybind11::arg("columns"), pybind11::arg("tree"), pybind11::arg("tiles"), pybind11::arg("head_dim"),
      pybind11::arg("kv_rows"), pybind11::arg("epilogue") = false,
      "Query columns per work item for `columns` columns per (row, kv head)");
  m.def(
      "fast_divisor",
      [](uint32_t d) {
        const mmha::FastDivisor f = mmha::make_fast_divisor(d);
        return pybind11::make_tuple(f.mul, f.shift);
      },
      pybind11::arg("d"),
      "(mul, shift) of the work items' division by d (FastDivisor): n / d = (umulhi(n, mul) + n) >> shift");
  m.def("build_check", &mmha::build_check,
        "Whether this build is a build check (MMHA_BUILD_CHECK=1: unoptimised PTX, its operators launch nothing)");
  m.def("kernel_sets", &mmha::kernel_sets,
        "The decode kernel sets this build holds (all but where MMHA_KERNELS chose some at build time)");
  m.def("timeline_built", &mmha::timeline_built,
        "Whether this build stamps the tile loop's per-block events (MMHA_TIMELINE=1 at build time)");
  m.def("set_timeline", &mmha::set_timeline, pybind11::arg("buffer"),
        "Later launches stamp block j's events into buffer[j] (int64 [blocks, TIMELINE_EVENTS], CUDA); "
        "None stops. MMHA_TIMELINE builds only");
  m.attr("TIMELINE_EVENTS") = static_cast<int>(mmha::kTimelineEvents);
}
