"""``TreeSteps``: a ``KVCache``'s speculative part: tree-masked multi-token steps (``mmha.tree``)
and ``accept``, which keeps each row's verified path.

``step_tree`` appends every node of ``parents [B, T]`` at slots ``length .. length + T - 1`` of
each layer (lengths do not move); ``accept`` then moves each row's path to the slots after its
tokens and advances the row by the path's length. Paths are checked against the last
``step_tree``'s trees on the host; device paths (an int tensor) let a CUDA graph capture both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import checks, tree
from .backends import TreeCall
from .rows import capturing


class TreeSteps:
    """The tree steps and accepts of ``cache`` (a ``KVCache``: its rows, storage, plans, backend)."""

    def __init__(self, cache):
        self.cache = cache
        self.trees: list[list[int]] | None = None  # the last step_tree's checked host trees

    # ------------------------------------------------------------------ tree steps
    def _checked_qkv(self, qkv: torch.Tensor) -> int:
        c = self.cache
        width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        if qkv.dim() != 3 or qkv.shape[2] != width or not 1 <= qkv.shape[0] <= c.max_batch:
            raise ValueError(
                f"qkv must have shape [B <= {c.max_batch}, T, (num_heads + 2 * num_kv_heads) * head_dim = "
                f"{width}], got {tuple(qkv.shape)}"
            )
        if qkv.dtype != c.dtype or qkv.device != c.device:
            raise ValueError(f"qkv must have dtype {c.dtype} on {c.device}, got {qkv.dtype} on {qkv.device}")
        attend = [r for r in c.rows.attend_rows if r < qkv.shape[0]]
        if attend:
            raise ValueError(f"rows {attend} are attend-only (attend_only): tree steps need stepping rows")
        return qkv.shape[0]

    def _host_trees(self, qkv, parents, node_counts, batch: int) -> list[list[int]]:
        """The trees, checked, and the blocks of every node's slot (outside capture)."""
        c = self.cache
        if isinstance(node_counts, torch.Tensor):
            node_counts = node_counts.tolist()
        trees = tree.check_parents(parents, batch, node_counts)
        if qkv.shape[1] != parents.shape[1]:
            raise ValueError(
                f"qkv must have T = {parents.shape[1]} nodes (parents' width), got {qkv.shape[1]}"
            )
        active = [r for r in range(batch) if c.rows.is_active(r)]
        over = [r for r in active if c.rows.host[r] + len(trees[r]) > c.max_seq_len]
        if over:
            raise ValueError(
                f"rows {over} would overflow the capacity: length + node count > max_seq_len "
                f"({c.max_seq_len})"
            )
        # The blocks of every node's slot (a no-op after the first layer).
        c.storage.reserve(active, [c.rows.host[r] + len(trees[r]) - 1 for r in active], "step_tree")
        return trees

    def _device_trees(self, parents, node_counts, batch: int, nodes: int, capture: bool):
        """``parents`` and ``node_counts`` as the kernel takes them (int32 on the device)."""
        dev = self.cache.device
        if not isinstance(parents, torch.Tensor) or parents.shape != (batch, nodes):
            raise ValueError(f"parents must be a tensor of shape [{batch}, {nodes}]")
        if capture and (parents.device != dev or parents.dtype != torch.int32):
            raise ValueError(f"parents must be int32 on {dev} inside CUDA-graph capture")
        if isinstance(node_counts, torch.Tensor):
            if capture and (node_counts.device != dev or node_counts.dtype != torch.int32):
                raise ValueError(f"node_counts must be int32 on {dev} inside CUDA-graph capture")
            node_counts = node_counts.to(device=dev, dtype=torch.int32)
        elif node_counts is not None:
            node_counts = torch.tensor(list(node_counts), dtype=torch.int32, device=dev)
        return parents.to(device=dev, dtype=torch.int32), node_counts

    def step_tree(
        self, layer, qkv, parents, node_counts, qkv_bias, return_lse, num_splits, stages, tile_source
    ):
        """``KVCache.step_tree`` (its docstring)."""
        c = self.cache
        if c.use_kernel and c.int4:
            raise ValueError(
                'step_tree: an int4 cache (kv_dtype="int4") takes tree steps on the reference path only '
                "(a CPU cache) until the kernel takes them; its one-token steps run on the GPU"
            )
        attention = c.attention_of(layer)
        checks.tree_spec(attention, f"attention[{layer}]")
        c.check_bias(qkv_bias)
        batch = self._checked_qkv(qkv)
        capture = capturing(c.device)
        trees = None if capture and c.use_kernel else self._host_trees(qkv, parents, node_counts, batch)
        call = TreeCall(
            qkv, *c.storage.view(layer, batch), c.rows.lengths[:batch], parents, attention, node_counts,
            qkv_bias, return_lse, c.scales_of(layer, batch), block_tables=c.storage.tables(batch),
        )  # fmt: skip
        if c.paged:  # free rows own no blocks: they take no part (zero output)
            call.row_active = c.rows.modes[:batch]
            call.active_rows = [r for r in range(batch) if c.rows.is_active(r)]
        if c.use_kernel:
            nodes = qkv.shape[1]
            call.parents, call.node_counts = self._device_trees(parents, node_counts, batch, nodes, capture)
            if num_splits is None or stages is None:
                keys = c.max_seq_len
                if c.dispatch_on == "length" and not capture:
                    keys = max(c.rows.host[r] + len(trees[r]) for r in range(batch))
                plan = c.planner.for_layer(batch, keys, attention, nodes=nodes)
                num_splits = plan.num_splits if num_splits is None else num_splits
                stages = plan.stages if stages is None else stages
            call.num_splits, call.stages, call.tile_source = num_splits, stages, tile_source
            call.workspace = c.planner.reserve(num_splits, nodes)
        else:
            call.node_counts = [len(t) for t in trees]
        out = c.backend.tree(call)
        if trees is not None:
            self.trees = trees
        return out

    # ------------------------------------------------------------------ accept
    def checked_paths(self, rows: list[int], paths: Sequence[Sequence[int]]) -> list[list[int]]:
        """accept's checks of host paths against the last step_tree's trees."""
        if self.trees is None:
            raise ValueError("accept needs a step_tree first")
        if len(paths) != len(rows):
            raise ValueError(f"paths must hold one path per row ({len(rows)}), got {len(paths)}")
        checked = []
        for i, (r, path) in enumerate(zip(rows, paths, strict=True)):
            if r >= len(self.trees) or not self.cache.rows.is_active(r):
                raise ValueError(f"rows[{i}] = {r} took no part in the last step_tree (or is free)")
            checked.append(tree.check_path(self.trees[r], path, i) if len(path) else [])
        return checked

    def accept(self, rows: Sequence[int], paths: Sequence[Sequence[int]] | torch.Tensor) -> None:
        """``KVCache.accept`` (its docstring)."""
        if isinstance(paths, torch.Tensor):
            if self.cache.int4:
                raise ValueError(
                    "paths: an int4 cache takes paths as lists (its accept commits K groups on the host)"
                )
            return self._accept_tensor(rows, paths)
        c = self.cache
        rows = c.rows.check(rows)
        checked = self.checked_paths(rows, paths)
        grown = [c.rows.host[r] + len(p) for r, p in zip(rows, checked, strict=True)]
        c.storage.check_room(rows, grown, "accept")
        for r, path in zip(rows, checked, strict=True):
            c.storage.accept_path(r, c.rows.host[r], path)
        c.rows.set_lengths(rows, grown)
        c.storage.reserve(rows, c.rows.next_slot_lengths(rows), "accept")

    def _host_check_tensor_paths(self, rows: list[int], paths: torch.Tensor) -> list[list[int]]:
        """Device paths read and checked on the host (outside capture)."""
        c = self.cache
        host = paths.tolist()
        kept = [[n for n in p if n >= 0] for p in host]
        for i, p in enumerate(host):
            if any(n >= 0 for n in p[len(kept[i]) :]) or any(n < -1 for n in p):
                raise ValueError(f"paths[{i}] must be its path, then -1s, got {p}")
        kept = self.checked_paths(rows, kept)
        c.storage.check_room(
            rows, [c.rows.host[r] + len(k) for r, k in zip(rows, kept, strict=True)], "accept"
        )
        return kept

    def _accept_tensor(self, rows: Sequence[int], paths: torch.Tensor) -> None:
        """accept with device paths: gathers of every kept node's K/V, scattered to its slot."""
        c = self.cache
        rows = c.rows.check(rows)
        if paths.dim() != 2 or paths.shape[0] != len(rows) or paths.device != c.device or paths.dtype not in (
            torch.int32, torch.int64,
        ):  # fmt: skip
            raise ValueError(
                f"paths must be an int32 / int64 tensor [{len(rows)}, P] on {c.device}, got "
                f"{paths.dtype} {tuple(paths.shape)} on {paths.device}"
            )
        capture = capturing(c.device)
        kept = None if capture else self._host_check_tensor_paths(rows, paths)
        if not rows:
            return
        if rows != list(range(rows[0], rows[0] + len(rows))):
            if capture:
                raise ValueError(f"rows must be consecutive inside CUDA-graph capture, got {rows}")
            idx = torch.tensor(rows, dtype=torch.long).to(c.device)
        else:
            idx = torch.arange(rows[0], rows[0] + len(rows), dtype=torch.long, device=c.device)
        p = paths.long()
        width = p.shape[1]
        n = c.rows.lengths[idx].long()
        count = (p >= 0).sum(1)
        t = torch.arange(width, device=c.device).expand(len(rows), width)
        # Past a path's end, repeat its last move (an identical write); an empty path copies slot n
        # onto itself.
        t = torch.where(t < count[:, None], t, (count - 1).clamp_min(0)[:, None])
        top = c.max_seq_len - 1
        src_at = c.storage.slots(idx, (n[:, None] + p.gather(1, t).clamp_min(0)).clamp(max=top))
        dst_at = c.storage.slots(idx, (n[:, None] + t).clamp(max=top))
        c.storage.copy_slots(src_at, dst_at)
        c.rows.lengths.index_add_(0, idx, count.to(c.rows.lengths.dtype))
        if kept is not None:
            c.rows.add_host(rows, [len(k) for k in kept])
            c.storage.reserve(rows, c.rows.next_slot_lengths(rows), "accept")

    def reserve_slots(self, count: int) -> None:
        """``KVCache.reserve_slots`` (its docstring)."""
        c = self.cache
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"count must be a positive int, got {count!r}")
        if not c.paged:
            return
        rows = c.rows.active_rows
        over = [r for r in rows if c.rows.host[r] + count > c.max_seq_len]
        if over:
            raise ValueError(
                f"rows {over} would overflow the capacity: length + count > max_seq_len ({c.max_seq_len})"
            )
        c.storage.reserve(rows, [c.rows.host[r] + count - 1 for r in rows], "reserve_slots")
