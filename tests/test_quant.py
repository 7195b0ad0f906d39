"""The integer K/V formats' semantics (``mmha.quant``): codes in range, read-back error within
half a step, zero and non-finite vectors, KIVI's per-channel groups with the partial group kept,
the smoothing factors and their fold into q; the accuracy study runs."""

from __future__ import annotations

import json

import pytest
import torch

from mmha import quant


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [8, 4])
def test_codes_and_read_back(bits, symmetric):
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(bits)) * 4
    codes, scale, zero = quant.quantize(x, bits, symmetric)
    assert codes.shape == x.shape and scale.shape == x.shape[:-1]
    if symmetric:
        assert zero is None and codes.dtype == torch.int8
        assert int(codes.abs().max()) == quant.QMAX[bits]  # the largest value uses the top code
    else:
        assert codes.dtype == torch.uint8 and int(codes.max()) == 2**bits - 1 and int(codes.min()) == 0
    back = quant.dequantize(codes, scale, zero)
    assert torch.all((back - x).abs() <= scale[..., None] / 2 + 1e-6)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("symmetric", [True, False])
def test_scales_stored_in_16_bits(scale_dtype, symmetric):
    # The scale and zero point are what a 16-bit field holds, and the codes are chosen with them:
    # the read-back error stays within half a step of that scale (plus, with a zero point, the
    # step's clamp at the top code, at most the zero point's rounding).
    x = torch.randn(6, 4, 64, generator=torch.Generator().manual_seed(3)) * 5 + 2
    codes, scale, zero = quant.quantize(x, 4, symmetric, scale_dtype)
    assert torch.equal(scale, scale.to(scale_dtype).float())
    if zero is not None:
        assert torch.equal(zero, zero.to(scale_dtype).float())
    exact_lo = x.amin(-1)
    slack = 0 if zero is None else (zero - exact_lo).abs() + (x.amax(-1) - exact_lo) * 2**-7
    back = quant.dequantize(codes, scale, zero)
    assert torch.all((back - x).abs() <= (scale / 2 + slack)[..., None] + 1e-5)
    full = quant.quantize(x, 4, symmetric)
    assert not torch.equal(scale, full[1])  # rounded, not the fp32 scale
    with pytest.raises(ValueError, match="scale_dtype"):
        quant.quantize(x, 4, symmetric, torch.int8)
    # Past the dtype's largest value: an infinite scale, read back non-finite (fp16's 65504).
    big = x.clone()
    big[1, 2, 7] = -7.0e4
    codes, scale, zero = quant.quantize(big, 4, symmetric, scale_dtype)
    back = quant.dequantize(codes, scale, zero)
    past = scale_dtype == torch.float16
    assert bool(torch.isinf(scale[1, 2])) == past and bool(torch.isfinite(back[1, 2]).all()) != past
    assert torch.isfinite(scale[0]).all() and torch.isfinite(back[0]).all()


def test_zero_and_non_finite_vectors():
    x = torch.zeros(2, 8)
    x[1, 3] = float("inf")
    codes, scale, _ = quant.quantize(x, 8)
    assert scale[0] == 0 and torch.equal(quant.dequantize(codes, scale, None)[0], torch.zeros(8))
    assert not torch.isfinite(scale[1])  # the guard's to report, not a saturated code
    assert torch.equal(codes[1], torch.zeros(8, dtype=torch.int8))  # no cast of a NaN code
    assert not torch.isfinite(quant.dequantize(codes, scale, None)[1]).all()


def test_channel_groups_keep_the_partial_group():
    """Per channel over full groups of tokens; the tokens past the last full group as they are."""
    x = torch.randn(70, 2, 16)
    back = quant.roundtrip_channels(x, 4, 32)
    assert torch.equal(back[64:], x[64:])
    group = x[:32, 1, 5]  # one channel of one group: its own scale and zero point
    codes, scale, zero = quant.quantize(group, 4, symmetric=False)
    assert torch.allclose(back[:32, 1, 5], quant.dequantize(codes, scale, zero))
    assert torch.equal(quant.roundtrip_channels(x[:20], 4, 32), x[:20])


def test_smoothing_folds_into_q():
    k = torch.randn(40, 2, 16) * torch.linspace(0.1, 30, 16)
    s = quant.smoothing_factors(k)
    assert s.shape == (2, 16)
    assert torch.allclose(torch.log(s).mean(-1), torch.zeros(2), atol=1e-5)
    assert s[0, -1] > s[0, 0]  # the large channels are divided most
    q = torch.randn(2, 16)
    assert torch.allclose((q * s * (k / s)).sum(-1), (q * k).sum(-1), rtol=1e-4, atol=1e-3)


def test_bad_bits():
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quant.quantize(torch.ones(3), 2)


def test_accuracy_study_runs(tmp_path):
    from mmha.bench import kv_accuracy

    assert (
        kv_accuracy.main(["--contexts", "128", "--seeds", "1", "--device", "cpu", "--out", str(tmp_path)])
        == 0
    )
    rows = json.loads((tmp_path / "kv_accuracy.json").read_text())["rows"]
    by = {(r["kv"], r["tensor"], r["format"]): r["mean_rel_err"] for r in rows}
    assert len(rows) == 2 * (len(kv_accuracy.K_FORMATS) + len(kv_accuracy.V_FORMATS))
    assert by[("random", "K", "int8")] < by[("random", "K", "int4")]  # 4 more bits, a smaller error


def test_model_formats_teacher_forced():
    """The formats on a small HF model, teacher-forced after a prompt: the 16-bit cache read
    through no format agrees with itself exactly; int8 stays closer than int4; the model's
    attention implementation is restored."""
    pytest.importorskip("transformers")
    from mmha.bench.families import build_family
    from mmha.bench.kv_formats_model import compare

    model = build_family("llama3", "cpu", torch.float32)
    own = model.config._attn_implementation
    rows = {r["format"]: r for r in compare(model, 80, 8, formats={"none": None, "int8": ("int8", "int8"),
                                                                   "int4": ("int4", "int4")})}  # fmt: skip
    assert rows["none"]["agreement"] == 1.0 and rows["none"]["mean_kl"] == 0.0
    assert rows["int8"]["mean_kl"] < rows["int4"]["mean_kl"]
    assert model.config._attn_implementation == own
