"""``StepPlanner``: the plan and the workspace of a step, made once per step and batch and reused
by every layer (as FlashInfer plans once and runs per layer).

A plan is a pure function of the shapes and the keys the step may read (``mmha.dispatch``): the
longest row plus the new tokens in eager use (``dispatch_on="length"``), or the capacity
(``"capacity"``), so that a captured CUDA graph stays right as rows grow. Plans are kept per
(batch, keys, window, epilogue, nodes, variant), so the layers of a step after the first only look
theirs up. The workspace is sized for every row and grows only (a graph captured earlier keeps
its addresses as long as later plans fit).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import dispatch, int4, ops
from .spec import AttentionSpec
from .workspace import Workspace

# Plans kept before the table is cleared (eager decoding plans a new length every step).
MAX_PLANS = 64


class StepPlanner:
    def __init__(
        self, cache_shape: tuple, dtype, kv_dtype, device: torch.device, use_kernel: bool, dispatch_on: str
    ):
        self.max_batch, self.num_heads, self.num_kv_heads, self.head_dim, self.max_seq_len = cache_shape
        # (an int4 cache's codes: the dispatcher's name for them, dispatch.INT4_CODES)
        self.dtype, self.device = dtype, device
        self.kv_dtype = dispatch.INT4_CODES if kv_dtype == int4.INT4 else kv_dtype
        self.use_kernel, self.dispatch_on = use_kernel, dispatch_on
        self.workspace: Workspace | None = None
        self._plans: dict[tuple, dispatch.Plan] = {}

    def keys(self, longest: int, nodes: int = 1) -> int:
        """Keys a step may read: the capacity, or the longest row plus its new tokens."""
        return self.max_seq_len if self.dispatch_on == "capacity" else longest + nodes

    def plan(
        self, batch: int, keys: int, window: int | None = None, epilogue: bool = False, nodes: int = 1,
        variant: str = "auto",
    ) -> dispatch.Plan:  # fmt: skip
        """The plan of a step over ``batch`` rows reading up to ``keys`` keys (a sliding ``window``
        bounds them); ``nodes``: a tree step's query rows per row (planned as ``nodes * Hq``
        columns)."""
        key = (batch, keys, window, epilogue, nodes, variant)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._choose(batch, dispatch.keys_read(keys, window), epilogue, nodes, variant)
            if not torch.compiler.is_compiling():
                if len(self._plans) >= MAX_PLANS:
                    self._plans.clear()
                self._plans[key] = plan
        return plan

    def _choose(self, batch: int, keys: int, epilogue: bool, nodes: int, variant: str) -> dispatch.Plan:
        heads = self.num_heads * nodes
        if not self.use_kernel:
            return dispatch.choose_variant(
                batch, heads, self.num_kv_heads, self.head_dim, keys, self.dtype, dispatch.ONE_SM, variant,
                self.kv_dtype, epilogue=epilogue, nodes=nodes,
            )  # fmt: skip
        return ops.plan_for(
            self.device, batch, heads, self.num_kv_heads, self.head_dim, keys, self.dtype, variant,
            self.kv_dtype, epilogue=epilogue, nodes=nodes,
        )  # fmt: skip

    def for_layer(
        self, batch: int, keys: int, attention: AttentionSpec, variant: str = "auto", nodes: int = 1
    ):
        return self.plan(batch, keys, attention.window, attention.epilogue is not None, nodes, variant)

    def reserve(self, num_splits: int, nodes: int = 1) -> Workspace:
        """A workspace that fits ``num_splits`` splits of ``nodes`` query rows for every row."""
        ws = self.workspace
        if ws is None or not ws.fits(self.max_batch, self.num_heads, self.head_dim, num_splits, nodes):
            splits = max(num_splits, ws.num_splits if ws is not None else 1)
            nodes = max(nodes, ws.nodes if ws is not None else 1)
            ws = Workspace.allocate(self.device, self.max_batch, self.num_heads, self.head_dim, splits, nodes)
            self.workspace = ws
        return ws

    def reserve_for(self, batch_sizes: Sequence[int], specs: Sequence[AttentionSpec]) -> Workspace | None:
        """The workspace of every plan of steps over each of ``batch_sizes`` rows with each
        layer's spec, sized now (before the first CUDA-graph capture)."""
        if not self.use_kernel:
            return None
        keys = self.keys(self.max_seq_len - 1)
        settings = {(s.window, s.epilogue is not None) for s in specs}
        splits = [self.plan(int(b), keys, w, e).num_splits for b in batch_sizes for w, e in settings]
        return self.reserve(max(splits))
