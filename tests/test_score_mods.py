"""Score modifiers (sliding window, logit soft-cap, ALiBi, attention sinks): mmha.reference's
definitions against a naive computation written here, their checks, KVCache's CPU path, and the
kernel's refusal until it applies them."""

from __future__ import annotations

import math

import pytest
import torch

from mmha import layout, reference
from mmha.cache import KVCache
from mmha.spec import AttentionSpec, Rotary, alibi_slopes

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
    slopes = alibi_slopes(hq) if mods.get("slopes") else None
    sinks = torch.randn(hq, generator=g) if mods.get("sinks") else None
    kw = dict(window=mods.get("window"), softcap=mods.get("softcap"), alibi_slopes=slopes, sinks=sinks)
    kc, vc = layout.pack_k(k), layout.pack_v(v)
    out, lse = reference.decode_step(
        qkv, kc, vc, torch.tensor(lengths), num_heads=hq, num_kv_heads=hkv, return_lse=True,
        compute_dtype=torch.float64, attention=AttentionSpec(**kw),
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
    assert alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]
    assert alibi_slopes(6).tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    assert alibi_slopes(1).tolist() == [2.0**-8]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(window=0), "window must be an int >= 1"),
        (dict(window=2.5), "window must be an int >= 1"),
        (dict(window=True), "window must be an int >= 1"),
        (dict(softcap=0.0), "softcap must be a finite number > 0"),
        (dict(softcap=float("inf")), "softcap must be a finite number > 0"),
        (dict(alibi_slopes=torch.ones(3)), r"attention\[1\]\.alibi_slopes must have shape \[4\]"),
        (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), "alibi_slopes must be a 1-D float32 tensor"),
        (dict(sinks=torch.ones(2, 2)), "sinks must be a 1-D float32 tensor"),
        (dict(sinks=torch.tensor([0.0, float("nan"), 0.0, 0.0])), "sinks must be finite"),
        (dict(rotary=Rotary(32)), r"attention\[1\]\.rotary\.dim must be <= head_dim \(16\)"),
        (dict(scale=float("nan")), "scale must be a finite number"),
    ],
)
def test_bad_modifiers_are_named_when_the_cache_is_built(kw, match):
    """A layer's spec is checked once: when built (its values) and when a cache takes it (its fit)."""
    with pytest.raises(ValueError, match=match):
        KVCache(2, 2, 16, 4, 2, 16, torch.float32, "cpu", attention=[AttentionSpec(), AttentionSpec(**kw)])


def test_a_cache_takes_one_spec_per_layer_or_one_for_all():
    spec = AttentionSpec(window=3)
    assert KVCache(3, 1, 16, 4, 2, 16, torch.float32, "cpu", attention=spec).attention == (spec,) * 3
    with pytest.raises(
        ValueError, match=r"attention must be one AttentionSpec or 3 \(one per layer\), got 2"
    ):
        KVCache(3, 1, 16, 4, 2, 16, torch.float32, "cpu", attention=[spec, spec])
    with pytest.raises(
        ValueError, match="rotary_dim, rotary_theta, rotary_interleaved and scale must be left out"
    ):
        KVCache(3, 1, 16, 4, 2, 16, torch.float32, "cpu", attention=spec, rotary_dim=16)
    with pytest.raises(ValueError, match=r"attention\[0\] must be a mmha.AttentionSpec, got dict"):
        KVCache(1, 1, 16, 4, 2, 16, torch.float32, "cpu", attention=[{}])
    with pytest.raises(TypeError):
        KVCache(1, 1, 16, 4, 2, 16, torch.float32, "cpu").step(0, torch.randn(1, 128), window=4)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_cpu_steps_with_a_window_and_sinks(paged):
    """Per-layer settings through KVCache: a sliding-window layer and a global layer with sinks,
    against the reference over the same cache contents."""
    g = torch.Generator().manual_seed(2)
    hq, hkv, d = 4, 2, 16
    sinks = torch.randn(hq, generator=g)
    specs = [AttentionSpec(rotary=Rotary(d), window=8), AttentionSpec(rotary=Rotary(d), sinks=sinks)]
    c = KVCache(2, 3, 64, hq, hkv, d, torch.float32, "cpu", attention=specs, paged=paged)
    flat = KVCache(2, 3, 64, hq, hkv, d, torch.float32, "cpu", attention=specs)
    k = torch.randn(3, 30, hkv, d, generator=g)
    for cache in (c, flat):
        for layer in range(2):
            cache.prefill(layer, k, k, [30, 7, 0])
    for _ in range(12):
        qkv = torch.randn(3, (hq + 2 * hkv) * d, generator=g)
        lengths = torch.tensor(flat.host_lengths, dtype=torch.int32)
        want = [  # each layer's own spec over the cache contents before the step
            reference.decode_step(qkv, flat.k_caches[i].clone(), flat.v_caches[i].clone(), lengths, num_heads=hq,
                                  num_kv_heads=hkv, attention=specs[i])
            for i in range(2)
        ]  # fmt: skip
        a0, b0 = c.step(0, qkv), flat.step(0, qkv)
        a1, b1 = c.step(1, qkv), flat.step(1, qkv)
        assert torch.equal(a0, b0) and torch.equal(a1, b1)
        assert torch.equal(b0, want[0]) and torch.equal(b1, want[1])
        c.advance()
        flat.advance()
    wide = KVCache(
        1, 3, 64, hq, hkv, d, torch.float32, "cpu", attention=AttentionSpec(rotary=Rotary(d), window=10**6)
    )
    plain = KVCache(1, 3, 64, hq, hkv, d, torch.float32, "cpu", rotary_dim=d)
    for cache in (wide, plain):
        cache.prefill(0, k, k, [30, 7, 0])
    assert torch.allclose(
        wide.step(0, qkv), plain.step(0, qkv), atol=1e-6
    )  # a window past every row is no window
