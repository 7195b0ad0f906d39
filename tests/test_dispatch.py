"""choose_variant on a table of cases; Python and C++ constants agree."""

from pathlib import Path

import pytest
import torch

from mmha import dispatch
from mmha._ext import _C

H100_SMS = 132
F16 = torch.float16

# (batch, Hq, Hkv, D, seq_len, blocks_per_sm, expected); fp16, so head_dim <= 128 runs the
# tensor-core loop ("grouped" where a block holds several query heads) and head_dim 256 the
# CUDA-core loop.
CASES = [
    # The docstring's examples: small tensor-core grids run as 8-warp blocks.
    (1, 32, 32, 128, 4096, 4, dispatch.Plan("split", 8, 8)),  # 264 // 32; 4096 // 256 allows 16
    (1, 32, 8, 128, 4096, 4, dispatch.Plan("split", 16, 8)),  # 132 // 8 = 16; 4096 // 256 = 16
    (64, 32, 32, 128, 4096, 4, dispatch.Plan("split", 2)),  # 2048 base blocks; 4096 // 2048
    (64, 32, 32, 128, 2048, 4, dispatch.Plan("single_pass", 1)),
    (1, 32, 32, 128, 100, 4, dispatch.Plan("single_pass", 1, 8)),  # too short to split
    (1, 32, 32, 128, 256, 4, dispatch.Plan("single_pass", 1, 8)),  # 8-warp splits keep 256 keys
    (1, 32, 32, 128, 512, 4, dispatch.Plan("split", 2, 8)),
    (1, 32, 8, 128, 256, 4, dispatch.Plan("single_pass", 1, 8)),  # grouped splits keep >= 256 keys
    (1, 32, 4, 128, 65536, 4, dispatch.Plan("split", 33, 8)),  # grouped wide: one block per SM
    (1, 32, 8, 128, 65536, 4, dispatch.Plan("split", 16, 16)),  # 4096 keys: 16 warps of >= 128
    (16, 32, 8, 128, 2048, 4, dispatch.Plan("single_pass", 1, 16)),  # 128 blocks: one per SM
    (16, 32, 8, 128, 1024, 4, dispatch.Plan("single_pass", 1, 8)),  # 1024 keys: 8 warps
    (16, 32, 32, 128, 512, 4, dispatch.Plan("single_pass", 1)),  # 512 blocks: past a wide wave
    (16, 32, 32, 128, 512, 2, dispatch.Plan("single_pass", 1)),
    (4, 32, 32, 128, 8192, 2, dispatch.Plan("single_pass", 1, 8)),  # 128 <= 132 wide blocks
    # MQA: 8 blocks of 8 heads; 132 // 8 = 16 splits of 8 warps.
    (1, 64, 1, 128, 8192, 2, dispatch.Plan("split", 16, 8)),
    (1, 32, 8, 128, 4096, 3, dispatch.Plan("split", 16, 8)),
    (1, 32, 32, 128, 1024, 4, dispatch.Plan("split", 4, 8)),  # 1024 // 256: two steps per warp
    (1, 32, 32, 256, 1024, 4, dispatch.Plan("split", 8)),  # CUDA-core loop: 4 warps, 1024 // 128
    # Grouped grids between one and two blocks per SM stay on 4-warp blocks (2 per SM).
    (32, 32, 8, 128, 2048, 4, dispatch.Plan("single_pass", 1)),
    # One head per block past a wide wave (264) but inside a 4-warp one (528): 4 warps, filled.
    (9, 32, 32, 128, 2048, 4, dispatch.Plan("single_pass", 1)),
    (9, 32, 32, 128, 4096, 4, dispatch.Plan("split", 2)),  # one-head 4-warp blocks: <= 2048 keys
    (5, 32, 32, 128, 4096, 4, dispatch.Plan("single_pass", 1, 8)),  # 160 <= 264
    # CUDA-core loop: one wave of 8192-key blocks is cut to 4096 keys per block.
    (16, 32, 32, 256, 8192, 4, dispatch.Plan("split", 2)),
    (16, 32, 32, 256, 32768, 4, dispatch.Plan("split", 8)),
    (64, 32, 32, 256, 16384, 4, dispatch.Plan("split", 4)),
    (64, 32, 32, 256, 4096, 4, dispatch.Plan("single_pass", 1)),
    # Tensor cores: grouped blocks have no key cap, and a grid inside one wave runs as it is.
    (16, 32, 32, 128, 8192, 4, dispatch.Plan("split", 4)),  # one head per block: 2048 keys
    (64, 32, 8, 128, 8192, 4, dispatch.Plan("single_pass", 1)),
    (16, 32, 8, 128, 32768, 3, dispatch.Plan("single_pass", 1, 16)),
    # A grid past one wave: 512 blocks on a 396-block wave take 2 waves; 3 splits, 4 full ones.
    (64, 32, 8, 128, 8192, 3, dispatch.Plan("split", 3)),
    (16, 32, 32, 128, 8192, 3, dispatch.Plan("split", 4)),  # 3 for the waves, 4 for the key cap
    (64, 32, 32, 128, 16384, 4, dispatch.Plan("split", 8)),
    # 2048 blocks: 6 waves; 2 splits (all S=256 allows) only reach 5.5, short of 10 %.
    (64, 32, 32, 256, 256, 3, dispatch.Plan("single_pass", 1)),
]


def test_uses_tensor_cores():
    assert dispatch.uses_tensor_cores(128, torch.float16)
    assert dispatch.uses_tensor_cores(64, torch.bfloat16)
    assert dispatch.uses_tensor_cores(32, torch.float16)
    assert not dispatch.uses_tensor_cores(256, torch.float16)
    assert not dispatch.uses_tensor_cores(128, torch.float32)


def test_wave_cost():
    assert [dispatch.wave_cost(n, 396) for n in (1, 396, 397, 512, 1536)] == [1, 1, 2, 2, 4]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}_Hq{c[1]}_Hkv{c[2]}_S{c[4]}_bps{c[5]}")
def test_choose_variant_table(case):
    b, hq, hkv, d, s, bps, expected = case
    assert dispatch.choose_variant(b, hq, hkv, d, s, F16, H100_SMS, blocks_per_sm=bps) == expected


def test_forced_variants():
    assert dispatch.choose_variant(64, 32, 32, 128, 4096, F16, 132, "single_pass").num_splits == 1
    forced = dispatch.choose_variant(64, 32, 32, 128, 4096, F16, 132, "split")
    assert forced.variant == "split" and forced.num_splits >= 2
    # A small grid: single pass keeps the wide blocks, a forced split runs 4-warp blocks.
    assert dispatch.choose_variant(16, 32, 8, 128, 2048, F16, 132, "single_pass") == dispatch.Plan(
        "single_pass", 1, 16
    )
    assert dispatch.choose_variant(16, 32, 8, 128, 2048, F16, 132, "split") == dispatch.Plan("split", 2)


def test_wide_blocks_per_sm_sets_the_wide_wave():
    # One head per block, 160 base blocks: a wave of 132 wide blocks is too small, one of 264 not.
    args = (5, 32, 32, 128, 4096, F16, 132, "auto", 4)
    assert dispatch.choose_variant(*args, wide_blocks_per_sm=1) == dispatch.Plan("split", 3)  # 528 // 160
    assert dispatch.choose_variant(*args, wide_blocks_per_sm=2) == dispatch.Plan("single_pass", 1, 8)
    # No wide blocks off the tensor-core loop.
    assert dispatch.choose_variant(1, 32, 8, 128, 4096, torch.float32, 132).warps == dispatch.WARPS


def test_pure_function_of_its_arguments():
    args = (3, 16, 4, 64, 3000, torch.bfloat16, 114)
    assert dispatch.choose_variant(*args) == dispatch.choose_variant(*args)


def test_rejects_bad_arguments():
    with pytest.raises(
        ValueError, match=r"Unsupported head_dim: 72 \(supported: \(32, 64, 80, 96, 128, 256\)\)"
    ):
        dispatch.choose_variant(1, 8, 8, 72, 100, F16, 132)
    with pytest.raises(ValueError, match=r"num_heads \(32\) must be divisible by num_kv_heads \(6\)"):
        dispatch.choose_variant(1, 32, 6, 128, 100, F16, 132)
    with pytest.raises(ValueError, match="variant must be one of"):
        dispatch.choose_variant(1, 8, 8, 128, 100, F16, 132, "fast")
    with pytest.raises(ValueError, match="dtype must be one of"):
        dispatch.choose_variant(1, 8, 8, 128, 100, torch.int8, 132)


def test_q_group_block():
    assert [dispatch.q_group_block(g) for g in (1, 2, 3, 4, 5, 8, 16, 32)] == [1, 2, 4, 4, 8, 8, 8, 8]


@pytest.mark.skipif(_C is None, reason="extension not built")
def test_python_and_cpp_constants_agree():
    assert tuple(_C.SUPPORTED_HEAD_DIMS) == dispatch.SUPPORTED_HEAD_DIMS
    assert tuple(_C.Q_GROUP_BLOCKS) == dispatch.Q_GROUP_BLOCKS
    assert _C.MAX_SPLITS == dispatch.MAX_SPLITS
    assert _C.WARPS == dispatch.WARPS
    assert tuple(_C.WARP_CHOICES) == dispatch.WARP_CHOICES


def test_every_dtype_and_head_dim_has_an_instantiation_file():
    root = Path(__file__).parent.parent / "csrc" / "kernels" / "instantiations"
    for name in ("fp16", "bf16", "fp32"):
        for d in dispatch.SUPPORTED_HEAD_DIMS:
            text = (root / f"decode_{name}_hd{d}.cu").read_text()
            for qb in dispatch.Q_GROUP_BLOCKS:
                assert f", {d}, {qb}>(" in text
