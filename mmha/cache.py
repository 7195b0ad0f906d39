"""``KVCache``: owns the per-layer caches, the lengths, and dispatch for every decode step.

Rows are slots (continuous batching): a row is active from ``admit`` (or construction) until
``release``. Lengths live on the device for the kernels and are mirrored on the host, so capacity
checks and dispatch never read device memory; a step issues no host synchronisation.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from . import dispatch, layout, ops, reference
from ._ext import extension_available

_warned_reference = False
# GPU caches hold a multiple of this many slots per row (see KVCache.capacity).
CAPACITY_ALIGN = 64


def _warn_reference_once(reason: str) -> None:
    global _warned_reference
    if not _warned_reference:
        _warned_reference = True
        warnings.warn(
            f"mmha: {reason}; KVCache.step runs the plain-torch reference path (slow)",
            RuntimeWarning,
            stacklevel=3,
        )


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class KVCache:
    """Preallocated K/V caches for ``num_layers`` layers and ``max_batch`` row slots.

    Parameters
    ----------
    num_layers, max_batch, max_seq_len, num_heads, num_kv_heads, head_dim : sizes.
    dtype : cache and activation dtype (fp16, bf16 or fp32).
    device : where the caches live; on a CPU (or without the extension) steps use the reference.
    rotary_dim, rotary_theta, rotary_interleaved : rotary embedding applied by each step
        (``rotary_dim = 0``: none; interleaved = GPT-J pairs, else GPT-NeoX halves).
    scale : softmax scale, default ``1 / sqrt(head_dim)``.
    dispatch_on : ``"length"`` dispatches on the longest current row (eager decoding);
        ``"capacity"`` on ``max_seq_len``, so a captured CUDA graph stays right as rows grow.

    Attributes
    ----------
    k_caches[layer] : ``[max_batch, Hkv, D / x, capacity, x]``
    v_caches[layer] : ``[max_batch, Hkv, capacity, D]``
    capacity : slots allocated per row: ``max_seq_len``, rounded up to a multiple of 64 on a GPU
        (the slots past ``max_seq_len`` are never used)
    lengths : ``[max_batch]`` int32 on ``device``: tokens cached per row.
    """

    def __init__(
        self,
        num_layers: int,
        max_batch: int,
        max_seq_len: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device = "cuda",
        *,
        rotary_dim: int = 0,
        rotary_theta: float = 10000.0,
        rotary_interleaved: bool = False,
        scale: float | None = None,
        dispatch_on: str = "length",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("max_batch", max_batch),
            ("max_seq_len", max_seq_len),
            ("num_heads", num_heads),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            _positive_int(name, value)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
        if dtype not in dispatch.SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {dispatch.SUPPORTED_DTYPES}, got {dtype}")
        if not (0 <= rotary_dim <= head_dim and rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be even and in [0, {head_dim}], got {rotary_dim}")
        if dispatch_on not in ("length", "capacity"):
            raise ValueError(f"dispatch_on must be 'length' or 'capacity', got {dispatch_on!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_layers, self.max_batch, self.max_seq_len = num_layers, max_batch, max_seq_len
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype = dtype
        self.rotary_dim, self.rotary_theta = rotary_dim, rotary_theta
        self.rotary_interleaved = rotary_interleaved
        self.scale = scale
        self.dispatch_on = dispatch_on
        # On a GPU the caches hold max_seq_len rounded up to a multiple of CAPACITY_ALIGN slots, so
        # that the tile loop's bulk tensor copies apply (they need S_max % 32 == 0; the cp.async
        # fallback issues every copy from one warp and ran the step benchmark's 32K rows at 0.71x
        # the SDPA graph step on the H200). Slots past max_seq_len are never written or read.
        self.capacity = max_seq_len
        if self.device.type == "cuda":
            self.capacity = -(-max_seq_len // CAPACITY_ALIGN) * CAPACITY_ALIGN
        k_shape = layout.k_cache_shape(max_batch, num_kv_heads, self.capacity, head_dim, dtype)
        v_shape = layout.v_cache_shape(max_batch, num_kv_heads, self.capacity, head_dim)

        self.use_kernel = self.device.type == "cuda" and extension_available()
        if self.use_kernel and head_dim not in dispatch.SUPPORTED_HEAD_DIMS:
            raise ValueError(f"Unsupported head_dim: {head_dim} (supported: {dispatch.SUPPORTED_HEAD_DIMS})")
        elem = torch.empty((), dtype=dtype).element_size()
        self.nbytes = 2 * num_layers * max_batch * num_kv_heads * self.capacity * head_dim * elem
        workspace_bytes = (
            max_batch * num_heads + 2 + max_batch
        ) * 4  # counters, status; partials grow on first use
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            if self.nbytes + workspace_bytes > free:
                raise MemoryError(
                    f"KVCache needs {self.nbytes + workspace_bytes} bytes "
                    f"({(self.nbytes + workspace_bytes) / 2**30:.2f} GiB) on {self.device}, "
                    f"but only {free} bytes ({free / 2**30:.2f} GiB) are free"
                )
        self.k_caches = [torch.empty(k_shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_caches = [torch.empty(v_shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.lengths = torch.zeros(max_batch, dtype=torch.int32, device=self.device)
        self._host_lengths = [0] * max_batch
        self._active = [True] * max_batch
        self._active_mask = torch.ones(max_batch, dtype=torch.int32, device=self.device)
        self._workspace: ops.Workspace | None = None
        if not self.use_kernel:
            reason = (
                "no CUDA device for this cache"
                if self.device.type != "cuda"
                else "the CUDA extension is not built"
            )
            _warn_reference_once(reason)

    # ----------------------------------------------------------------- bookkeeping
    @property
    def host_lengths(self) -> list[int]:
        """Host copy of the lengths (no device read)."""
        return list(self._host_lengths)

    @property
    def active_rows(self) -> list[int]:
        return [r for r in range(self.max_batch) if self._active[r]]

    @property
    def free_rows(self) -> list[int]:
        return [r for r in range(self.max_batch) if not self._active[r]]

    def _check_rows(self, rows: Sequence[int], name: str = "rows") -> list[int]:
        rows = [int(r) for r in rows]
        for r in rows:
            if not 0 <= r < self.max_batch:
                raise ValueError(f"{name} must be in [0, {self.max_batch - 1}], got {r}")
        if len(set(rows)) != len(rows):
            raise ValueError(f"{name} must not repeat a row, got {rows}")
        return rows

    def _set_lengths(self, rows: list[int], values: list[int]) -> None:
        for r, v in zip(rows, values, strict=True):
            self._host_lengths[r] = v
        if rows:
            idx = torch.tensor(rows, dtype=torch.long)
            self.lengths[idx.to(self.device)] = torch.tensor(values, dtype=torch.int32).to(self.device)

    def _set_active(self, rows: list[int], active: bool) -> None:
        for r in rows:
            self._active[r] = active
        if rows:
            self._active_mask[torch.tensor(rows, dtype=torch.long).to(self.device)] = int(active)

    def release(self, rows: Sequence[int]) -> None:
        """Free rows (their length drops to 0; their cache contents become unused)."""
        rows = self._check_rows(rows)
        self._set_active(rows, False)
        self._set_lengths(rows, [0] * len(rows))

    def admit(self, rows: Sequence[int] | None = None, count: int | None = None) -> list[int]:
        """Take free rows (given, or the first ``count`` free ones) for new sequences, length 0."""
        if rows is None:
            if count is None:
                raise ValueError("admit needs rows or count")
            free = self.free_rows
            if count > len(free):
                raise ValueError(f"count must be <= the {len(free)} free rows, got {count}")
            rows = free[:count]
        rows = self._check_rows(rows)
        busy = [r for r in rows if self._active[r]]
        if busy:
            raise ValueError(f"rows must be free (released) to be admitted, got active rows {busy}")
        self._set_lengths(rows, [0] * len(rows))
        self._set_active(rows, True)
        return rows

    def reset(self) -> None:
        """All rows active with length 0."""
        self._set_active(list(range(self.max_batch)), True)
        self._set_lengths(list(range(self.max_batch)), [0] * self.max_batch)

    # ----------------------------------------------------------------- prefill
    def prefill(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        lengths: Sequence[int] | torch.Tensor | None = None,
        rows: Sequence[int] | None = None,
    ) -> None:
        """Write prompt K/V ``[n, S, Hkv, D]`` of ``n`` rows; row ``i`` keeps its first ``lengths[i]``.

        Sets those rows' lengths (the same for every layer) and marks them active. Everything is
        checked before anything is written.
        """
        self._check_layer(layer)
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 4 or t.shape[2:] != (self.num_kv_heads, self.head_dim):
                raise ValueError(
                    f"{name} must have shape [n, S, {self.num_kv_heads}, {self.head_dim}], "
                    f"got {tuple(t.shape)}"
                )
            if t.dtype != self.dtype:
                raise ValueError(f"{name} must have dtype {self.dtype}, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} must be on {self.device}, got {t.device}")
        if k.shape != v.shape:
            raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
        n, s = k.shape[0], k.shape[1]
        rows = self._check_rows(range(n) if rows is None else rows)
        if len(rows) != n:
            raise ValueError(f"rows must name {n} rows (one per prompt), got {len(rows)}")
        if lengths is None:
            lens = [s] * n
        elif isinstance(lengths, torch.Tensor):
            lens = [int(x) for x in lengths.tolist()]
        else:
            lens = [int(x) for x in lengths]
        if len(lens) != n:
            raise ValueError(f"lengths must have {n} entries, got {len(lens)}")
        for i, length in enumerate(lens):
            if not 0 <= length <= s:
                raise ValueError(f"lengths[{i}] must be in [0, {s}] (the prompt width), got {length}")
            if length > self.max_seq_len:
                raise ValueError(
                    f"lengths[{i}] ({length}) exceeds the cache capacity max_seq_len "
                    f"({self.max_seq_len}) for row {rows[i]}"
                )
        kc, vc = self.k_caches[layer], self.v_caches[layer]
        for i, (row, length) in enumerate(zip(rows, lens, strict=True)):
            if length:
                layout.write_k(kc[row : row + 1], k[i : i + 1, :length], 0)
                layout.write_v(vc[row : row + 1], v[i : i + 1, :length], 0)
        self._set_active(rows, True)
        self._set_lengths(rows, lens)

    # ----------------------------------------------------------------- decode
    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers - 1}], got {layer!r}")

    def plan(self, batch: int, variant: str = "auto") -> dispatch.Plan:
        """The dispatch decision for the next step over the first ``batch`` rows (host only)."""
        if self.dispatch_on == "capacity":
            seq = self.max_seq_len
        else:
            seq = max(self._host_lengths[:batch], default=0) + 1
        if not self.use_kernel:
            return dispatch.choose_variant(
                batch, self.num_heads, self.num_kv_heads, self.head_dim, seq, self.dtype, 1, variant
            )
        return ops.plan_for(
            self.device, batch, self.num_heads, self.num_kv_heads, self.head_dim, seq, self.dtype,
            variant,
        )  # fmt: skip

    def step(
        self,
        layer: int,
        qkv: torch.Tensor,
        *,
        qkv_bias: torch.Tensor | None = None,
        return_lse: bool = False,
        variant: str = "auto",
        num_splits: int | None = None,
        stages: int | None = None,
        tile_source: str = "auto",
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One decode step of ``layer`` for rows ``0..B-1``: append the new K/V, attend.

        ``qkv [B, (Hq + 2 Hkv) D]`` with ``B <= max_batch``. Lengths are not changed: call
        ``advance()`` after the last layer. Returns ``out [B, Hq * D]`` (and fp32 ``lse [B, Hq]``).
        ``variant``, ``num_splits``, ``stages`` and ``tile_source`` override the plan (see
        ``mmha.ops.decode_attention``).
        """
        self._check_layer(layer)
        width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if qkv.dim() != 2 or qkv.shape[1] != width:
            raise ValueError(
                f"qkv must have shape [B, (num_heads + 2 * num_kv_heads) * head_dim = {width}], "
                f"got {tuple(qkv.shape)}"
            )
        batch = qkv.shape[0]
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"qkv must have 1..{self.max_batch} rows (max_batch), got {batch}")
        if qkv.dtype != self.dtype:
            raise ValueError(f"qkv must have dtype {self.dtype}, got {qkv.dtype}")
        if qkv.device != self.device:
            raise ValueError(f"qkv must be on {self.device}, got {qkv.device}")
        if qkv_bias is not None and (
            qkv_bias.shape != (width,) or qkv_bias.dtype != self.dtype or qkv_bias.device != self.device
        ):
            raise ValueError(
                f"qkv_bias must have shape [{width}], dtype {self.dtype} and device {self.device}, "
                f"got {tuple(qkv_bias.shape)} {qkv_bias.dtype} {qkv_bias.device}"
            )
        full = [r for r in range(batch) if self._host_lengths[r] >= self.max_seq_len]
        if full:
            raise ValueError(
                f"rows {full} are full: length {self.max_seq_len} == max_seq_len leaves no slot "
                "for the new token; release them or use a larger cache"
            )
        kc, vc = self.k_caches[layer][:batch], self.v_caches[layer][:batch]
        lengths = self.lengths[:batch]
        common = dict(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            qkv_bias=qkv_bias,
            scale=self.scale,
            rotary_dim=self.rotary_dim,
            rotary_theta=self.rotary_theta,
            rotary_interleaved=self.rotary_interleaved,
            return_lse=return_lse,
        )
        if not self.use_kernel:
            return reference.decode_step(qkv, kc, vc, lengths, **common)
        if num_splits is None or stages is None:
            plan = self.plan(batch, variant)
            num_splits = plan.num_splits if num_splits is None else num_splits
            stages = plan.stages if stages is None else stages
        ws = self._workspace
        if ws is None or not ws.fits(batch, self.num_heads, self.head_dim, num_splits):
            # Sized for every row so later steps (and graph replays) reuse it; grows only.
            splits = max(num_splits, ws.num_splits if ws is not None else 1)
            ws = ops.Workspace.allocate(self.device, self.max_batch, self.num_heads, self.head_dim, splits)
            self._workspace = ws
        return ops.decode_attention(
            qkv,
            kc,
            vc,
            lengths,
            num_splits=num_splits,
            stages=stages,
            tile_source=tile_source,
            workspace=ws,
            validate_lengths=False,
            **common,
        )

    def check(self) -> None:
        """Raise ``mmha.ops.LengthError`` if a step since the last check met a row whose device
        length was outside ``[0, max_seq_len - 1]`` (lengths changed behind the cache's back, or a
        replayed graph ran past the capacity): such a row wrote nothing and its output was NaN.
        The kernel raises a per-row flag instead of failing; this reads the flags (one device
        synchronisation, never inside a step) and clears them."""
        if self._workspace is not None:
            self._workspace.check()

    def advance(self) -> None:
        """Every active row's length moves on by one (after the last layer's ``step``).

        Inside CUDA-graph capture only the device update is recorded; call
        ``account_replay()`` after each replay to move the host mirror.
        """
        if not self._capturing():
            self._check_advance(1)
            for r in range(self.max_batch):
                if self._active[r]:
                    self._host_lengths[r] += 1
        self.lengths.add_(self._active_mask)

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _check_advance(self, steps: int) -> None:
        over = [
            r
            for r in range(self.max_batch)
            if self._active[r] and self._host_lengths[r] + steps > self.max_seq_len
        ]
        if over:
            raise ValueError(
                f"rows {over} would exceed max_seq_len ({self.max_seq_len}) after {steps} more steps"
            )

    def account_replay(self, steps: int = 1) -> None:
        """Move the host mirror after ``steps`` replays of a graph that captured ``advance()``."""
        self._check_advance(steps)
        for r in range(self.max_batch):
            if self._active[r]:
                self._host_lengths[r] += steps
