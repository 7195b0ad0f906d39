"""Where a token or a head lives when one layer's KV cache is spread over ``world`` ranks.

``heads``: rank ``r`` holds kv heads ``[r * Hkv / world, (r + 1) * Hkv / world)`` and the query
heads of their groups, ``[r * Hq / world, (r + 1) * Hq / world)`` (tensor parallelism).

``sequence``: every rank holds every head and a share of each row's tokens, in blocks of
``block`` tokens dealt out in turn: global position ``p`` is in block ``i = p // block``, owned
by rank ``i % world`` at local slot ``(i // world) * block + p % block``. A row of ``L`` tokens
is balanced to within one block, and the rank that owns position ``L`` (the slot of the row's
next token) is the one that appends it. Pure functions; no tensor leaves the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def head_range(num_heads: int, world: int, rank: int) -> tuple[int, int]:
    """Heads ``[first, last)`` of ``num_heads`` that rank ``rank`` of ``world`` holds."""
    if num_heads % world:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by the world size ({world})")
    share = num_heads // world
    return rank * share, (rank + 1) * share


def owner(position: int, world: int, block: int) -> int:
    """The rank that holds global ``position`` (sequence sharding)."""
    return (position // block) % world


def local_length(length: int, world: int, rank: int, block: int) -> int:
    """How many of a row's first ``length`` positions rank ``rank`` holds."""
    full, rem = divmod(length, block)  # complete blocks, tokens of the block in progress
    held = full // world + (1 if rank < full % world else 0)
    return held * block + (rem if full % world == rank else 0)


def local_capacity(max_seq_len: int, world: int, block: int) -> int:
    """Slots a rank needs per row for rows of up to ``max_seq_len`` tokens (the largest share)."""
    return max(local_length(max_seq_len, world, r, block) for r in range(world))


def local_positions(length: int, world: int, rank: int, block: int) -> torch.Tensor:
    """Global positions (int64, ascending, i.e. in local slot order) of a row's first ``length``
    tokens that rank ``rank`` holds."""
    pos = torch.arange(length, dtype=torch.long)
    return pos[(pos // block) % world == rank]


def local_lengths(lengths: Sequence[int], world: int, rank: int, block: int) -> list[int]:
    return [local_length(n, world, rank, block) for n in lengths]
