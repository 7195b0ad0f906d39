"""Bad input gets a clear error naming the argument, and nothing is written (CPU-side checks)."""

from __future__ import annotations

import warnings

import pytest
import torch

from mmha import KVCache
from mmha._ext import _C

HQ, HKV, D = 4, 2, 32
WIDTH = (HQ + 2 * HKV) * D


@pytest.fixture
def cache():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return KVCache(2, 3, 8, HQ, HKV, D, torch.float16, "cpu")


def state(c):
    return [t.clone() for t in c.k_caches + c.v_caches] + [c.lengths.clone()], c.host_lengths


def unchanged(c, before):
    tensors, host = before
    now = c.k_caches + c.v_caches + [c.lengths]
    return all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(now, tensors, strict=True)
    ) and (c.host_lengths == host)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_layers=0), r"num_layers must be a positive int, got 0"),
        (dict(num_heads=6, num_kv_heads=4), r"num_heads \(6\) must be divisible by num_kv_heads \(4\)"),
        (dict(head_dim=36), r"head_dim \(36\) must be divisible by x = 16 // element_size = 8"),
        (dict(dtype=torch.int8), r"dtype must be one of"),
        (dict(rotary_dim=33), r"rotary_dim must be even and in \[0, 32\], got 33"),
        (dict(dispatch_on="always"), r"dispatch_on must be 'length' or 'capacity'"),
    ],
)
def test_construction_errors(kwargs, match):
    args = dict(num_layers=1, max_batch=2, max_seq_len=8, num_heads=HQ, num_kv_heads=HKV, head_dim=D,
                dtype=torch.float16, device="cpu")  # fmt: skip
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        KVCache(**args)


@pytest.mark.parametrize(
    "make_qkv, kw, match",
    [
        (
            lambda: torch.randn(3, WIDTH + 1).half(),
            {},
            r"qkv must have shape \[B, .* = 256\], got \(3, 257\)",
        ),
        (lambda: torch.randn(4, WIDTH).half(), {}, r"qkv must have 1..3 rows \(max_batch\), got 4"),
        (lambda: torch.randn(3, WIDTH), {}, r"qkv must have dtype torch.float16, got torch.float32"),
        (lambda: torch.randn(3, WIDTH).half(), {"layer": 2}, r"layer must be in \[0, 1\], got 2"),
        (
            lambda: torch.randn(3, WIDTH).half(),
            {"qkv_bias": torch.zeros(3)},
            r"qkv_bias must have shape \[256\]",
        ),
    ],
)
def test_step_errors_write_nothing(cache, make_qkv, kw, match):
    before = state(cache)
    layer = kw.pop("layer", 0)
    with pytest.raises(ValueError, match=match):
        cache.step(layer, make_qkv(), **kw)
    assert unchanged(cache, before)


def test_prefill_errors_write_nothing(cache):
    before = state(cache)
    k = torch.randn(2, 5, HKV, D).half()
    with pytest.raises(ValueError, match=r"k must have shape \[n, S, 2, 32\], got \(2, 5, 3, 32\)"):
        cache.prefill(0, torch.randn(2, 5, 3, D).half(), k)
    with pytest.raises(ValueError, match=r"v must have dtype torch.float16, got torch.float32"):
        cache.prefill(0, k, k.float())
    with pytest.raises(ValueError, match=r"lengths\[1\] must be in \[0, 5\] \(the prompt width\), got 6"):
        cache.prefill(0, k, k, [5, 6])
    with pytest.raises(ValueError, match=r"rows must be in \[0, 2\], got 3"):
        cache.prefill(0, k, k, [1, 1], rows=[0, 3])
    with pytest.raises(ValueError, match=r"rows must not repeat a row"):
        cache.prefill(0, k, k, [1, 1], rows=[1, 1])
    assert unchanged(cache, before)


@pytest.mark.skipif(_C is None, reason="extension not built")
def test_raw_op_rejects_cpu_tensors_by_name():
    qkv = torch.randn(1, WIDTH).half()
    kc = torch.zeros(1, HKV, D // 8, 8, 8).half()
    vc = torch.zeros(1, HKV, 8, D).half()
    lengths = torch.zeros(1, dtype=torch.int32)
    out, lse = torch.empty(1, HQ * D).half(), torch.empty(1, HQ)
    ws, ctr, status = (
        torch.empty(0),
        torch.zeros(HQ + 2, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
    )
    with pytest.raises(RuntimeError, match=r"qkv must be a CUDA tensor, got a tensor on cpu"):
        torch.ops.mmha.decode_attention(qkv, kc, vc, lengths, None, out, lse, ws, ctr, status, HQ, HKV, 0.1,
                                        0, 1e4, False, 1)  # fmt: skip
    assert not kc.any() and not vc.any()
