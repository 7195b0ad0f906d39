"""Paged int4 caches (``mmha.int4``'s format in pages of one pool), and their reference steps.

A pool of ``num_blocks`` blocks of ``block_size`` slots (a multiple of 64, so each K group lies in
one block): codes ``k_codes [num_blocks, Hkv, D / 32, block_size, 16]`` / ``v_codes [num_blocks,
Hkv, block_size, D / 2]``, K's group scales and zero points ``[num_blocks, Hkv, block_size / 64,
D]``, V's ``[num_blocks, Hkv, block_size]``. The 16-bit residual of K's partial group (and a
tree's nodes) is per row, not per block: ``k_residual [max_batch, Hkv, 128, D]``. Row ``b``'s slot
``t`` is slot ``t % block_size`` of block ``block_tables[b, t // block_size]``, as for the other
caches (``mmha.reference.decode_step_paged``).

The steps gather each row's blocks and residual into a one-row ``Int4Cache``, run the contiguous
step there and write the blocks back: the same values, slot for slot, as a contiguous cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import checks, int4, layout, reference, tree
from .int4 import CHUNK, GROUP, RESIDUAL, Int4Cache
from .spec import PLAIN


@dataclass
class Int4Pages:
    """A paged int4 cache's tensors (shapes in the module docstring). Build one with ``empty``."""

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    k_residual: torch.Tensor

    @classmethod
    def empty(cls, num_blocks: int, block_size: int, max_batch: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, device: torch.device | str = "cpu") -> Int4Pages:  # fmt: skip
        """Zeroed pool of ``num_blocks`` blocks and residuals for ``max_batch`` rows."""
        checks.positive_int("num_blocks", num_blocks)
        checks.positive_int("block_size", block_size)
        if block_size % GROUP:
            raise ValueError(f"block_size must be a multiple of {GROUP} for an int4 cache (whole K groups "
                             f"per block), got {block_size}")  # fmt: skip
        checks.positive_int("max_batch", max_batch)
        pool = Int4Cache.empty(
            num_blocks, num_kv_heads, block_size, head_dim, dtype, device
        )  # checks the rest
        residual = torch.zeros(max_batch, num_kv_heads, RESIDUAL, head_dim, dtype=dtype, device=device)
        return cls(**{**vars(pool), "k_residual": residual})

    @property
    def block_size(self) -> int:
        return self.v_codes.shape[2]

    @property
    def num_blocks(self) -> int:
        return self.v_codes.shape[0]

    def gather(self, row: int, blocks: list[int]) -> Int4Cache:
        """Row ``row``'s ``blocks`` in order (and its residual) as a one-row contiguous cache (copies)."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.v_codes.device)

        def rows_of(t: torch.Tensor) -> torch.Tensor:  # [n, Hkv, L, ...] -> [1, Hkv, n * L, ...]
            p = t[idx]
            return p.transpose(0, 1).reshape(1, p.shape[1], -1, *p.shape[3:]).contiguous()

        return Int4Cache(
            k_codes=layout.gather_k(self.k_codes, blocks),
            v_codes=rows_of(self.v_codes),
            k_scale=rows_of(self.k_scale),
            k_zero=rows_of(self.k_zero),
            v_scale=rows_of(self.v_scale),
            v_zero=rows_of(self.v_zero),
            k_residual=self.k_residual[row : row + 1].clone(),
        )

    def scatter(self, row: int, blocks: list[int], cache: Int4Cache) -> None:
        """``gather``'s inverse: the one-row ``cache`` back into ``blocks`` and row ``row``'s residual."""
        n, h = len(blocks), cache.num_kv_heads
        idx = torch.tensor(blocks, dtype=torch.long, device=self.v_codes.device)
        bs = self.block_size
        self.k_codes[idx] = cache.k_codes[0].reshape(h, -1, n, bs, CHUNK // 2).permute(2, 0, 1, 3, 4)
        for name in ("v_codes", "k_scale", "k_zero", "v_scale", "v_zero"):
            t = getattr(cache, name)[0]  # [Hkv, n * L, ...]
            getattr(self, name)[idx] = t.reshape(h, n, -1, *t.shape[2:]).transpose(0, 1)
        self.k_residual[row] = cache.k_residual[0]


def prefill(pages: Int4Pages, row: int, blocks: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """``Int4Cache.prefill`` of row ``row`` whose slots lie in ``blocks`` (enough for the prompt)."""
    c = pages.gather(row, blocks)
    c.prefill(0, k, v)
    pages.scatter(row, blocks, c)


def accept(pages: Int4Pages, row: int, blocks: list[int], length: int, path: list[int]) -> None:
    """``Int4Cache.accept`` of row ``row`` whose slots lie in ``blocks`` (those of its tree step)."""
    c = pages.gather(row, blocks)
    c.accept(0, length, path)
    pages.scatter(row, blocks, c)


def _residual_rows(rows, batch: int, pool_rows: int) -> list[int]:
    """The pool's residual row of each of the step's ``batch`` rows (``rows``, default ``0 ..``)."""
    rows = list(range(batch)) if rows is None else [int(r) for r in rows]
    if len(rows) != batch or any(not 0 <= r < pool_rows for r in rows):
        raise ValueError(f"rows must name {batch} of the pool's {pool_rows} residual rows, got {rows}")
    return rows


def _rows(block_tables, lengths: list[int], pages: Int4Pages, need: list[int]) -> list[list[int]]:
    """Each row's blocks of slots ``0 .. need[b]``, after ``checks.block_tables``."""
    checks.block_tables(block_tables, need, pages.num_blocks, pages.block_size)
    tables = block_tables.tolist()
    return [tables[b][: n // pages.block_size + 1] for b, n in enumerate(need)]


def decode_step_paged(qkv, pages: Int4Pages, block_tables, lengths, *, num_heads: int, num_kv_heads: int,
                      return_lse: bool = False, row_active=None, positions=None, rows=None,
                      **kwargs):  # fmt: skip
    """``int4.decode_step`` over a paged int4 cache (row ``b``'s slot ``t`` as in the module
    docstring; its residual is the pool's row ``rows[b]``, default ``b``); every check runs before
    anything is written."""
    b = qkv.shape[0]
    pos = [int(p) for p in lengths.tolist()]
    for row, p in enumerate(pos):
        if p < 0:
            raise ValueError(f"lengths[{row}] must be >= 0, got {p}")
    res = pages.k_residual
    rows = _residual_rows(rows, b, res.shape[0])
    modes = int4.check_step(qkv, b, res.shape[1], res.shape[-1], res.dtype, num_heads, num_kv_heads,
                            kwargs.get("attention", PLAIN), row_active)  # fmt: skip
    reference.step_positions(lengths, positions, modes, 1 << 62, b)  # positions' shape
    blocks = _rows(block_tables, pos, pages, pos)
    outs, lses = [], []
    for row in range(b):
        c = pages.gather(rows[row], blocks[row])
        one = slice(row, row + 1)
        out, lse = int4.decode_step(
            qkv[one], c, lengths[one], num_heads=num_heads, num_kv_heads=num_kv_heads, return_lse=True,
            row_active=None if row_active is None else row_active[one],
            positions=None if positions is None else positions[one], **kwargs,
        )  # fmt: skip
        pages.scatter(rows[row], blocks[row], c)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs)
    return (out, torch.cat(lses)) if return_lse else out


def decode_tree_paged(qkv, pages: Int4Pages, block_tables, lengths, parents, *, num_heads: int,
                      num_kv_heads: int, node_counts: list[int] | None = None, return_lse: bool = False,
                      rows=None, **kwargs):  # fmt: skip
    """``int4.decode_tree`` over a paged int4 cache: row ``b``'s table holds the blocks of slots
    ``0 .. lengths[b] + count - 1``, its residual is the pool's row ``rows[b]`` (default ``b``);
    every check runs before anything is written."""
    residual_rows = _residual_rows(rows, qkv.shape[0], pages.k_residual.shape[0])
    rows = tree.check_parents(parents, qkv.shape[0], node_counts)
    pos = [int(p) for p in lengths.tolist()]
    for row, p in enumerate(pos):
        if p < 0:
            raise ValueError(f"lengths[{row}] must be >= 0, got {p}")
    blocks = _rows(block_tables, pos, pages, [p + len(r) - 1 for p, r in zip(pos, rows, strict=True)])
    outs, lses = [], []
    for row in range(qkv.shape[0]):
        c = pages.gather(residual_rows[row], blocks[row])
        one = slice(row, row + 1)
        o, lse = int4.decode_tree(
            qkv[one], c, lengths[one], parents[one], num_heads=num_heads, num_kv_heads=num_kv_heads,
            node_counts=[len(rows[row])], return_lse=True, **kwargs,
        )  # fmt: skip
        pages.scatter(residual_rows[row], blocks[row], c)
        outs.append(o)
        lses.append(lse)
    return (torch.cat(outs), torch.cat(lses)) if return_lse else torch.cat(outs)


__all__ = ["RESIDUAL", "Int4Pages", "accept", "decode_step_paged", "decode_tree_paged", "prefill"]
