"""FlashDecoding's merge across ranks: each rank's ``(out, lse)`` over its shard of the keys, one
collective, and the same rescale-and-sum the split kernel does.

For partials ``o_r`` (softmax-weighted values over shard ``r``) and ``l_r`` (log-sum-exp of that
shard's scaled logits; ``-inf`` for an empty shard), with ``m = max_r l_r``::

    out = sum_r exp(l_r - m) o_r / sum_r exp(l_r - m)        lse = m + log(sum_r exp(l_r - m))

which is exact. A sink (one logit per head with no value) joins the sum once, here. All in fp32.

What crosses ranks is one fp32 buffer, ``parts [G, B, H / G, D + 1]`` (``pack``): each head's
values, then its lse; ``G = 1`` for an all-gather (every rank merges every head), ``G = world``
for an all-to-all (rank ``g`` receives group ``g``: its heads). ``pack`` and ``merge`` are one
kernel each on a GPU (csrc/kernels/shard_merge.cu) and torch ops elsewhere.
"""

from __future__ import annotations

import torch

from .._ext import _C


def _kernel(t: torch.Tensor) -> bool:
    return t.is_cuda and _C is not None


def merge_partials(
    outs: torch.Tensor, lses: torch.Tensor, sinks: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``outs [W, B, H, D]`` and ``lses [W, B, H]`` of ``W`` shards -> fp32 ``out [B, H, D]`` and
    ``lse [B, H]``. Heads whose every shard is empty get zeros and ``-inf`` (with a sink: zeros
    and the sink)."""
    lses = lses.float()
    top = lses.amax(dim=0)
    ref = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # all shards empty: no weight
    weights = torch.exp(lses - ref)  # [W, B, H]; 0 for empty shards
    total = weights.sum(dim=0)
    out = (weights[..., None] * outs.float()).sum(dim=0)
    out = out / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    lse = ref + torch.log(total)  # -inf where every shard is empty
    if sinks is not None:
        return with_sinks(out, lse, sinks)
    return out, lse


def with_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A merged ``out [B, H, D]``, ``lse [B, H]`` with each head's sink (fp32 ``[H]``) in the sum."""
    sink = sinks.to(lse.device, torch.float32)[None, :].expand_as(lse)
    both = torch.logaddexp(lse, sink)
    return out * torch.exp(lse - both)[..., None], both


def pack(out: torch.Tensor, lse: torch.Tensor, num_heads: int, groups: int = 1) -> torch.Tensor:
    """``out [B, H * D]`` and fp32 ``lse [B, H]`` -> the fp32 buffer one collective carries,
    ``[groups, B, H / groups, D + 1]`` (lse last; group ``g``: heads ``g * H / groups`` on)."""
    b = out.shape[0]
    d = out.shape[1] // num_heads
    if _kernel(out) and out.is_contiguous() and lse.is_contiguous():
        parts = torch.empty((groups, b, num_heads // groups, d + 1), dtype=torch.float32, device=out.device)
        torch.ops.mmha.shard_pack(out, lse, parts)
        return parts
    buf = torch.cat([out.reshape(b, num_heads, d).float(), lse.float()[..., None]], dim=-1)
    return buf.view(b, groups, num_heads // groups, d + 1).transpose(0, 1).contiguous()


def merge(
    parts: torch.Tensor, sinks: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``parts [W, B, H, D + 1]`` of ``W`` shards (``pack``'s layout, one group) -> ``out [B, H *
    D]`` of ``dtype`` and fp32 ``lse [B, H]``, exactly as ``merge_partials`` (and its sinks, fp32
    ``[H]``)."""
    w, b, h, width = parts.shape
    if _kernel(parts) and dtype in (torch.float16, torch.bfloat16, torch.float32):
        out = torch.empty((b, h * (width - 1)), dtype=dtype, device=parts.device)
        lse = torch.empty((b, h), dtype=torch.float32, device=parts.device)
        sinks = None if sinks is None else sinks.to(parts.device, torch.float32).contiguous()
        torch.ops.mmha.shard_merge(parts.contiguous(), sinks, out, lse)
        return out, lse
    outs, lses = unpack(parts)
    out, lse = merge_partials(outs, lses, sinks)
    return out.reshape(b, -1).to(dtype), lse


def unpack(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack``'s inverse over leading dims: ``[..., H, D + 1]`` -> out ``[..., H, D]``, lse ``[..., H]``."""
    return buf[..., :-1], buf[..., -1]
