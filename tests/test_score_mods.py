"""Score modifiers (sliding window, logit soft-cap, ALiBi, attention sinks): mmha.reference's
definitions against a naive computation written here, their checks, KVCache's CPU path, and the
kernel's refusal until it applies them."""

from __future__ import annotations

import math

import pytest
import torch

from mmha import layout, reference
from mmha.cache import KVCache

pytestmark = pytest.mark.usefixtures("no_reference_warning")


def naive(q, k, v, pos, scale, window=None, softcap=None, slopes=None, sinks=None):
    """One row in float64 from the definitions: q [Hq, D], k and v [Hkv, L, D] (slots 0..L-1)."""
    hq, hkv = q.shape[0], k.shape[0]
    out = torch.zeros(hq, q.shape[1], dtype=torch.float64)
    lse = torch.zeros(hq, dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[h // (hq // hkv)].double(), v[h // (hq // hkv)].double()
        num, den = torch.zeros(q.shape[1], dtype=torch.float64), 0.0
        logits = []
        for t in range(k.shape[1]):
            if window is not None and t <= pos - window:
                continue
            s = float(q[h].double() @ kh[t]) * scale
            if softcap is not None:
                s = softcap * math.tanh(s / softcap)
            if slopes is not None:
                s += float(slopes[h]) * (t - pos)
            logits.append((t, s))
        extra = [float(sinks[h])] if sinks is not None else []
        m = max([s for _, s in logits] + extra)
        for t, s in logits:
            num += math.exp(s - m) * vh[t]
            den += math.exp(s - m)
        den += sum(math.exp(x - m) for x in extra)
        out[h] = num / den
        lse[h] = m + math.log(den)
    return out, lse


@pytest.mark.parametrize(
    "mods",
    [
        dict(window=1),
        dict(window=5),
        dict(window=100),
        dict(softcap=2.5),
        dict(slopes=True),
        dict(sinks=True),
        dict(window=7, softcap=3.0),
        dict(window=4, sinks=True, slopes=True, softcap=1.5),
    ],
)
def test_reference_follows_the_definitions(mods):
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, s_max = 6, 2, 16, 40
    lengths = [0, 3, 17, 39]
    k = torch.randn(4, s_max, hkv, d, generator=g) * 2
    v = torch.randn(4, s_max, hkv, d, generator=g)
    qkv = torch.randn(4, (hq + 2 * hkv) * d, generator=g) * 2
    slopes = reference.alibi_slopes(hq) if mods.get("slopes") else None
    sinks = torch.randn(hq, generator=g) if mods.get("sinks") else None
    kw = dict(window=mods.get("window"), softcap=mods.get("softcap"), alibi_slopes=slopes, sinks=sinks)
    kc, vc = layout.pack_k(k), layout.pack_v(v)
    out, lse = reference.decode_step(
        qkv, kc, vc, torch.tensor(lengths), num_heads=hq, num_kv_heads=hkv, return_lse=True,
        compute_dtype=torch.float64, **kw,
    )  # fmt: skip
    q, k_new, v_new = reference.split_qkv(qkv, hq, hkv, d)
    for b, pos in enumerate(lengths):
        keys = torch.cat([k[b, :pos].transpose(0, 1), k_new[b][:, None]], 1)
        values = torch.cat([v[b, :pos].transpose(0, 1), v_new[b][:, None]], 1)
        want, want_lse = naive(q[b], keys, values, pos, d**-0.5, mods.get("window"), mods.get("softcap"), slopes,
                               sinks)  # fmt: skip
        assert torch.allclose(out[b].double().reshape(hq, d), want, atol=1e-5), b
        assert torch.allclose(lse[b].double(), want_lse, atol=1e-5), b


def test_standard_alibi_slopes():
    assert reference.alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]
    assert reference.alibi_slopes(6).tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    assert reference.alibi_slopes(1).tolist() == [2.0**-8]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(window=0), "window must be an int >= 1"),
        (dict(window=2.5), "window must be an int >= 1"),
        (dict(window=True), "window must be an int >= 1"),
        (dict(softcap=0.0), "softcap must be a finite number > 0"),
        (dict(softcap=float("inf")), "softcap must be a finite number > 0"),
        (dict(alibi_slopes=torch.ones(3)), r"alibi_slopes must be a float32 tensor of shape \[4\]"),
        (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), "alibi_slopes must be a float32 tensor"),
        (dict(sinks=torch.tensor([0.0, float("nan"), 0.0, 0.0])), "sinks must be finite"),
    ],
)
def test_bad_modifiers_are_named_and_nothing_is_written(kw, match):
    c = KVCache(1, 2, 16, 4, 2, 16, torch.float32, "cpu")
    k0, l0 = c.k_caches[0].clone(), c.host_lengths
    with pytest.raises(ValueError, match=match):
        c.step(0, torch.randn(2, 8 * 16), **kw)
    assert torch.equal(c.k_caches[0].view(torch.uint8), k0.view(torch.uint8)) and c.host_lengths == l0


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_cpu_steps_with_a_window_and_sinks(paged):
    """Per-layer settings through KVCache: a sliding-window layer and a global layer with sinks,
    against the reference over the same cache contents."""
    g = torch.Generator().manual_seed(2)
    hq, hkv, d = 4, 2, 16
    c = KVCache(2, 3, 64, hq, hkv, d, torch.float32, "cpu", rotary_dim=d, paged=paged)
    flat = KVCache(2, 3, 64, hq, hkv, d, torch.float32, "cpu", rotary_dim=d)
    k = torch.randn(3, 30, hkv, d, generator=g)
    for cache in (c, flat):
        for layer in range(2):
            cache.prefill(layer, k, k, [30, 7, 0])
    sinks = torch.randn(hq, generator=g)
    for _ in range(12):
        qkv = torch.randn(3, (hq + 2 * hkv) * d, generator=g)
        a0, b0 = c.step(0, qkv, window=8), flat.step(0, qkv, window=8)
        a1, b1 = c.step(1, qkv, sinks=sinks), flat.step(1, qkv, sinks=sinks)
        assert torch.equal(a0, b0) and torch.equal(a1, b1)
        c.advance()
        flat.advance()
    full = flat.step(0, qkv, window=10**6)
    assert torch.allclose(full, flat.step(0, qkv), atol=1e-6)  # a window past every row is no window
