"""Greedy speculative decoding over token trees (``KVCache.step_tree`` / ``accept``).

A decoder here is anything with ``step_tree(tokens [B, T], parents [B, T]) -> logits [B, T, V]``
(lengths unchanged) and a ``cache`` (a ``KVCache``). Each round the draft grows a tree under each
row's current token (node 0: emitted but not yet cached), ``shape[d]`` children per node at depth
``d`` from its top tokens, one ``step_tree`` per level; the target then verifies the whole tree in
one ``step_tree``: from the root, a child is accepted while its token is the target's greedy pick
at its parent; the accepted path is kept in both caches (``accept``) and the target's pick at the
path's end becomes the next current token. The tokens are those of plain greedy decoding with the
target, whatever the draft proposes.
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


def grow_tree(draft, cur: torch.Tensor, shape: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    """The draft's tree under ``cur [B]``: tokens ``[B, N]`` and the (shared) parents list."""
    n, dev = cur.shape[0], cur.device
    tokens, parents, leaves = cur[:, None], [-1], [0]
    for b in shape:
        logits = draft.step_tree(tokens, torch.tensor([parents] * n, dtype=torch.int32, device=dev))
        top = logits[:, leaves].topk(b, dim=-1).indices  # [B, leaves, b]
        grown = []
        for j, leaf in enumerate(leaves):
            for c in range(b):
                parents.append(leaf)
                grown.append(len(parents) - 1)
                tokens = torch.cat([tokens, top[:, j, c : c + 1]], dim=1)
        leaves = grown
    return tokens, parents


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
def speculate(
    target, draft, cur: torch.Tensor, out: list[list[int]], max_new_tokens: int, shape: Sequence[int]
):
    """Rounds until every row of ``out`` (tokens emitted so far; ``cur`` their last, uncached)
    holds ``max_new_tokens``; returns ``out`` trimmed and the tokens accepted per round (stats).
    A row that is done keeps nothing of later rounds' trees."""
    tree_nodes(shape)
    n, rows = cur.shape[0], list(range(cur.shape[0]))
    accepted = []
    while min(len(o) for o in out) < max_new_tokens:
        tokens, parents = grow_tree(draft, cur, shape)
        tree = torch.tensor([parents] * n, dtype=torch.int32, device=cur.device)
        draft.step_tree(tokens, tree)  # every node's K/V in the draft's cache, for accept
        picks = target.step_tree(tokens, tree).argmax(-1).tolist()
        tok = tokens.tolist()
        paths, nxt = [], cur.tolist()
        for r in rows:
            if len(out[r]) >= max_new_tokens:
                paths.append([])
                continue
            path, pick = verify(tok[r], parents, picks[r])
            paths.append(path)
            nxt[r] = pick
            out[r] += [tok[r][c] for c in path[1:]] + [pick]
            accepted.append(len(path))
        target.cache.accept(rows, paths)
        draft.cache.accept(rows, paths)
        cur = torch.tensor(nxt, device=cur.device)
    return [o[:max_new_tokens] for o in out], accepted
