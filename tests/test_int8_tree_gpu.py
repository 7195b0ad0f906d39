"""Tree steps over int8 caches on the GPU (``mmha.ops.decode_tree``, ``KVCache.step_tree``): each
node's K and V quantised per token and kv head as a one-token step's new token, the attention on
narrow and wide items. The kernel against ``mmha.reference.decode_tree``'s int8 path (ragged rows,
every head dim, single pass and split, both tile sources, narrow and wide items, V scales over
orders of magnitude, large logits),
the appended codes and scales as the reference stores them with every other slot untouched, pages
against the contiguous cache, a node with a non-finite value flagged."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import FLOOR, assert_bits_equal, gpu, launched_kernels, lean_kernel_name
from int8_cases import int8_case, to_pages
from test_int8_gpu import assert_caches_as_reference
from test_qk_norm_gpu import _norm
from test_tree import random_tree

from mmha import dispatch, layout, ops, reference
from mmha._constants import ROW_STEP

pytestmark = gpu


def int8_tree_case(batch, hq, hkv, d, lengths, s_max, dtype, nodes, kind="random", *, seed=0, counts=None,
                   rotary=True, bias=False):  # fmt: skip
    """An int8 case (unused slots: stray codes, NaN scales), qkv [B, T, W], parents, counts."""
    case, ks, vs = int8_case(
        batch, hq, hkv, d, lengths, s_max, dtype, seed=seed, rotary_dim=d if rotary else 0, bias=bias
    )
    g = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(batch, nodes, (hq + 2 * hkv) * d, generator=g).to(dtype).cuda()
    rng = random.Random(seed)
    parents = torch.tensor([random_tree(rng, nodes, kind) for _ in range(batch)], dtype=torch.int32).cuda()
    counts = counts if counts is not None else [nodes] * batch
    return case, ks, vs, qkv, parents, counts


def kernel_tree(case, ks, vs, qkv, parents, counts, **kw):
    kc, vc = case.clone_caches()
    ks, vs = ks.clone(), vs.clone()
    out, lse = ops.decode_tree(
        qkv, kc, vc, case.lengths, parents, node_counts=torch.tensor(counts, dtype=torch.int32, device="cuda"),
        return_lse=True, k_scale=ks, v_scale=vs, **case.kwargs(), **kw,
    )  # fmt: skip
    torch.cuda.synchronize()
    return out, lse, (kc, vc, ks, vs)


def reference_tree(case, ks, vs, qkv, parents, counts, compute_dtype):
    kc, vc = case.clone_caches()
    ks, vs = ks.clone(), vs.clone()
    out, lse = reference.decode_tree(
        qkv, kc, vc, case.lengths, parents, node_counts=counts, compute_dtype=compute_dtype, return_lse=True,
        k_scale=ks, v_scale=vs, **case.kwargs(),
    )  # fmt: skip
    return out, lse, (kc, vc, ks, vs)


def check_int8_tree(case, ks, vs, qkv, parents, counts, **kw):
    """Per row: out and lse within twice the reference's own error in the activations' dtype plus
    the fp16-operand floor (tests/helpers.py), zeros and lse -inf past the count; the caches as
    the reference stores them."""
    out, lse, got = kernel_tree(case, ks, vs, qkv, parents, counts, **kw)
    ref, ref_lse, want = reference_tree(case, ks, vs, qkv, parents, counts, torch.float64)
    low, low_lse, _ = reference_tree(case, ks, vs, qkv, parents, counts, qkv.dtype)
    for b, n in enumerate(counts):
        if n < qkv.shape[1]:
            assert out[b, n:].abs().max().item() == 0, f"row {b}: nodes past the count"
            assert torch.isneginf(lse[b, n:]).all(), f"row {b}: lse of nodes past the count"
        o, r, lo = out[b, :n].double(), ref[b, :n].double(), low[b, :n].double()
        assert torch.isfinite(o).all(), f"row {b}: non-finite output"
        tol = 2 * (lo - r).abs().max().item() + FLOOR[qkv.dtype] * max(1.0, r.abs().max().item())
        err = (o - r).abs().max().item()
        assert err <= tol, f"row {b}: max error {err:.3e} > tolerance {tol:.3e}"
        e, r, lo = lse[b, :n].double(), ref_lse[b, :n].double(), low_lse[b, :n].double()
        tol = 2 * (lo - r).abs().max().item() + 1e-3 * max(1.0, r.abs().max().item())
        assert (e - r).abs().max().item() <= tol, f"row {b}: lse error {(e - r).abs().max().item():.3e}"
    assert_caches_as_reference(got, want, case.rotary)
    return out, lse, got


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("splits", [1, 3])
# 24, 36 and 132 columns per kv head: a small tree in one launch (the fused twins, up to
# FUSED_TREE_NODES nodes), narrow items after the check-and-append launch, wide (head dim <= 128)
@pytest.mark.parametrize("nodes", [6, 9, 33])
def test_int8_tree_matches_reference(dtype, head_dim, splits, nodes):
    lengths = [0, 70, 320 - nodes]  # an empty row, one filling the cache to S_max
    counts = [nodes, 5, nodes]
    case, ks, vs, qkv, parents, counts = int8_tree_case(
        3, 8, 2, head_dim, lengths, 320, dtype, nodes, seed=head_dim + nodes + splits, counts=counts
    )
    check_int8_tree(case, ks, vs, qkv, parents, counts, num_splits=splits)


@pytest.mark.parametrize("kind", ["chain", "star", "roots", "random"])
@pytest.mark.parametrize("source", ["cp_async", "tma"])
def test_int8_tree_shapes_and_sources(kind, source):
    nodes = 13
    case, ks, vs, qkv, parents, counts = int8_tree_case(
        4, 8, 2, 128, [1, 63, 64, 500], 640, torch.float16, nodes, kind, seed=len(kind), counts=[nodes, 1, 7, nodes],
    )  # fmt: skip
    check_int8_tree(case, ks, vs, qkv, parents, counts, num_splits=2, tile_source=source)


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("source", ["cp_async", "tma"])
def test_int8_wide_items_over_tile_and_split_edges(splits, source):
    """Wide items (40 nodes x group 4 = 160 columns per kv head: 64 + 64 + 32) where rows end on,
    before and after tile boundaries, V scales spread over four orders of magnitude (v_unit raised
    mid-item)."""
    assert dispatch.columns_block(160, True, True, 128, 4 * 2) == dispatch.WIDE_COLUMNS
    lengths = [0, 24, 64 - 40 + 64, 300]
    case, ks, vs = int8_case(4, 8, 2, 128, lengths, 384, torch.float16, seed=splits, v_spread=2.0,
                             rotary_dim=128)  # fmt: skip
    g = torch.Generator().manual_seed(splits)
    qkv = torch.randn(4, 40, 12 * 128, generator=g).half().cuda()
    rng = random.Random(splits)
    parents = torch.tensor([random_tree(rng, 40, "random") for _ in range(4)], dtype=torch.int32).cuda()
    check_int8_tree(case, ks, vs, qkv, parents, [40, 40, 17, 40], num_splits=splits, tile_source=source)


@pytest.mark.parametrize("head_dim", [96, 128])
def test_wide_items_one_chain_over_a_long_row(head_dim):
    """Wide items (40 nodes x group 4 = 160 columns) over one 32K-key row, no split, so each item's V
    sums run in one mma chain over the whole row; a small q keeps the weights nearly flat and the
    outputs small, so a bias in those sums shows (test_int8_gpu.py's one-chain case and bound). At
    head dim 96 the V mma takes 1152 + code on every GPU (the bias comes off about every step,
    attend_wide.cuh flush_v_bias); at 128 an sm_90a build widens V exactly and other builds do as at 96."""
    s, nodes, hq, d = 32768, 40, 8, head_dim
    assert dispatch.columns_block(nodes * 4, True, True, d, 2) == dispatch.WIDE_COLUMNS
    case, ks, vs, qkv, parents, counts = int8_tree_case(
        1, hq, 2, d, [s - nodes], s + 64, torch.float16, nodes, seed=d, rotary=False
    )
    qkv[..., : hq * d].mul_(0.02)
    out, _, _ = kernel_tree(case, ks, vs, qkv, parents, counts, num_splits=1)
    ref, _, _ = reference_tree(case, ks, vs, qkv, parents, counts, torch.float64)
    err = (out.double() - ref.double()).abs().max().item()
    tol = 1e-4 + 1e-2 * ref.double().abs().max().item()
    assert err <= tol, f"max error {err:.3e} > {tol:.3e} over one chain of {s} keys"


@pytest.mark.parametrize("source", ["cp_async", "tma"])
def test_int8_wide_items_run_with_the_consumers_registers_raised(source):
    """Wide items over int8 caches run their own kernel (decode_attention_kernel_wide: two
    warpgroups, the consumers' registers raised by setmaxnreg; kWideRegisterSplit in
    decode_traits.cuh) after the check-and-append launch, and the step matches the reference."""
    lengths = [5, 64, 130, 700]
    case, ks, vs = int8_case(4, 8, 2, 128, lengths, 768, torch.float16, seed=7, rotary_dim=128)
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(4, 40, 12 * 128, generator=g).half().cuda()
    rng = random.Random(7)
    parents = torch.tensor([random_tree(rng, 40, "random") for _ in range(4)], dtype=torch.int32).cuda()
    counts = [40, 33, 40, 12]
    kw = dict(num_splits=2, tile_source=source)
    names = launched_kernels(lambda: kernel_tree(case, ks, vs, qkv, parents, counts, **kw))
    assert sum("decode_attention_kernel_wide" in n for n in names) == 1, names
    assert sum("tree_prepare_kernel" in n for n in names) == 1, names
    check_int8_tree(case, ks, vs, qkv, parents, counts, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("feature", ["partial_interleaved", "bias", "q_norm"])
def test_int8_wide_items_q_features(feature, dtype):
    """Wide items' q over an int8 cache, staged raw and rotated in place after a first pass for
    the warp's largest |q| (WideConsumer::rotate_plain_rows, rotate_featured_rows): a partial
    rotary in the interleaved pair layout, a qkv bias, a q norm; bf16 rows become fp16 in place."""
    nodes = 33  # 132 columns per kv head: wide items
    assert dispatch.columns_block(4 * nodes, True, True, 128, 3 * 2) == dispatch.WIDE_COLUMNS
    case, ks, vs, qkv, parents, counts = int8_tree_case(
        3, 8, 2, 128, [0, 70, 500], 640, dtype, nodes, seed=len(feature), counts=[nodes, nodes - 4, nodes],
        bias=feature == "bias",
    )  # fmt: skip
    if feature == "partial_interleaved":
        case.rotary.update(dim=48, interleaved=True)
    if feature == "q_norm":
        case.mods["qk_norm"] = _norm(128, nodes, sides="q")
    check_int8_tree(case, ks, vs, qkv, parents, counts, num_splits=2)


@pytest.mark.parametrize(
    ("dtype", "factor", "attention_factor"),
    [
        (torch.float16, 1.0, 1.0),
        (torch.float16, 1e-3, 1.0),
        (torch.float16, 0.0, 1.0),
        (torch.bfloat16, 1e5, 1.0),
        (torch.bfloat16, 1e-30, 1.0),
        (torch.float16, 1.0, 4.0),
        (torch.float16, 1.0, 0.25),
    ],
    ids=["unit", "tiny", "zeros", "huge_bf16", "tiniest_bf16", "rotary_factor_4", "rotary_factor_quarter"],
)
def test_int8_wide_items_q_at_any_magnitude(dtype, factor, attention_factor):
    """Wide items' plain q over an int8 cache takes its power of two from the raw rows before its
    one rotation (WideConsumer::raw_rows_unit, its bound with the rotary's attention factor): q at
    any magnitude, a bf16 q past fp16's range (x 1e5) and far below it (x 1e-30) included, a zero
    q, and cos and sin x 4 and x 1/4. A large q comes with k as much smaller (the cache's K scales
    and the nodes' k), a small one with k as much larger, so the scores stay where the softmax is
    not one-hot."""
    nodes = 33  # 132 columns per kv head: wide items
    case, ks, vs, qkv, parents, counts = int8_tree_case(
        3, 8, 2, 128, [0, 70, 500], 640, dtype, nodes, seed=9, counts=[nodes, nodes - 4, nodes]
    )
    case.rotary["attention_factor"] = attention_factor
    qkv = qkv.clone()
    qkv[..., : 8 * 128] *= factor
    if factor != 0:
        qkv[..., 8 * 128 : 10 * 128] /= factor
        ks = ks / factor
    check_int8_tree(case, ks, vs, qkv, parents, counts, num_splits=2)


def test_int8_wide_items_with_large_logits():
    """q x 30: scores far past the rescale slack, so the running maxima move often."""
    case, ks, vs, qkv, parents, counts = int8_tree_case(
        2, 16, 2, 64, [100, 900], 1024, torch.float16, 20, seed=5
    )
    qkv = qkv.clone()
    qkv[..., : 16 * 64] *= 30
    check_int8_tree(case, ks, vs, qkv, parents, counts, num_splits=2)


def test_int8_tree_without_rotary_appends_bit_for_bit():
    case, ks, vs, qkv, parents, counts = int8_tree_case(
        2, 16, 4, 64, [10, 200], 256, torch.float16, 20, seed=3, rotary=False
    )
    check_int8_tree(case, ks, vs, qkv, parents, counts)


@pytest.mark.parametrize("block_size", [16, 64])
def test_int8_tree_over_pages_equals_contiguous(block_size):
    """The same step over pages: the output bit for bit, and each row's gathered pages (codes and
    scales) equal to the contiguous cache after the step."""
    lengths = [5, 100, 190]
    case, ks, vs, qkv, parents, counts = int8_tree_case(
        3, 8, 2, 128, lengths, 256, torch.float16, 11, seed=block_size, counts=[11, 4, 11]
    )
    flat_out, flat_lse, (kc, vc, kcs, vcs) = kernel_tree(
        case, ks, vs, qkv, parents, counts, num_splits=2, tile_source="cp_async"
    )
    kp, vp, ksp, vsp, tables = to_pages(case, ks, vs, block_size, seed=block_size)
    out, lse = ops.decode_tree(
        qkv, kp, vp, case.lengths, parents, node_counts=torch.tensor(counts, dtype=torch.int32, device="cuda"),
        return_lse=True, k_scale=ksp, v_scale=vsp, block_tables=tables, num_splits=2, tile_source="cp_async",
        **case.kwargs(),
    )  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(out, flat_out) and torch.equal(lse, flat_lse)
    for row, n in enumerate(lengths):
        end = n + counts[row]
        blocks = tables[row].tolist()
        gk, gv = layout.gather_k(kp, blocks), layout.gather_v(vp, blocks)
        gks = ksp[tables[row].long()].permute(1, 0, 2).reshape(ks.shape[1], -1)
        gvs = vsp[tables[row].long()].permute(1, 0, 2).reshape(vs.shape[1], -1)
        assert_bits_equal(gk[0, :, :, :end], kc[row, :, :, :end], "k pages")
        assert_bits_equal(gv[0, :, :end], vc[row, :, :end], "v pages")
        assert_bits_equal(gks[:, :end], kcs[row, :, :end], "k scale pages")
        assert_bits_equal(gvs[:, :end], vcs[row, :, :end], "v scale pages")


@pytest.mark.parametrize("which", ["k", "v"])
def test_non_finite_node_is_flagged(which):
    """A node whose k (or v) holds NaN: its scale is stored non-finite, the row's status says so
    (the workspace's check raises naming it); the other row's nodes match the reference."""
    hq, hkv, d, nodes = 8, 2, 64, 6
    case, ks, vs, qkv, parents, counts = int8_tree_case(
        2, hq, hkv, d, [10, 40], 128, torch.float16, nodes, seed=9
    )
    col = (hq + (hkv if which == "v" else 0)) * d + 3
    qkv[1, 2, col] = float("nan")
    ws = ops.Workspace.allocate("cuda", 2, hq, 128, dispatch.MAX_SPLITS, nodes=nodes)
    out, _, got = kernel_tree(case, ks, vs, qkv, parents, counts, workspace=ws)
    ref, _, _ = reference_tree(case, ks, vs, qkv, parents, counts, torch.float64)
    stored = (got[2] if which == "k" else got[3])[1, 0, 40 + 2]
    assert not torch.isfinite(stored), "the node's scale says it is not finite"
    assert torch.isfinite(out[0]).all()
    err = (out[0].double() - ref[0].double()).abs().max().item()
    assert err <= 2e-2 * max(1.0, ref[0].double().abs().max().item())
    with pytest.raises(ops.ScaleError, match=r"rows \[1\]"):
        ws.check()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("source", ["cp_async", "tma"])
def test_lean_twin_agrees_with_the_full_twin_bit_for_bit(dtype, splits, source):
    """A small int8 tree over contiguous caches with no modifiers, row modes or norms runs a lean
    unit's fused twin (csrc/kernels/lean_kernels.h); the same step with every row's mode given
    (ROW_STEP, the same step) runs the twin that has every feature. Both in one launch; same
    output, lse, codes and scales bit for bit, and the lean one matches the reference. Rows start
    next to tile edges and use fewer nodes than the step has."""
    lengths = [0, 60, 125, 700]
    case, ks, vs, qkv, parents, counts = int8_tree_case(
        len(lengths), 32, 8, 128, lengths, 1024, dtype, 4, seed=4 + splits, counts=[4, 4, 2, 1]
    )
    kw = dict(num_splits=splits, tile_source=source)
    modes = torch.full((len(lengths),), ROW_STEP, dtype=torch.int32, device="cuda")
    runs = []
    for row_active in (None, modes):
        names = launched_kernels(
            lambda r=row_active: kernel_tree(case, ks, vs, qkv, parents, counts, row_active=r, **kw)
        )
        twins = [n for n in names if "decode_attention_kernel" in n]
        assert len(twins) == 1 and not any("tree_prepare_kernel" in n for n in names), names
        assert lean_kernel_name(twins[0]) == (row_active is None), twins
        out, lse, got = kernel_tree(case, ks, vs, qkv, parents, counts, row_active=row_active, **kw)
        runs.append((out, lse, *got))
    check_int8_tree(case, ks, vs, qkv, parents, counts, **kw)
    for what, a, b in zip(("out", "lse", "k cache", "v cache", "k scale", "v scale"), *runs, strict=True):
        assert_bits_equal(a, b, what)
