"""Greedy speculative decoding over token trees (``KVCache.step_tree`` / ``accept``).

A decoder here is anything with ``step_tree(tokens [B, T], parents [B, T], node_counts) ->
logits [B, T, V]`` (lengths unchanged; row ``b`` uses its first ``node_counts[b]`` nodes) and a
``cache`` (a ``KVCache``). Each round the draft grows a tree under each row's current token (node
0: emitted but not yet cached), ``shape[d]`` children per node at depth ``d`` from its top
tokens, one ``step_tree`` per level; the target then verifies the whole tree in one
``step_tree``: from the root, a child is accepted while its token is the target's greedy pick at
its parent; the accepted path is kept in both caches (``accept``) and the target's pick at the
path's end becomes the next current token. The tokens are those of plain greedy decoding with
the target, whatever the draft proposes. Rows may grow trees of different shapes (ragged trees:
one step with each row's node count).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MAX_NODES = 64


def tree_nodes(shape: Sequence[int]) -> int:
    """Nodes of a tree of this shape, the root included; checks the shape."""
    if not shape or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in shape):
        raise ValueError(f"tree_shape must be a non-empty list of branching factors >= 1, got {list(shape)}")
    nodes, level = 1, 1
    for b in shape:
        level *= b
        nodes += level
    if nodes > MAX_NODES:
        raise ValueError(
            f"tree_shape {list(shape)} makes {nodes} nodes (with the root), more than {MAX_NODES}"
        )
    return nodes


def row_shapes(shape, rows: int) -> list[list[int]]:
    """One tree shape per row: ``shape`` itself for every row (a list of ints), or one shape per
    row (a list of ``rows`` lists: ragged trees, each row its own node count); each checked."""
    shapes = [list(s) for s in shape] if shape and not isinstance(shape[0], int) else [list(shape)] * rows
    if len(shapes) != rows:
        raise ValueError(f"tree_shape must be one shape or {rows} (one per row), got {len(shapes)}")
    for s in shapes:
        tree_nodes(s)
    return shapes


def padded(trees: list[list[int]], device, fill: int) -> torch.Tensor:
    """Rows of different lengths as one int32 ``[B, T]`` tensor (``fill`` past each row's end)."""
    width = max(len(t) for t in trees)
    return torch.tensor([t + [fill] * (width - len(t)) for t in trees], dtype=torch.int32, device=device)


def grow_tree(draft, cur: torch.Tensor, shapes: Sequence[Sequence[int]]):
    """The draft's trees under ``cur [B]``, row ``r`` of ``shapes[r]``: tokens ``[B, T]`` (padded),
    each row's parents list and the node counts. Each level is one ragged ``step_tree``."""
    n, dev = cur.shape[0], cur.device
    tokens = [[t] for t in cur.tolist()]
    parents, leaves = [[-1] for _ in range(n)], [[0] for _ in range(n)]
    for depth in range(max(len(s) for s in shapes)):
        counts = [len(p) for p in parents]
        logits = draft.step_tree(padded(tokens, dev, 0), padded(parents, dev, -1), counts)
        for r in range(n):
            branch = shapes[r][depth] if depth < len(shapes[r]) else 0
            if branch == 0:
                continue
            top = logits[r, leaves[r]].topk(branch, dim=-1).indices.tolist()  # [leaves, branch]
            grown = []
            for j, leaf in enumerate(leaves[r]):
                for c in range(branch):
                    parents[r].append(leaf)
                    tokens[r].append(top[j][c])
                    grown.append(len(parents[r]) - 1)
            leaves[r] = grown
    return padded(tokens, dev, 0), parents, [len(p) for p in parents]


def verify(tokens: list[int], parents: list[int], picks: list[int]) -> tuple[list[int], int]:
    """One row: the accepted root path (node 0 first) and the target's pick at its end."""
    children = [[c for c in range(len(parents)) if parents[c] == p] for p in range(len(parents))]
    node, path = 0, [0]
    while True:
        nxt = next((c for c in children[node] if tokens[c] == picks[node]), None)
        if nxt is None:
            return path, picks[node]
        node = nxt
        path.append(node)


@torch.no_grad()
def speculate(target, draft, cur: torch.Tensor, out: list[list[int]], max_new_tokens: int, shape):
    """Rounds until every row of ``out`` (tokens emitted so far; ``cur`` their last, uncached)
    holds ``max_new_tokens``; returns ``out`` trimmed and the tokens accepted per round (stats).
    ``shape``: one tree shape for every row, or one per row (ragged trees, ``row_shapes``). A row
    that is done keeps nothing of later rounds' trees."""
    n, rows = cur.shape[0], list(range(cur.shape[0]))
    shapes = row_shapes(shape, n)
    accepted = []
    while min(len(o) for o in out) < max_new_tokens:
        tokens, parents, counts = grow_tree(draft, cur, shapes)
        tree = padded(parents, cur.device, -1)
        draft.step_tree(tokens, tree, counts)  # every node's K/V in the draft's cache, for accept
        picks = target.step_tree(tokens, tree, counts).argmax(-1).tolist()
        tok = tokens.tolist()
        paths, nxt = [], cur.tolist()
        for r in rows:
            if len(out[r]) >= max_new_tokens:
                paths.append([])
                continue
            path, pick = verify(tok[r][: counts[r]], parents[r], picks[r])
            paths.append(path)
            nxt[r] = pick
            out[r] += [tok[r][c] for c in path[1:]] + [pick]
            accepted.append(len(path))
        target.cache.accept(rows, paths)
        draft.cache.accept(rows, paths)
        cur = torch.tensor(nxt, device=cur.device)
    return [o[:max_new_tokens] for o in out], accepted
