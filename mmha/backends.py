"""How a ``KVCache`` step is computed: the CUDA kernel (``KernelBackend``) or the plain-torch
reference (``ReferenceBackend``), behind one interface, so that the cache never routes inline.

A backend takes a ``StepCall`` (one layer's one-token step, fully resolved by the cache: the
caches' view, the spec, the row modes, the plan) or a ``TreeCall`` and returns ``out`` (and
``lse`` when asked).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import int4, int4_pages, ops, reference
from ._constants import ROW_STEP
from .spec import AttentionSpec

INT4_VIEWS = (int4.Int4Cache, int4_pages.Int4Pages)  # an int4 cache's view of a layer (mmha.int4_storage)


@dataclass
class StepCall:
    qkv: torch.Tensor  # [B, (Hq + 2 Hkv) D]
    k: torch.Tensor  # the kernel's view: rows 0 .. B - 1, or a paged pool
    v: torch.Tensor
    lengths: torch.Tensor  # [B] int32 on the device
    attention: AttentionSpec
    qkv_bias: torch.Tensor | None = None
    return_lse: bool = False
    scales: dict = field(default_factory=dict)  # fp8: k_scale, v_scale
    row_active: torch.Tensor | None = None  # [B] row modes, or None (every row steps)
    positions: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None  # [B, max_blocks] of a paged cache
    active_rows: list[int] | None = None  # rows that take part (a paged cache's reference path)
    num_splits: int = 1
    stages: int = 2
    tile_source: str = "auto"
    workspace: ops.Workspace | None = None


@dataclass
class TreeCall:
    qkv: torch.Tensor  # [B, T, (Hq + 2 Hkv) D]
    k: torch.Tensor
    v: torch.Tensor
    lengths: torch.Tensor
    parents: torch.Tensor  # [B, T]
    attention: AttentionSpec
    node_counts: list[int] | torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    return_lse: bool = False
    scales: dict = field(default_factory=dict)
    row_active: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    active_rows: list[int] | None = None
    num_splits: int = 1
    stages: int = 2
    tile_source: str = "auto"
    workspace: ops.Workspace | None = None


def _zeros(shape, dtype, device, attention: AttentionSpec) -> torch.Tensor:
    """The output of rows that take no part: zeros (through the epilogue, as the kernel gives)."""
    zeros = torch.zeros(shape, dtype=dtype, device=device)
    return zeros if attention.epilogue is None else attention.epilogue.apply(zeros, dtype)


class KernelBackend:
    """``mmha.ops`` on the GPU; the cache tracks lengths itself, so the kernel's device-side guard
    (status flags, ``KVCache.check``) stands in for host checks of the lengths."""

    needs_plan = True

    def __init__(self, num_heads: int, num_kv_heads: int):
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads

    def step(self, c: StepCall):
        if isinstance(c.k, INT4_VIEWS):  # the format's own view: codes, scales, zero points, residual
            return ops.decode_attention_int4(
                c.qkv, c.k, c.lengths, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                attention=c.attention, qkv_bias=c.qkv_bias, num_splits=c.num_splits, stages=c.stages,
                return_lse=c.return_lse, workspace=c.workspace, validate_lengths=False,
                row_active=c.row_active, positions=c.positions, block_tables=c.block_tables,
                tile_source=c.tile_source,
            )  # fmt: skip
        return ops.decode_attention(
            c.qkv, c.k, c.v, c.lengths, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            attention=c.attention, qkv_bias=c.qkv_bias, num_splits=c.num_splits, stages=c.stages,
            tile_source=c.tile_source, return_lse=c.return_lse, workspace=c.workspace, validate_lengths=False,
            block_tables=c.block_tables, row_active=c.row_active, positions=c.positions, **c.scales,
        )  # fmt: skip

    def tree(self, c: TreeCall):
        return ops.decode_tree(
            c.qkv, c.k, c.v, c.lengths, c.parents, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            attention=c.attention, node_counts=c.node_counts, qkv_bias=c.qkv_bias, num_splits=c.num_splits,
            stages=c.stages, tile_source=c.tile_source, return_lse=c.return_lse, workspace=c.workspace,
            validate=False, block_tables=c.block_tables, row_active=c.row_active, **c.scales,
        )  # fmt: skip


class ReferenceBackend:
    """``mmha.reference`` (CPU caches, or no extension); a paged cache's free rows own no blocks,
    so only ``active_rows`` are computed and the others get the output of rows that take no part."""

    needs_plan = False

    def __init__(self, num_heads: int, num_kv_heads: int):
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.scale_rows: set[int] = set()  # check()'s flags: rows that appended a non-finite token

    def check(self) -> None:
        """The kernel's device-side guard on this path: ``ScaleError`` naming the rows of an int8 or
        int4 cache that appended a token with a value that is not finite (int4: or past its fp16
        scales' range) since the last check (its scale is stored non-finite and the row's output is
        NaN, as on the GPU); flags cleared."""
        rows, self.scale_rows = sorted(self.scale_rows), set()
        if rows:
            raise ops.ScaleError(
                f"rows {rows}: a quantised cache's new token had a value that is not finite, or past "
                f"{int4.SCALE_MAX:g} in an int4 cache (its scale is stored non-finite; the output is NaN)"
            )

    def _flag(self, c, qkv: torch.Tensor, counts: list[int]) -> None:
        """Rows of an int8 cache that appended a new k or v (bias added) that is not finite, and of
        an int4 cache whose appended tokens it cannot hold (``_int4_unheld``): ``qkv [B, T, W]``,
        ``counts[b]`` the tokens row b appended (0 for rows that append none)."""
        if isinstance(c.k, INT4_VIEWS):
            self.scale_rows.update(row for row, n in enumerate(counts) if n and self._int4_unheld(c, row, n))
            return
        if c.k.dtype != torch.int8:
            return
        x = qkv.float()
        if c.qkv_bias is not None:
            x = x + c.qkv_bias.float()
        d = x.shape[-1] // (self.num_heads + 2 * self.num_kv_heads)
        bad = (~torch.isfinite(x[..., self.num_heads * d :])).any(-1).tolist()  # [B][T], one read
        self.scale_rows.update(row for row, n in enumerate(counts) if any(bad[row][:n]))

    @staticmethod
    def _int4_unheld(c, row: int, n: int) -> bool:
        """Whether row ``row``'s ``n`` new slots (from its length before the step) hold what an int4
        cache cannot: a V scale or zero point stored non-finite, or a K residual entry non-finite or
        past ``int4.SCALE_MAX`` (its group's scale will be, once committed). As stored: after the
        bias, the q/k norm, rotary and the rounding to the activations' dtype."""
        first = int(c.lengths[row])
        slots = range(first, first + n)
        if c.block_tables is None:
            scales = (c.k.v_scale[row, :, first : first + n], c.k.v_zero[row, :, first : first + n])
        else:
            table, size = c.block_tables[row].tolist(), c.k.block_size
            at = [(table[s // size], s % size) for s in slots]
            scales = tuple(torch.stack([t[b, :, o] for b, o in at], -1) for t in (c.k.v_scale, c.k.v_zero))
        keys = c.k.k_residual[row][:, [s % int4.RESIDUAL for s in slots]].float()
        held = all(bool(torch.isfinite(t).all()) for t in scales)
        return not (held and bool(torch.isfinite(keys).all()) and bool((keys.abs() <= int4.SCALE_MAX).all()))

    def _appending(self, c, batch: int) -> list[bool]:
        """Which rows append this step: stepping rows (row modes) that take part."""
        modes = c.row_active.tolist() if c.row_active is not None else [ROW_STEP] * batch
        taking = set(range(batch)) if c.active_rows is None else set(c.active_rows)
        return [modes[r] == ROW_STEP and r in taking for r in range(batch)]

    def step(self, c: StepCall):
        out = self._step(c)
        self._flag(c, c.qkv[:, None], [int(a) for a in self._appending(c, c.qkv.shape[0])])
        return out

    def tree(self, c: TreeCall):
        out = self._tree(c)
        appending = self._appending(c, c.qkv.shape[0])
        counts = [n if a else 0 for n, a in zip(c.node_counts, appending, strict=True)]
        self._flag(c, c.qkv, counts)
        return out

    def _step(self, c: StepCall):
        kw = dict(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, attention=c.attention,
                  qkv_bias=c.qkv_bias, **c.scales)  # fmt: skip
        four = isinstance(c.k, INT4_VIEWS)
        if c.block_tables is None:
            step_kw = dict(return_lse=c.return_lse, row_active=c.row_active, positions=c.positions, **kw)
            if four:
                return int4.decode_step(c.qkv, c.k, c.lengths, **step_kw)
            return reference.decode_step(c.qkv, c.k, c.v, c.lengths, **step_kw)

        def run(idx):
            args = (c.qkv[idx], c.k, c.block_tables[idx], c.lengths[idx])
            if four:
                return int4_pages.decode_step_paged(*args, return_lse=True, rows=c.active_rows, **kw)
            return reference.decode_step_paged(*args[:2], c.v, *args[2:], return_lse=True, **kw)

        out, lse = self._active_rows(c, (c.qkv.shape[0],), run)
        return (out, lse) if c.return_lse else out

    def _tree(self, c: TreeCall):
        if c.return_lse:  # refused before anything is written
            raise ValueError(
                "return_lse needs the GPU kernel (the cache's reference tree step returns out only)"
            )
        kw = dict(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, attention=c.attention,
                  qkv_bias=c.qkv_bias, **c.scales)  # fmt: skip
        four = isinstance(c.k, INT4_VIEWS)
        if c.block_tables is None:
            if four:
                return int4.decode_tree(c.qkv, c.k, c.lengths, c.parents, node_counts=c.node_counts, **kw)
            return reference.decode_tree(
                c.qkv, c.k, c.v, c.lengths, c.parents, node_counts=c.node_counts, **kw
            )

        def run(idx):
            args = (c.qkv[idx], c.k, c.block_tables[idx], c.lengths[idx], c.parents[idx])
            counts = [c.node_counts[r] for r in c.active_rows]
            if four:
                return int4_pages.decode_tree_paged(*args, node_counts=counts, rows=c.active_rows, **kw), None
            return reference.decode_tree_paged(*args[:2], c.v, *args[2:], node_counts=counts, **kw), None

        return self._active_rows(c, c.qkv.shape[:2], run)[0]

    def _active_rows(self, c, lead: tuple, run):
        """A paged cache's step over its active rows only (``run(idx)`` gives their out and lse,
        or None); the other rows get the output of rows that take no part (zeros, lse -inf)."""
        dev = c.qkv.device
        head_dim = c.k.k_residual.shape[-1] if isinstance(c.k, INT4_VIEWS) else c.v.shape[-1]
        out = _zeros((*lead, self.num_heads * head_dim), c.qkv.dtype, dev, c.attention)
        lse = torch.full((*lead, self.num_heads), float("-inf"), dtype=torch.float32, device=dev)
        if c.active_rows:
            idx = torch.tensor(c.active_rows, dtype=torch.long, device=dev)
            o, lse_rows = run(idx)
            out[idx] = o
            if lse_rows is not None:
                lse[idx] = lse_rows
        return out, lse
