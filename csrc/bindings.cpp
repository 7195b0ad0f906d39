// Every operator schema of mmha, and the Python module that carries them.
#include <torch/extension.h>
#include <torch/library.h>

#include "kernels/decode_launch.h"
#include "kernels/mmha_params.h"
#include "mmha_ops.h"

TORCH_LIBRARY(mmha, m) {
  // Caches, outputs and the split workspace are mutated in place; lengths are only read
  // (check_lengths: range-checked on the host first, one synchronisation).
  m.def(
      "decode_attention(Tensor qkv, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor lengths, "
      "Tensor? qkv_bias, Tensor(c!) out, Tensor(d!) lse, Tensor(e!) partials, "
      "Tensor(f!) counters, int num_heads, int num_kv_heads, float scale, int rotary_dim, "
      "float rotary_theta, bool rotary_interleaved, int num_splits, bool check_lengths=True, "
      "int warps=4) -> ()");
}

// The CUDA kernel; the CPU entry exists only to reject CPU tensors with a message naming them.
TORCH_LIBRARY_IMPL(mmha, CUDA, m) { m.impl("decode_attention", &mmha::decode_attention); }
TORCH_LIBRARY_IMPL(mmha, CPU, m) { m.impl("decode_attention", &mmha::decode_attention); }

PYBIND11_MODULE(_C, m) {
  m.doc() = "mmha CUDA extension: registers torch.ops.mmha.* and reports what was compiled";
  m.def("compiled_cuda_archs", &mmha::compiled_cuda_archs,
        "SM architectures this build holds device code for, e.g. '80 86 89 90'");
  m.def(
      "blocks_per_sm",
      [](int dtype, int head_dim, int q_group_block, int warps) {
        return mmha::decode_blocks_per_sm(static_cast<mmha::DType>(dtype), head_dim, q_group_block,
                                          warps);
      },
      pybind11::arg("dtype"), pybind11::arg("head_dim"), pybind11::arg("q_group_block"),
      pybind11::arg("warps") = mmha::kWarps,
      "Resident blocks of `warps` warps per SM of the decode kernel on the current device (dtype: "
      "0 fp16, 1 bf16, 2 fp32); 0 when it cannot run there");
  pybind11::list head_dims;
  for (int d : mmha::kSupportedHeadDims) head_dims.append(d);
  m.attr("SUPPORTED_HEAD_DIMS") = pybind11::tuple(head_dims);
  pybind11::list blocks;
  for (int qb : mmha::kQGroupBlocks) blocks.append(qb);
  m.attr("Q_GROUP_BLOCKS") = pybind11::tuple(blocks);
  m.attr("MAX_SPLITS") = mmha::kMaxSplits;
  m.attr("WARPS") = mmha::kWarps;
  pybind11::list warp_choices;
  for (int w : mmha::kWarpChoices) warp_choices.append(w);
  m.attr("WARP_CHOICES") = pybind11::tuple(warp_choices);
}
