"""Integer K/V quantisation: the semantics of int8 and int4 caches (what a cache stores for each
appended token and what attention reads back), in plain torch.

Each appended token's K (and V) of one kv head, ``x [D]``, is stored as integers with a scale of
its own (per token and kv head), so nothing needs calibrating before the first prompt and a
token's outliers cost only that token's precision:

- ``symmetric``: ``scale = amax(|x|) / qmax``, ``code = round_half_even(x / scale)`` in
  ``[-qmax, qmax]`` (qmax 127 for int8, 7 for int4); read back as ``code * scale``;
- ``asymmetric`` (int4's other option): ``scale = (max(x) - min(x)) / (2^bits - 1)``, a zero
  point ``zero = min(x)``, ``code = round((x - zero) / scale)`` in ``[0, 2^bits - 1]``; read back as
  ``code * scale + zero``.

K's channels are not alike in trained models: a few carry most of the magnitude (outlier channels,
kept in pairs by rotary), which per-token scales spend their range on. ``smoothing`` divides K's
channel ``c`` by a per-(kv head, channel) factor ``s[c]`` before quantising; attention then
multiplies q's channel ``c`` by ``s[c]`` (``q . k = (q * s) . (k / s)``), once per step and head,
so the tile loop is unchanged. The factors come from the prompt (``smoothing_factors``: the
channel's absolute maximum to the power ``alpha``, normalised to geometric mean 1).

A scale of 0 (an all-zero vector) reads back zeros; non-finite input gives a non-finite scale
(its codes 0), which reads back non-finite and which the device-side guard reports (the cache
must not silently saturate it).

An int8 cache (``KVCache(kv_dtype=torch.int8)``, ``mmha.ops.decode_attention`` and
``mmha.reference``; one-token steps) stores each appended token's K and V symmetric per token and kv head:
codes in the caches' layouts (int8, x = 16), scales fp32 beside the slots, ``[B, Hkv, S_max]``
(pages: ``[num_blocks, Hkv, block_size]``).
"""

from __future__ import annotations

import torch

QMAX = {8: 127, 4: 7}


def quantize(x: torch.Tensor, bits: int, symmetric: bool = True, scale_dtype: torch.dtype | None = None):
    """``x [..., D]`` -> ``(codes, scale, zero)`` with one scale (and zero point) per vector over
    the last dim: codes ``[..., D]`` (int8 when symmetric, uint8 with a zero point; int4 codes
    unpacked, one a byte), scale and zero fp32 ``[...]`` (zero is None when symmetric). Computed
    in fp32. ``scale_dtype`` (float16 / bfloat16): a format that stores its scales and zero points
    in 16 bits: both are rounded to it (then held in fp32) before the codes are chosen with them,
    and a vector with a value past that dtype's largest (fp16: 65504) gets an infinite scale, so it
    reads back non-finite, as a non-finite vector does (the format's range; never saturated)."""
    if bits not in QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    if scale_dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"scale_dtype must be float16, bfloat16 or float32, got {scale_dtype!r}")
    v = x.float()
    if scale_dtype is None:
        stored = lambda t: t  # noqa: E731
    else:
        past = v.abs().amax(-1) > torch.finfo(scale_dtype).max
        stored = lambda t: torch.where(past, torch.inf, t.to(scale_dtype).float())  # noqa: E731
    if symmetric:
        qmax = QMAX[bits]
        scale = stored(_divide(v.abs().amax(-1), qmax))
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(v / safe[..., None]).clamp(-qmax, qmax)
        return torch.where(torch.isfinite(codes), codes, 0).to(torch.int8), scale, None
    levels = 2**bits - 1
    lo, hi = v.amin(-1), v.amax(-1)
    scale = stored(_divide(hi - lo, levels))
    lo = stored(lo)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((v - lo[..., None]) / safe[..., None]).clamp(0, levels)
    return torch.where(torch.isfinite(codes), codes, 0).to(torch.uint8), scale, lo


def _divide(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x / n`` rounded once, on every device: torch's CUDA division by a Python number multiplies
    by its fp32 reciprocal (two roundings, one ulp off for about 1 value in 20), while the kernel
    divides (``__fdiv_rn``); a tensor divisor divides on both."""
    return x / torch.full_like(x, n)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype=torch.float32):
    """What attention reads back: ``codes * scale (+ zero)`` in ``dtype``."""
    out = codes.to(dtype) * scale.to(dtype)[..., None]
    return out if zero is None else out + zero.to(dtype)[..., None]


def roundtrip(x: torch.Tensor, bits: int, symmetric: bool = True, smoothing: torch.Tensor | None = None,
              scale_dtype: torch.dtype | None = None):  # fmt: skip
    """``x [..., Hkv, D]`` stored and read back (in fp32), divided by ``smoothing [Hkv, D]`` first
    and multiplied back after (the product with ``q * smoothing`` is then what attention sees)."""
    v = x.float() if smoothing is None else x.float() / smoothing.float()
    back = dequantize(*quantize(v, bits, symmetric, scale_dtype))
    return back if smoothing is None else back * smoothing.float()


def roundtrip_channels(
    x: torch.Tensor, bits: int, group: int, scale_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """KIVI's keys: ``x [S, Hkv, D]`` quantised per channel over each full group of ``group``
    tokens (a scale and zero point per (group, kv head, channel), asymmetric), the last partial
    group kept as it is (16-bit, until it fills); read back in fp32."""
    s = x.shape[0]
    full = s // group * group
    v = x.float()
    if full == 0:
        return v
    g = v[:full].unflatten(0, (-1, group)).movedim(1, -1)  # [S / group, Hkv, D, group]
    back = (
        dequantize(*quantize(g, bits, symmetric=False, scale_dtype=scale_dtype)).movedim(-1, 1).flatten(0, 1)
    )
    return torch.cat([back, v[full:]])


def smoothing_factors(k: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """Per-(kv head, channel) factors ``[Hkv, D]`` from a prompt's keys ``k [..., Hkv, D]``:
    ``amax_c ^ alpha`` over the prompt, normalised to geometric mean 1 per head (1 where a channel
    is all zero)."""
    amax = k.float().abs().flatten(0, -3).amax(0)  # [Hkv, D]
    s = torch.where(amax > 0, amax, torch.ones_like(amax)) ** alpha
    return s / torch.exp(torch.log(s).mean(-1, keepdim=True))
