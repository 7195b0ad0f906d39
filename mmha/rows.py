"""``RowTable``: the rows of a cache as slots for continuous batching, and their lengths.

Lengths live on the device (the kernels read them) and are mirrored on the host, so capacity
checks and dispatch never read device memory. A row is free, stepping (its length moves with
``advance``) or attend-only (it reads its cached tokens and writes nothing). Inside CUDA-graph
capture or a ``torch.compile`` trace only device work is recorded; the host mirror follows with
``account_replay`` or ``sync``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .spec import ROW_ATTEND, ROW_IDLE, ROW_STEP


def capturing(device: torch.device) -> bool:
    """Inside CUDA-graph capture or a ``torch.compile`` trace: only device work may be recorded."""
    if torch.compiler.is_compiling():
        return True
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class RowTable:
    """``max_batch`` row slots of at most ``max_seq_len`` tokens each, all stepping at length 0.

    Attributes: ``lengths`` (int32 ``[max_batch]`` on ``device``), ``active_mask`` (int32, 1 where
    ``advance`` adds a token), ``modes`` (int32 row modes, ``mmha.spec.ROW_*``, for the kernel),
    ``pass_modes`` (hand the kernel the modes on every step, so that a graph captured before a row
    turned attend-only replays right after: ``mmha.distributed``'s sequence shards set it)."""

    def __init__(self, max_batch: int, max_seq_len: int, device: torch.device):
        self.max_batch, self.max_seq_len, self.device = max_batch, max_seq_len, device
        self.lengths = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.active_mask = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.modes = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.pass_modes = False
        self.host = [0] * max_batch
        self._active = [True] * max_batch
        self._attend = [False] * max_batch
        self._version = 0  # moves whenever a host length does
        self._longest: tuple[int, dict[int, int]] = (-1, {})  # (version, batch -> longest row)

    # ------------------------------------------------------------------ queries
    @property
    def active_rows(self) -> list[int]:
        return [r for r in range(self.max_batch) if self._active[r]]

    @property
    def free_rows(self) -> list[int]:
        return [r for r in range(self.max_batch) if not self._active[r]]

    @property
    def attend_rows(self) -> list[int]:
        return [r for r in range(self.max_batch) if self._attend[r]]

    def is_active(self, row: int) -> bool:
        return self._active[row]

    def appending(self, row: int) -> bool:
        """Whether the row's length moves with ``advance`` (active, not attend-only)."""
        return self._active[row] and not self._attend[row]

    def any_attend(self, batch: int) -> bool:
        return any(self._attend[:batch])

    def longest(self, batch: int) -> int:
        """The longest host length among rows ``0 .. batch - 1`` (computed once per change)."""
        version, known = self._longest
        if version != self._version:
            known = {}
            self._longest = (self._version, known)
        n = known.get(batch)
        if n is None:
            n = known[batch] = max(self.host[:batch], default=0)
        return n

    def check(self, rows: Sequence[int], name: str = "rows") -> list[int]:
        """``rows`` as ints, each a row slot, none repeated (ValueError naming ``name``)."""
        rows = [int(r) for r in rows]
        for r in rows:
            if not 0 <= r < self.max_batch:
                raise ValueError(f"{name} must be in [0, {self.max_batch - 1}], got {r}")
        if len(set(rows)) != len(rows):
            raise ValueError(f"{name} must not repeat a row, got {rows}")
        return rows

    def full_rows(self, batch: int) -> list[int]:
        """Stepping rows of ``0 .. batch - 1`` with no slot left for a new token."""
        return [r for r in range(batch) if self.host[r] >= self.max_seq_len and not self._attend[r]]

    def next_slot_lengths(self, rows: Sequence[int], extra: int = 0) -> list[int]:
        """Lengths a page pool must cover for rows about to hold ``length + extra`` tokens: their
        tokens and the next token's slot, which a full row does not have."""
        return [min(self.host[r] + extra, self.max_seq_len - 1) for r in rows]

    def modes_for(self, batch: int, always: bool = False) -> torch.Tensor | None:
        """The kernel's ``row_active`` for rows ``0 .. batch - 1``: where asked (a paged cache's
        free rows own no blocks), where ``pass_modes`` is on, or where a row attends only."""
        if always or self.pass_modes or self.any_attend(batch):
            return self.modes[:batch]
        return None

    # ------------------------------------------------------------------ changes
    def set_lengths(self, rows: list[int], values: list[int]) -> None:
        for r, v in zip(rows, values, strict=True):
            self.host[r] = v
        if rows:
            self._version += 1
            idx = torch.tensor(rows, dtype=torch.long)
            self.lengths[idx.to(self.device)] = torch.tensor(values, dtype=torch.int32).to(self.device)

    def set_active(self, rows: list[int], active: bool) -> None:
        """Rows become stepping or free; either way no longer attend-only."""
        for r in rows:
            self._active[r] = active
            self._attend[r] = False
        if rows:
            idx = torch.tensor(rows, dtype=torch.long).to(self.device)
            self.active_mask[idx] = int(active)
            self.modes[idx] = ROW_STEP if active else ROW_IDLE

    def set_attend(self, rows: Sequence[int], on: bool) -> None:
        """Active ``rows`` become attend-only (``on``) or stepping again (checked first)."""
        rows = self.check(rows)
        free = [r for r in rows if not self._active[r]]
        if free:
            raise ValueError(f"rows must be active to be made attend-only or stepping, got free rows {free}")
        if not on:
            full = [r for r in rows if self.host[r] >= self.max_seq_len]
            if full:
                raise ValueError(f"rows {full} are full (length {self.max_seq_len}): they cannot step again")
        for r in rows:
            self._attend[r] = on
        if rows:
            idx = torch.tensor(rows, dtype=torch.long).to(self.device)
            self.active_mask[idx] = 0 if on else 1
            self.modes[idx] = ROW_ATTEND if on else ROW_STEP

    def check_advance(self, steps: int) -> None:
        over = [
            r for r in range(self.max_batch) if self.appending(r) and self.host[r] + steps > self.max_seq_len
        ]
        if over:
            raise ValueError(
                f"rows {over} would exceed max_seq_len ({self.max_seq_len}) after {steps} more steps"
            )

    def advance_host(self, steps: int) -> None:
        """The host mirror of ``steps`` advances (checked by ``check_advance`` first)."""
        for r in range(self.max_batch):
            if self.appending(r):
                self.host[r] += steps
        self._version += 1

    def advance_device(self) -> None:
        self.lengths.add_(self.active_mask)

    def add_host(self, rows: Sequence[int], counts: Sequence[int]) -> None:
        """Rows' host lengths grow by ``counts`` (their device lengths moved already)."""
        for r, c in zip(rows, counts, strict=True):
            self.host[r] += c
        self._version += 1

    def sync(self) -> None:
        """Read the device lengths into the host mirror (one synchronisation)."""
        self.host = [int(v) for v in self.lengths.tolist()]
        self._version += 1
