"""The per-head q/k norm inside the decode kernel's q/k build (``mmha.spec.QKNorm``,
``QKNormParams`` in csrc/kernels/new_token.cuh): one-token steps (tile loop, CUDA-core loop,
single pass and split) and tree steps (narrow and wide items, the tree append) against
``mmha.reference``; the fused norm equal to the row norm in place followed by the plain step; a
CUDA-graph replay; bad weights refused by name with nothing written."""

from __future__ import annotations

import pytest
import torch
from fp8_cases import quantize_cache
from helpers import (
    assert_bits_equal,
    check_against_reference,
    check_cache_writes,
    gpu,
    make_case,
    run_reference,
)
from test_tree_gpu import FP8, check_tree, tree_case

from mmha import dispatch, ops
from mmha.spec import QKNorm

pytestmark = gpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (offset, cast_first): Llama-style weight * n.to(dtype) (Qwen 3), Gemma-style n * (1 + weight).
FORMS = [(0.0, True), (1.0, False)]


def _weights(d: int, seed: int, sides: str) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = {s: (torch.randn(d, generator=g) * 0.5 + 1.0).cuda() for s in "qk" if s in sides}
    return dict(q_weight=w.get("q"), k_weight=w.get("k"))


def _norm(d: int, seed: int, sides: str = "qk", form=FORMS[0], eps: float = 1e-6) -> QKNorm:
    offset, cast_first = form
    return QKNorm(**_weights(d, seed, sides), eps=eps, offset=offset, cast_first=cast_first)


@pytest.mark.parametrize("variant", ["single_pass", "split"])
@pytest.mark.parametrize("sides", ["qk", "q", "k"])
@pytest.mark.parametrize("form", FORMS, ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_step_matches_reference(dtype, form, sides, variant):
    """GQA, bias, partial rotary, ragged lengths (0 and a row at the capacity's edge); fp32 runs
    the CUDA-core loop, fp16 / bf16 the tile loop."""
    d = 128
    case = make_case(3, 8, 2, d, [0, 37, 511], 512, dtype, seed=len(sides), bias=True, rotary_dim=64,
                     value_scale=2.0)  # fmt: skip
    case.mods["qk_norm"] = _norm(d, 7, sides, form)
    _, _, ref_k, ref_v = run_reference(case)
    out, lse = ops.decode_attention(
        case.qkv, case.k_cache, case.v_cache, case.lengths, variant=variant, return_lse=True, **case.kwargs()
    )
    check_against_reference(case, out, lse)
    check_cache_writes(case, ref_k, ref_v)


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 256])
def test_head_dims(head_dim):
    """Head dims whose values a warp's lanes cover unevenly (80, 96) or several times (256)."""
    case = make_case(2, 4, 4, head_dim, [5, 200], 256, torch.bfloat16, seed=head_dim, rotary_dim=head_dim)
    case.mods["qk_norm"] = _norm(head_dim, head_dim, form=FORMS[1])
    _, _, ref_k, ref_v = run_reference(case)
    out = ops.decode_attention(case.qkv, case.k_cache, case.v_cache, case.lengths, **case.kwargs())
    check_against_reference(case, out)
    check_cache_writes(case, ref_k, ref_v)


@pytest.mark.parametrize("kv_dtype", [None, FP8], ids=["16-bit", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_equals_the_row_norm_then_the_step(dtype, kv_dtype):
    """The kernel's norm gives what ``ops.rms_norm`` in place on the qkv row followed by the plain
    step gives: the same output and caches to one unit in the last place (the sums of squares
    are reduced in another order)."""
    if kv_dtype is not None and dtype == torch.float32:
        pytest.skip("fp8 caches take fp16 / bf16 activations")
    b, hq, hkv, d = 4, 16, 4, 128
    case = make_case(b, hq, hkv, d, [1, 64, 300, 1000], 1024, dtype, seed=3, rotary_dim=d, value_scale=3.0)
    norm = _norm(d, 11, form=FORMS[0], eps=1e-5)
    scales = {}
    if kv_dtype is not None:
        scales = dict(
            k_scale=torch.full((hkv,), 0.02, device="cuda"), v_scale=torch.full((hkv,), 0.03, device="cuda")
        )
        case = quantize_cache(case, scales["k_scale"], scales["v_scale"])
    k_cache, v_cache = case.clone_caches()
    common = dict(num_heads=hq, num_kv_heads=hkv, **scales)
    kc_fused, vc_fused = k_cache.clone(), v_cache.clone()
    fused = ops.decode_attention(case.qkv, kc_fused, vc_fused, case.lengths,
                                 attention=case.spec(qk_norm=norm), **common)  # fmt: skip
    normed = case.qkv.clone()
    ops.rms_norm(normed, normed, [norm.q_weight, norm.k_weight], [0, hq, d, hq * d, hkv, d], [1e-5, 1e-5])
    kc_two, vc_two = k_cache.clone(), v_cache.clone()
    two = ops.decode_attention(normed, kc_two, vc_two, case.lengths, attention=case.spec(), **common)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(fused.float(), two.float(), rtol=tol, atol=tol)
    if kv_dtype is None:
        torch.testing.assert_close(kc_fused.float(), kc_two.float(), rtol=tol, atol=tol, equal_nan=True)
    else:  # one e4m3 step at most
        assert torch.equal(kc_fused.float().isnan(), kc_two.float().isnan())
        diff = (kc_fused.float() - kc_two.float()).nan_to_num(0).abs()
        step = torch.exp2(torch.floor(torch.log2(kc_two.float().abs().clamp_min(2.0**-6))) - 3)
        assert ((diff <= step) | kc_two.float().isnan()).all()
    assert_bits_equal(vc_fused, vc_two, "v_cache")


@pytest.mark.parametrize("kv_dtype", [None, FP8], ids=["16-bit", "fp8"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("nodes", [5, 33])  # narrow items; wide items (132 columns per kv head)
def test_tree_steps_match_reference(nodes, splits, kv_dtype):
    """Every node's q normed in the attention kernel (narrow or wide items) and its k in the tree
    append, then rotated at its depth."""
    wide = dispatch.columns_block(4 * nodes, True, True, 128, 3 * 2) == dispatch.WIDE_COLUMNS
    assert wide == (nodes == 33)
    case, qkv, parents, counts, scales = tree_case(
        3, 8, 2, 128, [0, 37, 500], 640, torch.float16, nodes, "random", seed=nodes + splits, bias=True,
        counts=[nodes, nodes - 3, nodes], kv_dtype=kv_dtype,
    )  # fmt: skip
    case.mods["qk_norm"] = _norm(128, nodes, form=FORMS[nodes % 2])
    check_tree(case, qkv, parents, counts, scales, num_splits=splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("form", FORMS, ids=["llama", "gemma"])
def test_wide_tree_items_q_norm_without_bias(form, dtype):
    """Wide items' q pass with a q norm and no bias (test_tree_steps_match_reference has a bias),
    in each norm form and both 16-bit types."""
    nodes = 33
    assert dispatch.columns_block(4 * nodes, True, True, 128, 3 * 2) == dispatch.WIDE_COLUMNS
    case, qkv, parents, counts, scales = tree_case(
        3, 8, 2, 128, [0, 37, 500], 640, dtype, nodes, "random", seed=2, counts=[nodes, nodes - 5, nodes]
    )
    case.mods["qk_norm"] = _norm(128, nodes, sides="q", form=form)
    check_tree(case, qkv, parents, counts, scales, num_splits=2)


def test_graph_replay():
    """A step captured in a CUDA graph normalises each replay's new qkv."""
    case = make_case(2, 8, 2, 128, [10, 90], 256, torch.float16, seed=5, rotary_dim=128)
    case.mods["qk_norm"] = _norm(128, 5)
    qkv = case.qkv.clone()
    kc, vc = case.clone_caches()
    kw = case.kwargs()
    ops.decode_attention(qkv, kc.clone(), vc.clone(), case.lengths, **kw)  # warm-up: plans, tables
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.decode_attention(qkv, kc, vc, case.lengths, **kw)
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        qkv.copy_(torch.randn(qkv.shape, generator=g).to(qkv.dtype))
        kc.copy_(case.k_cache)
        vc.copy_(case.v_cache)
        graph.replay()
        torch.cuda.synchronize()
        case.qkv = qkv.clone()
        check_against_reference(case, out.clone())


BAD = [
    ("q_weight", 64, "cuda", r"attention\.qk_norm\.q_weight must have shape \[128\]"),
    ("k_weight", 128, "cpu", r"attention\.qk_norm\.k_weight must be on cuda"),
]


@pytest.mark.parametrize("side, size, device, message", BAD)
def test_bad_weights_are_refused_by_name_and_nothing_is_written(side, size, device, message):
    case = make_case(2, 4, 2, 128, [3, 7], 64, torch.float16, seed=1)
    norm = QKNorm(**{side: torch.ones(size, device=device)})
    kc, vc = case.clone_caches()
    with pytest.raises(ValueError, match=message):
        ops.decode_attention(case.qkv, kc, vc, case.lengths, **case.kwargs(qk_norm=norm))
    assert_bits_equal(kc, case.k_cache, "k_cache")
    assert_bits_equal(vc, case.v_cache, "v_cache")


def test_the_operator_names_a_bad_weight():
    """The raw operator checks what the spec would have: shape, dtype, device."""
    case = make_case(1, 4, 2, 64, [3], 64, torch.float16, seed=2)
    kc, vc = case.clone_caches()
    args = case.spec().kernel_args(64, case.qkv.device)
    ws = ops.Workspace.allocate(case.qkv.device, 1, 4, 64, 1, 1)
    out = torch.empty(1, 4 * 64, dtype=torch.float16, device="cuda")
    lse = torch.empty(1, 4, device="cuda")
    for bad, message in (
        (torch.ones(32, device="cuda"), r"q_norm_weight must have shape \[64\]"),
        (torch.ones(64, device="cuda", dtype=torch.float16), r"q_norm_weight must have dtype"),
    ):
        with pytest.raises(RuntimeError, match=message):
            torch.ops.mmha.decode_attention(
                case.qkv, kc, vc, case.lengths, None, out, lse, ws.partials, ws.counters, ws.status, 4, 2,
                num_splits=1, **{**args, "q_norm_weight": bad, "qk_norm_eps": 1e-6},
            )  # fmt: skip
    assert_bits_equal(kc, case.k_cache, "k_cache")
    assert_bits_equal(vc, case.v_cache, "v_cache")
