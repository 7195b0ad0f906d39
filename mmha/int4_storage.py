"""Where an int4 ``KVCache``'s K/V live (``KVCache(kv_dtype="int4")``, the reference path): one
``mmha.int4.Int4Cache`` per layer for contiguous rows, one ``mmha.int4_pages.Int4Pages`` pool per
layer for a paged cache, behind the interface of ``mmha.storage``'s storages (the kernel's view of
a layer, prompts, block bookkeeping, fork, a tree step's accept).

What differs from the other formats: a step's view is the format's object (its codes, scales,
zero points and K residual together), prompts are quantised here (``Int4Cache.prefill``), and a
tree step's accept commits the K groups its path completes (``accept_path``), so accepts take host
paths only (a device path would need that commit on the device).
"""

from __future__ import annotations

import torch

from . import int4_pages, paging
from .int4 import GROUP, INT4, Int4Cache
from .int4_pages import Int4Pages
from .storage import ContiguousStorage, PagedStorage, pool_size


def _check_free(nbytes: int, device: torch.device) -> None:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        if nbytes > free:
            raise MemoryError(f"KVCache needs {nbytes} bytes on {device}, but only {free} bytes are free")


def _nbytes(parts) -> int:
    return sum(t.numel() * t.element_size() for p in parts for t in vars(p).values())


class _Int4Slots:
    """What both int4 storages share: no per-token scale planes, and slots that move only through
    ``accept_path`` (a move elsewhere would skip the K groups' commit)."""

    def scales_view(self, layer: int, batch: int) -> dict:
        return {}

    def move(self, row: int, src: list[int], dst: list[int]) -> None:
        raise ValueError("an int4 cache moves slots only through accept_path (its K groups commit there)")

    def copy_slots(self, src: tuple, dst: tuple) -> None:
        raise ValueError("an int4 cache moves slots only through accept_path (its K groups commit there)")


class Int4ContiguousStorage(_Int4Slots, ContiguousStorage):
    """Row ``b`` of a layer is row ``b`` of ``caches[layer]``; capacities are whole K groups
    (``max_seq_len`` rounded up to a multiple of 64; slots past ``max_seq_len`` are never used).
    ``ContiguousStorage``'s bookkeeping (a contiguous cache owns every slot already)."""

    def __init__(
        self, num_layers, max_batch, max_seq_len, num_kv_heads, head_dim, dtype, device, extra_bytes=0
    ):
        self.capacity = -(-max_seq_len // GROUP) * GROUP
        self.caches = [
            Int4Cache.empty(max_batch, num_kv_heads, self.capacity, head_dim, dtype, device)
            for _ in range(num_layers)
        ]
        self.nbytes = _nbytes(self.caches)
        _check_free(extra_bytes, device)
        self.device = device

    k_caches = property(lambda self: [c.k_codes for c in self.caches])
    v_caches = property(lambda self: [c.v_codes for c in self.caches])

    def view(self, layer: int, batch: int) -> tuple[Int4Cache, None]:
        """Rows ``0 .. batch - 1`` of ``layer`` (views: a step writes through them)."""
        return Int4Cache(**{name: t[:batch] for name, t in vars(self.caches[layer]).items()}), None

    def write_prompt(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor, scales=None) -> None:
        """Slots ``0 .. n - 1`` of ``row`` get the prompt ``k, v [1, n, Hkv, D]`` (after rotary),
        quantised as appends would leave them."""
        self.caches[layer].prefill(row, k[0].transpose(0, 1), v[0].transpose(0, 1))

    def accept_path(self, row: int, length: int, path: list[int]) -> None:
        """A tree step's kept ``path`` to slots ``length ..``, its completed groups committed."""
        for c in self.caches:
            c.accept(row, length, path)


class Int4PagedStorage(_Int4Slots, PagedStorage):
    """One ``Int4Pages`` pool per layer; ``pool`` allocates blocks to rows as for the other formats
    (``PagedStorage``'s bookkeeping: tables, room, reserve, assign, release). Blocks hold whole K
    groups (``block_size`` 64 or 128)."""

    def __init__(
        self, num_layers, max_batch, max_seq_len, num_kv_heads, head_dim, dtype, device, block_size,
        num_blocks=None, extra_bytes=0,
    ):  # fmt: skip
        max_blocks, num_blocks = pool_size(max_batch, max_seq_len, block_size, num_blocks)
        if block_size % GROUP:
            raise ValueError(
                f"block_size must be 64 or 128 for an int4 cache (whole K groups), got {block_size}"
            )
        self.pages = [
            Int4Pages.empty(num_blocks, block_size, max_batch, num_kv_heads, head_dim, dtype, device)
            for _ in range(num_layers)
        ]
        self.nbytes = _nbytes(self.pages)
        _check_free(extra_bytes, device)
        self.capacity, self.device = max_seq_len, device
        self.block_size, self.num_blocks = block_size, num_blocks
        self.pool = paging.PagePool(num_blocks, block_size, max_batch, max_blocks, device)
        self.block_tables = self.pool.tables
        self.k_scales, self.v_scales = [], []

    k_caches = property(lambda self: [p.k_codes for p in self.pages])
    v_caches = property(lambda self: [p.v_codes for p in self.pages])

    def view(self, layer: int, batch: int) -> tuple[Int4Pages, None]:
        return self.pages[layer], None

    def write_prompt(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor, scales=None) -> None:
        n = k.shape[1]
        blocks = self.pool.rows[row][: -(-n // self.block_size)]
        int4_pages.prefill(self.pages[layer], row, blocks, k[0].transpose(0, 1), v[0].transpose(0, 1))

    def fork(self, src: int, dsts: list[int], length: int) -> None:
        """Rows ``dsts`` share ``src``'s full blocks, copy its partial one and its K residual."""
        copies = self.pool.fork(src, dsts, length)
        old = torch.tensor([a for a, _ in copies], dtype=torch.long, device=self.device)
        new = torch.tensor([b for _, b in copies], dtype=torch.long, device=self.device)
        for p in self.pages:
            for name, t in vars(p).items():
                if name != "k_residual" and copies:
                    t[new] = t[old]
            for d in dsts:
                p.k_residual[d] = p.k_residual[src]

    def accept_path(self, row: int, length: int, path: list[int]) -> None:
        blocks = self.pool.table(row)  # the row's blocks, those of the tree's nodes included
        for p in self.pages:
            int4_pages.accept(p, row, blocks, length, path)


def make_storage(shape: tuple, dtype, paged: bool, block_size: int, num_blocks, extra_bytes: int):
    """The storage of ``shape = (layers, max_batch, max_seq_len, Hkv, D, kv_dtype, device)``: an
    int4 cache's own (codes, scales, zero points and K residual, ``mmha.int4_storage``) or the
    planes of the other formats (``mmha.storage``), contiguous or paged."""
    if shape[5] == INT4:
        shape = (*shape[:5], dtype, shape[6])
        paged_type, contiguous_type = Int4PagedStorage, Int4ContiguousStorage
    else:
        paged_type, contiguous_type = PagedStorage, ContiguousStorage
    if paged:
        return paged_type(*shape, block_size, num_blocks, extra_bytes=extra_bytes)
    return contiguous_type(*shape, extra_bytes=extra_bytes)
