"""KV-cache layouts and conversions between them.

``cache_k [B, Hkv, D / x, S_max, x]``: for a fixed 16-byte chunk of the head dim, consecutive
tokens are contiguous, so a warp reading one chunk of consecutive keys reads contiguous memory.
``cache_v [B, Hkv, S_max, D]``: each token's value row is contiguous.
``x = 16 // element_size``: 8 for fp16/bf16, 4 for fp32.
"""

from __future__ import annotations

import torch

LAYOUTS = ("bshd", "bhsd")


def kv_x(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in 16 bytes: the innermost dim of the K cache."""
    size = torch.empty((), dtype=dtype).element_size()
    if 16 % size:
        raise ValueError(f"dtype must have an element size dividing 16 bytes, got {dtype}")
    return 16 // size


def _check_head_dim(head_dim: int, dtype: torch.dtype) -> int:
    x = kv_x(dtype)
    if head_dim % x:
        raise ValueError(
            f"head_dim ({head_dim}) must be divisible by x = 16 // element_size = {x} for {dtype}"
        )
    return x


def k_cache_shape(
    batch: int, num_kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype
) -> tuple[int, int, int, int, int]:
    x = _check_head_dim(head_dim, dtype)
    return (batch, num_kv_heads, head_dim // x, max_seq_len, x)


def v_cache_shape(
    batch: int, num_kv_heads: int, max_seq_len: int, head_dim: int
) -> tuple[int, int, int, int]:
    return (batch, num_kv_heads, max_seq_len, head_dim)


def _to_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if t.dim() != 4:
        raise ValueError(f"tensor must have 4 dims ({layout}), got shape {tuple(t.shape)}")
    return t.transpose(1, 2) if layout == "bshd" else t


def _from_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.transpose(1, 2).contiguous() if layout == "bshd" else t.contiguous()


def pack_k(
    k: torch.Tensor, max_seq_len: int | None = None, layout: str = "bshd", fill: float = 0.0
) -> torch.Tensor:
    """``k [B, S, Hkv, D]`` (or ``[B, Hkv, S, D]``) -> ``cache_k [B, Hkv, D/x, S_max, x]``.

    Slots ``S..S_max-1`` are set to ``fill``.
    """
    k = _to_bhsd(k, layout)
    b, h, s, d = k.shape
    s_max = s if max_seq_len is None else max_seq_len
    if s > s_max:
        raise ValueError(f"max_seq_len ({s_max}) must be >= the sequence length ({s})")
    cache = k.new_full(k_cache_shape(b, h, s_max, d, k.dtype), fill)
    write_k(cache, k, 0, layout="bhsd")
    return cache


def unpack_k(cache_k: torch.Tensor, length: int | None = None, layout: str = "bshd") -> torch.Tensor:
    """``cache_k [B, Hkv, D/x, S_max, x]`` -> ``[B, S, Hkv, D]`` (or bhsd) of the first ``length``."""
    b, h, dx, s_max, x = cache_k.shape
    s = s_max if length is None else length
    k = cache_k[:, :, :, :s, :].permute(0, 1, 3, 2, 4).reshape(b, h, s, dx * x)
    return _from_bhsd(k, layout)


def pack_v(
    v: torch.Tensor, max_seq_len: int | None = None, layout: str = "bshd", fill: float = 0.0
) -> torch.Tensor:
    """``v [B, S, Hkv, D]`` (or ``[B, Hkv, S, D]``) -> ``cache_v [B, Hkv, S_max, D]``."""
    v = _to_bhsd(v, layout)
    b, h, s, d = v.shape
    s_max = s if max_seq_len is None else max_seq_len
    if s > s_max:
        raise ValueError(f"max_seq_len ({s_max}) must be >= the sequence length ({s})")
    cache = v.new_full(v_cache_shape(b, h, s_max, d), fill)
    cache[:, :, :s, :] = v
    return cache


def unpack_v(cache_v: torch.Tensor, length: int | None = None, layout: str = "bshd") -> torch.Tensor:
    """``cache_v [B, Hkv, S_max, D]`` -> ``[B, S, Hkv, D]`` (or bhsd) of the first ``length``."""
    s = cache_v.shape[2] if length is None else length
    return _from_bhsd(cache_v[:, :, :s, :], layout)


def write_k(cache_k: torch.Tensor, k: torch.Tensor, start: int, layout: str = "bshd") -> None:
    """Write ``k`` (``[B, S, Hkv, D]`` or bhsd) into slots ``start..start+S-1`` of ``cache_k``."""
    k = _to_bhsd(k, layout)
    b, h, s, d = k.shape
    x = cache_k.shape[-1]
    if d != cache_k.shape[2] * x:
        raise ValueError(f"k head_dim ({d}) must match cache_k's D/x * x = {cache_k.shape[2] * x}")
    cache_k[:b, :, :, start : start + s, :] = k.reshape(b, h, s, d // x, x).permute(0, 1, 3, 2, 4)


def write_v(cache_v: torch.Tensor, v: torch.Tensor, start: int, layout: str = "bshd") -> None:
    """Write ``v`` (``[B, S, Hkv, D]`` or bhsd) into slots ``start..start+S-1`` of ``cache_v``."""
    v = _to_bhsd(v, layout)
    cache_v[: v.shape[0], :, start : start + v.shape[2], :] = v


# ------------------------------------------------------------------ paged caches
# Pages of a paged cache (mmha.paging): the contiguous layouts with blocks of ``block_size`` slots
# in place of rows, ``k_pages [num_blocks, Hkv, D/x, block_size, x]`` (vLLM's paged K layout) and
# ``v_pages [num_blocks, Hkv, block_size, D]`` (each token's V row contiguous, as in cache_v).


def k_pages_shape(
    num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype
) -> tuple[int, int, int, int, int]:
    x = _check_head_dim(head_dim, dtype)
    return (num_blocks, num_kv_heads, head_dim // x, block_size, x)


def v_pages_shape(
    num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int
) -> tuple[int, int, int, int]:
    return (num_blocks, num_kv_heads, block_size, head_dim)


def gather_k(k_pages: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """Blocks of ``k_pages`` in order as one contiguous ``cache_k [1, Hkv, D/x, n * block_size, x]``."""
    n, (_, h, dx, bs, x) = len(blocks), k_pages.shape
    pages = k_pages[torch.tensor(blocks, dtype=torch.long, device=k_pages.device)]  # [n, Hkv, D/x, bs, x]
    return pages.permute(1, 2, 0, 3, 4).reshape(1, h, dx, n * bs, x).contiguous()


def gather_v(v_pages: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """Blocks of ``v_pages`` in order as one contiguous ``cache_v [1, Hkv, n * block_size, D]``."""
    n, (_, h, bs, d) = len(blocks), v_pages.shape
    pages = v_pages[torch.tensor(blocks, dtype=torch.long, device=v_pages.device)]  # [n, Hkv, bs, D]
    return pages.permute(1, 0, 2, 3).reshape(1, h, n * bs, d).contiguous()


def write_pages(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    blocks: list[int],
    k: torch.Tensor,
    v: torch.Tensor,
    start: int = 0,
) -> None:
    """Write ``k, v [S, Hkv, D]`` (in the pages' dtype) into slots ``start .. start + S - 1`` of the
    row whose blocks are ``blocks``."""
    bs, x = k_pages.shape[3], k_pages.shape[4]
    s, h, d = k.shape
    for i in range(s):
        block, off = blocks[(start + i) // bs], (start + i) % bs
        k_pages[block, :, :, off, :] = k[i].reshape(h, d // x, x)
        v_pages[block, :, off, :] = v[i]
