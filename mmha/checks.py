"""Checks of a step's inputs shared by the kernel path, the cache and the reference: each raises
ValueError naming the argument, before anything is written."""

from __future__ import annotations

import torch

from .spec import FP8, ROW_IDLE, ROW_MODES, ROW_STEP, AttentionSpec


def positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def cache_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale) -> None:
    """A quantised cache's scales are given exactly when the cache is quantised: fp8 one per kv head
    (``[Hkv]``), int8 one per token and kv head (fp32 ``[B, Hkv, S_max]``, or per page slot
    ``[num_blocks, Hkv, block_size]``: ``v_cache``'s first three dims)."""
    if k_cache.dtype == torch.int8:
        shape = tuple(v_cache.shape[:3])
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != shape:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"{name} must be a float32 tensor {list(shape)} (a scale per token and kv head) for an "
                    f"int8 cache, got {got}"
                )
        return
    if (k_cache.dtype == FP8) != (k_scale is not None and v_scale is not None):
        raise ValueError(
            "k_scale and v_scale must be given for float8_e4m3fn and int8 caches, and only for them"
        )


def row_modes(row_active: torch.Tensor | None, batch: int, tree: bool = False) -> list[int]:
    """The host list of ``row_active``'s modes (every row ``ROW_STEP`` without it), checked: shape
    ``[batch]`` and values in ``ROW_MODES`` (a tree step's rows idle or stepping)."""
    if row_active is None:
        return [ROW_STEP] * batch
    if not isinstance(row_active, torch.Tensor) or row_active.shape != (batch,):
        got = tuple(row_active.shape) if isinstance(row_active, torch.Tensor) else type(row_active).__name__
        raise ValueError(f"row_active must have shape [{batch}], got {got}")
    modes = [int(m) for m in row_active.tolist()]
    allowed = (ROW_IDLE, ROW_STEP) if tree else ROW_MODES
    for row, m in enumerate(modes):
        if m not in allowed:
            raise ValueError(f"row_active[{row}] must be one of {allowed} (row modes), got {m}")
    return modes


def block_tables(tables: torch.Tensor, lengths: list[int], num_blocks: int, block_size: int) -> None:
    """Every row's table holds the blocks of slots ``0 .. lengths[b]``: enough entries, each in
    ``[0, num_blocks)``, none repeated within the row. Raises ValueError naming ``block_tables``."""
    if tables.dim() != 2 or tables.shape[0] != len(lengths):
        raise ValueError(
            f"block_tables must have shape [{len(lengths)}, max_blocks], got {tuple(tables.shape)}"
        )
    host = tables.tolist()
    for b, n in enumerate(lengths):
        need = n // block_size + 1
        if need > len(host[b]):
            raise ValueError(
                f"block_tables must hold {need} blocks for row {b} (length {n}, block_size {block_size}), "
                f"got {len(host[b])} per row"
            )
        row = host[b][:need]
        for i, blk in enumerate(row):
            if not 0 <= blk < num_blocks:
                raise ValueError(f"block_tables[{b}, {i}] must be in [0, {num_blocks - 1}], got {blk}")
        if len(set(row)) != len(row):
            dup = next(blk for blk in row if row.count(blk) > 1)
            raise ValueError(f"block_tables[{b}] must not repeat a block within a row, got block {dup} twice")


def attention_spec(
    attention, num_heads: int, head_dim: int, device, name: str = "attention"
) -> AttentionSpec:
    """``attention`` is an ``AttentionSpec`` that fits the layer (``AttentionSpec.check_for``)."""
    if not isinstance(attention, AttentionSpec):
        raise ValueError(f"{name} must be a mmha.AttentionSpec, got {type(attention).__name__}")
    attention.check_for(num_heads, head_dim, device, name)
    return attention


def tree_spec(attention: AttentionSpec, name: str = "attention") -> None:
    """Tree steps take rotary (one table), scale and an epilogue, no score modifiers."""
    if attention.rotary.by_length:
        raise ValueError(
            f"{name}.rotary follows the sequence's length (a table of {attention.rotary.inv_freq.shape[0]} "
            "rows), which one-token steps take, not tree steps (a tree's nodes have no one length)"
        )
    if attention.has_mods:
        mods = [
            f for f in ("window", "softcap", "alibi_slopes", "sinks") if getattr(attention, f) is not None
        ]
        raise ValueError(
            f"{name} must have no score modifiers for a tree step (tree steps take no {', '.join(mods)})"
        )


def step_args(
    qkv, batch: int, head_dim: int, num_heads: int, num_kv_heads: int, attention, row_active
) -> list[int]:
    """A one-token step's head counts, ``qkv [batch, (Hq + 2 Hkv) D]``, spec and row modes
    (``row_modes``, returned), whatever the cache's format."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.shape != (batch, width):
        raise ValueError(f"qkv must have shape [{batch}, {width}], got {tuple(qkv.shape)}")
    attention_spec(attention, num_heads, head_dim, qkv.device)
    return row_modes(row_active, batch)
