"""fp8 (e4m3) caches on the GPU: the kernel against mmha.reference's fp8 path (same quantised
bytes, outputs within fp32-accumulation tolerance), e4m3's error against unquantised attention,
the checks on scales, KVCache and CUDA graphs."""

from __future__ import annotations

import math

import pytest
import torch
from fp8_cases import FP8, e4m3_error_bound, fp8_case, run_reference_fp8
from helpers import FLOOR, assert_bits_equal, gpu, make_case

from mmha import layout, ops, reference, spec
from mmha.cache import KVCache

pytestmark = gpu

HEAD_DIMS = (32, 64, 80, 96, 128, 256)


def run_kernel(case, k_scale, v_scale, **kw):
    out, lse = ops.decode_attention(
        case.qkv, case.k_cache, case.v_cache, case.lengths, return_lse=True,
        k_scale=k_scale, v_scale=v_scale, **case.kwargs(), **kw,
    )  # fmt: skip
    return out, lse


def check_fp8(case, k_scale, v_scale, rotary=False, **kw):
    ref, ref_lse, ref_k, ref_v = run_reference_fp8(case, k_scale, v_scale)
    out, lse = run_kernel(case, k_scale, v_scale, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "kernel output has non-finite values"
    dtype = case.qkv.dtype
    err = (out.double() - ref.double()).abs().max().item()
    tol = FLOOR[dtype] * max(1.0, ref.double().abs().max().item())
    assert err <= tol, f"max error {err:.3e} > {tol:.3e}"
    lse_err = (lse.double() - ref_lse.double()).abs().max().item()
    assert lse_err <= 1e-3 * max(1.0, ref_lse.abs().max().item()), f"lse error {lse_err:.3e}"
    # The append: the same quantised bytes (rotated k may sit one e4m3 step away: the kernel's
    # sincos and torch's differ in the last fp32 bit).
    assert_bits_equal(case.v_cache, ref_v, "v_cache")
    if rotary:
        diff = (case.k_cache.float() - ref_k.float()).abs().nan_to_num(0)
        step = (ref_k.float().abs().nan_to_num(0) * 2.0**-3).clamp_min(2.0**-9)
        assert bool((diff <= step).all()), "rotated k more than one e4m3 step from the reference"
    else:
        assert_bits_equal(case.k_cache, ref_k, "k_cache")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_matches_fp8_reference(dtype, head_dim, splits):
    case, ks, vs = fp8_case(3, 8, 2, head_dim, [0, 63, 200], 256, dtype, seed=head_dim + splits)
    check_fp8(case, ks, vs, num_splits=splits)


@pytest.mark.parametrize("source", ["cp_async", "tma"])
@pytest.mark.parametrize("heads", [(32, 32), (32, 8), (8, 1), (6, 2)])
def test_gqa_groups_and_sources(source, heads):
    hq, hkv = heads
    case, ks, vs = fp8_case(2, hq, hkv, 128, [5, 500], 512, torch.float16, seed=hq * 7 + hkv)
    check_fp8(case, ks, vs, tile_source=source)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotary_and_bias(interleaved, dtype):
    case, ks, vs = fp8_case(
        4,
        8,
        4,
        64,
        [1, 17, 64, 129],
        192,
        dtype,
        seed=11,
        bias=True,
        rotary_dim=64,
        rotary_interleaved=interleaved,
    )
    check_fp8(case, ks, vs, rotary=True)


@pytest.mark.parametrize("value_scale", [1e-3, 1e3])
def test_bf16_activations_beyond_fp16_range(value_scale):
    """bf16 q far outside what fp16 holds after scaling (the kernel brings q to range itself)."""
    case, ks, vs = fp8_case(2, 4, 2, 128, [40, 300], 320, torch.bfloat16, seed=5, value_scale=value_scale)
    case.qkv[:, : 4 * 128] *= 1e4  # q only: |q| ~ 1e7 * value_scale
    check_fp8(case, ks, vs)


def test_unused_slots_nan_do_not_reach_output():
    case, ks, vs = fp8_case(2, 8, 8, 128, [3, 70], 128, torch.float16, unused_fill=float("nan"))
    assert torch.isnan(case.v_cache.float()).any()
    check_fp8(case, ks, vs, num_splits=2)


def test_determinism_and_split_agreement():
    case, ks, vs = fp8_case(2, 16, 4, 128, [1000, 2047], 2048, torch.bfloat16, seed=3)
    outs = []
    for splits in (1, 4, 4, 16):
        k, v = case.clone_caches()
        outs.append(ops.decode_attention(case.qkv, k, v, case.lengths, k_scale=ks, v_scale=vs,
                                         num_splits=splits, **case.kwargs()))  # fmt: skip
    assert torch.equal(outs[1], outs[2]), "same split count not bit-identical"
    for o in outs[1:]:
        assert (o.float() - outs[0].float()).abs().max().item() <= 2e-2


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_error_against_fp16_attention_within_e4m3_bound(head_dim):
    """N(0, 1) data, per-head scales from the absolute maxima: the kernel's fp8 output against
    fp64 attention over the unquantised fp16 cache is within e4m3_error_bound for every head."""
    hq, hkv, length = 8, 2, 1024
    case = make_case(
        1, hq, hkv, head_dim, [length], length + 64, torch.float16, seed=head_dim, unused_fill=0.0
    )
    q, k_new, v_new = reference.split_qkv(case.qkv.double(), hq, hkv, head_dim)
    keys = layout.unpack_k(case.k_cache, length, layout="bhsd")[0].double()
    values = case.v_cache[0, :, :length].double()
    amax_k = torch.maximum(keys.abs().amax(dim=(1, 2)), k_new[0].abs().amax(-1))
    amax_v = torch.maximum(values.abs().amax(dim=(1, 2)), v_new[0].abs().amax(-1))
    ks, vs = spec.fp8_scale(amax_k).cuda(), spec.fp8_scale(amax_v).cuda()
    keys = torch.cat([keys, k_new[0][:, None]], 1)
    values = torch.cat([values, v_new[0][:, None]], 1)
    exact, _ = reference.attend(q[0], keys, values, 1 / math.sqrt(head_dim))
    from fp8_cases import quantize_cache

    qcase = quantize_cache(case, ks, vs)
    out, _ = run_kernel(qcase, ks, vs)
    err = (out.double().reshape(hq, head_dim) - exact).abs()
    group = hq // hkv
    for h in range(hq):
        kvh = h // group
        bound = e4m3_error_bound(q[0, h].float(), keys[kvh].float(), values[kvh].float(), ks[kvh].item(),
                                 vs[kvh].item(), 1 / math.sqrt(head_dim))  # fmt: skip
        assert err[h].max().item() <= bound, f"head {h}: {err[h].max().item():.3e} > bound {bound:.3e}"


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0, float("inf")])
@pytest.mark.parametrize("which", ["k", "v"])
def test_bad_scale_values_refuse_the_step(bad, which):
    case, ks, vs = fp8_case(2, 8, 2, 128, [10, 100], 128, torch.float16)
    (ks if which == "k" else vs)[1] = bad
    k0, v0 = case.clone_caches()
    ws = ops.Workspace.allocate("cuda", 2, 8, 128, ops.dispatch.MAX_SPLITS)
    out = ops.decode_attention(case.qkv, case.k_cache, case.v_cache, case.lengths, k_scale=ks, v_scale=vs,
                               workspace=ws, **case.kwargs())  # fmt: skip
    assert torch.isnan(out.float()).all(), "every row of a refused step is NaN"
    assert_bits_equal(case.k_cache, k0, "k_cache")
    assert_bits_equal(case.v_cache, v0, "v_cache")
    with pytest.raises(ops.ScaleError, match="not finite and positive"):
        ws.check()
    ws.check()  # cleared


def test_argument_checks_name_the_argument():
    case, ks, vs = fp8_case(1, 4, 2, 64, [3], 64, torch.float16)
    k0, v0 = case.clone_caches()
    kw = case.kwargs()

    def call(**over):
        args = dict(k_scale=ks, v_scale=vs)
        args.update(over)
        qkv = args.pop("qkv", case.qkv)
        return ops.decode_attention(qkv, case.k_cache, case.v_cache, case.lengths, **args, **kw)

    with pytest.raises(RuntimeError, match="k_scale must be given"):
        call(k_scale=None)
    with pytest.raises(RuntimeError, match=r"v_scale must have shape \[2\]"):
        call(v_scale=vs[:1].clone())
    with pytest.raises(RuntimeError, match="k_scale must have dtype Float"):
        call(k_scale=ks.double())
    with pytest.raises(RuntimeError, match="v_scale must be a CUDA tensor"):
        call(v_scale=vs.cpu())
    with pytest.raises(
        ValueError, match="qkv must have dtype float16 or bfloat16 with a torch.float8_e4m3fn"
    ):
        call(qkv=case.qkv.float())
    assert_bits_equal(case.k_cache, k0, "k_cache")
    assert_bits_equal(case.v_cache, v0, "v_cache")
    c16 = make_case(1, 4, 2, 64, [3], 64, torch.float16)
    with pytest.raises(RuntimeError, match="k_scale and v_scale must be None"):
        ops.decode_attention(c16.qkv, c16.k_cache, c16.v_cache, c16.lengths, k_scale=ks, v_scale=vs, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kvcache_fp8_steps_match_reference_and_graph_replay(dtype):
    torch.manual_seed(0)
    hq, hkv, d, layers = 8, 2, 128, 2
    cache = KVCache(
        layers, 3, 100, hq, hkv, d, dtype, "cuda", kv_dtype=FP8, rotary_dim=d, dispatch_on="capacity"
    )
    ref = KVCache(layers, 3, 100, hq, hkv, d, dtype, "cpu", kv_dtype=FP8, rotary_dim=d)
    k = torch.randn(3, 20, hkv, d, dtype=dtype) * 3
    v = torch.randn(3, 20, hkv, d, dtype=dtype)
    for layer in range(layers):
        cache.prefill(layer, k.cuda(), v.cuda(), [20, 7, 1])
        ref.prefill(layer, k, v, [20, 7, 1])
    assert torch.equal(cache.k_scales.cpu(), ref.k_scales)
    assert_bits_equal(cache.k_caches[0][0, :, :, :20].cpu(), ref.k_caches[0][0, :, :, :20], "prefilled k")
    qkv = torch.randn(3, (hq + 2 * hkv) * d, dtype=dtype)
    static = qkv.cuda()
    outs = [cache.step(layer, static) for layer in range(layers)]  # warm-up eager step
    cache.advance()
    for layer in range(layers):
        ref.step(layer, qkv)
    ref.advance()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [cache.step(layer, static) for layer in range(layers)]
        cache.advance()
    for _ in range(3):
        qkv = torch.randn(3, (hq + 2 * hkv) * d, dtype=dtype)
        static.copy_(qkv)
        g.replay()
        cache.account_replay()
        want = [ref.step(layer, qkv) for layer in range(layers)]
        ref.advance()
        for o, w in zip(outs, want, strict=True):
            assert (o.float().cpu() - w.float()).abs().max().item() <= FLOOR[dtype] * max(
                1.0, w.float().abs().max().item()
            )
    cache.check()
    assert cache.host_lengths == ref.host_lengths
