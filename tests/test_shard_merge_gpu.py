"""The shard kernels of mmha.distributed on the GPU (csrc/kernels/shard_merge.cu): ``merge.pack``
equal to the torch layout bit for bit, ``merge.merge`` against the float64 rescale-and-merge
(empty shards, heads empty everywhere, sinks large and very negative, a NaN partial), poisoned
outputs, CUDA-graph capture, and argument errors that name the argument and write nothing."""

from __future__ import annotations

import pytest
import torch
from helpers import gpu

from mmha.distributed import merge

pytestmark = gpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-6}


def _partials(shards, batch, heads, head_dim, seed, empty=0.3):
    """Random fp32 partials ``[W, B, H, D]`` and lses ``[W, B, H]``, a share of them empty (-inf,
    their values NaN: an empty shard's values must never be looked at), head 0 of row 0 empty
    on every shard."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    outs = torch.randn(shards, batch, heads, head_dim, generator=g, device="cuda")
    lses = torch.randn(shards, batch, heads, generator=g, device="cuda") * 4 + 2
    gone = torch.rand(shards, batch, heads, generator=g, device="cuda") < empty
    gone[:, 0, 0] = True
    lses[gone] = float("-inf")
    outs[gone] = float("nan")
    return outs, lses


def _expected(outs, lses, sinks):
    """The definition (merge's module docstring) in float64; empty shards' values unread."""
    outs = torch.where(torch.isinf(lses)[..., None], torch.zeros_like(outs), outs).double()
    lses = lses.double()
    top = lses.amax(dim=0)
    if sinks is not None:
        top = torch.maximum(top, sinks.double())
    ref = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lses - ref)
    total = weights.sum(dim=0) + (0 if sinks is None else torch.exp(sinks.double() - ref))
    out = (weights[..., None] * outs).sum(dim=0)
    return out / torch.where(total > 0, total, torch.ones_like(total))[..., None], ref + torch.log(total)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("head_dim", [32, 80, 128, 256])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_pack_matches_torch_layout(dtype, head_dim, groups):
    batch, heads = 3, 8
    g = torch.Generator(device="cuda").manual_seed(head_dim + groups)
    out = torch.randn(batch, heads * head_dim, generator=g, device="cuda").to(dtype)
    lse = torch.randn(batch, heads, generator=g, device="cuda")
    lse[0, 1] = float("-inf")
    parts = merge.pack(out, lse, heads, groups)
    assert parts.shape == (groups, batch, heads // groups, head_dim + 1) and parts.dtype == torch.float32
    ref = torch.cat([out.reshape(batch, heads, head_dim).float(), lse[..., None]], dim=-1)
    ref = ref.view(batch, groups, heads // groups, head_dim + 1).transpose(0, 1)
    assert torch.equal(parts, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shards", [1, 2, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 80, 256])
@pytest.mark.parametrize("sinks", [None, "mixed"])
def test_merge_matches_float64(dtype, shards, head_dim, sinks):
    batch, heads = 4, 6
    outs, lses = _partials(shards, batch, heads, head_dim, seed=shards * 1000 + head_dim)
    sink = None
    if sinks:  # large, very negative and ordinary logits
        sink = torch.tensor([30.0, -1e4, 0.5, -2.0, 8.0, -50.0], device="cuda")
    parts = torch.cat([outs, lses[..., None]], dim=-1).contiguous()
    out, lse = merge.merge(parts, sink, dtype)
    ref_out, ref_lse = _expected(outs, lses, sink)
    assert out.shape == (batch, heads * head_dim) and out.dtype == dtype and lse.dtype == torch.float32
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and bool((lse[empty] < 0).all())
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty], rtol=1e-5, atol=1e-5)
    assert bool((out.reshape(batch, heads, head_dim)[empty] == 0).all())
    err = (out.double().reshape(batch, heads, head_dim) - ref_out).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref_out.abs().max().item()), err


def test_merge_keeps_nan_and_overwrites_poison():
    outs, lses = _partials(2, 2, 4, 64, seed=7, empty=0.0)
    lses[1, 1, 2] = float("nan")  # a row the kernel refused on one shard
    parts = torch.cat([outs, lses[..., None]], dim=-1).contiguous()
    out = torch.full((2, 4 * 64), 12345.0, device="cuda", dtype=torch.float16)
    lse = torch.full((2, 4), 12345.0, device="cuda")
    torch.ops.mmha.shard_merge(parts, None, out, lse)
    nan = torch.zeros(2, 4, dtype=torch.bool, device="cuda")
    nan[1, 2] = True
    assert bool(torch.isnan(lse[nan]).all()) and bool(torch.isnan(out.view(2, 4, 64)[nan]).all())
    assert not bool(torch.isnan(lse[~nan]).any()) and bool(torch.isfinite(out.view(2, 4, 64)[~nan]).all())
    assert not bool((out == 12345.0).any())


def test_pack_and_merge_in_a_cuda_graph():
    batch, heads, d, shards = 2, 8, 128, 2
    out_in = torch.randn(batch, heads * d, device="cuda", dtype=torch.float16)
    lse_in = torch.randn(batch, heads, device="cuda")
    sinks = torch.randn(heads, device="cuda")
    parts = torch.empty(shards, batch, heads, d + 1, device="cuda")
    out = torch.empty(batch, heads * d, device="cuda", dtype=torch.float16)
    lse = torch.empty(batch, heads, device="cuda")

    def step():
        one = merge.pack(out_in, lse_in, heads)
        parts.copy_(one.expand(shards, -1, -1, -1))
        torch.ops.mmha.shard_merge(parts, sinks, out, lse)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        torch.manual_seed(seed)
        out_in.copy_(torch.randn_like(out_in))
        lse_in.copy_(torch.randn_like(lse_in))
        graph.replay()
        ref_out, ref_lse = _expected(
            out_in.view(1, batch, heads, d).float().expand(shards, -1, -1, -1),
            lse_in[None].expand(shards, -1, -1),
            sinks,
        )
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.double().view(batch, heads, d), ref_out, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize(
    "case,match",
    [
        ("parts_dtype", "parts must have dtype"),
        ("parts_shape", "parts must have shape"),
        ("out_shape", "out must have shape"),
        ("out_dtype", "out must have dtype"),
        ("lse_shape", "lse must have shape"),
        ("sinks_shape", "sinks must have shape"),
        ("sinks_dtype", "sinks must have dtype"),
        ("parts_cpu", "parts must be a CUDA tensor"),
    ],
)
def test_merge_arguments_checked_and_nothing_written(case, match):
    parts = torch.randn(2, 3, 4, 65, device="cuda")
    out = torch.full((3, 4 * 64), 7.0, device="cuda", dtype=torch.float16)
    lse = torch.full((3, 4), 7.0, device="cuda")
    sinks = torch.zeros(4, device="cuda")
    if case == "parts_dtype":
        parts = parts.half()
    elif case == "parts_shape":
        parts = parts[0]
    elif case == "out_shape":
        out = torch.full((3, 4 * 65), 7.0, device="cuda", dtype=torch.float16)
    elif case == "out_dtype":
        out = out.to(torch.int8)
    elif case == "lse_shape":
        lse = torch.full((3, 5), 7.0, device="cuda")
    elif case == "sinks_shape":
        sinks = torch.zeros(5, device="cuda")
    elif case == "sinks_dtype":
        sinks = sinks.half()
    elif case == "parts_cpu":
        parts = parts.cpu()
    before = (out.clone(), lse.clone())
    with pytest.raises(RuntimeError, match=match):
        torch.ops.mmha.shard_merge(parts, sinks, out, lse)
    assert torch.equal(out, before[0]) and torch.equal(lse, before[1])


def test_pack_arguments_checked():
    parts = torch.empty(2, 3, 4, 65, device="cuda")
    out = torch.zeros(3, 8 * 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="lse must have shape"):
        torch.ops.mmha.shard_pack(out, torch.zeros(3, 4, device="cuda"), parts)
    with pytest.raises(RuntimeError, match="out must have shape"):
        torch.ops.mmha.shard_pack(out[:, :64], torch.zeros(3, 8, device="cuda"), parts)
