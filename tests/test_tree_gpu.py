"""Tree steps on the GPU (mmha.ops.decode_tree, KVCache.step_tree / accept): the kernel against
mmha.reference.decode_tree for chains, stars, random trees and ragged rows, every dtype, head dim
and tile source, single pass and split; T = 1 equal to a one-token step bit for bit; the device
guard; accept after a GPU tree step equal to one-token steps; capture in a CUDA graph; greedy
speculative decoding on the GPU equal to plain greedy."""

from __future__ import annotations

import random

import pytest
import torch
from fp8_cases import quantize_cache
from helpers import FLOOR, assert_bits_equal, gpu, launched_kernels, make_case
from test_generate import random_prompts
from test_tree import random_tree

from mmha import dispatch, ops, reference, spec
from mmha._constants import FUSED_TREE_NODES, ROW_STEP
from mmha.cache import KVCache

pytestmark = gpu
FP8 = torch.float8_e4m3fn
KINDS = ["chain", "star", "roots", "random"]


def tree_case(batch, hq, hkv, d, lengths, s_max, dtype, nodes, kind, *, seed=0, counts=None, rotary=True,
              bias=False, kv_dtype=None):  # fmt: skip
    """Random qkv [B, T, W], caches (NaN past each row's length), parents of `kind`, counts."""
    case = make_case(batch, hq, hkv, d, lengths, s_max, dtype, seed=seed, bias=bias,
                     rotary_dim=d if rotary else 0)  # fmt: skip
    g = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(batch, nodes, (hq + 2 * hkv) * d, generator=g).to(dtype).cuda()
    rng = random.Random(seed)
    parents = torch.tensor([random_tree(rng, nodes, kind) for _ in range(batch)], dtype=torch.int32).cuda()
    counts = counts if counts is not None else [nodes] * batch
    scales = {}
    if kv_dtype is not None:
        amax_k = case.k_cache.float().nan_to_num(0).abs().amax(dim=(0, 2, 3, 4))
        amax_v = case.v_cache.float().nan_to_num(0).abs().amax(dim=(0, 2, 3))
        k_scale, v_scale = spec.fp8_scale(amax_k * 1.5), spec.fp8_scale(amax_v * 1.5)
        case = quantize_cache(case, k_scale, v_scale)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    return case, qkv, parents, counts, scales


def run_tree(case, qkv, parents, counts, scales, **kw):
    kc, vc = case.clone_caches()
    out, lse = ops.decode_tree(
        qkv, kc, vc, case.lengths, parents, node_counts=torch.tensor(counts, dtype=torch.int32, device="cuda"),
        return_lse=True, **case.kwargs(), **scales, **kw,
    )  # fmt: skip
    torch.cuda.synchronize()
    return out, lse, kc, vc


def ref_tree(case, qkv, parents, counts, scales, compute_dtype, return_lse=False):
    kc, vc = case.clone_caches()
    s = {k: v for k, v in scales.items()}
    out = reference.decode_tree(
        qkv, kc, vc, case.lengths, parents, node_counts=counts, compute_dtype=compute_dtype, **case.kwargs(), **s,
        return_lse=return_lse,
    )  # fmt: skip
    return out, kc, vc


def check_tree(case, qkv, parents, counts, scales=None, **kw):
    """Kernel vs reference: the tolerance rule of tests/helpers.py per node (out and lse), zeros
    and lse -inf past a row's count, caches equal to the reference's (rotated k within one
    rounding step)."""
    scales = scales or {}
    out, lse, kc, vc = run_tree(case, qkv, parents, counts, scales, **kw)
    (ref, ref_lse), ref_k, ref_v = ref_tree(
        case, qkv, parents, counts, scales, torch.float64, return_lse=True
    )
    (low, low_lse), _, _ = ref_tree(case, qkv, parents, counts, scales, qkv.dtype, return_lse=True)
    for b, n in enumerate(counts):
        assert out[b, n:].abs().max().item() == 0 if n < qkv.shape[1] else True, "nodes past the count"
        assert torch.isneginf(lse[b, n:]).all(), f"row {b}: lse of nodes past the count"
        e, r, lo = lse[b, :n].double(), ref_lse[b, :n].double(), low_lse[b, :n].double()
        assert torch.isfinite(e).all(), f"row {b}: non-finite lse"
        tol = 2 * (lo - r).abs().max().item() + 1e-3 * (4 if scales else 1) * max(1.0, r.abs().max().item())
        assert (e - r).abs().max().item() <= tol, (
            f"row {b}: lse error {(e - r).abs().max().item():.3e} > {tol:.3e}"
        )
        o, r, lo = out[b, :n].double(), ref[b, :n].double(), low[b, :n].double()
        assert torch.isfinite(o).all(), f"row {b}: non-finite output"
        err = (o - r).abs().max().item()
        base = (lo - r).abs().max().item()
        floor = FLOOR[qkv.dtype] * (4 if scales else 1)
        tol = 2 * base + floor * max(1.0, r.abs().max().item())
        assert err <= tol, f"row {b}: max error {err:.3e} > tolerance {tol:.3e}"
    if case.rotary:
        a, r = kc.float().nan_to_num(0), ref_k.float().nan_to_num(0)
        diff = (a - r).abs()
        if kc.dtype == FP8:  # fp32 against float64 rotation: at most one e4m3 step (3 mantissa bits)
            step = torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), r.abs()).clamp_min(2.0**-6))) - 3)
            assert (diff <= step).all(), (
                f"k_cache: {(diff > step).sum().item()} values off by more than one step"
            )
        else:
            assert diff.max().item() <= 2e-2 * max(1.0, r.abs().max().item())
        assert_bits_equal(vc, ref_v, "v_cache")
    else:
        assert_bits_equal(kc, ref_k, "k_cache")
        assert_bits_equal(vc, ref_v, "v_cache")
    return out, lse


@pytest.mark.parametrize("nodes", [6, 40])  # narrow and wide items
def test_tree_rotary_frequency_table(nodes):
    """A frequency table and an attention factor rotate every node at its own depth."""
    case, qkv, parents, counts, scales = tree_case(
        3, 8, 2, 64, [0, 100, 500], 1024, torch.float16, nodes, "random", seed=nodes
    )
    g = torch.Generator().manual_seed(nodes)
    case.rotary.update(inv_freq=(torch.rand(32, generator=g) ** 3).cuda(), attention_factor=1.2)
    check_tree(case, qkv, parents, counts, scales)


@pytest.mark.parametrize("dtype", [torch.float16, FP8, torch.int8], ids=str)
@pytest.mark.parametrize(
    "nodes, lengths", [(2, [1000, 37]), (4, [1000, 37]), (FUSED_TREE_NODES, [100, 37]), (FUSED_TREE_NODES + 1, [100, 37])]
)  # fmt: skip
def test_small_trees_run_in_one_launch(dtype, nodes, lengths):
    """Trees of up to FUSED_TREE_NODES nodes on narrow items whose node area leaves the grid as
    planned (at head dim 128 over fp16: 16 nodes would fit beside three stages): the attention kernel
    checks and appends them itself, no check-and-append launch before it (int8 caches too: their
    nodes quantised per token in the node area). Wider trees keep that launch."""
    if dtype == torch.int8:
        from test_int8_tree_gpu import check_int8_tree, int8_tree_case, kernel_tree

        case, ks, vs, qkv, parents, counts = int8_tree_case(2, 32, 8, 128, lengths, 1100, torch.float16, nodes,
                                                            seed=nodes)  # fmt: skip
        names = launched_kernels(lambda: kernel_tree(case, ks, vs, qkv, parents, counts))
    else:
        kv = dtype if dtype == FP8 else None
        case, qkv, parents, counts, scales = tree_case(
            2, 32, 8, 128, lengths, 1100, torch.float16, nodes, "random", seed=nodes, kv_dtype=kv
        )  # fmt: skip
        names = launched_kernels(lambda: run_tree(case, qkv, parents, counts, scales))
    assert sum("decode_attention_kernel" in n for n in names) == 1, names
    fused = nodes <= FUSED_TREE_NODES
    assert sum("tree_prepare_kernel" in n for n in names) == (0 if fused else 1), names
    if dtype == torch.int8:
        check_int8_tree(case, ks, vs, qkv, parents, counts)
    else:
        check_tree(case, qkv, parents, counts, scales)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads, nodes", [((32, 8), 4), ((16, 8), FUSED_TREE_NODES), ((8, 2), 3)], ids=str)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("source", ["cp_async", "tma"])
def test_lean_twin_agrees_with_the_full_twin_bit_for_bit(dtype, heads, nodes, splits, source):
    """A small tree over contiguous 16-bit caches with no modifiers, row modes or norms runs a lean
    unit's fused twin (csrc/kernels/lean_kernels.h); the same step with every row's mode given
    (ROW_STEP, the same step) runs the twin that has every feature. Both in one launch; same
    output, lse and caches bit for bit, and the lean one matches the reference. Rows start next to
    tile edges and use fewer nodes than the step has."""
    hq, hkv = heads
    lengths = [0, 60, 125, 700]
    counts = [nodes, nodes, max(1, nodes - 2), 1]
    case, qkv, parents, counts, scales = tree_case(
        len(lengths), hq, hkv, 128, lengths, 1024, dtype, nodes, "random", seed=nodes + splits, counts=counts,
        bias=True,
    )  # fmt: skip
    kw = dict(num_splits=splits, tile_source=source)
    modes = torch.full((len(lengths),), ROW_STEP, dtype=torch.int32, device="cuda")
    runs, names = [], []
    for row_active in (None, modes):
        names.append(
            launched_kernels(
                lambda r=row_active: run_tree(case, qkv, parents, counts, scales, row_active=r, **kw)
            )
        )
        runs.append(run_tree(case, qkv, parents, counts, scales, row_active=row_active, **kw))
    # One launch each: the twin (FUSED true), lean (LEAN true) or not.
    for got, lean in zip(names, (True, False), strict=True):
        twins = [n for n in got if "decode_attention_kernel" in n]
        assert len(twins) == 1 and not any("tree_prepare_kernel" in n for n in got), got
        assert twins[0].endswith(f"Lb1ELb{int(lean)}EEEvNS_10MmhaParamsE") or f"true, {str(lean).lower()}>" in twins[0], (
            twins
        )  # fmt: skip
    check_tree(case, qkv, parents, counts, scales, **kw)
    for what, a, b in zip(("out", "lse", "k cache", "v cache"), *runs, strict=True):
        assert_bits_equal(a, b, what)


def padded_tree(qkv, parents, width):
    """The same tree in a wider step (nodes past it unused: parents -1, qkv zeros)."""
    b, n, w = qkv.shape
    wide_qkv = torch.zeros(b, width, w, dtype=qkv.dtype, device=qkv.device)
    wide_qkv[:, :n] = qkv
    wide_parents = torch.full((b, width), -1, dtype=torch.int32, device=parents.device)
    wide_parents[:, :n] = parents
    return wide_qkv, wide_parents


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, FP8], ids=str)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("source", ["cp_async", "tma"])
def test_one_launch_equals_two_launches_bit_for_bit(dtype, splits, source):
    """A small tree in one launch (the attention kernel builds, patches and appends the nodes)
    against the same tree as the first nodes of a step too wide for it (the check-and-append
    kernel first): outputs, lse and caches bit for bit. Rows start next to tile edges, so that
    their nodes straddle tiles and splits."""
    kv = dtype if dtype == FP8 else None
    act = torch.float16 if dtype == FP8 else dtype
    nodes = 7
    lengths = [0, 60, 125, 190, 700]
    counts = [7, 7, 3, 6, 1]
    # (No bias with fp8: the wide step's unused nodes would then have q != 0, and an fp8 item scales
    # its q by its columns' largest.)
    case, qkv, parents, counts, scales = tree_case(
        5, 8, 2, 128, lengths, 1024, act, nodes, "random", seed=splits, counts=counts, kv_dtype=kv, bias=kv is None
    )  # fmt: skip
    kw = dict(num_splits=splits, tile_source=source, stages=2)  # (fp8 pairs tiles from 4 stages)
    one, one_lse, k1, v1 = run_tree(case, qkv, parents, counts, scales, **kw)
    wide_qkv, wide_parents = padded_tree(qkv, parents, FUSED_TREE_NODES + 1)
    two, two_lse, k2, v2 = run_tree(case, wide_qkv, wide_parents, counts, scales, **kw)
    assert_bits_equal(one, two[:, :nodes], "out")
    assert torch.equal(one_lse, two_lse[:, :nodes])
    assert_bits_equal(k1, k2, "k_cache")
    assert_bits_equal(v1, v2, "v_cache")


@pytest.mark.parametrize("splits", [2, 5])
def test_nodes_across_split_edges(splits):
    """A tree whose node slots lie in two splits' keys: each split builds, patches and appends its
    own nodes (one launch), with a q/k norm."""
    nodes = FUSED_TREE_NODES
    lengths = [58, 122, 250 - nodes]
    case, qkv, parents, counts, scales = tree_case(3, 8, 2, 64, lengths, 256, torch.float16, nodes, "random",
                                                   seed=splits, bias=True)  # fmt: skip
    from test_qk_norm_gpu import _norm

    case.mods["qk_norm"] = _norm(64, splits)
    check_tree(case, qkv, parents, counts, scales, num_splits=splits, tile_source="cp_async")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("source", ["cp_async", "tma"])
def test_tree_shapes_against_reference(kind, splits, source):
    nodes = 13
    lengths = [0, 63, 64, 300, 1000 - nodes]  # ragged, one row filling the cache to S_max
    counts = [nodes, 5, nodes, 1, nodes]
    case, qkv, parents, counts, _ = tree_case(5, 8, 2, 128, lengths, 1024, torch.float16, nodes, kind,
                                              seed=len(kind) + splits, counts=counts)  # fmt: skip
    check_tree(case, qkv, parents, counts, num_splits=splits, tile_source=source)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("nodes", [9, 33])  # 36 columns per kv head (narrow items), 132 (wide: 64 + 64 + 4)
def test_tree_dtypes_and_head_dims(dtype, head_dim, splits, nodes):
    wide = (
        dispatch.columns_block(4 * nodes, True, dtype != torch.float32, head_dim, 3 * 2)
        == dispatch.WIDE_COLUMNS
    )
    assert wide == (nodes == 33 and dtype != torch.float32 and head_dim <= dispatch.WIDE_MAX_HEAD_DIM)
    case, qkv, parents, counts, _ = tree_case(3, 8, 2, head_dim, [0, 37, 500], 512 + 64, dtype, nodes,
                                              "random", seed=head_dim + nodes, bias=True,
                                              counts=[nodes, nodes - 5, nodes])  # fmt: skip
    check_tree(case, qkv, parents, counts, num_splits=splits)


@pytest.mark.parametrize("source", ["cp_async", "tma"])
@pytest.mark.parametrize("splits", [1, 2, 7])
def test_wide_items_over_tile_and_split_edges(source, splits):
    # Wide items (64 columns: 16 nodes x G = 4) over rows whose keys end on, before and after tile
    # boundaries, a row of none cached, and unused warps (the last item of 20 nodes holds 16).
    nodes = 20
    assert dispatch.columns_block(4 * nodes, True, True, 128, 9 * 4) == dispatch.WIDE_COLUMNS
    lengths = [0, 1, 63 - nodes, 64 - nodes, 65 - nodes, 127, 128, 1000, 2048 - nodes]
    counts = [nodes, 16, nodes, 3, nodes, 1, nodes, 19, nodes]
    case, qkv, parents, counts, _ = tree_case(9, 16, 4, 128, lengths, 2048, torch.float16, nodes, "random",
                                              seed=splits, counts=counts)  # fmt: skip
    check_tree(case, qkv, parents, counts, num_splits=splits, tile_source=source)


@pytest.mark.parametrize(
    ("pad", "offset"), [(8, 0), (3, 0), (8, 1)], ids=["aligned", "odd_stride", "odd_start"]
)
def test_wide_items_q_rows_at_any_stride_and_start(pad, offset):
    # Wide items copy their q rows by 16-byte cp.async where qkv's rows start 16-byte aligned and
    # element by element otherwise (WideConsumer::stage_raw_rows): qkv as rows of a wider buffer
    # (row stride W + pad), from its first element or the second, gives the contiguous qkv's bits.
    nodes = 20
    assert dispatch.columns_block(4 * nodes, True, True, 128, 9 * 4) == dispatch.WIDE_COLUMNS
    lengths = [5, 300, 900, 0, 44, 64, 130, 700, 1000]
    counts = [nodes, 7, nodes, nodes, 1, nodes, 16, nodes, nodes]
    case, qkv, parents, counts, _ = tree_case(9, 16, 4, 128, lengths, 1024, torch.float16, nodes, "random",
                                              seed=pad + offset, bias=True, counts=counts)  # fmt: skip
    b, t, w = qkv.shape
    buf = torch.full((offset + b * t * (w + pad),), float("nan"), dtype=qkv.dtype, device="cuda")
    strided = buf[offset:].view(b, t, w + pad)[..., :w]
    strided.copy_(qkv)
    check_tree(case, strided, parents, counts, num_splits=2)
    for name, x, y in zip(("out", "lse", "k_cache", "v_cache"), run_tree(case, strided, parents, counts, {}),
                          run_tree(case, qkv, parents, counts, {}), strict=True):  # fmt: skip
        assert_bits_equal(x, y, name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
def test_wide_items_partial_rotary(bias, interleaved, dtype):
    # The wide q pass over rotation pairs and the unrotated dims past rotary_dim, both pair
    # layouts: without bias or q norm WideConsumer::rotate_plain_rows, with bias rotate_featured_rows.
    nodes = 32  # 128 columns per kv head: wide items whatever the grid
    assert dispatch.columns_block(4 * nodes, True, True, 128, 3 * 4) == dispatch.WIDE_COLUMNS
    case, qkv, parents, counts, _ = tree_case(3, 16, 4, 128, [0, 300, 990], 1024, dtype, nodes, "random",
                                              seed=7 + interleaved, bias=bias, counts=[nodes, 13, nodes])  # fmt: skip
    case.rotary.update(dim=48, interleaved=interleaved)
    check_tree(case, qkv, parents, counts, num_splits=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize(("nodes", "head_dim", "splits"), [(52, 128, 1), (33, 128, 3), (64, 64, 2), (64, 128, 1)])
def test_wide_items_paired_equal_one_to_a_block(dtype, nodes, head_dim, splits):
    # Two column blocks of a (row, kv head) to a block, its two warpgroups over one ring (wide_pairs;
    # the kernels pair 16-bit caches at head dims 64 and 128 on sm_90), against one to a block: the
    # same bits in out, lse and both caches, and the reference's values. 52 nodes (208 columns: 64 +
    # 64, then 64 + 16) leave the second warpgroup 16 columns; 33 (132: 64 + 64, then 4 + none) give
    # a block whose second warpgroup has no columns (it only hands the stages back); rows end on and
    # off tile edges.
    assert dispatch.columns_block(4 * nodes, True, True, head_dim, 6 * 2) == dispatch.WIDE_COLUMNS
    lengths = [0, 63, 64 - nodes % 64, 700, 1000, 1500]
    counts = [nodes, nodes - 3, 1, nodes, 16, nodes]
    case, qkv, parents, counts, _ = tree_case(6, 8, 2, head_dim, lengths, 1600, dtype, nodes, "random",
                                              seed=nodes + head_dim + splits, bias=True, counts=counts)  # fmt: skip
    paired = run_tree(case, qkv, parents, counts, {}, num_splits=splits, wide_pairs=True)
    single = run_tree(case, qkv, parents, counts, {}, num_splits=splits, wide_pairs=False)
    for name, x, y in zip(("out", "lse", "k_cache", "v_cache"), paired, single, strict=True):
        assert_bits_equal(x, y, name)
    check_tree(case, qkv, parents, counts, num_splits=splits, wide_pairs=True)


def test_wide_items_with_large_logits():
    # Scores far above the online softmax's slack in one tile and far below in the next: the
    # running max moves both ways within an item.
    nodes = 32  # 128 columns per kv head: wide items
    case, qkv, parents, counts, _ = tree_case(2, 8, 2, 64, [500, 1500], 2048, torch.bfloat16, nodes, "chain",
                                              seed=3, rotary=False)  # fmt: skip
    case.k_cache[:, :, :, 300:340] *= 40
    check_tree(case, qkv, parents, counts, num_splits=1)


@pytest.mark.parametrize("nodes", [5, 20])  # 20 columns per kv head (narrow items), 80 (wide)
@pytest.mark.parametrize("splits", [1, 5])
def test_tree_steps_are_deterministic(nodes, splits):
    # Many items per SM, taken from the work counter in whatever order blocks finish: out, lse
    # and both caches bit-equal over 50 runs (splits merge in split order).
    g = torch.Generator().manual_seed(nodes)
    lengths = torch.randint(0, 1500, (24,), generator=g).tolist()
    case, qkv, parents, counts, _ = tree_case(24, 16, 4, 128, lengths, 1600, torch.bfloat16, nodes, "random",
                                              seed=splits, counts=[nodes - i % 3 for i in range(24)])  # fmt: skip
    wide = dispatch.columns_block(4 * nodes, True, True, 128, 24 * 4) == dispatch.WIDE_COLUMNS
    assert wide == (nodes == 20)
    first = run_tree(case, qkv, parents, counts, {}, num_splits=splits)
    for _ in range(50):
        again = run_tree(case, qkv, parents, counts, {}, num_splits=splits)
        for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), first, again, strict=True):
            assert_bits_equal(b, a, name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("nodes", [11, 40])  # 44 columns per kv head (narrow items), 160 (wide)
def test_tree_fp8_caches(dtype, head_dim, splits, nodes):
    case, qkv, parents, counts, scales = tree_case(3, 8, 2, head_dim, [0, 100, 700], 768, dtype, nodes,
                                                   "random", seed=7 + head_dim, kv_dtype=FP8)  # fmt: skip
    check_tree(case, qkv, parents, counts, scales, num_splits=splits)


@pytest.mark.parametrize("heads", [(1, 1), (8, 8), (8, 1), (32, 8), (12, 4), (16, 1)], ids=str)
@pytest.mark.parametrize("nodes", [2, 17, 64])
def test_tree_groups_and_node_counts(heads, nodes):
    hq, hkv = heads
    case, qkv, parents, counts, _ = tree_case(2, hq, hkv, 64, [10, 400], 512, torch.float16, nodes, "random",
                                              seed=hq * 7 + nodes)  # fmt: skip
    check_tree(case, qkv, parents, counts)


def test_seed_configuration():
    # The design this project started from: batch 4, one head, head_dim 64, 54 nodes, prompt 10.
    case, qkv, parents, counts, _ = tree_case(
        4, 1, 1, 64, [10] * 4, 128, torch.float16, 54, "random", seed=54
    )
    check_tree(case, qkv, parents, counts)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("splits", [1, 3])
def test_one_node_equals_a_one_token_step_bit_for_bit(dtype, splits):
    case = make_case(4, 8, 2, 128, [0, 5, 64, 700], 1024, dtype, seed=11, rotary_dim=128)
    kc1, vc1 = case.clone_caches()
    kc2, vc2 = case.clone_caches()
    kw = dict(num_splits=splits, stages=3, return_lse=True, **case.kwargs())
    out1, lse1 = ops.decode_attention(case.qkv, kc1, vc1, case.lengths, **kw)
    parents = torch.full((4, 1), -1, dtype=torch.int32, device="cuda")
    out2, lse2 = ops.decode_tree(case.qkv[:, None], kc2, vc2, case.lengths, parents, **kw)
    assert_bits_equal(out2[:, 0], out1, "out")
    assert_bits_equal(lse2[:, 0], lse1, "lse")
    assert_bits_equal(kc2, kc1, "k_cache")
    assert_bits_equal(vc2, vc1, "v_cache")


def test_device_guard_refuses_bad_trees_and_lengths():
    nodes = 6
    case, qkv, parents, counts, _ = tree_case(4, 8, 2, 64, [3, 10, 20, 512 - 3], 512, torch.float16, nodes,
                                              "chain", seed=5)  # fmt: skip
    parents[1, 4] = 4  # not an earlier node
    kc, vc = case.clone_caches()
    ws = ops.Workspace.allocate("cuda", 4, 8, 64, 1, nodes)
    out = ops.decode_tree(
        qkv, kc, vc, case.lengths, parents, workspace=ws, validate=False, num_splits=1, **case.kwargs()
    )
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all() and torch.isnan(out[3]).all()  # row 3: 509 + 6 > 512
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()
    for row in (1, 3):  # nothing written for the refused rows
        assert_bits_equal(kc[row], case.k_cache[row], f"k_cache row {row}")
        assert_bits_equal(vc[row], case.v_cache[row], f"v_cache row {row}")
    assert ws.status.tolist() == [0, ops.STATUS_TREE, 0, ops.STATUS_LENGTH]
    with pytest.raises(ops.LengthError):
        ws.check()
    assert ws.status.tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match=r"parents\[1, 4\] must be -1"):
        ops.decode_tree(qkv, kc, vc, case.lengths, parents, **case.kwargs())
    with pytest.raises(ValueError, match="parents must be an int32 tensor"):
        ops.decode_tree(qkv, kc, vc, case.lengths, parents.cpu(), **case.kwargs())


def test_tree_error_names_rows():
    case, qkv, parents, _, _ = tree_case(2, 4, 4, 64, [3, 10], 128, torch.float16, 4, "chain", seed=6)
    parents[0, 2] = -2
    ws = ops.Workspace.allocate("cuda", 2, 4, 64, 1, 4)
    kc, vc = case.clone_caches()
    ops.decode_tree(
        qkv, kc, vc, case.lengths, parents, workspace=ws, validate=False, num_splits=1, **case.kwargs()
    )
    with pytest.raises(ops.TreeError, match=r"rows \[0\]"):
        ws.check()


def _cache(dtype=torch.float16, kv_dtype=None, batch=3, s_max=256):
    return KVCache(2, batch, s_max, 8, 2, 64, dtype, "cuda", rotary_dim=64, kv_dtype=kv_dtype)


@pytest.mark.parametrize("kv_dtype", [None, FP8, torch.int8], ids=str)
def test_accept_after_a_gpu_tree_step_equals_one_token_steps(kv_dtype):
    g = torch.Generator().manual_seed(8)
    dtype = torch.float16
    nodes = 7
    parents = torch.tensor([[-1, 0, 0, 1, 3, 2, 4], [-1, 0, 1, 2, 3, 4, 5], [-1, -1, 0, 1, 1, 0, 2]],
                           dtype=torch.int32)  # fmt: skip
    paths = [[0, 1, 3, 4, 6], [0, 1, 2], []]
    k = torch.randn(3, 30, 2, 64, generator=g).to(dtype).cuda()
    qkv = torch.randn(3, nodes, (8 + 4) * 64, generator=g).to(dtype).cuda()
    lengths = [5, 30, 17]
    a = _cache(dtype, kv_dtype)
    for layer in range(2):
        a.prefill(layer, k, k, lengths)
    for layer in range(2):
        a.step_tree(layer, qkv, parents)
    a.accept([0, 1, 2], paths)
    assert a.lengths.tolist() == [10, 33, 17]
    for r in range(3):  # each row alone, one-token steps over its accepted path
        solo = _cache(dtype, kv_dtype, batch=1)
        for layer in range(2):
            if kv_dtype == FP8:
                solo.set_scales(layer, a.k_scales[layer], a.v_scales[layer])
        for layer in range(2):
            solo.prefill(layer, k[r : r + 1], k[r : r + 1], [lengths[r]])
        for node in paths[r]:
            for layer in range(2):
                solo.step(layer, qkv[r : r + 1, node])
            solo.advance()
        n = a.lengths[r].item()
        for layer in range(2):
            assert_bits_equal(
                a.k_caches[layer][r, :, :, :n], solo.k_caches[layer][0, :, :, :n], f"k {layer} {r}"
            )
            assert_bits_equal(a.v_caches[layer][r, :, :n], solo.v_caches[layer][0, :, :n], f"v {layer} {r}")
            if kv_dtype == torch.int8:  # the token scales moved with their codes
                got, want = a.scales_of(layer, 3), solo.scales_of(layer, 1)
                for name in ("k_scale", "v_scale"):
                    assert_bits_equal(got[name][r, :, :n], want[name][0, :, :n], f"{name} {layer} {r}")


def test_tree_step_in_a_cuda_graph_replays_with_new_trees():
    nodes = 8
    c = _cache()
    g = torch.Generator().manual_seed(9)
    k = torch.randn(3, 40, 2, 64, generator=g).half().cuda()
    c.prefill(0, k, k, [4, 40, 22])
    qkv = torch.randn(3, nodes, 12 * 64, generator=g).half().cuda()
    parents = torch.tensor([random_tree(random.Random(r), nodes, "random") for r in range(3)],
                           dtype=torch.int32, device="cuda")  # fmt: skip
    counts = torch.tensor([nodes, 3, nodes], dtype=torch.int32, device="cuda")
    plan = dict(num_splits=2, stages=3)  # eager and captured steps on the same plan
    c.step_tree(0, qkv, parents, node_counts=counts, **plan)  # warm-up (workspace) outside capture
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        out = c.step_tree(0, qkv, parents, node_counts=counts, **plan)
    torch.cuda.current_stream().wait_stream(s)
    for r in range(3):
        parents[r] = torch.tensor(random_tree(random.Random(100 + r), nodes, "random"), dtype=torch.int32)
        counts.fill_(nodes - 1)
        qkv.normal_()
        graph.replay()
        torch.cuda.synchronize()
        want = c.step_tree(0, qkv, parents, node_counts=counts.tolist(), **plan)
        assert_bits_equal(out, want, "graph replay vs eager")


def test_tree_steps_and_accept_in_one_cuda_graph():
    # A verification round as one graph: step_tree on every layer, then accept with device paths;
    # replayed with new trees, qkv and paths, it leaves the cache as eager steps and list paths do.
    nodes = 8
    c, e = _cache(), _cache()
    g = torch.Generator().manual_seed(12)
    k = torch.randn(3, 40, 2, 64, generator=g).half().cuda()
    for cache in (c, e):
        for layer in range(2):
            cache.prefill(layer, k, k, [4, 40, 22])
    qkv = torch.randn(3, nodes, 12 * 64, generator=g).half().cuda()
    trees = [random_tree(random.Random(r), nodes, "random") for r in range(3)]
    parents = torch.tensor(trees, dtype=torch.int32, device="cuda")
    paths = torch.full((3, nodes), -1, dtype=torch.int32, device="cuda")
    plan = dict(num_splits=2, stages=3)

    def round_(cache, ps):
        outs = [cache.step_tree(layer, qkv, parents, **plan) for layer in range(2)]
        cache.accept([0, 1, 2], paths if ps is None else ps)
        return outs

    c.step_tree(0, qkv, parents, **plan)  # warm-up (workspace) outside capture
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph):
        outs = round_(c, None)
    torch.cuda.current_stream().wait_stream(s)
    for i in range(3):
        trees = [random_tree(random.Random(50 + 3 * i + r), nodes, "random") for r in range(3)]
        rng = random.Random(i)
        ps = []
        for t in trees:  # a random root-to-node path of each tree (possibly empty)
            node = rng.randrange(-1, nodes)
            path = []
            while node >= 0:
                path.insert(0, node)
                node = t[node]
            ps.append(path)
        parents.copy_(torch.tensor(trees, dtype=torch.int32))
        paths.copy_(torch.tensor([p + [-1] * (nodes - len(p)) for p in ps], dtype=torch.int32))
        qkv.normal_()
        graph.replay()
        want = round_(e, ps)
        torch.cuda.synchronize()
        for layer in range(2):
            assert_bits_equal(outs[layer], want[layer], f"round {i} layer {layer}")
        assert torch.equal(c.lengths, e.lengths)
        for row, n in enumerate(e.host_lengths):
            for layer in range(2):
                assert_bits_equal(
                    c.k_caches[layer][row, :, :, :n], e.k_caches[layer][row, :, :, :n], "k_cache"
                )
                assert_bits_equal(c.v_caches[layer][row, :, :n], e.v_caches[layer][row, :, :n], "v_cache")
    c.sync_lengths()
    assert c.host_lengths == e.host_lengths


def test_step_tree_refuses_modifier_free_calls_only_where_needed():
    c = _cache()
    qkv = torch.zeros(3, 70, 12 * 64, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="1..64 nodes"):
        c.step_tree(0, qkv, torch.full((3, 70), -1, dtype=torch.int32))


def test_gpu_speculative_demo_is_lossless():
    """The demo model (fp32 caches: the CUDA-core loop) drafting with its own first layer: the
    tokens of plain greedy decoding, on the GPU."""
    from mmha.models.generate import speculative_demo
    from mmha.models.llama import PRESETS, TinyLlama

    model = TinyLlama(PRESETS["tiny"], seed=1).eval().cuda()
    prompts = random_prompts(3, [3, 9, 6], model.cfg.vocab_size, seed=2)
    for shape in ([2, 2, 1], [1, 1, 1], [4]):
        a = speculative_demo(model, prompts, 12, 1, shape)
        assert a["identical"], (shape, a)
        assert a["mean_accepted"] >= 1


def test_raw_op_refuses_bad_tree_arguments():
    case, qkv, parents, _, _ = tree_case(2, 4, 2, 64, [3, 10], 128, torch.float16, 4, "chain", seed=12)
    ws = ops.Workspace.allocate("cuda", 2, 4, 64, 1, 4)
    out = torch.empty(2, 4, 4 * 64, dtype=torch.float16, device="cuda")
    lse = torch.empty(2, 4, 4, device="cuda")
    kc, vc = case.clone_caches()

    def call(**kw):
        args = dict(
            qkv=qkv, out=out, lse=lse, parents=parents, node_counts=None, counters=ws.counters, window=0
        )
        args.update(kw)
        torch.ops.mmha.decode_attention(
            args["qkv"], kc, vc, case.lengths, None, args["out"], args["lse"], ws.partials, args["counters"],
            ws.status, 4, 2, 0.125, 0, 10000.0, False, 1, True, 2, 0, None, None, args["window"], 0.0, None,
            None, args["parents"], args["node_counts"],
        )  # fmt: skip

    for kw, msg in [
        (dict(parents=parents.long()), "parents must have dtype Int"),
        (dict(parents=parents[:, :0]), r"parents must have shape \[2, T\] with 1 <= T <= 64"),
        (dict(qkv=qkv[:, :3]), "qkv must have T = 4 nodes"),
        (dict(out=out[:, 0]), r"out must have shape \[2, 4, 256\]"),
        (
            dict(node_counts=torch.tensor([1, 5], dtype=torch.int32, device="cuda")),
            r"node_counts\[1\] must be",
        ),
        (dict(window=8), "tree steps take no score modifiers yet"),
        (dict(counters=ws.counters[:20]), r"counters must hold at least B \* T \* Hq"),
    ]:
        with pytest.raises(RuntimeError, match=msg):
            call(**kw)
    assert_bits_equal(kc, case.k_cache, "k_cache after refusals")
    assert_bits_equal(vc, case.v_cache, "v_cache after refusals")
    with pytest.raises(RuntimeError, match="node_counts must be None without parents"):
        torch.ops.mmha.decode_attention(
            case.qkv, kc, vc, case.lengths, None, torch.empty(2, 256, dtype=torch.float16, device="cuda"),
            torch.empty(2, 4, device="cuda"), ws.partials, ws.counters, ws.status, 4, 2, 0.125, 0, 10000.0,
            False, 1, True, 2, 0, None, None, 0, 0.0, None, None, None, torch.ones(2, dtype=torch.int32,
            device="cuda"),
        )  # fmt: skip
