"""``KVCache(kv_dtype=torch.int8)`` on the reference path: prompts stored per token as ``mmha.quant``
quantises them (codes and scales), steps close to a full-precision cache's, a tree step's accepted
path moving codes and scales as one-token steps would have written them; on a GPU fp32 activations
are refused by name (the kernel's int8 caches: ``tests/test_int8_gpu.py``). Paged int8 caches
against contiguous ones: ``tests/test_paging.py``."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import gpu

from mmha import KVCache, layout, ops, quant

L, B, S, HQ, HKV, D = 2, 2, 64, 4, 2, 32


def _cache(kv_dtype=torch.int8, dtype=torch.float32):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference path's warning
        return KVCache(L, B, S, HQ, HKV, D, dtype, "cpu", rotary_dim=D, kv_dtype=kv_dtype)


def _prompts(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 12, HKV, D, generator=g), torch.randn(B, 12, HKV, D, generator=g)


def test_prefill_stores_codes_and_scales_per_token():
    c = _cache()
    k, v = _prompts()
    for layer in range(L):
        c.prefill(layer, k, v, [12, 5])
    scales = c.storage.scales_view(0, B)
    for row, n in enumerate([12, 5]):
        (kc, ks, _), (vc, vs, _) = quant.quantize(k[row, :n], 8), quant.quantize(v[row, :n], 8)
        assert torch.equal(layout.unpack_k(c.k_caches[0][row : row + 1], n)[0], kc)
        assert torch.equal(c.v_caches[0][row, :, :n], vc.transpose(0, 1))
        assert torch.equal(scales["k_scale"][row, :, :n], ks.T) and torch.equal(
            scales["v_scale"][row, :, :n], vs.T
        )


def test_steps_stay_close_to_a_full_precision_cache():
    ours, full = _cache(), _cache(None)
    k, v = _prompts(1)
    g = torch.Generator().manual_seed(1)
    for c in (ours, full):
        for layer in range(L):
            c.prefill(layer, k, v, [12, 5])
    for _ in range(6):
        qkv = torch.randn(B, (HQ + 2 * HKV) * D, generator=g)
        for layer in range(L):
            a, b = ours.step(layer, qkv), full.step(layer, qkv)
            assert (a - b).abs().max() <= 0.03 * b.abs().max()
        ours.advance()
        full.advance()


def test_accept_moves_codes_and_scales():
    """A star tree's path [0, 2] accepted equals one-token steps of nodes 0 and 2."""
    tree, seq = _cache(), _cache()
    k, v = _prompts(2)
    for c in (tree, seq):
        for layer in range(L):
            c.prefill(layer, k, v, [12, 5])
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(B, 3, (HQ + 2 * HKV) * D, generator=g)
    parents = torch.tensor([[-1, 0, 0]] * B, dtype=torch.int32)
    for layer in range(L):
        tree.step_tree(layer, qkv, parents)
    tree.accept([0, 1], [[0, 2], [0, 2]])
    for node in (0, 2):
        for layer in range(L):
            seq.step(layer, qkv[:, node])
        seq.advance()
    assert tree.host_lengths == seq.host_lengths == [14, 7]
    for layer in range(L):
        for row, n in enumerate([14, 7]):
            assert torch.equal(tree.k_caches[layer][row, :, :, :n], seq.k_caches[layer][row, :, :, :n])
            assert torch.equal(tree.v_caches[layer][row, :, :n], seq.v_caches[layer][row, :, :n])
            for name, t in tree.storage.scales_view(layer, B).items():
                assert torch.equal(t[row, :, :n], seq.storage.scales_view(layer, B)[name][row, :, :n])
    nxt = torch.randn(B, (HQ + 2 * HKV) * D, generator=g)
    assert torch.equal(tree.step(0, nxt), seq.step(0, nxt))


def test_int8_takes_any_activation_dtype_and_counts_its_scales():
    c = _cache(dtype=torch.bfloat16)
    codes = L * 2 * B * HKV * S * D  # one byte a value, K and V
    assert c.nbytes == codes + L * 2 * B * HKV * S * 4


@gpu
def test_a_gpu_cache_refuses_int8_under_fp32_by_name():
    with pytest.raises(ValueError, match=r"dtype must be float16 or bfloat16 with an int8 cache on a GPU"):
        KVCache(L, B, S, HQ, HKV, D, torch.float32, "cuda", kv_dtype=torch.int8)


@pytest.mark.parametrize("part", ["k", "v"])
def test_non_finite_new_token_is_flagged_as_on_the_gpu(part):
    """The reference path keeps the kernel's guard: a row that appends a token with a NaN k or v
    gets a non-finite scale and NaN output, and check() raises ScaleError naming it (then clears);
    the other row is unaffected. A tree step's non-finite node is flagged the same way."""
    c = _cache(dtype=torch.float16)
    k, v = _prompts()
    for layer in range(L):
        c.prefill(layer, k.half(), v.half(), [12, 5])
    qkv = torch.randn(B, (HQ + 2 * HKV) * D).half()
    qkv[1, (HQ + (HKV if part == "v" else 0)) * D + 3] = float("nan")
    out = c.step(0, qkv)
    assert torch.isfinite(out[0]).all() and not torch.isfinite(out[1]).all()
    scales = c.storage.scales_view(0, B)[f"{part}_scale"]
    assert not torch.isfinite(scales[1, 0, 5]) and torch.isfinite(scales[0, :, 12]).all()
    with pytest.raises(ops.ScaleError, match=r"rows \[1\]"):
        c.check()
    c.check()  # cleared
    nodes = torch.randn(B, 3, (HQ + 2 * HKV) * D).half()
    nodes[0, 2, HQ * D] = float("inf")
    c.step_tree(1, nodes, torch.tensor([[-1, 0, 1], [-1, 0, 0]], dtype=torch.int32), node_counts=[3, 2])
    with pytest.raises(ops.ScaleError, match=r"rows \[0\]"):
        c.check()
    nodes[0, 2, HQ * D] = 0.0
    nodes[1, 2, HQ * D] = float("nan")  # past row 1's count: not appended, not flagged
    c.step_tree(1, nodes, torch.tensor([[-1, 0, 1], [-1, 0, 0]], dtype=torch.int32), node_counts=[3, 2])
    c.check()
