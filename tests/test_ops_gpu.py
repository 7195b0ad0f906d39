"""The CUDA kernel against mmha.reference (RELIABILITY.md rows 1-5, 10, 12-19, 21, 23)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    DTYPES,
    assert_bits_equal,
    check_against_reference,
    check_cache_writes,
    gpu,
    make_case,
    raw_args,
    run_reference,
)

from mmha import dispatch, ops
from mmha._constants import ROW_STEP

pytestmark = gpu

HEAD_DIMS = dispatch.SUPPORTED_HEAD_DIMS
# Forced variants: single pass, split with the dispatcher's count, and odd split counts.
SPLITS = {"single_pass": 1, "split2": 2, "split3": 3, "split7": 7, "split64": 64}


def run_kernel(case, num_splits=None, variant="auto", **kw):
    out, lse = ops.decode_attention(
        case.qkv, case.k_cache, case.v_cache, case.lengths, num_splits=num_splits,
        variant=variant, return_lse=True, **case.kwargs(), **kw,
    )  # fmt: skip
    return out, lse


def check_case(case, num_splits=None, variant="auto", **kw):
    """Kernel vs reference: output within tolerance, caches bit-identical to the fp32 reference."""
    _, _, ref_k, ref_v = run_reference(case)
    out, lse = run_kernel(case, num_splits, variant, **kw)
    torch.cuda.synchronize()
    check_against_reference(case, out, lse)
    check_cache_writes(case, ref_k, ref_v)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("variant", ["single_pass", "split3"])
def test_head_dims_and_dtypes(dtype, head_dim, variant):
    lengths = [0, 1, 37, 300, 511]  # last row fills the cache to exactly S_max
    case = make_case(5, 4, 2, head_dim, lengths, 512, dtype, seed=head_dim)
    check_case(case, SPLITS[variant])


@pytest.mark.parametrize(
    "heads", [(8, 8), (8, 4), (8, 2), (16, 2), (16, 1), (12, 4), (24, 4), (32, 8)], ids=str
)
@pytest.mark.parametrize("variant", ["single_pass", "split7", "auto"])
def test_gqa_groups(heads, variant):
    hq, hkv = heads
    case = make_case(3, hq, hkv, 128, [5, 250, 1023], 1024, torch.float16, seed=hq * 31 + hkv)
    check_case(case, SPLITS.get(variant), "auto")


TILE_DTYPES = [torch.float16, torch.bfloat16]
TMA_HEAD_DIMS = [d for d in HEAD_DIMS if d % 64 == 0]


@pytest.mark.parametrize("dtype", TILE_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", TMA_HEAD_DIMS)
@pytest.mark.parametrize("splits", [1, 3])
def test_tile_sources_agree_bit_for_bit(dtype, head_dim, splits):
    # The bulk-tensor-copy source and the cp.async one (what sm_80/86/89 run) fill the same
    # stage layout: same output bits, same cache writes; rows whose new token sits at the first,
    # last and a middle key of a tile, and one that fills the cache to S_max.
    lengths = [0, 63, 64, 100, 1000, 4095]
    outs = []
    for source in ("cp_async", "tma"):
        case = make_case(len(lengths), 8, 2, head_dim, lengths, 4096, dtype, seed=head_dim + splits)
        outs.append(check_case(case, splits, tile_source=source))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", TILE_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("heads", [(8, 8), (8, 4), (16, 4), (32, 4)], ids=str)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("source", ["cp_async", "tma"])
def test_lean_kernels_agree_with_the_others_bit_for_bit(dtype, head_dim, heads, splits, source):
    # A call with none of the features lean kernels leave out runs a lean unit's kernel
    # (csrc/kernels/lean_kernels.h); the same call with every row's mode given (ROW_STEP, the
    # same step) runs the kernel that has them all. Same output, lse and cache writes, bit for
    # bit, and the lean one matches the reference.
    hq, hkv = heads
    lengths = [0, 63, 64, 100, 1000, 4095]
    modes = torch.full((len(lengths),), ROW_STEP, dtype=torch.int32, device="cuda")
    runs = []
    for row_active in (None, modes):
        case = make_case(len(lengths), hq, hkv, head_dim, lengths, 4096, dtype, seed=head_dim + hq + splits)
        if row_active is None:
            _, _, ref_k, ref_v = run_reference(case)
        out, lse = run_kernel(case, splits, tile_source=source, row_active=row_active)
        torch.cuda.synchronize()
        if row_active is None:
            check_against_reference(case, out, lse)
            check_cache_writes(case, ref_k, ref_v)
        runs.append((out, lse, case.k_cache, case.v_cache))
    for what, a, b in zip(("out", "lse", "k cache", "v cache"), *runs, strict=True):
        assert_bits_equal(a, b, what)


def test_capacity_not_a_multiple_of_32_runs_cp_async():
    # The K tensor map sees each chunk as groups of 32 keys: other capacities take cp.async (auto),
    # and asking for bulk copies says why not.
    lengths = [0, 64, 500, 1022]
    case = make_case(len(lengths), 8, 2, 128, lengths, 1023, torch.float16, seed=5)
    check_case(case, 3)
    with pytest.raises(
        RuntimeError, match=r"tile_source 2 \(tma\) needs .* S_max a multiple of 32, got S_max 1023"
    ):
        run_kernel(case, 3, tile_source="tma")


@pytest.mark.parametrize("dtype", TILE_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [32, 80, 96])
def test_padded_head_dims_on_cp_async(dtype, head_dim):
    # Head dims that are not a multiple of 64 run the cp.async source everywhere (padded V rows).
    lengths = [0, 64, 500, 1023]
    case = make_case(len(lengths), 8, 4, head_dim, lengths, 1024, dtype, seed=head_dim)
    check_case(case, 3)
    with pytest.raises(RuntimeError, match="tile_source 2 \\(tma\\) needs float16 or bfloat16 caches"):
        run_kernel(case, 3, tile_source="tma")


@pytest.mark.parametrize("source", ["cp_async", "tma"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_every_stage_count(source, head_dim):
    # Rings of 2 stages up to what one block may hold: the same bits (only the depth of the
    # pipeline changes), including walks longer than the ring and shorter than it.
    lengths = [10, 200, 3000]
    dev = ops.device_spec(torch.cuda.current_device())
    most = dispatch.max_stages(head_dim, 2, dev, dispatch.q_group_block(4))
    outs = []
    for stages in range(dispatch.MIN_STAGES, most + 1):
        case = make_case(3, 8, 2, head_dim, lengths, 3072, torch.float16, seed=head_dim)
        outs.append(check_case(case, 2, stages=stages, tile_source=source))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_stages_past_shared_memory_rejected():
    case = make_case(2, 8, 2, 256, [10, 20], 64, torch.float16, seed=1)
    most = dispatch.max_stages(
        256, 2, ops.device_spec(torch.cuda.current_device()), dispatch.q_group_block(4)
    )
    with pytest.raises(RuntimeError, match=rf"stages must be in \[2, {most}\] for head_dim 256"):
        run_kernel(case, 1, stages=most + 1)


@pytest.mark.parametrize("heads", [(8, 8), (8, 1), (12, 4), (32, 8), (64, 1)], ids=str)
@pytest.mark.parametrize("splits", [1, 2, 7, 64])
def test_query_groups_on_tiles(heads, splits):
    # 1, 2, 4 and 8 query heads per block, MQA with several blocks per kv head (64:1).
    hq, hkv = heads
    case = make_case(3, hq, hkv, 128, [3, 700, 2047], 2048, torch.float16, seed=hq * 7 + hkv + splits)
    check_case(case, splits)


def test_tiles_repeat_bit_equal():
    case = make_case(4, 32, 8, 128, [100, 1500, 4095, 2222], 4096, torch.bfloat16, seed=9)
    k0, v0 = case.clone_caches()
    outs = []
    for _ in range(5):
        case.k_cache, case.v_cache = k0.clone(), v0.clone()
        outs.append(run_kernel(case, 4))
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])


STRADDLE = [
    1,
    2,
    5,
    15,
    16,
    17,
    63,
    64,
    65,
    97,
    127,
    128,
    129,
    191,
    192,
    193,
    239,
    255,
    256,
    257,
    3577,
    16385,
]


@pytest.mark.parametrize("variant", ["single_pass", "split7", "split64", "auto"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_lengths_straddle_tiles_and_thresholds(variant, dtype):
    # Lengths around a consumer warp's 16 keys, the 64-key tile, and split boundaries.
    lengths = [n - 1 for n in STRADDLE]  # the new token makes n keys
    case = make_case(len(lengths), 8, 2, 128, lengths, 16400, dtype, seed=7)
    check_case(case, SPLITS.get(variant))


@pytest.mark.parametrize("batch", [1, 3, 17, 60, 128])
def test_odd_batches(batch):
    g = torch.Generator().manual_seed(batch)
    lengths = torch.randint(0, 700, (batch,), generator=g).tolist()
    case = make_case(batch, 8, 8, 64, lengths, 700, torch.bfloat16, seed=batch)
    check_case(case)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_and_bias(interleaved, rotary_fraction, bias, dtype):
    head_dim = 128
    case = make_case(
        4, 8, 2, head_dim, [0, 3, 700, 4000], 4096, dtype, seed=11, bias=bias,
        rotary_dim=int(head_dim * rotary_fraction), rotary_interleaved=interleaved,
    )  # fmt: skip
    check_case(case, 5)


@pytest.mark.parametrize("factor", [1.0, 1.25], ids=["no-factor", "factor"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_frequency_table(dtype, interleaved, factor):
    """A rotation given as a frequency table (any of transformers' variants) and an attention
    factor on cos and sin: the kernel against the reference, partial rotary, long positions."""
    case = make_case(
        4, 8, 2, 128, [0, 3, 700, 4000], 4096, dtype, seed=12, bias=True, rotary_dim=96,
        rotary_interleaved=interleaved,
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    table = (torch.rand(48, generator=g) ** 4).cuda()  # frequencies from ~1 down to ~1e-8
    case.rotary.update(inv_freq=table, attention_factor=factor)
    check_case(case, 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_table_by_length(dtype):
    """A table of rows by the sequence's length (dynamic NTK, longrope): each row rotates by the
    row of its length (before the start, between, past the last row), against the reference."""
    case = make_case(
        5, 8, 2, 128, [3, 99, 100, 101, 3000], 4096, dtype, seed=14, bias=True, rotary_dim=128,
    )  # fmt: skip
    g = torch.Generator().manual_seed(4)
    table = (torch.rand(4, 64, generator=g) ** 4).cuda()  # lengths <= 100, 101, 102, >= 103
    case.rotary.update(inv_freq=table, table_start=100)
    check_case(case, 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_past_sincos_fast_range(dtype):
    """Positions on both sides of 105615, where sincosf leaves its fast argument reduction for
    Payne-Hanek (the angle is position times a frequency of at most 1): 128K-token contexts
    rotate there. Output and appended K / V against the reference, q and k alike."""
    lengths = [105614, 105615, 131072, 200000]
    case = make_case(4, 4, 1, 128, lengths, 200001, dtype, seed=15, rotary_dim=128)
    check_case(case, 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_frequency_table_of_theta_is_the_theta_rotation(dtype):
    """A theta rotation and the table of its frequencies (torch's fp32 1 / theta^(2i / d)) give
    the same bits: the kernel is handed theta as that table (``Rotary.kernel_table``)."""
    from mmha.spec import Rotary

    case = make_case(3, 8, 2, 128, [5, 900, 3000], 4096, dtype, seed=13, rotary_dim=128)
    theta, theta_lse = run_kernel(case, 2)[:2]
    case.rotary.update(inv_freq=Rotary(128, 10000.0).frequencies(torch.float32, "cuda"))
    table, table_lse = run_kernel(case, 2)[:2]
    assert torch.equal(table, theta) and torch.equal(table_lse, theta_lse)


def test_bias_cache_write_bit_exact():
    case = make_case(3, 8, 4, 96, [0, 10, 99], 100, torch.float16, seed=3, bias=True)
    check_case(case, 1)


def test_strided_qkv_equals_contiguous():
    case = make_case(6, 8, 2, 128, [1, 50, 500, 999, 3, 77], 1000, torch.float16, seed=5)
    width = case.qkv.shape[1]
    big = torch.randn(6, width + 384, device="cuda", dtype=torch.float16)
    big[:, 128 : 128 + width] = case.qkv
    strided = big[:, 128 : 128 + width]
    assert not strided.is_contiguous()
    k0, v0 = case.clone_caches()
    out_c, _ = run_kernel(case)
    kc, vc = case.k_cache, case.v_cache
    case.k_cache, case.v_cache, case.qkv = k0, v0, strided
    out_s, _ = run_kernel(case)
    assert torch.equal(out_c, out_s)
    assert_bits_equal(kc, case.k_cache, "k_cache")
    assert_bits_equal(vc, case.v_cache, "v_cache")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("splits", [1, 3])
def test_out_may_start_anywhere(dtype, splits):
    # The raw operator's out (no epilogue) need not be aligned: the stores of four values at once
    # (several columns per item, a split's merge) fall back to one value at a time.
    case = make_case(3, 32, 8, 128, [5, 700, 1500], 2048, dtype, seed=41 + splits)
    k0, v0 = case.clone_caches()
    aligned = raw_args(case, splits)
    torch.ops.mmha.decode_attention(**aligned)
    b, width = aligned["out"].shape
    flat = torch.full((b * width + 1,), float("nan"), dtype=dtype, device="cuda")
    shifted = flat[1:].view(b, width)
    assert shifted.data_ptr() % 8 != 0
    case.k_cache, case.v_cache = k0, v0
    torch.ops.mmha.decode_attention(**raw_args(case, splits, out=shifted))
    torch.cuda.synchronize()
    assert_bits_equal(aligned["out"], shifted, "out")
    check_against_reference(case, shifted, aligned["lse"])


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), 1e4], ids=["nan", "inf", "1e4"])
def test_unused_slots_do_not_reach_output(fill):
    lengths = [0, 16, 17, 333]
    dirty = make_case(4, 8, 2, 128, lengths, 400, torch.float16, seed=9, unused_fill=fill)
    for splits in (1, 3):
        a, _ = run_kernel(make_case(4, 8, 2, 128, lengths, 400, torch.float16, seed=9,
                                    unused_fill=0.0), splits)  # fmt: skip
        b, _ = run_kernel(make_case(4, 8, 2, 128, lengths, 400, torch.float16, seed=9,
                                    unused_fill=fill), splits)  # fmt: skip
        assert torch.isfinite(b).all()
        assert torch.equal(a, b)
    check_case(dirty, 3)


def test_split_counts_agree_and_repeat_bit_equal():
    lengths = [4095, 17, 2048, 1]
    outs = {}
    for name, splits in SPLITS.items():
        case = make_case(4, 16, 4, 128, lengths, 4096, torch.float16, seed=21)
        outs[name] = check_case(case, splits)
        case2 = make_case(4, 16, 4, 128, lengths, 4096, torch.float16, seed=21)
        again, _ = run_kernel(case2, splits)
        assert torch.equal(outs[name], again), f"{name} not bit-equal run to run"


def test_independent_of_smax_and_batch_mates():
    lengths = [100, 900]
    small = make_case(2, 8, 2, 64, lengths, 1000, torch.float16, seed=4)
    out_small, _ = run_kernel(small, 3)
    big = make_case(2, 8, 2, 64, lengths, 3000, torch.float16, seed=4)
    # Same logical contents in a larger cache.
    big.qkv = small.qkv.clone()
    from mmha import layout

    k = layout.unpack_k(make_case(2, 8, 2, 64, lengths, 1000, torch.float16, seed=4).k_cache)
    v = layout.unpack_v(make_case(2, 8, 2, 64, lengths, 1000, torch.float16, seed=4).v_cache)
    big.k_cache, big.v_cache = layout.pack_k(k, 3000), layout.pack_v(v, 3000)
    out_big, _ = run_kernel(big, 3)
    torch.testing.assert_close(out_small, out_big, atol=2e-3, rtol=0)
    # Row 1 alone gives what it gave next to row 0.
    solo = make_case(2, 8, 2, 64, lengths, 1000, torch.float16, seed=4)
    solo.qkv, solo.k_cache, solo.v_cache, solo.lengths = (
        solo.qkv[1:].clone(), solo.k_cache[1:].clone(), solo.v_cache[1:].clone(), solo.lengths[1:].clone()
    )  # fmt: skip
    out_solo, _ = run_kernel(solo, 3)
    torch.testing.assert_close(out_small[1:], out_solo, atol=2e-3, rtol=0)


@pytest.mark.parametrize("splits", [1, 6])
def test_determinism_100_runs(splits):
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 2000, (64,), generator=g).tolist()
    case = make_case(64, 16, 4, 128, lengths, 2048, torch.bfloat16, seed=2)
    k0, v0 = case.clone_caches()
    first, _ = run_kernel(case, splits)
    for _ in range(100):
        case.k_cache.copy_(k0)
        case.v_cache.copy_(v0)
        out, _ = run_kernel(case, splits)
        assert torch.equal(out, first)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("value_scale", [1e-3, 30.0])
def test_large_and_tiny_values(dtype, value_scale):
    # q . k of order 1e3 * 1e3 * D: softmax saturates; the kernel must stay finite and right.
    case = make_case(3, 8, 2, 128, [10, 500, 1500], 1600, dtype, seed=13, value_scale=value_scale)
    check_case(case, 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("profile", ["rising", "falling", "sink", "steps"])
@pytest.mark.parametrize("splits", [1, 5])
def test_logit_profiles(dtype, profile, splits):
    """Logits that rise or fall along the sequence, one dominant first key, or jumps of a few
    log2 units: the tensor-core loop raises its reference max only when a head's max outgrows
    it by more than 2^8, so some steps rescale the accumulators and others keep P up to 2^8."""
    from mmha import layout

    b, hq, hkv, d, smax = 2, 8, 2, 128, 1600
    lengths = [700, 1500]
    case = make_case(b, hq, hkv, d, lengths, smax, dtype, seed=17)
    g = torch.Generator(device="cpu").manual_seed(18)
    t = torch.arange(smax, dtype=torch.float32)[None, :, None, None] / 1500.0
    ramp = {
        "rising": 4.0 * t,  # logits 0 -> ~45 along the row (q ~ 1 in every dim)
        "falling": 4.0 * (1.0 - t),
        "sink": torch.where(t == 0, torch.tensor(4.0), torch.tensor(0.0)),
        "steps": 0.5 * torch.floor(t * 1500.0 / 97.0) % 7.0,  # jumps of ~6 natural-log units
    }[profile]
    k = ramp + 0.05 * torch.randn(b, smax, hkv, d, generator=g)
    slot = torch.arange(smax)[None, :, None, None]
    k = torch.where(slot < torch.tensor(lengths)[:, None, None, None], k, torch.tensor(float("nan")))
    case.k_cache = layout.pack_k(k.to(dtype).cuda())
    q = 1.0 + 0.05 * torch.randn(b, hq * d, generator=g)
    case.qkv[:, : hq * d] = q.to(dtype).cuda()
    check_case(case, splits)


def test_extreme_scale():
    case = make_case(2, 4, 4, 64, [50, 500], 512, torch.float32, seed=14)
    for scale in (1e-6, 10.0):
        kc, vc = case.clone_caches()
        from mmha import reference

        ref = reference.decode_step(case.qkv, kc, vc, case.lengths, **case.kwargs(scale=scale))
        out = ops.decode_attention(
            case.qkv, case.k_cache.clone(), case.v_cache.clone(), case.lengths, num_splits=3,
            **case.kwargs(scale=scale),
        )  # fmt: skip
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


OUT_OF_RANGE = {"capacity": 64, "past": 1000, "negative": -3, "very negative": -(2**31)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("source", ["cp_async", "tma"])
@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("bad", sorted(OUT_OF_RANGE))
def test_out_of_range_length_writes_nothing_and_flags_the_row(dtype, source, splits, bad):
    # The device-side guard (RELIABILITY.md row 27): with the host check bypassed, a row whose
    # length is outside [0, S_max - 1] reads and writes nothing in the caches, gets NaN output
    # and lse, and raises its status flag; the other rows are computed as usual.
    case = make_case(3, 4, 2, 64, [5, 10, 20], 64, dtype, seed=3)
    case.lengths[1] = OUT_OF_RANGE[bad]
    k0, v0 = case.clone_caches()
    ws = ops.Workspace.allocate("cuda", 3, 4, 64, splits)
    source = source if dtype != torch.float32 else "auto"
    out, lse = ops.decode_attention(
        case.qkv, case.k_cache, case.v_cache, case.lengths, validate_lengths=False, num_splits=splits,
        workspace=ws, return_lse=True, tile_source=source, **case.kwargs(),
    )  # fmt: skip
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    assert torch.isfinite(out[[0, 2]]).all()
    assert ws.status.tolist() == [0, 1, 0]
    for row, pos in ((0, 5), (2, 20)):
        k0[row, :, :, pos, :] = case.k_cache[row, :, :, pos, :]
        v0[row, :, pos, :] = case.v_cache[row, :, pos, :]
    assert_bits_equal(case.k_cache, k0, "k_cache")
    assert_bits_equal(case.v_cache, v0, "v_cache")
    with pytest.raises(ops.LengthError, match=r"lengths of rows \[1\] were outside \[0, S_max - 1\]"):
        ws.check()
    assert ws.status.tolist() == [0, 0, 0]
    ws.check()  # cleared


def test_non_default_stream():
    case = make_case(8, 16, 4, 128, [1000] * 8, 1024, torch.float16, seed=17)
    expect, _ = run_kernel(make_case(8, 16, 4, 128, [1000] * 8, 1024, torch.float16, seed=17), 4)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out, _ = run_kernel(case, 4)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(out, expect)


@pytest.mark.slow
def test_int64_offsets_large_cache():
    # k_cache of 2 * 8 * 128 * 1.1M = 2.25e9 elements (> 2^31): rows at the highest slots.
    smax = 1_100_000
    b, hkv, d = 2, 8, 128
    width = (hkv + 2 * hkv) * d
    dtype = torch.float16
    free, _ = torch.cuda.mem_get_info()
    need = 2 * b * hkv * smax * d * 2
    if need * 1.3 > free:
        pytest.skip(f"needs {need} bytes free")
    k_cache = torch.empty((b, hkv, d // 8, smax, 8), dtype=dtype, device="cuda")
    v_cache = torch.empty((b, hkv, smax, d), dtype=dtype, device="cuda")
    assert k_cache.numel() > 2**31
    lengths = torch.tensor([smax - 1, smax - 2], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    # Fill only the tail that is attended (keep the test fast): the first slots get a constant.
    k_cache.fill_(0.01)
    v_cache.fill_(0.02)
    tail = 4096
    k_cache[:, :, :, -tail:, :] = torch.randn(b, hkv, d // 8, tail, 8, generator=g, device="cuda").to(dtype)
    v_cache[:, :, -tail:, :] = torch.randn(b, hkv, tail, d, generator=g, device="cuda").to(dtype)
    qkv = torch.randn(b, width, generator=g, device="cuda").to(dtype)
    from mmha import reference

    out = ops.decode_attention(
        qkv, k_cache, v_cache, lengths, num_heads=hkv, num_kv_heads=hkv, validate_lengths=False
    )
    new_k = k_cache[:, :, :, -2:, :].clone()
    new_v = v_cache[:, :, -2:, :].clone()
    # Undo the kernel's writes, then let the reference do the same step.
    k_cache[0, :, :, smax - 1, :] = 0
    v_cache[0, :, smax - 1, :] = 0
    ref = reference.decode_step(qkv, k_cache, v_cache, lengths, num_heads=hkv, num_kv_heads=hkv)
    assert torch.equal(new_k[0, :, :, 1], k_cache[0, :, :, smax - 1])
    assert torch.equal(new_v[1, :, 0], v_cache[1, :, smax - 2])
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def test_opcheck():
    case = make_case(3, 8, 2, 64, [3, 40, 100], 128, torch.float16, seed=1)
    for splits in (1, 3):
        out = torch.empty(3, 8 * 64, dtype=torch.float16, device="cuda")
        lse = torch.empty(3, 8, dtype=torch.float32, device="cuda")
        ws = ops.Workspace.allocate("cuda", 3, 8, 64, splits)
        args = (
            case.qkv, case.k_cache, case.v_cache, case.lengths, None, out, lse, ws.partials,
            ws.counters, ws.status, 8, 2, 0.125, 0, 10000.0, False, splits,
        )  # fmt: skip
        torch.library.opcheck(torch.ops.mmha.decode_attention.default, args)
