"""``KVCache``: owns the per-layer caches, the lengths, and dispatch for every decode step.

Rows are slots (continuous batching): a row is active from ``admit`` (or construction) until
``release``. Lengths live on the device for the kernels and are mirrored on the host, so capacity
checks and dispatch never read device memory; a step issues no host synchronisation.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Sequence

import torch

from . import dispatch, layout, ops, paging, reference
from ._ext import extension_available
from .epilogue import OutEpilogue, check_epilogue

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
    dtype : activation dtype (fp16, bf16 or fp32), and the caches' unless ``kv_dtype`` says.
    kv_dtype : the caches' dtype: ``dtype`` (default) or ``torch.float8_e4m3fn`` (under fp16 /
        bf16 activations): half the bytes of fp16, with one fp32 scale per layer and kv head
        for K and one for V (``k_scales``, ``v_scales``; see ``set_scales`` and ``prefill``).
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
    paged, block_size, num_blocks : a paged cache (``mmha.paging``): each layer's K/V live in one
        pool of ``num_blocks`` blocks of ``block_size`` slots (16, 32, 64 or 128; default enough
        blocks for every row at ``max_seq_len``), ``k_caches[layer]`` is ``k_pages [num_blocks,
        Hkv, D/x, block_size, x]``, ``v_caches[layer]`` is ``v_pages [num_blocks, Hkv,
        block_size, D]``, and ``block_tables [max_batch, ceil(max_seq_len / block_size)]`` int32
        says which blocks each row owns (host allocator ``pool``; updated in place). Rows own the
        blocks of their tokens and of the next token's slot; ``fork`` shares a prefix's full blocks.
        On a GPU the kernel reads the pages through the tables (tiles by cp.async); released rows
        take no part in a step (zero output). Tree steps need a contiguous cache.
    k_scales, v_scales : ``[num_layers, Hkv]`` fp32 on ``device`` (fp8 caches; None otherwise):
        the cache stores ``saturate(k / k_scale)`` rounded to e4m3. They start at 1 and are set by
        ``set_scales`` or by the first ``prefill`` of a layer (from the prompt's absolute maxima).
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
        kv_dtype: torch.dtype | None = None,
        paged: bool = False,
        block_size: int = 16,
        num_blocks: int | None = None,
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
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        dispatch.check_kv_dtype(dtype, kv_dtype)
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
        self.kv_dtype = kv_dtype
        self.fp8 = kv_dtype == reference.FP8
        self.rotary_dim, self.rotary_theta = rotary_dim, rotary_theta
        self.rotary_interleaved = rotary_interleaved
        self.scale = scale
        self.dispatch_on = dispatch_on
        # On a GPU the caches hold max_seq_len rounded up to a multiple of CAPACITY_ALIGN slots, so
        # that the tile loop's bulk tensor copies apply (they need S_max % 32 == 0; the cp.async
        # fallback issues every copy from one warp and ran the step benchmark's 32K rows at 0.71x
        # the SDPA graph step on the H200). Slots past max_seq_len are never written or read.
        self.capacity = max_seq_len
        if self.device.type == "cuda" and not paged:
            self.capacity = -(-max_seq_len // CAPACITY_ALIGN) * CAPACITY_ALIGN
        self.paged = bool(paged)
        self.pool: paging.PagePool | None = None
        self.block_tables: torch.Tensor | None = None
        if self.paged:
            paging.check_block_size(block_size)
            max_blocks = -(-max_seq_len // block_size)
            num_blocks = max_batch * max_blocks if num_blocks is None else num_blocks
            if not isinstance(num_blocks, int) or num_blocks < max_batch:
                raise ValueError(
                    f"num_blocks must be an int >= max_batch ({max_batch}): every row holds the block of its "
                    f"next token, got {num_blocks!r}"
                )
            k_shape = layout.k_pages_shape(num_blocks, num_kv_heads, block_size, head_dim, kv_dtype)
            v_shape = layout.v_pages_shape(num_blocks, num_kv_heads, block_size, head_dim)
        else:
            k_shape = layout.k_cache_shape(max_batch, num_kv_heads, self.capacity, head_dim, kv_dtype)
            v_shape = layout.v_cache_shape(max_batch, num_kv_heads, self.capacity, head_dim)

        self.use_kernel = self.device.type == "cuda" and extension_available()
        if self.use_kernel and head_dim not in dispatch.SUPPORTED_HEAD_DIMS:
            raise ValueError(f"Unsupported head_dim: {head_dim} (supported: {dispatch.SUPPORTED_HEAD_DIMS})")
        elem = torch.empty((), dtype=kv_dtype).element_size()
        slots = num_blocks * block_size if self.paged else max_batch * self.capacity
        self.nbytes = 2 * num_layers * slots * num_kv_heads * head_dim * elem
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
        self.k_caches = [torch.empty(k_shape, dtype=kv_dtype, device=self.device) for _ in range(num_layers)]
        self.v_caches = [torch.empty(v_shape, dtype=kv_dtype, device=self.device) for _ in range(num_layers)]
        self.k_scales: torch.Tensor | None = None
        self.v_scales: torch.Tensor | None = None
        if self.fp8:
            self.k_scales = torch.ones(num_layers, num_kv_heads, dtype=torch.float32, device=self.device)
            self.v_scales = torch.ones(num_layers, num_kv_heads, dtype=torch.float32, device=self.device)
        self._scales_set = [False] * num_layers
        self.lengths = torch.zeros(max_batch, dtype=torch.int32, device=self.device)
        self._host_lengths = [0] * max_batch
        self._active = [True] * max_batch
        self._attend = [False] * max_batch  # attend-only rows (attend_only)
        # Per row on the device: 1 where the row appends (what advance adds to lengths), and its
        # mode for the kernel (reference.ROW_IDLE / ROW_STEP / ROW_ATTEND).
        self._active_mask = torch.ones(max_batch, dtype=torch.int32, device=self.device)
        self._row_modes = torch.ones(max_batch, dtype=torch.int32, device=self.device)
        # True: every step hands the kernel the row modes (free rows idle), not only steps with an
        # attend-only row, so that a CUDA graph captured before a row turned attend-only replays
        # right after (mmha.distributed's sequence shards set it).
        self.pass_row_modes = False
        self._workspace: ops.Workspace | None = None
        self._checked_mods: dict = {}  # id -> (weakref, version) of score-mod tensors whose values were read
        if self.paged:
            self.pool = paging.PagePool(num_blocks, block_size, max_batch, max_blocks, self.device)
            self.block_tables = self.pool.tables
            self.pool.ensure(range(max_batch), [0] * max_batch, "KVCache")
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
        """Rows become active (stepping) or free; either way no longer attend-only."""
        for r in rows:
            self._active[r] = active
            self._attend[r] = False
        if rows:
            idx = torch.tensor(rows, dtype=torch.long).to(self.device)
            self._active_mask[idx] = int(active)
            self._row_modes[idx] = reference.ROW_STEP if active else reference.ROW_IDLE

    def attend_only(self, rows: Sequence[int], on: bool = True) -> None:
        """Make active ``rows`` attend-only (``on``) or stepping again. An attend-only row's steps
        attend to its cached tokens and write nothing (the new token is neither stored nor
        attended; q is rotated at the row's length), ``advance`` leaves its length, and that length
        may reach ``max_seq_len``: one shard of a context spread over several caches, whose new
        token another cache appends (``mmha.distributed``). Contiguous caches, one-token steps;
        ``admit``, ``release`` and ``prefill`` make rows stepping again."""
        if self.paged:
            raise ValueError("attend_only needs a contiguous cache (paged=False)")
        rows = self._check_rows(rows)
        free = [r for r in rows if not self._active[r]]
        if free:
            raise ValueError(f"rows must be active to be made attend-only or stepping, got free rows {free}")
        if not on:
            full = [r for r in rows if self._host_lengths[r] >= self.max_seq_len]
            if full:
                raise ValueError(f"rows {full} are full (length {self.max_seq_len}): they cannot step again")
        for r in rows:
            self._attend[r] = on
        if rows:
            idx = torch.tensor(rows, dtype=torch.long).to(self.device)
            self._active_mask[idx] = 0 if on else 1
            self._row_modes[idx] = reference.ROW_ATTEND if on else reference.ROW_STEP

    @property
    def attend_rows(self) -> list[int]:
        """The attend-only rows (``attend_only``)."""
        return [r for r in range(self.max_batch) if self._attend[r]]

    def _next_slot_lengths(self, rows: Sequence[int], extra: int = 0) -> list[int]:
        """Lengths the page pool must cover for rows about to hold ``length + extra`` tokens: their
        tokens and the next token's slot, which a full row does not have."""
        return [min(self._host_lengths[r] + extra, self.max_seq_len - 1) for r in rows]

    def release(self, rows: Sequence[int]) -> None:
        """Free rows (their length drops to 0; their cache contents become unused; a paged cache
        takes back their blocks, except those another row shares)."""
        rows = self._check_rows(rows)
        if self.paged:
            self.pool.release(rows)
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
        if self.paged:
            self.pool.assign(rows, [0] * len(rows), "admit")
        self._set_lengths(rows, [0] * len(rows))
        self._set_active(rows, True)
        return rows

    def reset(self) -> None:
        """All rows active with length 0."""
        if self.paged:
            self.pool.release(range(self.max_batch))
            self.pool.ensure(range(self.max_batch), [0] * self.max_batch, "reset")
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
        *,
        scales: str = "auto",
        scale_margin: float = 1.0,
    ) -> None:
        """Write prompt K/V ``[n, S, Hkv, D]`` of ``n`` rows; row ``i`` keeps its first ``lengths[i]``.

        Sets those rows' lengths (the same for every layer) and marks them active. Everything is
        checked before anything is written.

        fp8 caches: ``scales="auto"`` sets the layer's scales from this prompt (``amax * margin /
        448`` per kv head over the kept tokens, ``mmha.reference.fp8_scale``) if they were never set
        (by ``set_scales`` or an earlier prefill), and otherwise keeps them; ``"amax"`` always
        sets them from this prompt; ``"keep"`` never does. Scales are shared by every row of a
        layer, so setting them while another active row holds tokens of it is refused (those
        tokens were quantised with the old scales). Values past ``scale * 448`` saturate.
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
        if scales not in ("auto", "amax", "keep"):
            raise ValueError(f"scales must be 'auto', 'amax' or 'keep', got {scales!r}")
        if not (isinstance(scale_margin, (int, float)) and math.isfinite(scale_margin) and scale_margin > 0):
            raise ValueError(f"scale_margin must be a finite positive number, got {scale_margin!r}")
        calibrate = self.fp8 and (scales == "amax" or (scales == "auto" and not self._scales_set[layer]))
        if calibrate:
            self._check_scales_unused(layer, rows)
        if self.paged:  # the rows' blocks (all or nothing; no-op when an earlier layer assigned them)
            self.pool.assign(rows, [min(n, self.max_seq_len - 1) for n in lens], "prefill")
        if calibrate:
            kept = [k[i, :length] for i, length in enumerate(lens) if length]
            kept_v = [v[i, :length] for i, length in enumerate(lens) if length]
            if kept:
                k_amax = torch.stack([t.float().abs().amax(dim=(0, 2)) for t in kept]).amax(dim=0)
                v_amax = torch.stack([t.float().abs().amax(dim=(0, 2)) for t in kept_v]).amax(dim=0)
                self.k_scales[layer].copy_(reference.fp8_scale(k_amax, scale_margin))
                self.v_scales[layer].copy_(reference.fp8_scale(v_amax, scale_margin))
                self._scales_set[layer] = True
        kc, vc = self.k_caches[layer], self.v_caches[layer]
        for i, (row, length) in enumerate(zip(rows, lens, strict=True)):
            if length:
                ki, vi = k[i : i + 1, :length], v[i : i + 1, :length]
                if self.fp8:
                    ki = reference.quantize_fp8(ki, self.k_scales[layer])
                    vi = reference.quantize_fp8(vi, self.v_scales[layer])
                if self.paged:
                    layout.write_pages(kc, vc, self.pool.rows[row], ki[0], vi[0])
                else:
                    layout.write_k(kc[row : row + 1], ki, 0)
                    layout.write_v(vc[row : row + 1], vi, 0)
        self._set_active(rows, True)
        self._set_lengths(rows, lens)

    # ----------------------------------------------------------------- fp8 scales
    def _check_scales_unused(self, layer: int, rows: Sequence[int]) -> None:
        others = [
            r for r in range(self.max_batch) if self._active[r] and self._host_lengths[r] and r not in rows
        ]
        if others:
            raise ValueError(
                f"the scales of layer {layer} cannot change while rows {others} hold tokens quantised "
                "with them (release those rows first, or prefill with scales='keep')"
            )

    def set_scales(self, layer: int, k_scale, v_scale) -> None:
        """Set layer ``layer``'s fp8 scales: floats (every kv head) or ``[Hkv]`` tensors, e.g. a
        checkpoint's calibrated scales, with stored = saturate(value / scale). Values must be
        finite and positive (checked here: one host read). Refused while an active row holds
        tokens of the layer. Updated in place, so captured CUDA graphs see the new values."""
        self._check_layer(layer)
        if not self.fp8:
            raise ValueError(
                f"set_scales needs an fp8 cache (kv_dtype={reference.FP8}), got kv_dtype={self.kv_dtype}"
            )
        values = []
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            t = torch.as_tensor(s, dtype=torch.float32).detach().to("cpu")
            if t.dim() == 0:
                t = t.expand(self.num_kv_heads)
            if t.shape != (self.num_kv_heads,):
                raise ValueError(
                    f"{name} must be a number or have shape [{self.num_kv_heads}] (one per kv head), "
                    f"got shape {tuple(t.shape)}"
                )
            if not bool(torch.all(torch.isfinite(t) & (t > 0))):
                raise ValueError(f"{name} must be finite and positive, got {t.tolist()}")
            values.append(t)
        self._check_scales_unused(layer, [])
        self.k_scales[layer].copy_(values[0].to(self.device))
        self.v_scales[layer].copy_(values[1].to(self.device))
        self._scales_set[layer] = True

    # ----------------------------------------------------------------- decode
    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers - 1}], got {layer!r}")

    def plan(
        self, batch: int, variant: str = "auto", window: int | None = None, epilogue: bool = False
    ) -> dispatch.Plan:
        """The dispatch decision for the next step over the first ``batch`` rows (host only); a
        sliding ``window`` bounds the keys a row reads; ``epilogue``: the step has an output epilogue."""
        if self.dispatch_on == "capacity":
            seq = self.max_seq_len
        else:
            seq = max(self._host_lengths[:batch], default=0) + 1
        seq = dispatch.keys_read(seq, window)
        if not self.use_kernel:
            return dispatch.choose_variant(
                batch,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                seq,
                self.dtype,
                dispatch.ONE_SM,
                variant,
                self.kv_dtype,
                epilogue=epilogue,
            )
        return ops.plan_for(
            self.device, batch, self.num_heads, self.num_kv_heads, self.head_dim, seq, self.dtype,
            variant, self.kv_dtype, epilogue=epilogue,
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
        window: int | None = None,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        epilogue: OutEpilogue | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One decode step of ``layer`` for rows ``0..B-1``: append the new K/V, attend.

        ``qkv [B, (Hq + 2 Hkv) D]`` with ``B <= max_batch``. Lengths are not changed: call
        ``advance()`` after the last layer. Returns ``out [B, Hq * D]`` (and fp32 ``lse [B, Hq]``).
        ``variant``, ``num_splits``, ``stages`` and ``tile_source`` override the plan (see
        ``mmha.ops.decode_attention``). ``window``, ``softcap``, ``alibi_slopes`` and ``sinks``
        modify the scores (``mmha.reference.ScoreMods``; per call, so each layer may have its own);
        the values of ``alibi_slopes`` and ``sinks`` are read on the host the first time a tensor
        (at its version) is seen, outside CUDA-graph capture and ``torch.compile``. ``epilogue``
        (``mmha.epilogue.OutEpilogue``, per call: each layer its own) shifts, smooths and quantises
        the output in the kernel; ``out`` then has its dtype. ``positions`` (int32 ``[B]`` on the
        cache's device): rotary positions of the rows' tokens instead of their lengths (a cache
        holding one shard of a longer context, ``mmha.distributed``).
        """
        self._check_layer(layer)
        check_epilogue(epilogue, self.num_heads, self.head_dim, self.device)
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
        check_values = self._unchecked(alibi_slopes, sinks)
        mods = reference.ScoreMods(
            self.num_heads, self.device, window, softcap, alibi_slopes, sinks, check_values=check_values
        )
        if check_values:
            self._mark_checked(alibi_slopes, sinks)
        full = [r for r in range(batch) if self._host_lengths[r] >= self.max_seq_len and not self._attend[r]]
        if full:
            raise ValueError(
                f"rows {full} are full: length {self.max_seq_len} == max_seq_len leaves no slot "
                "for the new token; release them or use a larger cache"
            )
        if self.paged:
            kc, vc = self.k_caches[layer], self.v_caches[layer]
        else:
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
        if self.fp8:
            common.update(k_scale=self.k_scales[layer], v_scale=self.v_scales[layer])
        if mods.any:
            common.update(window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
        if epilogue is not None:
            common.update(epilogue=epilogue)
        if positions is not None:
            if self.paged:
                raise ValueError("positions needs a contiguous cache (paged=False)")
            if (positions.shape, positions.dtype, positions.device) != ((batch,), torch.int32, self.device):
                raise ValueError(
                    f"positions must be an int32 tensor [{batch}] on {self.device}, got "
                    f"{tuple(positions.shape)} {positions.dtype} {positions.device}"
                )
            common.update(positions=positions)
        if self.pass_row_modes or any(self._attend[:batch]):  # attend-only rows write nothing
            common.update(row_active=self._row_modes[:batch])
        if self.paged and not self.use_kernel:  # free rows own no blocks: they write nothing and get zeros
            return self._step_paged(qkv, kc, vc, batch, common)
        if not self.use_kernel:
            return reference.decode_step(qkv, kc, vc, lengths, **common)
        if self.paged:  # free rows own no blocks: row_active makes them write nothing and get zeros
            common.update(block_tables=self.block_tables[:batch], row_active=self._row_modes[:batch])
        if num_splits is None or stages is None:
            plan = self.plan(batch, variant, window, epilogue is not None)
            num_splits = plan.num_splits if num_splits is None else num_splits
            stages = plan.stages if stages is None else stages
        ws = self._reserve_workspace(num_splits)
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

    def _zero_out(self, shape: tuple[int, ...], epilogue: OutEpilogue | None) -> torch.Tensor:
        """The output of rows that take no part: zeros (through the epilogue, as the kernel gives)."""
        zeros = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return zeros if epilogue is None else epilogue.apply(zeros, self.dtype)

    def _reserve_workspace(self, num_splits: int, nodes: int = 1) -> ops.Workspace:
        ws = self._workspace
        if ws is None or not ws.fits(self.max_batch, self.num_heads, self.head_dim, num_splits, nodes):
            # Sized for every row so later steps (and graph replays) reuse it; grows only.
            splits = max(num_splits, ws.num_splits if ws is not None else 1)
            nodes = max(nodes, ws.nodes if ws is not None else 1)
            ws = ops.Workspace.allocate(
                self.device, self.max_batch, self.num_heads, self.head_dim, splits, nodes
            )
            self._workspace = ws
        return ws

    def reserve_workspace(
        self, batch_sizes: Sequence[int], windows: Sequence[int | None] = (None,)
    ) -> ops.Workspace | None:
        """Size the kernel's workspace for the plans of steps over each of ``batch_sizes`` rows (with
        each of the layers' sliding ``windows``) now, and return it (``check()`` reads its flags).
        CUDA graphs captured for several batch sizes need this before the first capture: a
        workspace that grew later would leave the earlier graphs writing to freed memory."""
        if not self.use_kernel:
            return None
        splits = [self.plan(int(b), window=w).num_splits for b in batch_sizes for w in windows]
        return self._reserve_workspace(max(splits))

    def _unchecked(self, *tensors) -> bool:
        """Whether score-modifier tensors need their values read: a tensor not read before, or
        changed in place since (its version), outside capture and compilation (where nothing may be
        read)."""
        if self._capturing():
            return False
        for t in tensors:
            if t is not None:
                seen = self._checked_mods.get(id(t))
                if seen is None or seen[0]() is not t or seen[1] != t._version:
                    return True
        return False

    def _mark_checked(self, *tensors) -> None:
        if len(self._checked_mods) > 256:  # forget tensors that are gone
            self._checked_mods = {k: v for k, v in self._checked_mods.items() if v[0]() is not None}
        for t in tensors:
            if t is not None:
                self._checked_mods[id(t)] = (weakref.ref(t), t._version)

    # ----------------------------------------------------------------- tree steps
    def step_tree(
        self,
        layer: int,
        qkv: torch.Tensor,
        parents: torch.Tensor,
        *,
        node_counts: Sequence[int] | torch.Tensor | None = None,
        qkv_bias: torch.Tensor | None = None,
        return_lse: bool = False,
        num_splits: int | None = None,
        stages: int | None = None,
        tile_source: str = "auto",
        epilogue: OutEpilogue | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """A tree-masked multi-token step of ``layer`` (``mmha.tree``) for rows ``0..B-1``:
        ``qkv [B, T, (Hq + 2 Hkv) D]`` for the T nodes of ``parents [B, T]``; node ``t`` is
        appended at slot ``length + t`` and attends to the cache and to its ancestors. Returns
        ``out [B, T, Hq * D]`` (and fp32 ``lse [B, T, Hq]``). Lengths do not move: ``accept`` keeps
        each row's verified path (use the same ``parents`` for every layer). On a GPU the kernel
        (``mmha.ops.decode_tree``) takes ``parents`` (int32) and ``node_counts`` as device tensors
        (host values are copied over); their values are checked on the host outside CUDA-graph
        capture, and a captured step reads them from the device each replay. A paged cache gives
        each active row the blocks of its node slots first (all or nothing; inside capture they
        must be there already: ``reserve_slots``); free rows take no part (zero output).
        ``epilogue`` as in ``step``."""
        from . import tree

        self._check_layer(layer)
        check_epilogue(epilogue, self.num_heads, self.head_dim, self.device)
        width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if qkv.dim() != 3 or qkv.shape[2] != width or not 1 <= qkv.shape[0] <= self.max_batch:
            raise ValueError(
                f"qkv must have shape [B <= {self.max_batch}, T, (num_heads + 2 * num_kv_heads) * head_dim = "
                f"{width}], got {tuple(qkv.shape)}"
            )
        if qkv.dtype != self.dtype or qkv.device != self.device:
            raise ValueError(
                f"qkv must have dtype {self.dtype} on {self.device}, got {qkv.dtype} on {qkv.device}"
            )
        batch = qkv.shape[0]
        attend = [r for r in range(batch) if self._attend[r]]
        if attend:
            raise ValueError(f"rows {attend} are attend-only (attend_only): tree steps need stepping rows")
        if self.use_kernel and self._capturing():
            return self._step_tree_kernel(
                layer, qkv, parents, node_counts, qkv_bias, return_lse, num_splits, stages, tile_source, None,
                epilogue,
            )  # fmt: skip
        if isinstance(node_counts, torch.Tensor):
            node_counts = node_counts.tolist()
        rows = tree.check_parents(parents, batch, node_counts)
        if qkv.shape[1] != parents.shape[1]:
            raise ValueError(
                f"qkv must have T = {parents.shape[1]} nodes (parents' width), got {qkv.shape[1]}"
            )
        over = [
            r
            for r in range(batch)
            if self._active[r] and self._host_lengths[r] + len(rows[r]) > self.max_seq_len
        ]
        if over:
            raise ValueError(
                f"rows {over} would overflow the capacity: length + node count > max_seq_len "
                f"({self.max_seq_len})"
            )
        if self.paged:  # the blocks of every node's slot (a no-op after the first layer)
            active = [r for r in range(batch) if self._active[r]]
            self.pool.ensure(
                active, [self._host_lengths[r] + len(rows[r]) - 1 for r in active], "step_tree"
            )  # fmt: skip
        if self.use_kernel:
            return self._step_tree_kernel(
                layer, qkv, parents, node_counts, qkv_bias, return_lse, num_splits, stages, tile_source, rows,
                epilogue,
            )  # fmt: skip
        if return_lse:  # refused before anything is written
            raise ValueError("return_lse needs the GPU kernel (mmha.reference.decode_tree returns out only)")
        kw = dict(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, scale=self.scale,
            rotary_dim=self.rotary_dim, rotary_theta=self.rotary_theta,
            rotary_interleaved=self.rotary_interleaved, node_counts=[len(r) for r in rows], qkv_bias=qkv_bias,
            epilogue=epilogue,
        )  # fmt: skip
        if self.fp8:
            kw.update(k_scale=self.k_scales[layer], v_scale=self.v_scales[layer])
        if self.paged:
            out = self._step_tree_paged(layer, qkv, parents, batch, kw)
        else:
            out = reference.decode_tree(
                qkv,
                self.k_caches[layer][:batch],
                self.v_caches[layer][:batch],
                self.lengths[:batch],
                parents,
                **kw,
            )
        self._tree = rows
        return out

    def _step_tree_paged(self, layer: int, qkv, parents, batch: int, kw: dict) -> torch.Tensor:
        """The reference tree step over pages for the active rows (free rows: zero output)."""
        rows = [r for r in range(batch) if self._active[r]]
        counts = kw.pop("node_counts")
        width = self.num_heads * self.head_dim
        out = self._zero_out((batch, qkv.shape[1], width), kw["epilogue"])
        if rows:
            idx = torch.tensor(rows, dtype=torch.long, device=qkv.device)
            out[idx] = reference.decode_tree_paged(
                qkv[idx], self.k_caches[layer], self.v_caches[layer], self.block_tables[idx],
                self.lengths[idx], parents[idx], node_counts=[counts[r] for r in rows], **kw,
            )  # fmt: skip
        return out

    def _step_tree_kernel(
        self, layer, qkv, parents, node_counts, qkv_bias, return_lse, num_splits, stages, tile_source, rows,
        epilogue=None,
    ):  # fmt: skip
        """step_tree on the GPU; rows: the checked host trees (None inside capture: not read)."""
        batch, nodes = qkv.shape[0], qkv.shape[1]  # qkv checked by step_tree
        capturing = rows is None
        if not isinstance(parents, torch.Tensor) or parents.dim() != 2 or parents.shape != (batch, nodes):
            raise ValueError(f"parents must be a tensor of shape [{batch}, {nodes}]")
        if capturing and (parents.device != self.device or parents.dtype != torch.int32):
            raise ValueError(f"parents must be int32 on {self.device} inside CUDA-graph capture")
        parents = parents.to(device=self.device, dtype=torch.int32)
        if node_counts is not None and not isinstance(node_counts, torch.Tensor):
            node_counts = torch.tensor(list(node_counts), dtype=torch.int32, device=self.device)
        elif node_counts is not None:
            if capturing and (node_counts.device != self.device or node_counts.dtype != torch.int32):
                raise ValueError(f"node_counts must be int32 on {self.device} inside CUDA-graph capture")
            node_counts = node_counts.to(device=self.device, dtype=torch.int32)
        if num_splits is None or stages is None:
            if self.dispatch_on == "capacity" or capturing:
                keys = self.max_seq_len
            else:
                keys = max(self._host_lengths[r] + len(rows[r]) for r in range(batch))
            plan = ops.plan_for(
                self.device, batch, self.num_heads * nodes, self.num_kv_heads, self.head_dim, keys,
                self.dtype, "auto", self.kv_dtype, tree=nodes > 1, epilogue=epilogue is not None,
            )  # fmt: skip
            num_splits = plan.num_splits if num_splits is None else num_splits
            stages = plan.stages if stages is None else stages
        ws = self._reserve_workspace(num_splits, nodes)
        kw = {}
        if self.fp8:
            kw.update(k_scale=self.k_scales[layer], v_scale=self.v_scales[layer])
        kc, vc = self.k_caches[layer], self.v_caches[layer]
        if self.paged:  # free rows own no blocks: row_active makes them write nothing and get zeros
            kw.update(block_tables=self.block_tables[:batch], row_active=self._row_modes[:batch])
        else:
            kc, vc = kc[:batch], vc[:batch]
        out = ops.decode_tree(
            qkv, kc, vc, self.lengths[:batch], parents,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, node_counts=node_counts,
            qkv_bias=qkv_bias, scale=self.scale, rotary_dim=self.rotary_dim, rotary_theta=self.rotary_theta,
            rotary_interleaved=self.rotary_interleaved, num_splits=num_splits, stages=stages,
            tile_source=tile_source, return_lse=return_lse, workspace=ws, validate=False,
            epilogue=epilogue, **kw,
        )  # fmt: skip
        if rows is not None:
            self._tree = rows
        return out

    def accept(self, rows: Sequence[int], paths: Sequence[Sequence[int]] | torch.Tensor) -> None:
        """After ``step_tree`` on every layer: each row of ``rows`` keeps the nodes of its path
        (root first; an empty path keeps none), moved on the device to slots ``length ..
        length + len(path) - 1`` in path order in every layer; its length advances by
        ``len(path)``, and the other nodes are forgotten. Paths are checked against the last
        step_tree's parents; nothing changes on a refusal.

        ``paths`` may be an integer tensor ``[len(rows), P]`` on the cache's device, each row its
        path then ``-1``s: the moves and the lengths' update are then device work only, which a
        CUDA graph can capture with the tree steps (``rows`` consecutive there). Outside capture
        the paths are read and checked as above; inside capture nothing is checked (a path that
        is not one of the tree's moves what it names, clamped to the capacity) and the host
        mirror of the lengths stays behind: call ``sync_lengths()`` after replays.

        A paged cache moves the nodes through the rows' block tables and then gives each row the
        block of its next token (all or nothing, checked before anything moves; inside capture
        the tables must hold it already: ``reserve_slots``)."""
        if isinstance(paths, torch.Tensor):
            return self._accept_tensor(rows, paths)
        rows = self._check_rows(rows)
        checked = self._checked_paths(rows, paths)
        grown = [self._host_lengths[r] + len(p) for r, p in zip(rows, checked, strict=True)]
        if self.paged:
            self._check_pool_for(rows, grown, "accept")
        for r, path in zip(rows, checked, strict=True):
            n = self._host_lengths[r]
            if not path or path == list(range(len(path))):
                continue  # already in place
            src = [n + t for t in path]
            dst = list(range(n, n + len(path)))
            for kc, vc in zip(self.k_caches, self.v_caches, strict=True):
                if self.paged:
                    (sb, so), (db, do) = self._page_slots(r, src), self._page_slots(r, dst)
                    kc[db, :, :, do] = kc[sb, :, :, so]
                    vc[db, :, do] = vc[sb, :, so]
                else:
                    s_idx = torch.tensor(src, dtype=torch.long, device=self.device)
                    d_idx = torch.tensor(dst, dtype=torch.long, device=self.device)
                    kc[r, :, :, d_idx] = kc[r, :, :, s_idx].clone()
                    vc[r, :, d_idx] = vc[r, :, s_idx].clone()
        self._set_lengths(rows, grown)
        if self.paged:
            self.pool.ensure(rows, self._next_slot_lengths(rows), "accept")

    def _page_slots(self, row: int, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Paged: the (block, offset) index tensors of a row's slots."""
        bs = self.pool.block_size
        blocks = self.pool.rows[row]
        blk = torch.tensor([blocks[s // bs] for s in slots], dtype=torch.long, device=self.device)
        off = torch.tensor([s % bs for s in slots], dtype=torch.long, device=self.device)
        return blk, off

    def _check_pool_for(self, rows: list[int], lengths: list[int], what: str) -> None:
        """Paged: raise PoolExhausted (before anything changes) if rows about to hold ``lengths``
        tokens need more free blocks than the pool has (their next token's slot included)."""
        next_slot = [min(n, self.max_seq_len - 1) for n in lengths]
        need = self.pool.need(rows, next_slot)
        if need > self.pool.free_blocks:
            raise paging.PoolExhausted(
                f"{what}: the page pool has {self.pool.free_blocks} free blocks, {need} are needed for "
                f"rows {rows}; nothing was changed"
            )

    def reserve_slots(self, count: int) -> None:
        """Paged caches: every active row gets the blocks of its slots ``length .. length + count
        - 1`` (all or nothing). ``step_tree`` and ``accept`` do this themselves outside CUDA-graph
        capture; a captured tree step of ``count`` nodes (and a captured ``accept``) reads the
        tables as they are, so call this before each replay (after ``sync_lengths()``)."""
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a positive int, got {count!r}")
        if not self.paged:
            return
        rows = self.active_rows
        over = [r for r in rows if self._host_lengths[r] + count > self.max_seq_len]
        if over:
            raise ValueError(
                f"rows {over} would overflow the capacity: length + count > max_seq_len ({self.max_seq_len})"
            )
        self.pool.ensure(rows, [self._host_lengths[r] + count - 1 for r in rows], "reserve_slots")

    def _checked_paths(self, rows: list[int], paths: Sequence[Sequence[int]]) -> list[list[int]]:
        """accept's checks of host paths against the last step_tree's trees."""
        from . import tree

        trees = getattr(self, "_tree", None)
        if trees is None:
            raise ValueError("accept needs a step_tree first")
        if len(paths) != len(rows):
            raise ValueError(f"paths must hold one path per row ({len(rows)}), got {len(paths)}")
        checked = []
        for i, (r, path) in enumerate(zip(rows, paths, strict=True)):
            if r >= len(trees) or not self._active[r]:
                raise ValueError(f"rows[{i}] = {r} took no part in the last step_tree (or is free)")
            checked.append(tree.check_path(trees[r], path, i) if len(path) else [])
        return checked

    def _accept_tensor(self, rows: Sequence[int], paths: torch.Tensor) -> None:
        """accept with device paths: gathers of every kept node's K/V, scattered to its slot."""
        rows = self._check_rows(rows)
        if (
            paths.dim() != 2
            or paths.shape[0] != len(rows)
            or paths.device != self.device
            or paths.dtype not in (torch.int32, torch.int64)
        ):
            raise ValueError(
                f"paths must be an int32 / int64 tensor [{len(rows)}, P] on {self.device}, got "
                f"{paths.dtype} {tuple(paths.shape)} on {paths.device}"
            )
        capturing = self._capturing()
        kept = None
        if not capturing:
            host = paths.tolist()
            kept = [[n for n in p if n >= 0] for p in host]
            for i, p in enumerate(host):
                if any(n >= 0 for n in p[len(kept[i]) :]) or any(n < -1 for n in p):
                    raise ValueError(f"paths[{i}] must be its path, then -1s, got {p}")
            kept = self._checked_paths(rows, kept)
            if self.paged:
                grown = [self._host_lengths[r] + len(k) for r, k in zip(rows, kept, strict=True)]
                self._check_pool_for(rows, grown, "accept")
        if not rows:
            return
        if rows != list(range(rows[0], rows[0] + len(rows))):
            if capturing:
                raise ValueError(f"rows must be consecutive inside CUDA-graph capture, got {rows}")
            idx = torch.tensor(rows, dtype=torch.long).to(self.device)
        else:
            idx = torch.arange(rows[0], rows[0] + len(rows), dtype=torch.long, device=self.device)
        p = paths.long()
        width = p.shape[1]
        n = self.lengths[idx].long()
        count = (p >= 0).sum(1)
        t = torch.arange(width, device=self.device).expand(len(rows), width)
        # Past a path's end, repeat its last move (an identical write); an empty path copies slot n
        # onto itself.
        t = torch.where(t < count[:, None], t, (count - 1).clamp_min(0)[:, None])
        top = self.max_seq_len - 1
        src = (n[:, None] + p.gather(1, t).clamp_min(0)).clamp(max=top)
        dst = (n[:, None] + t).clamp(max=top)
        if self.paged:  # slots through the tables: (block, offset) pairs
            bs = self.pool.block_size
            tables = self.block_tables[idx].long()
            src_at = (tables.gather(1, src // bs), src % bs)
            dst_at = (tables.gather(1, dst // bs), dst % bs)
        else:
            r = idx[:, None].expand(len(rows), width)
            src_at, dst_at = (r, src), (r, dst)
        for kc, vc in zip(self.k_caches, self.v_caches, strict=True):
            kc[dst_at[0], :, :, dst_at[1]] = kc[src_at[0], :, :, src_at[1]]
            vc[dst_at[0], :, dst_at[1]] = vc[src_at[0], :, src_at[1]]
        self.lengths.index_add_(0, idx, count.to(self.lengths.dtype))
        if kept is not None:
            for row, path in zip(rows, kept, strict=True):
                self._host_lengths[row] += len(path)
            if self.paged:
                self.pool.ensure(rows, self._next_slot_lengths(rows), "accept")

    def sync_lengths(self) -> None:
        """Read the device lengths into the host mirror (one synchronisation): after replays of a
        graph that captured ``accept`` with tensor paths."""
        self._host_lengths = [int(v) for v in self.lengths.tolist()]

    def _step_paged(self, qkv, kc, vc, batch: int, common: dict):
        rows = [r for r in range(batch) if self._active[r]]
        return_lse = common.pop("return_lse")
        out = self._zero_out((batch, self.num_heads * self.head_dim), common.get("epilogue"))
        lse = torch.full((batch, self.num_heads), float("-inf"), dtype=torch.float32, device=qkv.device)
        if rows:
            idx = torch.tensor(rows, dtype=torch.long, device=qkv.device)
            o, l_ = reference.decode_step_paged(
                qkv[idx], kc, vc, self.block_tables[idx], self.lengths[idx], return_lse=True, **common
            )
            out[idx], lse[idx] = o, l_
        return (out, lse) if return_lse else out

    def check(self) -> None:
        """Raise ``mmha.ops.LengthError`` if a step since the last check met a row whose device
        length was outside ``[0, max_seq_len - 1]`` (lengths changed behind the cache's back, or a
        replayed graph ran past the capacity): such a row wrote nothing and its output was NaN;
        ``mmha.ops.ScaleError`` if an fp8 scale was not finite and positive (written behind the
        cache's back: the step wrote nothing).
        The kernel raises a per-row flag instead of failing; this reads the flags (one device
        synchronisation, never inside a step) and clears them."""
        if self._workspace is not None:
            self._workspace.check()

    def advance(self) -> None:
        """Every active row's length moves on by one (after the last layer's ``step``); attend-only
        rows keep theirs.

        Inside CUDA-graph capture only the device update is recorded; call
        ``account_replay()`` after each replay to move the host mirror.
        """
        if not self._capturing():
            self._check_advance(1)
            self._reserve_pages(1)
            for r in range(self.max_batch):
                if self._appending(r):
                    self._host_lengths[r] += 1
        self.lengths.add_(self._active_mask)

    def _reserve_pages(self, steps: int) -> None:
        """Paged: the blocks active rows need after ``steps`` more tokens (all or nothing)."""
        if self.paged:
            rows = self.active_rows
            self.pool.ensure(rows, self._next_slot_lengths(rows, steps), "advance")

    def fork(self, src_row: int, dst_rows: Sequence[int]) -> None:
        """Paged caches: free rows ``dst_rows`` become copies of active row ``src_row`` (its length
        and tokens, every layer), sharing its full blocks (reference counted, never written
        again while shared) and each taking a copy of the block that holds its next slot. All or
        nothing: a pool too small for the copies raises ``mmha.paging.PoolExhausted``."""
        if not self.paged:
            raise ValueError("fork needs a paged cache (KVCache(..., paged=True))")
        (src,) = self._check_rows([src_row], "src_row")
        dsts = self._check_rows(dst_rows, "dst_rows")
        if not self._active[src]:
            raise ValueError(f"src_row must be an active row, got free row {src}")
        if src in dsts:
            raise ValueError(f"dst_rows must not include src_row {src}")
        busy = [r for r in dsts if self._active[r]]
        if busy:
            raise ValueError(f"dst_rows must be free (released) rows, got active rows {busy}")
        length = self._host_lengths[src]
        copies = self.pool.fork(src, dsts, min(length, self.max_seq_len - 1))
        if copies:
            old = torch.tensor([a for a, _ in copies], dtype=torch.long, device=self.device)
            new = torch.tensor([b for _, b in copies], dtype=torch.long, device=self.device)
            for kc, vc in zip(self.k_caches, self.v_caches, strict=True):
                kc[new] = kc[old]
                vc[new] = vc[old]
        self._set_active(dsts, True)
        self._set_lengths(dsts, [length] * len(dsts))

    def _capturing(self) -> bool:
        """Inside CUDA-graph capture or a ``torch.compile`` trace: only device work is recorded
        (the host mirror follows with ``account_replay``, or is not used)."""
        if torch.compiler.is_compiling():
            return True
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _appending(self, r: int) -> bool:
        """Whether row r's length moves with ``advance`` (active, not attend-only)."""
        return self._active[r] and not self._attend[r]

    def _check_advance(self, steps: int) -> None:
        over = [
            r
            for r in range(self.max_batch)
            if self._appending(r) and self._host_lengths[r] + steps > self.max_seq_len
        ]
        if over:
            raise ValueError(
                f"rows {over} would exceed max_seq_len ({self.max_seq_len}) after {steps} more steps"
            )

    def account_replay(self, steps: int = 1) -> None:
        """Move the host mirror after ``steps`` replays of a graph that captured ``advance()`` (a
        paged cache also gives rows the block of their next token before the next replay)."""
        self._check_advance(steps)
        self._reserve_pages(steps)
        for r in range(self.max_batch):
            if self._appending(r):
                self._host_lengths[r] += steps
