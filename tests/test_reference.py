"""mmha.reference against a naive float64 implementation written independently here."""

from __future__ import annotations

import math

import pytest
import torch

from mmha import layout, reference
from mmha.spec import AttentionSpec, Rotary


def naive_step(qkv, k_rows, v_rows, lengths, hq, hkv, d, bias, rd, theta, interleaved, scale):
    """Per row, per head, per key loops in float64 from the plain formulas.

    ``k_rows[b]`` / ``v_rows[b]``: lists of past keys/values, each ``[Hkv, D]`` float64.
    Returns out ``[B, Hq * D]``, lse ``[B, Hq]`` and the new (rotated) k, v per row.
    """
    outs, lses, new_k, new_v = [], [], [], []
    for b in range(qkv.shape[0]):
        row = qkv[b].double() + (bias.double() if bias is not None else 0)
        q = row[: hq * d].view(hq, d).clone()
        k = row[hq * d : (hq + hkv) * d].view(hkv, d).clone()
        v = row[(hq + hkv) * d :].view(hkv, d).clone()
        pos = int(lengths[b])

        def rotate(x):
            y = x.clone()
            for i in range(rd // 2):
                ang = pos / theta ** (2 * i / rd)
                c, s = math.cos(ang), math.sin(ang)
                a, bb = (2 * i, 2 * i + 1) if interleaved else (i, i + rd // 2)
                y[:, a] = x[:, a] * c - x[:, bb] * s
                y[:, bb] = x[:, bb] * c + x[:, a] * s
            return y

        q, k = rotate(q), rotate(k)
        keys = [*k_rows[b], k]
        values = [*v_rows[b], v]
        out = torch.zeros(hq, d, dtype=torch.float64)
        lse = torch.zeros(hq, dtype=torch.float64)
        for h in range(hq):
            kvh = h // (hq // hkv)
            logits = [float((q[h] * kk[kvh]).sum()) * scale for kk in keys]
            m = max(logits)
            w = [math.exp(x - m) for x in logits]
            total = sum(w)
            lse[h] = m + math.log(total)
            for wi, vv in zip(w, values, strict=True):
                out[h] += wi / total * vv[kvh]
        outs.append(out.reshape(-1))
        lses.append(lse)
        new_k.append(k)
        new_v.append(v)
    return torch.stack(outs), torch.stack(lses), new_k, new_v


CASES = [
    # (B, Hq, Hkv, D, lengths, rotary_dim, interleaved, bias, dtype)
    (2, 4, 4, 16, [0, 3], 0, False, False, torch.float32),
    (3, 4, 2, 16, [1, 0, 6], 16, False, True, torch.float32),
    (2, 6, 2, 8, [5, 2], 8, True, False, torch.float64),
    (2, 4, 1, 32, [7, 0], 16, True, True, torch.float32),  # MQA, partial rotary
    (1, 8, 2, 16, [12], 8, False, False, torch.float16),
    (2, 2, 2, 16, [4, 9], 0, False, True, torch.bfloat16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}_Hq{c[1]}_Hkv{c[2]}_D{c[3]}_{c[8]}")
def test_reference_matches_naive_float64(case):
    b, hq, hkv, d, lengths, rd, interleaved, use_bias, dtype = case
    g = torch.Generator().manual_seed(sum(lengths) + d)
    smax = max(lengths) + 3
    width = (hq + 2 * hkv) * d
    qkv = torch.randn(b, width, generator=g).to(dtype)
    bias = torch.randn(width, generator=g).to(dtype) if use_bias else None
    k = torch.randn(b, smax, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, smax, hkv, d, generator=g).to(dtype)
    k_cache, v_cache = layout.pack_k(k), layout.pack_v(v)
    lens = torch.tensor(lengths, dtype=torch.int32)
    theta = 500.0
    out, lse = reference.decode_step(
        qkv, k_cache, v_cache, lens, num_heads=hq, num_kv_heads=hkv, qkv_bias=bias,
        attention=AttentionSpec(rotary=Rotary(rd, theta, interleaved)), return_lse=True,
        compute_dtype=torch.float64,
    )  # fmt: skip
    k_rows = [[k[i, t].double() for t in range(lengths[i])] for i in range(b)]
    v_rows = [[v[i, t].double() for t in range(lengths[i])] for i in range(b)]
    scale = 1 / math.sqrt(d)
    exp_out, exp_lse, new_k, new_v = naive_step(
        qkv, k_rows, v_rows, lengths, hq, hkv, d, bias, rd, theta, interleaved, scale
    )
    # The reference attends over the cache contents: the new k/v rounded to the cache dtype.
    tol = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.double(), exp_out.to(out.dtype).double(), atol=tol, rtol=tol)
    lse_tol = max(tol, 1e-6)  # lse is returned in fp32
    torch.testing.assert_close(lse.double(), exp_lse, atol=lse_tol * 10, rtol=lse_tol)
    for i in range(b):
        pos = lengths[i]
        got_k = layout.unpack_k(k_cache[i : i + 1])[0, pos]
        torch.testing.assert_close(got_k.double(), new_k[i].to(dtype).double(), atol=tol, rtol=tol)
        assert torch.equal(v_cache[i, :, pos], new_v[i].to(dtype))
        # Every other slot is unchanged.
        keep = [t for t in range(smax) if t != pos]
        assert torch.equal(layout.unpack_k(k_cache[i : i + 1])[0, keep], k[i, keep])
        assert torch.equal(v_cache[i, :, keep].transpose(0, 1), v[i, keep])


def test_reference_default_scale_and_return_types():
    qkv = torch.randn(1, 3 * 16)
    kc = layout.pack_k(torch.zeros(1, 4, 1, 16))
    vc = layout.pack_v(torch.zeros(1, 4, 1, 16))
    out = reference.decode_step(qkv, kc, vc, torch.tensor([0]), num_heads=1, num_kv_heads=1)
    # One key: the output is exactly the new value.
    torch.testing.assert_close(out, qkv[:, 32:])


def test_reference_rejects_full_row_and_bad_heads():
    qkv = torch.randn(1, 3 * 16)
    kc = layout.pack_k(torch.zeros(1, 2, 1, 16))
    vc = layout.pack_v(torch.zeros(1, 2, 1, 16))
    with pytest.raises(ValueError, match=r"lengths\[0\] must be in \[0, 1\]"):
        reference.decode_step(qkv, kc, vc, torch.tensor([2]), num_heads=1, num_kv_heads=1)
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be divisible by num_kv_heads \(2\)"):
        reference.decode_step(qkv, kc, vc, torch.tensor([0]), num_heads=3, num_kv_heads=2)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_is_a_rotation(interleaved):
    x = torch.randn(3, 4, 32, dtype=torch.float64)
    pos = torch.tensor([0, 5, 1000])
    y = reference.apply_rotary(x, pos, Rotary(24, 10000.0, interleaved))
    # Norms of rotated pairs are preserved, untouched dims stay, position 0 is the identity.
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    assert torch.equal(y[..., 24:], x[..., 24:])
    torch.testing.assert_close(y[0], x[0])
