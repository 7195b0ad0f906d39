"""Where a cache's K/V live: contiguous rows or pages of one pool, behind one interface.

``ContiguousStorage``: per layer ``k [max_batch, Hkv, D/x, capacity, x]`` and ``v [max_batch,
Hkv, capacity, D]`` (``mmha.layout``; an int8 cache also its per-token scales, ``k_scales`` /
``v_scales`` ``[max_batch, Hkv, capacity]`` fp32). ``PagedStorage``: per layer a pool ``k_pages [num_blocks,
Hkv, D/x, block_size, x]`` / ``v_pages [num_blocks, Hkv, block_size, D]`` and the block tables of
its ``mmha.paging.PagePool`` (one table serves every layer). Both give the kernel's view of a
layer, write prompts, and move or copy slots (``accept``, ``fork``); the paged one also owns the
allocation of blocks, all or nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import layout, paging

# GPU caches hold a multiple of this many slots per row (see ContiguousStorage.capacity).
CAPACITY_ALIGN = 64


def _allocate(
    num_layers: int, k_shape, v_shape, dtype, device, workspace_bytes: int
) -> tuple[list, list, int]:
    """Every layer's K and V, after checking that they fit the device's free memory (with an int8
    cache's token scales, ``token_scales``)."""
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = num_layers * (torch.Size(k_shape).numel() + torch.Size(v_shape).numel()) * elem
    if dtype == torch.int8:
        nbytes += num_layers * 2 * torch.Size(v_shape[:3]).numel() * 4
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        if nbytes + workspace_bytes > free:
            need = nbytes + workspace_bytes
            raise MemoryError(
                f"KVCache needs {need} bytes ({need / 2**30:.2f} GiB) on {device}, but only {free} bytes "
                f"({free / 2**30:.2f} GiB) are free"
            )
    k = [torch.empty(k_shape, dtype=dtype, device=device) for _ in range(num_layers)]
    v = [torch.empty(v_shape, dtype=dtype, device=device) for _ in range(num_layers)]
    return k, v, nbytes


def token_scales(num_layers: int, v_shape, kv_dtype, device) -> tuple[list, list]:
    """An int8 cache's per-token scales of every layer: fp32, K's and V's, each ``v_shape[:3]``
    (a scale per slot and kv head, beside the slots); empty lists for other caches."""
    if kv_dtype != torch.int8:
        return [], []
    make = [torch.zeros(v_shape[:3], dtype=torch.float32, device=device) for _ in range(2 * num_layers)]
    return make[:num_layers], make[num_layers:]


class _Planes:
    """What both storages share: the per-slot planes of each layer (K, V and an int8 cache's K and
    V scales: ``[row or block, Hkv, D/x, slot, x]`` for K, ``[row or block, Hkv, slot, ...]`` for the
    others), moved and copied together."""

    def _planes(self):
        for layer, (kc, vc) in enumerate(zip(self.k_caches, self.v_caches, strict=True)):
            yield kc, vc, *((self.k_scales[layer], self.v_scales[layer]) if self.k_scales else ())

    def scales_view(self, layer: int, batch: int) -> dict:
        """An int8 cache's ``k_scale`` / ``v_scale`` as the kernel's view of ``layer`` takes them
        (rows ``0 .. batch - 1``, or the pool's); ``{}`` for other caches."""
        if not self.k_scales:
            return {}
        rows = slice(None) if self.paged else slice(0, batch)
        return dict(k_scale=self.k_scales[layer][rows], v_scale=self.v_scales[layer][rows])

    def accept_path(self, row: int, length: int, path: list[int]) -> None:
        """A tree step's kept ``path`` (node indices) moved to slots ``length .. length + len(path) -
        1`` of ``row`` in every layer (``move``; nothing to do when it is already in place)."""
        if path and path != list(range(len(path))):
            self.move(row, [length + t for t in path], list(range(length, length + len(path))))

    def copy_slots(self, src: tuple, dst: tuple) -> None:
        """Slots at ``dst = (row or block [R, W], offset [R, W])`` take those at ``src`` (device
        indices, ``slots``), in every layer and plane."""
        for kc, *rest in self._planes():
            kc[dst[0], :, :, dst[1]] = kc[src[0], :, :, src[1]]
            for t in rest:
                t[dst[0], :, dst[1]] = t[src[0], :, src[1]]


class ContiguousStorage(_Planes):
    """Row ``b`` of a layer is ``k[b]`` / ``v[b]``. On a GPU the rows hold ``max_seq_len`` rounded
    up to a multiple of ``CAPACITY_ALIGN`` slots, so that the tile loop's bulk tensor copies apply
    (they need S_max % 32 == 0; the cp.async fallback issues every copy from one warp and ran the
    step benchmark's 32K rows at 0.71x the SDPA graph step on the H200); slots past
    ``max_seq_len`` are never written or read."""

    paged = False
    pool = None
    block_tables = None

    def __init__(
        self, num_layers, max_batch, max_seq_len, num_kv_heads, head_dim, kv_dtype, device, extra_bytes=0
    ):
        self.capacity = max_seq_len
        if device.type == "cuda":
            self.capacity = -(-max_seq_len // CAPACITY_ALIGN) * CAPACITY_ALIGN
        k_shape = layout.k_cache_shape(max_batch, num_kv_heads, self.capacity, head_dim, kv_dtype)
        v_shape = layout.v_cache_shape(max_batch, num_kv_heads, self.capacity, head_dim)
        self.k_caches, self.v_caches, self.nbytes = _allocate(
            num_layers, k_shape, v_shape, kv_dtype, device, extra_bytes
        )
        self.k_scales, self.v_scales = token_scales(num_layers, v_shape, kv_dtype, device)
        self.device = device

    def view(self, layer: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's caches of rows ``0 .. batch - 1``."""
        return self.k_caches[layer][:batch], self.v_caches[layer][:batch]

    def tables(self, batch: int) -> None:
        return None

    def write_prompt(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor, scales=None) -> None:
        """Slots ``0 .. n - 1`` of ``row`` get ``k, v [1, n, Hkv, D]`` (in the cache's dtype; an int8
        cache's ``scales``: K's and V's ``[1, n, Hkv]``)."""
        layout.write_k(self.k_caches[layer][row : row + 1], k, 0)
        layout.write_v(self.v_caches[layer][row : row + 1], v, 0)
        if scales is not None:
            n = k.shape[1]
            self.k_scales[layer][row, :, :n] = scales[0][0].T
            self.v_scales[layer][row, :, :n] = scales[1][0].T

    # Block bookkeeping: a contiguous cache owns every slot already.
    def check_room(self, rows, lengths, what: str) -> None:
        pass

    def reserve(self, rows, lengths, what: str) -> None:
        pass

    def assign(self, rows, lengths, what: str) -> None:
        pass

    def release(self, rows) -> None:
        pass

    def move(self, row: int, src: list[int], dst: list[int]) -> None:
        """In every layer, slots ``dst`` of ``row`` take the contents of slots ``src``."""
        s_idx = torch.tensor(src, dtype=torch.long, device=self.device)
        d_idx = torch.tensor(dst, dtype=torch.long, device=self.device)
        for kc, *rest in self._planes():
            kc[row, :, :, d_idx] = kc[row, :, :, s_idx].clone()
            for t in rest:
                t[row, :, d_idx] = t[row, :, s_idx].clone()

    def slots(self, rows: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Device indices ``(row or block, offset)`` of ``slots [R, W]`` of ``rows [R]`` (device work)."""
        return rows[:, None].expand_as(slots), slots


def pool_size(max_batch: int, max_seq_len: int, block_size: int, num_blocks) -> tuple[int, int]:
    """``(blocks a row may hold, blocks in the pool)``: ``num_blocks`` checked (default: every row
    at ``max_seq_len``), after ``block_size``."""
    paging.check_block_size(block_size)
    max_blocks = -(-max_seq_len // block_size)
    num_blocks = max_batch * max_blocks if num_blocks is None else num_blocks
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < max_batch:
        raise ValueError(
            f"num_blocks must be an int >= max_batch ({max_batch}): every row holds the block of its "
            f"next token, got {num_blocks!r}"
        )
    return max_blocks, num_blocks


class PagedStorage(_Planes):
    """Pages of one pool per layer (``mmha.paging``); ``pool`` allocates their blocks to rows."""

    paged = True

    def __init__(
        self, num_layers, max_batch, max_seq_len, num_kv_heads, head_dim, kv_dtype, device, block_size,
        num_blocks=None, extra_bytes=0,
    ):  # fmt: skip
        max_blocks, num_blocks = pool_size(max_batch, max_seq_len, block_size, num_blocks)
        k_shape = layout.k_pages_shape(num_blocks, num_kv_heads, block_size, head_dim, kv_dtype)
        v_shape = layout.v_pages_shape(num_blocks, num_kv_heads, block_size, head_dim)
        self.k_caches, self.v_caches, self.nbytes = _allocate(
            num_layers, k_shape, v_shape, kv_dtype, device, extra_bytes
        )
        self.k_scales, self.v_scales = token_scales(num_layers, v_shape, kv_dtype, device)
        self.capacity, self.device = max_seq_len, device
        self.block_size, self.num_blocks = block_size, num_blocks
        self.pool = paging.PagePool(num_blocks, block_size, max_batch, max_blocks, device)
        self.block_tables = self.pool.tables

    def view(self, layer: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_caches[layer], self.v_caches[layer]

    def tables(self, batch: int) -> torch.Tensor:
        return self.block_tables[:batch]

    def write_prompt(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor, scales=None) -> None:
        layout.write_pages(self.k_caches[layer], self.v_caches[layer], self.pool.rows[row], k[0], v[0])
        if scales is not None:
            blk, off = self._page_slots(row, list(range(k.shape[1])))
            self.k_scales[layer][blk, :, off] = scales[0][0]
            self.v_scales[layer][blk, :, off] = scales[1][0]

    def check_room(self, rows: list[int], lengths: list[int], what: str) -> None:
        """Raise ``PoolExhausted`` (before anything changes) if rows about to hold ``lengths`` tokens
        need more free blocks than the pool has (their next token's slot included)."""
        next_slot = [min(n, self.capacity - 1) for n in lengths]
        need = self.pool.need(rows, next_slot)
        if need > self.pool.free_blocks:
            raise paging.PoolExhausted(
                f"{what}: the page pool has {self.pool.free_blocks} free blocks, {need} are needed for "
                f"rows {rows}; nothing was changed"
            )

    def reserve(self, rows: Sequence[int], lengths: Sequence[int], what: str) -> None:
        """Rows own the blocks of slots ``0 .. lengths[i]`` (all or nothing)."""
        self.pool.ensure(rows, lengths, what)

    def assign(self, rows: Sequence[int], lengths: Sequence[int], what: str) -> None:
        """Rows start new sequences owning the blocks of slots ``0 .. lengths[i]`` (all or nothing)."""
        self.pool.assign(rows, lengths, what)

    def release(self, rows: Sequence[int]) -> None:
        self.pool.release(rows)

    def fork(self, src: int, dsts: list[int], length: int) -> None:
        """Rows ``dsts`` share ``src``'s full blocks and copy its partial one (every layer)."""
        copies = self.pool.fork(src, dsts, length)
        if copies:
            old = torch.tensor([a for a, _ in copies], dtype=torch.long, device=self.device)
            new = torch.tensor([b for _, b in copies], dtype=torch.long, device=self.device)
            for planes in self._planes():
                for t in planes:
                    t[new] = t[old]

    def _page_slots(self, row: int, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        bs, blocks = self.block_size, self.pool.rows[row]
        blk = torch.tensor([blocks[s // bs] for s in slots], dtype=torch.long, device=self.device)
        off = torch.tensor([s % bs for s in slots], dtype=torch.long, device=self.device)
        return blk, off

    def move(self, row: int, src: list[int], dst: list[int]) -> None:
        self.copy_slots(self._page_slots(row, src), self._page_slots(row, dst))

    def slots(self, rows: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tables = self.block_tables[rows].long()
        return tables.gather(1, slots // self.block_size), slots % self.block_size
