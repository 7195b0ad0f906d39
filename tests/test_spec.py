"""mmha.spec's Rotary: the frequency table and attention factor are checked when built (naming the
field), a table that describes theta's frequencies is the same rotation, and a layer's spec
refuses a table on another device than the cache's."""

from __future__ import annotations

import math

import pytest
import torch

from mmha import reference
from mmha.spec import AttentionSpec, Rotary


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
