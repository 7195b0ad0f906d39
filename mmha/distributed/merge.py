"""FlashDecoding's merge across ranks: each rank's ``(out, lse)`` over its shard of the keys, one
collective, and the same rescale-and-sum the split kernel does.

For partials ``o_r`` (softmax-weighted values over shard ``r``) and ``l_r`` (log-sum-exp of that
shard's scaled logits; ``-inf`` for an empty shard), with ``m = max_r l_r``::

    out = sum_r exp(l_r - m) o_r / sum_r exp(l_r - m)        lse = m + log(sum_r exp(l_r - m))

which is exact. A sink (one logit per head with no value) joins the sum once, here. All in fp32.
"""

from __future__ import annotations

import torch


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


def pack(out: torch.Tensor, lse: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``out [B, H * D]`` and ``lse [B, H]`` -> one fp32 ``[B, H, D + 1]`` buffer (lse last), what
    one collective carries."""
    b = out.shape[0]
    return torch.cat([out.reshape(b, num_heads, -1).float(), lse.float()[..., None]], dim=-1)


def unpack(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack``'s inverse over leading dims: ``[..., H, D + 1]`` -> out ``[..., H, D]``, lse ``[..., H]``."""
    return buf[..., :-1], buf[..., -1]
