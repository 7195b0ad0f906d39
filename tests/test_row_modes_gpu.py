"""Row modes and rotary positions on the GPU: attend-only rows (one shard of a context spread over
caches), idle and stepping rows in one call, q and k rotated at ``positions``; the kernel against
the float64 reference (the tolerance rule), NaN in unused slots, a poisoned output; the caches
keep every byte except the stepping rows' new slot. Then ``ShardedKVCache`` on the GPU: two ranks
over gloo sharing one GPU, and over NCCL where there are two GPUs."""

from __future__ import annotations

import time

import pytest
import torch
from distributed_cases import run_ranks
from fp8_cases import fp8_case
from helpers import FLOOR, gpu, make_case

from mmha import ops, reference

pytestmark = gpu

FP8 = torch.float8_e4m3fn
# Lengths and modes of the rows: attend-only rows of no slot (idle), one slot, across tile and
# split boundaries and at the capacity (256); stepping and idle rows among them.
LENGTHS = [0, 1, 63, 64, 65, 200, 256, 130, 17]
MODES = [2, 2, 1, 2, 0, 2, 2, 1, 2]
S_MAX = 256

CASES = [
    (torch.float16, None, 128, 1, "tma", {}),
    (torch.float16, None, 128, 3, "tma", {}),
    (torch.bfloat16, None, 64, 3, "cp_async", {}),
    (torch.float16, None, 96, 1, "cp_async", {}),
    (torch.float32, None, 64, 1, "auto", {}),
    (torch.float32, None, 128, 4, "auto", {}),
    (torch.float16, FP8, 128, 3, "tma", {}),
    (torch.bfloat16, FP8, 64, 1, "cp_async", {}),
    (torch.float16, None, 128, 2, "tma", {"window": 50, "sinks": True}),
]


def _ids(c):
    dtype, kv, hd, splits, src, mods = c
    name = f"{str(dtype)[6:]}{'-e4m3' if kv else ''}-hd{hd}-s{splits}-{src}"
    return name + ("-" + "-".join(mods) if mods else "")


@pytest.mark.parametrize(
    "dtype,kv_dtype,head_dim,num_splits,tile_source,mods", CASES, ids=[_ids(c) for c in CASES]
)
def test_row_modes_and_positions_match_reference(dtype, kv_dtype, head_dim, num_splits, tile_source, mods):
    batch, hq, hkv = len(LENGTHS), 8, 2
    kw = dict(seed=7, bias=True, rotary_dim=head_dim // 2)
    if kv_dtype is None:
        case = make_case(batch, hq, hkv, head_dim, LENGTHS, S_MAX, dtype, **kw)
        extra = {}
    else:
        case, k_scale, v_scale = fp8_case(batch, hq, hkv, head_dim, LENGTHS, S_MAX, dtype, **kw)
        extra = dict(k_scale=k_scale, v_scale=v_scale)
    if mods.get("window"):
        case.mods["window"] = mods["window"]
    if mods.get("sinks"):
        case.mods["sinks"] = torch.linspace(-2.0, 3.0, hq, device="cuda")
    modes = torch.tensor(MODES, dtype=torch.int32, device="cuda")
    positions = torch.randint(0, 5000, (batch,), generator=torch.Generator().manual_seed(3)).to(
        "cuda", torch.int32
    )
    args = dict(case.kwargs(), **extra, row_active=modes, positions=positions)
    ref, ref_lse = [], []
    for compute in (torch.float64, dtype):
        kc, vc = case.clone_caches()
        out, lse = reference.decode_step(
            case.qkv, kc, vc, case.lengths, return_lse=True, compute_dtype=compute, **args
        )
        ref.append(out)
        ref_lse.append(lse)
    kc, vc = case.clone_caches()
    k_before, v_before = kc.clone(), vc.clone()
    out, lse = ops.decode_attention(
        case.qkv,
        kc,
        vc,
        case.lengths,
        num_splits=num_splits,
        tile_source=tile_source,
        return_lse=True,
        **args,
    )
    idle = [r for r, (n, m) in enumerate(zip(LENGTHS, MODES, strict=True)) if m == 0 or (m == 2 and n == 0)]
    assert torch.equal(out[idle].float(), torch.zeros_like(out[idle].float()))
    assert torch.isinf(lse[idle]).all() and (lse[idle] < 0).all()
    assert torch.isfinite(out).all(), "kernel output has non-finite values"
    err = (out.double() - ref[0].double()).abs().max().item()
    base = (ref[1].double() - ref[0].double()).abs().max().item()
    scale = max(1.0, ref[0].double().abs().max().item())
    tol = 2 * base + FLOOR[dtype] * scale * (4 if kv_dtype is not None else 1)
    assert err <= tol, f"max error {err:.3e} > tolerance {tol:.3e}"
    live = [r for r in range(batch) if r not in idle]
    lse_err = (lse[live].double() - ref_lse[0][live].double()).abs().max().item()
    assert lse_err <= 1e-3 * max(1.0, ref_lse[0][live].abs().max().item()), f"lse error {lse_err:.3e}"
    # Bytes: only the stepping rows' slot lengths[b] changed (k within a rounding of the reference's).
    step_rows = [r for r, m in enumerate(MODES) if m == 1]
    for r in range(batch):
        kb, vb, ka, va = k_before[r], v_before[r], kc[r], vc[r]
        if r in step_rows:
            p = LENGTHS[r]
            kb, vb, ka, va = (
                torch.cat([t[..., :p, :], t[..., p + 1 :, :]], dim=-2) for t in (kb, vb, ka, va)
            )
        assert torch.equal(kb.view(torch.uint8), ka.view(torch.uint8)), f"row {r}: k_cache bytes changed"
        assert torch.equal(vb.view(torch.uint8), va.view(torch.uint8)), f"row {r}: v_cache bytes changed"
    for r in step_rows:
        assert torch.isfinite(kc[r, :, :, LENGTHS[r], :].float()).all(), f"row {r}: new k not written"


def test_attend_only_refused_in_tree_steps_and_checked():
    case = make_case(2, 4, 2, 64, [5, 9], 64, torch.float16)
    parents = torch.tensor([[-1, 0], [-1, 0]], dtype=torch.int32, device="cuda")
    qkv = case.qkv[:, None].expand(2, 2, -1).contiguous()
    with pytest.raises(ValueError, match="row_active"):
        ops.decode_tree(qkv, *case.clone_caches(), case.lengths, parents, num_heads=4, num_kv_heads=2,
                        row_active=torch.tensor([1, 2], dtype=torch.int32, device="cuda"))  # fmt: skip
    with pytest.raises((ValueError, RuntimeError), match="row_active"):
        ops.decode_attention(case.qkv, *case.clone_caches(), case.lengths, num_heads=4, num_kv_heads=2,
                             row_active=torch.tensor([1, 3], dtype=torch.int32, device="cuda"))  # fmt: skip
    # an attend-only row may sit at the capacity; a stepping row may not
    full = torch.tensor([64, 9], dtype=torch.int32, device="cuda")
    ops.decode_attention(case.qkv, *case.clone_caches(), full, num_heads=4, num_kv_heads=2,
                         row_active=torch.tensor([2, 1], dtype=torch.int32, device="cuda"))  # fmt: skip
    with pytest.raises((ValueError, RuntimeError), match="lengths"):
        ops.decode_attention(case.qkv, *case.clone_caches(), full, num_heads=4, num_kv_heads=2)


SHARDED = [
    dict(mode="sequence", dtype=torch.float16),
    dict(mode="sequence", dtype=torch.bfloat16, output="heads", mods=True),
    dict(mode="sequence", dtype=torch.float16, kv_dtype=FP8),
    dict(mode="sequence", dtype=torch.float32, block=1),
    dict(mode="heads", dtype=torch.float16, output="full", mods=True),
]


@pytest.mark.parametrize(
    "kw", SHARDED, ids=lambda kw: "-".join(f"{v}".replace("torch.", "") for v in kw.values())
)
def test_sharded_cache_on_one_gpu_over_gloo(kw):
    run_ranks("decode_matches_single", 2, backend="gloo", device="cuda", **kw)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize(
    "kw", SHARDED, ids=lambda kw: "-".join(f"{v}".replace("torch.", "") for v in kw.values())
)
def test_sharded_cache_over_nccl(kw):
    run_ranks("decode_matches_single", 2, backend="nccl", device="cuda", **kw)


def test_sharded_step_in_a_cuda_graph_one_rank():
    run_ranks("graph_matches_single", 1, backend="gloo")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("output", [None, "heads"])
def test_sharded_step_in_a_cuda_graph_over_nccl(output):
    run_ranks("graph_matches_single", 2, backend="nccl", output=output)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_failing_rank_ends_the_step_over_nccl():
    t0 = time.monotonic()
    run_ranks("rank_fails", 2, backend="nccl", timeout_s=5.0, device="cuda")
    assert time.monotonic() - t0 < 90
