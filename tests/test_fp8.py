"""fp8 (e4m3) caches without a GPU: the reference's quantisation, KVCache's scales and checks,
dispatch, and the status flags of a refused step."""

from __future__ import annotations

import pytest
import torch

from mmha import dispatch, ops, reference, spec
from mmha.cache import KVCache
from mmha.spec import AttentionSpec, Rotary

FP8 = torch.float8_e4m3fn


pytestmark = pytest.mark.usefixtures("no_reference_warning")


def test_quantize_saturates_rounds_to_nearest_even_and_keeps_nan():
    scale = torch.tensor([2.0])
    x = torch.tensor([[1000.0, -1000.0, 2 * 1.0625, 2 * 1.1875, 2 * 2.0**-10, float("nan")]])
    q = spec.quantize_fp8(x, scale).float()[0]
    assert q[0].item() == 448 and q[1].item() == -448  # saturated, not NaN
    assert q[2].item() == 1.0  # 1.0625 is halfway between 1 and 1.125: ties to even (1.0)
    assert q[3].item() == 1.25  # 1.1875 is halfway between 1.125 and 1.25: ties to even (1.25)
    assert q[4].item() == 0.0  # half the smallest subnormal (2^-9): ties to even (0)
    assert torch.isnan(q[5])


def test_dequantize_and_scales_from_amax():
    s = spec.fp8_scale(torch.tensor([448.0, 0.0, float("inf"), 4.48]), margin=2.0)
    assert s.tolist() == [2.0, 1.0, 1.0, pytest.approx(0.02)]
    x = torch.tensor([[3.0], [-5.0]]).to(FP8)
    assert spec.dequantize_fp8(x, torch.tensor([0.5, 2.0])).flatten().tolist() == [1.5, -10.0]


def cache(**kw):
    args = dict(num_layers=2, max_batch=3, max_seq_len=32, num_heads=4, num_kv_heads=2, head_dim=32,
                dtype=torch.float16, device="cpu", kv_dtype=FP8)  # fmt: skip
    args.update(kw)
    return KVCache(**args)


def test_kv_dtype_rules():
    with pytest.raises(ValueError, match="dtype must be float16 or bfloat16 with an fp8"):
        cache(dtype=torch.float32)
    with pytest.raises(ValueError, match="kv_dtype must be torch.float16"):
        cache(kv_dtype=torch.bfloat16)
    c = cache()
    assert c.k_caches[0].shape == (3, 2, 2, 32, 16) and c.k_caches[0].dtype == FP8
    assert c.nbytes == 2 * 2 * 3 * 2 * 32 * 32  # one byte per element
    assert c.k_scales.shape == (2, 2) and c.k_scales.dtype == torch.float32


def test_prefill_calibrates_once_then_keeps_and_quantises():
    c = cache()
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 10, 2, 32, generator=g).half() * 3
    v = torch.randn(2, 10, 2, 32, generator=g).half()
    c.prefill(0, k, v, [10, 4])
    amax = torch.maximum(k[0, :10].float().abs().amax(dim=(0, 2)), k[1, :4].float().abs().amax(dim=(0, 2)))
    assert torch.equal(c.k_scales[0], spec.fp8_scale(amax))
    assert torch.equal(c.k_scales[1], torch.ones(2))  # layer 1 untouched
    want = spec.quantize_fp8(k[0, :10], c.k_scales[0])
    got = c.k_caches[0][0, :, :, :10].permute(2, 0, 1, 3).reshape(10, 2, 32)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    before = c.k_scales.clone()
    c.prefill(0, k[:1] * 10, v[:1], [10], rows=[2])  # "auto": scales are kept once set
    assert torch.equal(c.k_scales, before)
    assert c.k_caches[0][2, :, :, :10].float().abs().max().item() == 448  # saturated


def test_scales_cannot_change_under_cached_rows_and_nothing_is_written():
    c = cache()
    k = torch.randn(1, 5, 2, 32).half()
    c.prefill(0, k, k, [5])
    k0, s0 = c.k_caches[0].clone(), c.k_scales.clone()
    with pytest.raises(ValueError, match="cannot change while rows \\[0\\] hold tokens"):
        c.prefill(0, k, k, [5], rows=[1], scales="amax")
    with pytest.raises(ValueError, match="cannot change while rows \\[0\\]"):
        c.set_scales(0, 1.0, 1.0)
    assert torch.equal(c.k_caches[0].view(torch.uint8), k0.view(torch.uint8)) and torch.equal(c.k_scales, s0)
    assert c.host_lengths[1] == 0
    c.release([0])
    c.set_scales(0, torch.tensor([0.5, 0.25]), 2.0)
    assert c.k_scales[0].tolist() == [0.5, 0.25] and c.v_scales[0].tolist() == [2.0, 2.0]


@pytest.mark.parametrize(
    "k_scale, match",
    [(float("nan"), "finite and positive"), (0.0, "finite and positive"), (-1.0, "finite and positive"),
     (float("inf"), "finite and positive"), (torch.ones(3), r"shape \[2\]")],
)  # fmt: skip
def test_set_scales_rejects_bad_values(k_scale, match):
    c = cache()
    with pytest.raises(ValueError, match=match):
        c.set_scales(0, k_scale, 1.0)
    assert torch.equal(c.k_scales, torch.ones(2, 2))
    with pytest.raises(ValueError, match="needs an fp8 cache"):
        cache(kv_dtype=None).set_scales(0, 1.0, 1.0)
    with pytest.raises(ValueError, match="scale_margin must be a finite positive"):
        c.prefill(0, torch.zeros(1, 2, 2, 32).half(), torch.zeros(1, 2, 2, 32).half(), scale_margin=0)


def test_cpu_steps_follow_the_reference():
    c = cache(rotary_dim=32)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(3, 8, 2, 32, generator=g).half()
    c.prefill(0, k, k, [8, 3, 0])
    qkv = torch.randn(3, 8 * 32, generator=g).half()
    kc, vc = c.k_caches[0].clone(), c.v_caches[0].clone()
    want = reference.decode_step(qkv, kc, vc, c.lengths, num_heads=4, num_kv_heads=2, attention=AttentionSpec(rotary=Rotary(32)),
                                 k_scale=c.k_scales[0], v_scale=c.v_scales[0])  # fmt: skip
    got = c.step(0, qkv)
    assert torch.equal(got, want)
    assert torch.equal(c.k_caches[0].view(torch.uint8), kc.view(torch.uint8))


def test_dispatch_fp8_stages_hold_twice_the_keys():
    p16 = dispatch.choose_variant(16, 32, 32, 128, 8192, torch.float16)
    p8 = dispatch.choose_variant(16, 32, 32, 128, 8192, torch.float16, kv_dtype=FP8)
    assert dispatch.tile_stage_bytes(128, 1, False) * 2 == dispatch.tile_stage_bytes(128, 2, False)
    assert p8.stages > p16.stages
    with pytest.raises(ValueError, match="dtype must be float16 or bfloat16"):
        dispatch.choose_variant(1, 8, 8, 128, 64, torch.float32, kv_dtype=FP8)


def test_workspace_check_names_the_refusal():
    ws = ops.Workspace(
        torch.empty(0), torch.zeros(4, dtype=torch.int32), torch.tensor([0, 2, 2], dtype=torch.int32), 1
    )
    with pytest.raises(ops.ScaleError, match=r"rows \[1, 2\]"):
        ws.check()
    ws.check()
    ws.status[0] = 3
    with pytest.raises(ops.LengthError, match=r"rows \[0\]"):
        ws.check()


def test_dispatch_fp8_fills_every_resident_block():
    """A grid of fewer items than resident blocks is split to fill them with fp8 caches (the
    consumers bound fp8), to one item per SM with 16-bit caches."""
    p16 = dispatch.choose_variant(16, 32, 8, 128, 32768, torch.float16)
    p8 = dispatch.choose_variant(16, 32, 8, 128, 32768, torch.float16, kv_dtype=FP8)
    assert (p16.num_splits, p8.num_splits) == (1, 2)
    base = 16 * 8
    assert base * p8.num_splits <= dispatch.H100.num_sms * p8.blocks_per_sm
