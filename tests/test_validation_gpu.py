"""The raw operator and the mmha.ops wrapper reject bad input by name and write nothing
(RELIABILITY.md rows 4-9, 11 through torch.ops.mmha; KVCache rows in test_validation.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import gpu, make_case

from mmha import KVCache, ops

pytestmark = gpu

HQ, HKV, D = 8, 2, 64


def call(case, **over):
    """The raw op with every argument explicit; ``over`` replaces any of them."""
    b = case.qkv.shape[0]
    a = dict(
        qkv=case.qkv, k_cache=case.k_cache, v_cache=case.v_cache, lengths=case.lengths, qkv_bias=None,
        out=torch.empty(b, HQ * D, dtype=case.qkv.dtype, device="cuda"),
        lse=torch.empty(b, HQ, device="cuda"), partials=torch.empty(b * HQ * 4 * (D + 2), device="cuda"),
        counters=torch.zeros(b * HQ + 2, dtype=torch.int32, device="cuda"),
        status=torch.zeros(b, dtype=torch.int32, device="cuda"), num_heads=HQ, num_kv_heads=HKV,
        scale=0.125, rotary_dim=0, rotary_theta=1e4, rotary_interleaved=False, num_splits=2,
        check_lengths=True, stages=2, tile_source=0,
    )  # fmt: skip
    a.update(over)
    torch.ops.mmha.decode_attention(**a)


def base_case():
    return make_case(3, HQ, HKV, D, [1, 5, 9], 16, torch.float16, seed=0)


def off16(t):
    """The same values, contiguous, starting one element past a 16-byte boundary."""
    out = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    out.copy_(t)
    return out


def nc(t):
    """A non-contiguous tensor with the same shape and values."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() > 1 else t.repeat(2)[::2]


BAD = [
    ("qkv on cpu", lambda c: dict(qkv=c.qkv.cpu()), r"qkv must be a CUDA tensor, got a tensor on cpu"),
    ("k_cache on cpu", lambda c: dict(k_cache=c.k_cache.cpu()), r"k_cache must be a CUDA tensor"),
    ("lengths on cpu", lambda c: dict(lengths=c.lengths.cpu()), r"lengths must be a CUDA tensor"),
    ("qkv dtype", lambda c: dict(qkv=c.qkv.float()), r"k_cache must have dtype Float, got Half"),
    (
        "qkv int",
        lambda c: dict(qkv=c.qkv.int()),
        r"qkv must have dtype float16, bfloat16 or float32, got Int",
    ),
    ("v dtype", lambda c: dict(v_cache=c.v_cache.bfloat16()), r"v_cache must have dtype Half, got BFloat16"),
    ("lengths dtype", lambda c: dict(lengths=c.lengths.long()), r"lengths must have dtype Int, got Long"),
    (
        "lengths shape",
        lambda c: dict(lengths=c.lengths[:2]),
        r"lengths must have shape \[3\], got shape \[2\]",
    ),
    ("lengths non-contiguous", lambda c: dict(lengths=nc(c.lengths)), r"lengths must be contiguous"),
    (
        "head dim",
        lambda c: dict(v_cache=torch.zeros(3, HKV, 16, 72, dtype=torch.float16, device="cuda")),
        r"Unsupported head_dim: 72 \(supported: 32, 64, 80, 96, 128, 256\)",
    ),
    (
        "heads divisible",
        lambda c: dict(num_heads=6, num_kv_heads=4),
        r"num_heads \(6\) must be divisible by num_kv_heads \(4\)",
    ),
    ("kv heads", lambda c: dict(num_heads=8, num_kv_heads=4), r"v_cache must have num_kv_heads \(4\) heads"),
    (
        "qkv width",
        lambda c: dict(qkv=torch.zeros(3, 100, dtype=torch.float16, device="cuda")),
        r"qkv must have width \(num_heads \+ 2 \* num_kv_heads\) \* head_dim",
    ),
    ("qkv batch", lambda c: dict(qkv=c.qkv[:2]), r"qkv must have batch 3 \(the caches' batch\)"),
    (
        "wrong x",
        lambda c: dict(k_cache=c.k_cache.reshape(3, HKV, D // 4, 16, 4)),
        r"k_cache must have x = 16 / element_size = 8",
    ),
    (
        "k/v capacity",
        lambda c: dict(k_cache=torch.zeros(3, HKV, D // 8, 17, 8, dtype=torch.float16, device="cuda")),
        r"k_cache must have shape \[3, 2, 8, 16, 8\] to match v_cache",
    ),
    ("non-contiguous k", lambda c: dict(k_cache=nc(c.k_cache)), r"k_cache must be contiguous"),
    ("non-contiguous v", lambda c: dict(v_cache=nc(c.v_cache)), r"v_cache must be contiguous"),
    ("unaligned k", lambda c: dict(k_cache=off16(c.k_cache)), r"k_cache must start 16-byte aligned"),
    ("unaligned v", lambda c: dict(v_cache=off16(c.v_cache)), r"v_cache must start 16-byte aligned"),
    (
        "rotary odd",
        lambda c: dict(rotary_dim=7),
        r"rotary_dim must be even and in \[0, head_dim = 64\], got 7",
    ),
    ("splits", lambda c: dict(num_splits=65), r"num_splits must be in \[1, 64\], got 65"),
    (
        "workspace",
        lambda c: dict(partials=torch.empty(10, device="cuda")),
        r"partials must hold at least B \* Hq \* num_splits \* \(D \+ 2\)",
    ),
    ("stages", lambda c: dict(stages=1), r"stages must be in \[2, \d\] for head_dim 64 \(shared memory"),
    ("stages many", lambda c: dict(stages=9), r"stages must be in \[2, \d\] for head_dim 64"),
    (
        "tile source",
        lambda c: dict(tile_source=3),
        r"tile_source must be 0 \(auto\), 1 \(cp.async\) or 2 \(tma\), got 3",
    ),
    (
        "tma fp32",
        lambda c: dict(
            qkv=c.qkv.float(),
            v_cache=c.v_cache.float(),
            out=torch.empty(3, HQ * D, device="cuda"),
            k_cache=torch.zeros(3, HKV, D // 4, 16, 4, device="cuda"),
            tile_source=2,
        ),  # fmt: skip
        r"tile_source 2 \(tma\) needs float16 or bfloat16 caches with head_dim a multiple of 64, or float8_e4m3fn "
        r"caches with head_dim a multiple of 128, got Float",
    ),
    (
        "counters short",
        lambda c: dict(counters=torch.zeros(3 * HQ, dtype=torch.int32, device="cuda")),
        r"counters must hold at least B \* Hq \+ 2 = 26 int32, got 24",
    ),
    (
        "status short",
        lambda c: dict(status=torch.zeros(2, dtype=torch.int32, device="cuda")),
        r"status must hold at least B = 3 int32, got 2",
    ),
    (
        "status dtype",
        lambda c: dict(status=torch.zeros(3, dtype=torch.int64, device="cuda")),
        r"status must have dtype Int, got Long",
    ),
    (
        "status on cpu",
        lambda c: dict(status=torch.zeros(3, dtype=torch.int32)),
        r"status must be a CUDA tensor",
    ),
    (
        "out shape",
        lambda c: dict(out=torch.empty(3, 10, dtype=torch.float16, device="cuda")),
        r"out must have shape \[3, 512\]",
    ),
    (
        "bias shape",
        lambda c: dict(qkv_bias=torch.zeros(5, dtype=torch.float16, device="cuda")),
        r"qkv_bias must have shape \[768\]",
    ),
]


@pytest.mark.parametrize("name, over, match", BAD, ids=[b[0] for b in BAD])
def test_raw_op_rejects_and_writes_nothing(name, over, match):
    case = base_case()
    k0, v0, l0 = case.k_cache.clone(), case.v_cache.clone(), case.lengths.clone()
    with pytest.raises(RuntimeError, match=match):
        call(case, **over(case))
    assert torch.equal(case.k_cache.view(torch.uint8), k0.view(torch.uint8))
    assert torch.equal(case.v_cache.view(torch.uint8), v0.view(torch.uint8))
    assert torch.equal(case.lengths, l0)


@pytest.mark.parametrize("bad", [-1, 16, -(2**31)], ids=["negative", "capacity", "int32-min"])
@pytest.mark.parametrize("through", ["raw op", "wrapper"])
def test_length_values_rejected(bad, through):
    case = base_case()
    case.lengths[1] = bad
    k0, v0, l0 = case.k_cache.clone(), case.v_cache.clone(), case.lengths.clone()
    match = rf"lengths\[1\] must be in \[0, 15\] \(the cache capacity is 16 .*\), got {bad}"
    with pytest.raises(RuntimeError, match=match):
        if through == "raw op":
            call(case)
        else:
            ops.decode_attention(
                case.qkv, case.k_cache, case.v_cache, case.lengths, num_heads=HQ, num_kv_heads=HKV
            )
    assert torch.equal(case.k_cache.view(torch.uint8), k0.view(torch.uint8))
    assert torch.equal(case.v_cache.view(torch.uint8), v0.view(torch.uint8))
    assert torch.equal(case.lengths, l0)


def test_raw_op_length_check_refused_in_graph_capture():
    case = base_case()
    k0, v0 = case.k_cache.clone(), case.v_cache.clone()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"check_lengths must be False during CUDA graph capture"):
        with torch.cuda.graph(g):
            call(case)
    torch.cuda.synchronize()
    assert torch.equal(case.k_cache.view(torch.uint8), k0.view(torch.uint8))
    assert torch.equal(case.v_cache.view(torch.uint8), v0.view(torch.uint8))


def test_kvcache_rejects_other_device_and_unsupported_head_dim():
    cache = KVCache(1, 2, 8, HQ, HKV, D, torch.float16, "cuda")
    with pytest.raises(ValueError, match=r"qkv must be on cuda:0, got cpu"):
        cache.step(0, torch.zeros(2, (HQ + 2 * HKV) * D, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"Unsupported head_dim: 48"):
        KVCache(1, 2, 8, HQ, HKV, 48, torch.float16, "cuda")


def test_allocation_that_cannot_fit_fails_before_allocating():
    free, _ = torch.cuda.mem_get_info()
    before = torch.cuda.memory_allocated()
    layers = free // (2 * 8 * 8 * 65536 * 128 * 2) + 2
    with pytest.raises(MemoryError, match=r"KVCache needs \d+ bytes .* but only \d+ bytes .* are free"):
        KVCache(layers, 8, 65536, 8, 8, 128, torch.float16, "cuda")
    assert torch.cuda.memory_allocated() == before


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_gpu_device_guard():
    case = make_case(2, HQ, HKV, D, [3, 7], 16, torch.float16, seed=1, device="cuda:1")
    out = ops.decode_attention(
        case.qkv, case.k_cache, case.v_cache, case.lengths, num_heads=HQ, num_kv_heads=HKV
    )
    assert out.device == torch.device("cuda:1") and torch.isfinite(out).all()
    with pytest.raises(RuntimeError, match=r"k_cache must be on the same device as qkv"):
        call(case, k_cache=case.k_cache.to("cuda:0"))
