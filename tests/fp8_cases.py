"""fp8 (e4m3) decode cases: a 16-bit case whose caches are quantised with per-kv-head scales, and
the error bound of e4m3 against unquantised attention."""

from __future__ import annotations

import math

import torch
from helpers import Case, make_case

from mmha import reference, spec

FP8 = torch.float8_e4m3fn
# Half the spacing of e4m3 values relative to a normal value: 3 mantissa bits.
E4M3_REL = 2.0**-4
# Half the spacing of e4m3 subnormals (2^-9), in units of the scale.
E4M3_SUB = 2.0**-10


def quantize_cache(case: Case, k_scale: torch.Tensor, v_scale: torch.Tensor) -> Case:
    """``case`` with its caches quantised per kv head (NaN slots stay NaN)."""
    kc = case.k_cache  # [B, Hkv, D/8, S, 8] -> values per head
    b, h, dx, s, x = kc.shape
    k = kc.permute(0, 1, 3, 2, 4).reshape(b, h, s, dx * x)
    v = case.v_cache
    kq = (k.float() / k_scale[None, :, None, None]).clamp(-448, 448).to(FP8)
    vq = (v.float() / v_scale[None, :, None, None]).clamp(-448, 448).to(FP8)
    d = dx * x
    kq = kq.reshape(b, h, s, d // 16, 16).permute(0, 1, 3, 2, 4).contiguous()
    return Case(
        case.qkv, kq, vq.contiguous(), case.lengths, case.num_heads, case.num_kv_heads, case.bias, case.rotary,
        case.mods,
    )  # fmt: skip


def fp8_case(batch, num_heads, num_kv_heads, head_dim, lengths, max_seq_len, dtype, *, seed=0, **kw):
    """A random case with fp8 caches and scales from each kv head's absolute maximum (times a
    per-head factor in [1, 2], so heads differ)."""
    case = make_case(batch, num_heads, num_kv_heads, head_dim, lengths, max_seq_len, dtype, seed=seed, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    amax_k = case.k_cache.float().nan_to_num(0).abs().amax(dim=(0, 2, 3, 4)).cpu()
    amax_v = case.v_cache.float().nan_to_num(0).abs().amax(dim=(0, 2, 3)).cpu()
    k_scale = spec.fp8_scale(amax_k * (1 + torch.rand(num_kv_heads, generator=g)))
    v_scale = spec.fp8_scale(amax_v * (1 + torch.rand(num_kv_heads, generator=g)))
    dev = case.qkv.device
    k_scale, v_scale = k_scale.to(dev), v_scale.to(dev)
    return quantize_cache(case, k_scale, v_scale), k_scale, v_scale


def run_reference_fp8(case: Case, k_scale, v_scale, compute_dtype=torch.float64):
    kc, vc = case.clone_caches()
    out, lse = reference.decode_step(
        case.qkv, kc, vc, case.lengths, return_lse=True, compute_dtype=compute_dtype,
        k_scale=k_scale, v_scale=v_scale, **case.kwargs(),
    )  # fmt: skip
    return out, lse, kc, vc


def e4m3_error_bound(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale, v_scale, scale: float
) -> float:
    """Worst-case |out_fp8 - out| of one head, from e4m3's rounding: every cached value moves by
    at most E4M3_REL of itself (E4M3_SUB * scale for subnormals, and saturation is excluded by the
    scales), so V moves each output by at most max|dv|, and each score by at most
    eps = scale * sum_d |q_d| |dk_d|, which moves the softmax weights by a factor in
    [e^-2eps, e^2eps] and the output by at most (e^2eps - 1) max|v|.

    q ``[D]``, k and v ``[L, D]`` unquantised fp32, scales fp32 numbers."""
    dk = E4M3_REL * k.abs() + E4M3_SUB * k_scale
    dv = E4M3_REL * v.abs() + E4M3_SUB * v_scale
    eps = scale * (q.abs()[None, :] * dk).sum(-1).max().item()
    vmax = (v.abs() + dv).max().item()
    return dv.max().item() + math.expm1(2 * eps) * vmax
