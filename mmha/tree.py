"""Token trees of a multi-token decode step (speculative decoding: Medusa, EAGLE, SpecInfer).

A step verifies ``T`` draft tokens per row, nodes ``0 .. T - 1`` of a tree given as ``parents
[B, T]`` int32: ``parents[b, t]`` is ``-1`` for a root, else a node ``< t`` (nodes are
topologically ordered, so there are no cycles). Node ``t`` of row ``b`` is appended at slot
``lengths[b] + t``, sits at position ``lengths[b] + depth(t)`` for rotary, and attends to slots
``0 .. lengths[b] - 1`` and to the nodes on its path to the root (itself included). A chain
(``parents[t] = t - 1``) is ordinary multi-token decode. Rows may use fewer nodes
(``node_counts[b] <= T``); nodes past a row's count are ignored.

After verification ``accept`` keeps one root-to-node path per row: its nodes move to slots
``lengths[b] .. lengths[b] + len(path) - 1`` in path order (node ``path[i]`` has depth ``i``,
so its rotary position is its new slot) and the rest are forgotten.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._constants import MAX_TREE_NODES as MAX_NODES


def check_parents(
    parents: torch.Tensor, batch: int, node_counts: Sequence[int] | None = None
) -> list[list[int]]:
    """``parents [B, T]`` as host lists, checked: T in [1, MAX_NODES], each entry -1 or an earlier
    node (for the nodes a row uses). Raises ValueError naming ``parents`` (or ``node_counts``)."""
    if not isinstance(parents, torch.Tensor) or parents.dim() != 2 or parents.shape[0] != batch:
        got = tuple(parents.shape) if isinstance(parents, torch.Tensor) else type(parents).__name__
        raise ValueError(f"parents must be an int tensor of shape [{batch}, T], got {got}")
    if parents.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"parents must have dtype int32 or int64, got {parents.dtype}")
    t = parents.shape[1]
    if not 1 <= t <= MAX_NODES:
        raise ValueError(f"parents must have 1..{MAX_NODES} nodes per row (T), got {t}")
    counts = [t] * batch if node_counts is None else [int(c) for c in node_counts]
    if len(counts) != batch or any(not 1 <= c <= t for c in counts):
        raise ValueError(f"node_counts must hold {batch} values in [1, {t}], got {counts}")
    host = parents.tolist()
    for b, row in enumerate(host):
        for i in range(counts[b]):
            if not -1 <= row[i] < i:
                raise ValueError(
                    f"parents[{b}, {i}] must be -1 (a root) or an earlier node in [0, {i - 1}] (nodes are "
                    f"topologically ordered), got {row[i]}"
                )
    return [row[: counts[b]] for b, row in enumerate(host)]


def depths(parents: Sequence[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def ancestors(parents: Sequence[int]) -> list[list[int]]:
    """For each node, the nodes on its path to the root, root first, itself last."""
    out: list[list[int]] = []
    for i, p in enumerate(parents):
        out.append(([] if p < 0 else out[p]) + [i])
    return out


def check_path(parents: Sequence[int], path: Sequence[int], row: int) -> list[int]:
    """A root-to-node path of the tree: ``path[0]`` a root, each next node a child of the last."""
    path = [int(n) for n in path]
    for i, n in enumerate(path):
        if not 0 <= n < len(parents):
            raise ValueError(f"paths[{row}][{i}] must be a node in [0, {len(parents) - 1}], got {n}")
        want = -1 if i == 0 else path[i - 1]
        if parents[n] != want:
            what = "a root" if i == 0 else f"a child of node {want}"
            raise ValueError(f"paths[{row}] must be a path from a root: node {n} at index {i} is not {what}")
    return path
