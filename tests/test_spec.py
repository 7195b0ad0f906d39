"""mmha.spec's Rotary and QKNorm: the frequency table, the attention factor and the q/k norm's
weights are checked when built (naming the field), a table that describes theta's frequencies is
the same rotation, a layer's spec refuses a table on another device than the cache's, and the
reference's q/k norm is the row norm's value."""

from __future__ import annotations

import math

import pytest
import torch

from mmha import reference
from mmha.spec import AttentionSpec, QKNorm, Rotary


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dim=7), r"rotary dim must be an even int >= 0, got 7"),
        (dict(dim=8, theta=0.0), r"rotary theta must be a finite number > 0, got 0.0"),
        (dict(dim=8, interleaved=1), r"rotary interleaved must be a bool, got 1"),
        (dict(dim=8, attention_factor=float("nan")), r"rotary attention_factor must be a finite number > 0"),
        (dict(dim=8, attention_factor=0.0), r"rotary attention_factor must be a finite number > 0"),
        (dict(dim=8, inv_freq=torch.ones(3)), r"rotary inv_freq must be a float32 tensor \[dim // 2 = 4\] or \[rows, 4\], got"),
        (dict(dim=8, inv_freq=torch.ones(4, dtype=torch.float64)), r"\[dim // 2 = 4\] or \[rows, 4\], got torch.float64"),
        (dict(dim=8, inv_freq=[1.0, 0.5, 0.25, 0.125]), r"\[dim // 2 = 4\] or \[rows, 4\], got list"),
        (dict(dim=8, inv_freq=torch.tensor([1.0, float("inf"), 0.5, 0.1])), r"rotary inv_freq must be finite"),
        (dict(dim=8, inv_freq=torch.ones(3, 5)), r"float32 tensor \[dim // 2 = 4\] or \[rows, 4\], got"),
        (dict(dim=8, inv_freq=torch.ones(0, 4)), r"or \[rows, 4\], got torch.float32 \(0, 4\)"),
        (dict(dim=8, inv_freq=torch.ones(2, 4), table_start=-1), r"rotary table_start must be an int in"),
    ],
)  # fmt: skip
def test_rotary_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Rotary(**kwargs)


def test_table_of_theta_is_the_same_rotation():
    plain = Rotary(16, 5e5)
    table = Rotary(16, 5e5, inv_freq=plain.frequencies(torch.float32, "cpu"))
    assert not table.same(plain)
    assert table.same(Rotary(16, 5e5, inv_freq=table.inv_freq.clone()))
    want = [1.0 / 5e5 ** (2 * i / 16) for i in range(8)]
    assert torch.allclose(plain.frequencies(torch.float64, "cpu"), torch.tensor(want, dtype=torch.float64))
    # fp32 angles from the same fp32 frequencies: bit for bit, at long positions too
    x = torch.randn(5, 2, 16)
    pos = torch.tensor([0, 1, 100, 4095, 70000])
    assert torch.equal(reference.apply_rotary(x, pos, plain), reference.apply_rotary(x, pos, table))


def test_the_kernel_gets_theta_as_a_table():
    """The kernel's arguments carry theta's fp32 frequencies as a table (one per dim, theta and
    device, made once), so kernel and reference rotate by the same values; a given table as it is."""
    spec = AttentionSpec(rotary=Rotary(16, 5e5))
    args = spec.kernel_args(64, "cpu")
    assert torch.equal(args["rotary_inv_freq"], Rotary(16, 5e5).frequencies(torch.float32, "cpu"))
    assert spec.kernel_args(64, "cpu")["rotary_inv_freq"] is args["rotary_inv_freq"]
    assert args["rotary_factor"] == 1.0 and args["rotary_dim"] == 16
    table = torch.rand(8)
    given = AttentionSpec(rotary=Rotary(16, 5e5, inv_freq=table, attention_factor=1.5)).kernel_args(64, "cpu")
    assert torch.equal(given["rotary_inv_freq"], table) and given["rotary_factor"] == 1.5
    assert AttentionSpec().kernel_args(64, "cpu")["rotary_inv_freq"] is None


def test_table_by_length_picks_a_row_per_sequence_length():
    """A table of rows by the sequence's length: row min(max(pos + 1 - table_start, 0), rows - 1);
    the kernel gets it with its start; tree steps refuse it."""
    from mmha import checks

    rows = torch.stack([Rotary(8, t).frequencies(torch.float32, "cpu") for t in (1e4, 2e4, 4e4)])
    by_length = Rotary(8, 1e4, inv_freq=rows, table_start=10)
    assert by_length.by_length and not Rotary(8, 1e4, inv_freq=rows[:1]).by_length
    x = torch.randn(5, 2, 8)
    pos = torch.tensor([0, 9, 10, 11, 500])  # lengths 1, 10, 11, 12, 501: rows 0, 0, 1, 2, 2
    got = reference.apply_rotary(x, pos, by_length)
    for b, theta in enumerate([1e4, 1e4, 2e4, 4e4, 4e4]):
        assert torch.equal(
            got[b : b + 1], reference.apply_rotary(x[b : b + 1], pos[b : b + 1], Rotary(8, theta))
        )
    args = AttentionSpec(rotary=by_length).kernel_args(64, "cpu")
    assert args["rotary_inv_freq"] is by_length.inv_freq and args["rotary_table_start"] == 10
    assert not by_length.same(Rotary(8, 1e4, inv_freq=rows, table_start=11))
    with pytest.raises(ValueError, match=r"attention.rotary follows the sequence's length .* not tree steps"):
        checks.tree_spec(AttentionSpec(rotary=by_length))


def test_attention_factor_scales_cos_and_sin():
    x = torch.randn(3, 1, 8, dtype=torch.float64)
    pos = torch.tensor([2, 9, 31])
    one = reference.apply_rotary(x, pos, Rotary(8, 1e4))
    scaled = reference.apply_rotary(x, pos, Rotary(8, 1e4, attention_factor=1.25))
    assert torch.allclose(scaled, one * 1.25)
    angle = 9 * 1.0  # pair 0 of position 9: inv_freq 1
    a, b = x[1, 0, 0], x[1, 0, 4]
    assert math.isclose(float(one[1, 0, 0]), float(a * math.cos(angle) - b * math.sin(angle)), rel_tol=1e-12)


def test_spec_refuses_a_table_on_another_device():
    spec = AttentionSpec(rotary=Rotary(8, inv_freq=torch.ones(4)))
    spec.check_for(4, 32, "cpu")
    with pytest.raises(ValueError, match=r"attention.rotary.inv_freq must be on cuda, got cpu"):
        spec.check_for(4, 32, "cuda")
    with pytest.raises(ValueError, match=r"attention.rotary.dim must be <= head_dim \(4\), got 8"):
        spec.check_for(4, 4, "cpu")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(), r"QKNorm needs q_weight or k_weight \(or both\), got neither"),
        (dict(q_weight=torch.ones(2, 4)), r"QKNorm q_weight must be a 1-D float tensor \[head_dim\], got"),
        (dict(k_weight=torch.ones(4, dtype=torch.int32)), r"QKNorm k_weight must be a 1-D float tensor"),
        (dict(q_weight=torch.tensor([1.0, float("nan")])), r"QKNorm q_weight \(\+ offset\) must be finite, got 1"),
        (dict(q_weight=torch.ones(4), eps=-1e-6), r"QKNorm eps must be a finite number >= 0"),
        (dict(q_weight=torch.ones(4), offset=float("inf")), r"QKNorm offset must be a finite number"),
        (dict(q_weight=torch.ones(4), cast_first=1), r"QKNorm cast_first must be a bool, got 1"),
    ],
)  # fmt: skip
def test_qk_norm_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QKNorm(**kwargs)


def test_qk_norm_tables_and_kernel_args():
    """The kernel reads fp32 weight + offset; a side without a weight is passed as None."""
    w = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.bfloat16)
    norm = QKNorm(k_weight=w, eps=1e-5, offset=1.0, cast_first=False)
    assert norm.q_table is None
    assert norm.k_table.dtype == torch.float32 and torch.equal(norm.k_table, w.float() + 1.0)
    args = AttentionSpec(qk_norm=norm).kernel_args(4, "cpu")
    assert args["q_norm_weight"] is None and args["k_norm_weight"] is norm.k_table
    assert args["qk_norm_eps"] == 1e-5 and args["qk_norm_cast_first"] is False
    assert "q_norm_weight" not in AttentionSpec().kernel_args(4, "cpu")
    with pytest.raises(ValueError, match=r"layer\.qk_norm\.k_weight must have shape \[8\] \(head_dim\)"):
        AttentionSpec(qk_norm=norm).check_for(2, 8, "cpu", "layer")
    with pytest.raises(ValueError, match=r"qk_norm must be a mmha.spec.QKNorm or None, got dict"):
        AttentionSpec(qk_norm={})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("offset, cast_first", [(0.0, True), (1.0, False)])
def test_reference_norm_is_the_row_norm_then_the_plain_step(offset, cast_first, dtype):
    """``reference.decode_step`` with a ``QKNorm`` equals the plain step on a qkv row whose q and
    k heads ``reference.rms_norm`` normed first (the value the kernel's norm leaves), bit for bit."""
    b, hq, hkv, d, s_max = 2, 4, 2, 16, 8
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(b, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype)
    wq, wk = torch.randn(d, generator=g), torch.randn(d, generator=g)
    k_cache = torch.randn(
        b, hkv, d // (16 // qkv.element_size()), s_max, 16 // qkv.element_size(), generator=g
    )
    v_cache = torch.randn(b, hkv, s_max, d, generator=g)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    lengths = torch.tensor([3, 5])
    spec = AttentionSpec(rotary=Rotary(d), qk_norm=QKNorm(wq, wk, 1e-6, offset, cast_first))
    kc, vc = k_cache.clone(), v_cache.clone()
    ours = reference.decode_step(qkv, kc, vc, lengths, num_heads=hq, num_kv_heads=hkv, attention=spec)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    normed = torch.cat([
        reference.rms_norm(q.unflatten(1, (hq, d)), wq, 1e-6, offset, cast_first).flatten(1),
        reference.rms_norm(k.unflatten(1, (hkv, d)), wk, 1e-6, offset, cast_first).flatten(1), v,
    ], dim=1)  # fmt: skip
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    plain = reference.decode_step(
        normed, kc2, vc2, lengths, num_heads=hq, num_kv_heads=hkv, attention=spec.replace(qk_norm=None)
    )
    assert torch.equal(ours, plain) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_a_cache_refuses_a_q_k_norm_of_another_head_dim():
    from mmha import KVCache

    spec = AttentionSpec(qk_norm=QKNorm(torch.ones(8)))
    with pytest.raises(
        ValueError, match=r"attention\[1\]\.qk_norm\.q_weight must have shape \[16\] \(head_dim\)"
    ):
        KVCache(2, 1, 8, 2, 1, 16, torch.float32, "cpu", attention=[AttentionSpec(), spec])


def test_reference_tree_of_one_node_is_the_one_token_step_with_a_q_k_norm():
    b, hq, hkv, d, s_max = 2, 4, 2, 16, 8
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g)
    k_cache, v_cache = (
        torch.randn(b, hkv, d // 4, s_max, 4, generator=g),
        torch.randn(b, hkv, s_max, d, generator=g),
    )
    spec = AttentionSpec(
        rotary=Rotary(d), qk_norm=QKNorm(torch.rand(d, generator=g), torch.rand(d, generator=g))
    )
    lengths = torch.tensor([2, 6])
    kw = dict(num_heads=hq, num_kv_heads=hkv, attention=spec)
    kc, vc = k_cache.clone(), v_cache.clone()
    step = reference.decode_step(qkv, kc, vc, lengths, **kw)
    kt, vt = k_cache.clone(), v_cache.clone()
    tree = reference.decode_tree(qkv[:, None], kt, vt, lengths, torch.full((b, 1), -1), **kw)
    assert torch.equal(tree[:, 0], step) and torch.equal(kt, kc) and torch.equal(vt, vc)
