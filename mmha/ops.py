"""Typed wrappers around ``torch.ops.mmha.*`` and their fake (meta) registrations.

The operators write into caller-allocated tensors; these wrappers allocate them, choose the
variant (``mmha.dispatch.choose_variant``) and provide the split-sequence workspace.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import dispatch
from ._ext import _C, IMPORT_ERROR

if _C is not None:

    @torch.library.register_fake("mmha::decode_attention")
    def _decode_attention_fake(
        qkv, k_cache, v_cache, lengths, qkv_bias, out, lse, partials, counters, num_heads,
        num_kv_heads, scale, rotary_dim, rotary_theta, rotary_interleaved, num_splits,
        check_lengths=True, warps=4,
    ):  # fmt: skip
        return None


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


@functools.cache
def _blocks_per_sm(device_index: int, dtype: torch.dtype, head_dim: int, qb: int, warps: int) -> int:
    with torch.cuda.device(device_index):
        return _C.blocks_per_sm(_DTYPE_CODES[dtype], head_dim, qb, warps)


def blocks_per_sm(
    device, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int, warps: int = dispatch.WARPS
) -> int:
    """Resident blocks of ``warps`` warps per SM of the kernel this shape runs (asked of the device
    once, cached)."""
    fallback = max(1, dispatch.DEFAULT_BLOCKS_PER_SM * dispatch.WARPS // warps)
    if _C is None or head_dim not in dispatch.SUPPORTED_HEAD_DIMS:
        return fallback
    index = torch.device(device).index
    qb = dispatch.q_group_block(num_heads // num_kv_heads)
    n = _blocks_per_sm(torch.cuda.current_device() if index is None else index, dtype, head_dim, qb, warps)
    return n if n > 0 else fallback


def plan_for(
    device, batch: int, num_heads: int, num_kv_heads: int, head_dim: int, seq_len: int,
    dtype: torch.dtype, variant: str = "auto",
) -> dispatch.Plan:  # fmt: skip
    """``dispatch.choose_variant`` with this device's SM count and the kernel's occupancy (for
    blocks of 4 and of ``dispatch.WIDE_WARPS`` warps)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    return dispatch.choose_variant(
        batch, num_heads, num_kv_heads, head_dim, seq_len, dtype, num_sms(index), variant,
        blocks_per_sm(index, dtype, head_dim, num_heads, num_kv_heads),
        blocks_per_sm(index, dtype, head_dim, num_heads, num_kv_heads, dispatch.WIDE_WARPS)
        if dispatch.uses_tensor_cores(head_dim, dtype) else None,
    )  # fmt: skip


@dataclass
class Workspace:
    """Split-sequence scratch: fp32 partials and int32 counters (zero between launches).

    Counters are reset by the kernel itself, so one workspace serves any number of launches
    ordered on one stream; launches on concurrent streams need one workspace each.
    """

    partials: torch.Tensor
    counters: torch.Tensor
    num_splits: int

    @classmethod
    def allocate(cls, device, batch: int, num_heads: int, head_dim: int, num_splits: int):
        partials = torch.empty(
            batch * num_heads * num_splits * (head_dim + 2) if num_splits > 1 else 0,
            dtype=torch.float32,
            device=device,
        )
        counters = torch.zeros(batch * num_heads, dtype=torch.int32, device=device)
        return cls(partials, counters, num_splits)

    def fits(self, batch: int, num_heads: int, head_dim: int, num_splits: int) -> bool:
        need = batch * num_heads * num_splits * (head_dim + 2) if num_splits > 1 else 0
        return self.partials.numel() >= need and self.counters.numel() >= batch * num_heads


def _require_extension() -> None:
    if _C is None:
        raise RuntimeError(
            "mmha's CUDA extension is not built or failed to import "
            f"({IMPORT_ERROR}); run `python -m mmha info` for details"
        )


def decode_attention(
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
    variant: str = "auto",
    num_splits: int | None = None,
    warps: int | None = None,
    max_len: int | None = None,
    return_lse: bool = False,
    workspace: Workspace | None = None,
    validate_lengths: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused append + attention for one decode step on the GPU.

    Parameters
    ----------
    qkv : ``[B, (Hq + 2 * Hkv) * D]``; rows may be strided (a view into a larger buffer).
    k_cache : ``[B, Hkv, D / x, S_max, x]``, new k written at slot ``lengths[b]``.
    v_cache : ``[B, Hkv, S_max, D]``, new v written at slot ``lengths[b]``.
    lengths : ``[B]`` int32 on the GPU: tokens already cached; not modified.
    variant : ``"auto"``, ``"single_pass"`` or ``"split"``; ``num_splits`` overrides the count.
    warps : warps per block (``dispatch.WARP_CHOICES`` on the tensor-core loop, else 4); by
        default the plan's, or 4 where ``num_splits`` is given.
    max_len : longest ``lengths[b] + 1`` the caller knows of (for dispatch); default capacity.
    validate_lengths : the operator reads ``lengths`` on the host and rejects values outside
        ``[0, S_max - 1]`` (one sync; skipped inside CUDA-graph capture); callers that track
        lengths themselves (``KVCache``) pass ``False``.

    Returns
    -------
    out ``[B, Hq * D]`` in the input dtype, and with ``return_lse`` the fp32 ``lse [B, Hq]``.
    """
    _require_extension()
    batch, head_dim, max_seq_len = v_cache.shape[0], v_cache.shape[-1], v_cache.shape[-2]
    if num_splits is None:
        plan = plan_for(
            qkv.device, batch, num_heads, num_kv_heads, head_dim,
            max_seq_len if max_len is None else max_len, qkv.dtype, variant,
        )  # fmt: skip
        num_splits = plan.num_splits
        warps = plan.warps if warps is None else warps
    warps = dispatch.WARPS if warps is None else warps
    check = validate_lengths and not torch.cuda.is_current_stream_capturing()
    if workspace is None or not workspace.fits(batch, num_heads, head_dim, num_splits):
        workspace = Workspace.allocate(qkv.device, batch, num_heads, head_dim, num_splits)
    out = torch.empty((batch, num_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    lse = torch.empty((batch, num_heads), dtype=torch.float32, device=qkv.device)
    torch.ops.mmha.decode_attention(
        qkv, k_cache, v_cache, lengths, qkv_bias, out, lse, workspace.partials,
        workspace.counters, num_heads, num_kv_heads,
        1.0 / math.sqrt(head_dim) if scale is None else scale,
        rotary_dim, rotary_theta, rotary_interleaved, num_splits, check, warps,
    )  # fmt: skip
    return (out, lse) if return_lse else out
