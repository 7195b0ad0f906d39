"""The kernel's scratch (``Workspace``) and the errors its status flags raise.

The flags are raised by the device-side guard: a row the kernel refuses (a length outside the
cache, a broken tree, a block outside the pool, an fp8 scale that is not finite and positive)
writes nothing to the caches and returns NaN, and its flag stays raised until ``check()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._constants import (
    STATUS_LENGTH,
    STATUS_PAGES,
    STATUS_SCALE,
    STATUS_TREE,
    workspace_counters,
    workspace_partials,
)


class StepError(ValueError):
    """The kernel refused rows of a step it was given (see ``Workspace.check``)."""


class LengthError(StepError):
    """A row reached the kernel with a length outside ``[0, S_max - 1]``: it wrote nothing to the
    caches and returned NaN for that row."""


class TreeError(StepError):
    """A tree step's ``parents`` or ``node_counts`` broke ``mmha.tree``'s rules when the kernel ran
    (a parent that is not -1 or an earlier node, a count outside ``[1, T]``): the row wrote nothing
    to the caches and returned NaN."""


class ScaleError(StepError):
    """An fp8 cache's ``k_scale`` or ``v_scale`` held a value that is not finite and positive when
    the kernel ran: the step wrote nothing to the caches and returned NaN for every row. Or an
    int8 cache's new token had a value that is not finite: its stored scale is not finite (so
    every later read of that token says so) and the row's output is NaN."""


class PageError(StepError):
    """A paged cache's block table named a block outside the pool for a slot a row needed when
    the kernel ran: the row wrote nothing to the caches and returned NaN."""


def tree_counters(batch: int, num_heads: int, nodes: int) -> int:
    """int32 counters a step of ``nodes`` query rows per row needs (``mmha._constants``)."""
    return workspace_counters(batch, nodes, num_heads)


@dataclass
class Workspace:
    """Scratch of the operator: fp32 split partials, int32 counters (merge arrivals, the tile
    loop's work counter and a tree step's masks, depths and row counts: ``mmha._constants``'s
    layout; zero between launches) and the int32 per-row status flags of the device-side guard.

    Counters are reset by the kernel itself, so one workspace serves any number of launches
    ordered on one stream; launches on concurrent streams need one workspace each. Status flags
    stay raised until ``check()`` reads and clears them.
    """

    partials: torch.Tensor
    counters: torch.Tensor
    status: torch.Tensor
    num_splits: int
    nodes: int = 1  # query rows per row it was sized for (tree steps: T)

    @classmethod
    def allocate(cls, device, batch: int, num_heads: int, head_dim: int, num_splits: int, nodes: int = 1):
        partials = torch.empty(
            workspace_partials(batch, nodes, num_heads, num_splits, head_dim),
            dtype=torch.float32,
            device=device,
        )
        counters = torch.zeros(workspace_counters(batch, nodes, num_heads), dtype=torch.int32, device=device)
        status = torch.zeros(batch, dtype=torch.int32, device=device)
        return cls(partials, counters, status, num_splits, nodes)

    def fits(self, batch: int, num_heads: int, head_dim: int, num_splits: int, nodes: int = 1) -> bool:
        return (
            self.partials.numel() >= workspace_partials(batch, nodes, num_heads, num_splits, head_dim)
            and self.counters.numel() >= workspace_counters(batch, nodes, num_heads)
            and self.status.numel() >= batch
        )

    def check(self) -> None:
        """Raise ``LengthError`` naming the rows whose length was out of range in a launch since
        the last check (``TreeError``, ``PageError`` or ``ScaleError`` for rows refused for their
        tree, block table or fp8 scales), and clear the flags. One device synchronisation."""
        status = self.status.tolist()
        if not any(status):
            return
        self.status.zero_()
        rows = {
            bit: [r for r, v in enumerate(status) if v & bit]
            for bit in (STATUS_LENGTH, STATUS_TREE, STATUS_PAGES)
        }
        if rows[STATUS_LENGTH]:
            raise LengthError(
                f"lengths of rows {rows[STATUS_LENGTH]} were outside [0, S_max - 1] (a tree step: [0, "
                "S_max - node count]) when the kernel ran: nothing was written to their cache slots and "
                "their output is NaN"
            )
        if rows[STATUS_TREE]:
            raise TreeError(
                f"parents or node_counts of rows {rows[STATUS_TREE]} broke mmha.tree's rules when the kernel "
                "ran: nothing was written to their cache slots and their output is NaN"
            )
        if rows[STATUS_PAGES]:
            raise PageError(
                f"block tables of rows {rows[STATUS_PAGES]} named a block outside the page pool when the "
                "kernel ran: nothing was written to their cache slots and their output is NaN"
            )
        scales = [r for r, v in enumerate(status) if v & STATUS_SCALE]
        raise ScaleError(
            f"rows {scales}: an fp8 cache's k_scale / v_scale held a value that is not finite and positive "
            "when the kernel ran (nothing was written to the caches; the output is NaN), or an int8 cache's "
            "new token had a value that is not finite (its scale is stored non-finite; the output is NaN)"
        )
