"""The exact semantics of one decode step, in plain torch: the oracle and the CPU fallback.

One step for row ``b`` (with ``pos = lengths[b]`` tokens already cached):

1. ``x = qkv[b] + qkv_bias`` in the compute dtype, split into q ``[Hq, D]``, k and v ``[Hkv, D]``;
2. rotary embedding of q and k at position ``pos`` on the first ``rotary_dim`` dims
   (GPT-NeoX halves, or GPT-J interleaved pairs), with ``inv_freq = 1 / theta ** (2i / rd)``;
3. k and v are rounded to the cache dtype and written to slot ``pos``;
4. ``out = softmax(q . K[0..pos] * scale) . V[0..pos]`` over the cache contents, query head ``h``
   using kv head ``h // (Hq // Hkv)``; ``lse`` is the natural-log log-sum-exp of the scaled logits.

``lengths`` are not changed (the cache manager advances them once per step).
"""

from __future__ import annotations

import math

import torch

from . import layout


def rotary_inv_freq(rotary_dim: int, theta: float, dtype: torch.dtype, device) -> torch.Tensor:
    """``[rotary_dim // 2]``: ``1 / theta ** (2i / rotary_dim)``."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=dtype, device=device) / rotary_dim
    return 1.0 / torch.pow(torch.tensor(theta, dtype=dtype, device=device), exponent)


def apply_rotary(
    x: torch.Tensor,
    pos: torch.Tensor,
    rotary_dim: int,
    theta: float,
    interleaved: bool,
    inv_freq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dims of ``x [B, H, D]`` by angles ``pos[B] * inv_freq``.

    ``inv_freq`` (from ``rotary_inv_freq``, on ``x``'s device) may be passed in precomputed, as
    CUDA-graph capture needs: computing it creates a host tensor."""
    if rotary_dim == 0:
        return x
    # Angles in at least fp32: in a 16-bit dtype position * inv_freq is meaningless past ~2K.
    angle_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    if inv_freq is None:
        inv_freq = rotary_inv_freq(rotary_dim, theta, angle_dtype, x.device)
    inv_freq = inv_freq.to(angle_dtype)
    angle = pos.to(angle_dtype)[:, None] * inv_freq[None, :]  # [B, rd/2]
    cos = torch.cos(angle)[:, None, :].to(x.dtype)
    sin = torch.sin(angle)[:, None, :].to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        half = rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((out, rest), dim=-1)


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``qkv [B, (Hq + 2 Hkv) D]`` -> q ``[B, Hq, D]``, k ``[B, Hkv, D]``, v ``[B, Hkv, D]``."""
    b = qkv.shape[0]
    q = qkv[:, : num_heads * head_dim].reshape(b, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :]
    return q, k.reshape(b, num_kv_heads, head_dim), v.reshape(b, num_kv_heads, head_dim)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: ``q [Hq, D]``, ``k, v [Hkv, L, D]`` -> out ``[Hq, D]``, lse ``[Hq]``."""
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scores = torch.einsum("hd,hld->hl", q, k) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hl,hld->hd", torch.softmax(scores, dim=-1), v)
    return out, lse


def decode_step(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    qkv_bias: torch.Tensor | None = None,
    scale: float | None = None,
    rotary_dim: int = 0,
    rotary_theta: float = 10000.0,
    rotary_interleaved: bool = False,
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Append the new K/V to the caches and return ``out [B, Hq * D]`` (and ``lse [B, Hq]``).

    Parameters
    ----------
    qkv : ``[B, (Hq + 2 * Hkv) * D]`` in the cache dtype.
    k_cache : ``[B, Hkv, D / x, S_max, x]``, updated in place at slot ``lengths[b]``.
    v_cache : ``[B, Hkv, S_max, D]``, updated in place at slot ``lengths[b]``.
    lengths : ``[B]`` int, tokens already cached per row (read, not changed).
    compute_dtype : ``torch.float32`` (default) or ``torch.float64``.
    """
    b, hkv, s_max, d = v_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    if qkv.shape != (b, (num_heads + 2 * num_kv_heads) * d):
        raise ValueError(
            f"qkv must have shape [{b}, {(num_heads + 2 * num_kv_heads) * d}], got {tuple(qkv.shape)}"
        )
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    pos_list = [int(p) for p in lengths.tolist()]
    for row, p in enumerate(pos_list):
        if not 0 <= p < s_max:
            raise ValueError(f"lengths[{row}] must be in [0, {s_max - 1}] (cache capacity {s_max}), got {p}")
    x = qkv.to(compute_dtype)
    if qkv_bias is not None:
        x = x + qkv_bias.to(compute_dtype)
    q, k, v = split_qkv(x, num_heads, num_kv_heads, d)
    pos = torch.tensor(pos_list, device=qkv.device)
    q = apply_rotary(q, pos, rotary_dim, rotary_theta, rotary_interleaved)
    k = apply_rotary(k, pos, rotary_dim, rotary_theta, rotary_interleaved)
    k_new, v_new = k.to(k_cache.dtype), v.to(v_cache.dtype)
    x_elems = k_cache.shape[-1]
    outs, lses = [], []
    for row, p in enumerate(pos_list):
        k_cache[row, :, :, p, :] = k_new[row].reshape(hkv, d // x_elems, x_elems)
        v_cache[row, :, p, :] = v_new[row]
        keys = layout.unpack_k(k_cache[row : row + 1], p + 1, layout="bhsd")[0]
        values = v_cache[row, :, : p + 1, :]
        o, lse = attend(q[row], keys.to(compute_dtype), values.to(compute_dtype), scale)
        outs.append(o.reshape(-1))
        lses.append(lse)
    out = torch.stack(outs).to(qkv.dtype)
    if return_lse:
        return out, torch.stack(lses).float()
    return out
