"""Pages of a paged KV cache: which fixed-size blocks of one pool each row owns.

A paged cache stores every layer's K/V in a pool of ``num_blocks`` blocks of ``block_size`` slots
(``k_pages [num_blocks, Hkv, D/x, block_size, x]``, ``v_pages [num_blocks, Hkv, block_size, D]``);
row ``b``'s slot ``t`` lives in block ``block_tables[b, t // block_size]`` at offset
``t % block_size``. One table serves every layer (the layers of a row hold the same tokens).

``PagePool`` is the host-side allocator behind ``KVCache(paged=True)``: a free list, a reference
count per block and each row's block list, mirrored into the device ``tables`` in place (so a
captured CUDA graph reads the current tables). A row of length ``n`` always owns the blocks of
slots ``0 .. n`` (the next token's slot included), so a decode step never allocates. Blocks are
shared only by ``fork``, and a shared block is never written: appends go to slot ``n`` and later,
whose block is always the row's own. Every operation checks before it changes anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BLOCK_SIZES = (16, 32, 64, 128)
NO_BLOCK = -1  # table entries past a row's blocks


class PoolExhausted(MemoryError):
    """The pool has fewer free blocks than an operation needs (nothing was changed)."""


def check_block_size(block_size: int) -> int:
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {block_size!r}")
    return block_size


def blocks_for(length: int, block_size: int) -> int:
    """Blocks a row of ``length`` cached tokens owns: those of slots ``0 .. length``."""
    return length // block_size + 1


class PagePool:
    """Blocks ``0 .. num_blocks - 1`` shared by ``max_batch`` rows of at most ``max_blocks`` each."""

    def __init__(self, num_blocks: int, block_size: int, max_batch: int, max_blocks: int, device) -> None:
        self.block_size = check_block_size(block_size)
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks!r}")
        self.num_blocks, self.max_batch, self.max_blocks = num_blocks, max_batch, max_blocks
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: lowest ids handed out first
        self.rows: list[list[int]] = [[] for _ in range(max_batch)]
        self.tables = torch.full((max_batch, max_blocks), NO_BLOCK, dtype=torch.int32, device=device)

    # ----------------------------------------------------------------- queries
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def shared(self, block: int) -> bool:
        return self.refs[block] > 1

    def table(self, row: int) -> list[int]:
        return list(self.rows[row])

    # ----------------------------------------------------------------- changes
    def _sync(self, rows: Sequence[int]) -> None:
        """Write the rows' block lists into the device tables (one small copy, no sync)."""
        if not rows:
            return
        host = torch.full((len(rows), self.max_blocks), NO_BLOCK, dtype=torch.int32)
        for i, r in enumerate(rows):
            host[i, : len(self.rows[r])] = torch.tensor(self.rows[r], dtype=torch.int32)
        idx = torch.tensor(list(rows), dtype=torch.long).to(self.tables.device)
        self.tables[idx] = host.to(self.tables.device)

    def _take(self) -> int:
        block = self._free.pop()
        self.refs[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free.append(block)

    def _check_fits(self, rows: Sequence[int], lengths: Sequence[int], what: str) -> None:
        for r, n in zip(rows, lengths, strict=True):
            if blocks_for(n, self.block_size) > self.max_blocks:
                raise ValueError(
                    f"{what}: row {r} at length {n} needs {blocks_for(n, self.block_size)} blocks, more "
                    f"than max_blocks_per_row ({self.max_blocks})"
                )

    def need(self, rows: Sequence[int], lengths: Sequence[int]) -> int:
        """Free blocks ``ensure(rows, lengths)`` would take."""
        return sum(
            max(0, blocks_for(n, self.block_size) - len(self.rows[r]))
            for r, n in zip(rows, lengths, strict=True)
        )

    def ensure(self, rows: Sequence[int], lengths: Sequence[int], what: str = "rows") -> None:
        """Give each row the blocks of slots ``0 .. lengths[i]`` (all or nothing; extra blocks
        past them are returned)."""
        self._check_fits(rows, lengths, what)
        need = self.need(rows, lengths)
        if need > len(self._free):
            raise PoolExhausted(
                f"{what}: the page pool has {len(self._free)} free blocks of {self.block_size} slots, "
                f"{need} are needed (rows {list(rows)} at lengths {list(lengths)}); nothing was written. "
                "Release rows, or build the cache with more num_blocks"
            )
        changed = []
        for r, n in zip(rows, lengths, strict=True):
            want = blocks_for(n, self.block_size)
            blocks = self.rows[r]
            if len(blocks) != want:
                changed.append(r)
            while len(blocks) > want:
                self._drop(blocks.pop())
            while len(blocks) < want:
                blocks.append(self._take())
        self._sync(changed)  # most decode steps change no row: no copy

    def assign(self, rows: Sequence[int], lengths: Sequence[int], what: str = "rows") -> None:
        """Rows start new sequences of ``lengths`` tokens (all or nothing): a row that shares a
        block gives all its blocks back first (its old tokens are not its any more, and a shared
        block must not be written); then each row gets the blocks of slots ``0 .. lengths[i]``."""
        self._check_fits(rows, lengths, what)
        fresh = [r for r in rows if any(self.refs[b] > 1 for b in self.rows[r])]
        freed = sum(1 for r in fresh for b in self.rows[r] if self.refs[b] == 1)
        need = sum(
            max(0, blocks_for(n, self.block_size) - (0 if r in fresh else len(self.rows[r])))
            for r, n in zip(rows, lengths, strict=True)
        )
        if need > len(self._free) + freed:
            raise PoolExhausted(
                f"{what}: the page pool has {len(self._free) + freed} free blocks of {self.block_size} "
                f"slots, {need} are needed (rows {list(rows)} at lengths {list(lengths)}); nothing was "
                "written. Release rows, or build the cache with more num_blocks"
            )
        self.release(fresh)
        self.ensure(rows, lengths, what)

    def release(self, rows: Sequence[int]) -> None:
        """Return the rows' blocks (a block shared with another row stays with it)."""
        for r in rows:
            for block in self.rows[r]:
                self._drop(block)
            self.rows[r] = []
        self._sync(rows)

    def fork(self, src: int, dsts: Sequence[int], length: int) -> list[tuple[int, int]]:
        """Rows ``dsts`` (holding no blocks) take row ``src``'s first ``length`` tokens: its full
        blocks are shared (reference counted), the block of slot ``length`` is each row's own.
        Returns the ``(source block, new block)`` pairs whose slots below ``length`` the caller
        must copy (the partial last block), for every layer."""
        busy = [d for d in dsts if self.rows[d]]
        if busy:
            raise ValueError(f"dst_rows must hold no blocks (released rows), got rows {busy}")
        full = length // self.block_size
        partial = length % self.block_size != 0
        src_blocks = self.rows[src]
        if len(src_blocks) < blocks_for(length, self.block_size):
            raise ValueError(
                f"src_row {src} holds {len(src_blocks)} blocks, fewer than length {length} needs"
            )
        if len(dsts) > len(self._free):
            raise PoolExhausted(
                f"fork: the page pool has {len(self._free)} free blocks, {len(dsts)} are needed (one per "
                "destination row for the block of its next token); nothing was changed"
            )
        copies = []
        for d in dsts:
            for block in src_blocks[:full]:
                self.refs[block] += 1
            own = self._take()
            self.rows[d] = src_blocks[:full] + [own]
            if partial:
                copies.append((src_blocks[full], own))
        self._sync(list(dsts))
        return copies

    def check(self) -> None:
        """The pool's invariants (tests): every block is free or referenced by exactly its count
        of row entries, no row lists a block twice, the device tables equal the host lists."""
        counts = [0] * self.num_blocks
        for r, blocks in enumerate(self.rows):
            if len(set(blocks)) != len(blocks):
                raise AssertionError(f"row {r} lists a block twice: {blocks}")
            for b in blocks:
                counts[b] += 1
        if counts != self.refs:
            raise AssertionError("reference counts disagree with the rows' block lists")
        free = sorted(self._free)
        if free != [b for b in range(self.num_blocks) if counts[b] == 0]:
            raise AssertionError("the free list is not exactly the unreferenced blocks")
        host = torch.full((self.max_batch, self.max_blocks), NO_BLOCK, dtype=torch.int32)
        for r, blocks in enumerate(self.rows):
            host[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        if not torch.equal(self.tables.cpu(), host):
            raise AssertionError("device tables differ from the host block lists")
