"""``KVCache``: a decode step's caches, lengths and dispatch, as one object over parts with one job each.

- ``AttentionSpec`` per layer (``mmha.spec``): what each layer's attention is, checked once here;
- storage (``mmha.storage``): contiguous rows or a page pool, the kernel's view of a layer;
- the row table (``mmha.rows``): rows as slots for continuous batching and their lengths, on the
  device and mirrored on the host, so capacity checks and dispatch never read device memory;
- fp8 scales (``mmha.scales``);
- the step planner (``mmha.step_plan``): a plan and a workspace per step and batch, for every layer;
- a backend (``mmha.backends``): the CUDA kernel, or the plain-torch reference on a CPU;
- tree steps and ``accept`` (``mmha.tree_steps``).

A step issues no host synchronisation; inside CUDA-graph capture only device work is recorded.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from . import checks, dispatch, quant
from ._ext import extension_available
from .backends import KernelBackend, ReferenceBackend, StepCall
from .int4 import INT4
from .int4_storage import make_storage
from .rows import RowTable, capturing
from .scales import Fp8Scales, amax_of, check_margin
from .spec import FP8, AttentionSpec, Rotary, layer_specs
from .step_plan import StepPlanner
from .storage import CAPACITY_ALIGN  # noqa: F401  (CAPACITY_ALIGN: API)
from .tree_steps import TreeSteps

_warned_reference = False


def _warn_reference_once(reason: str) -> None:
    global _warned_reference
    if not _warned_reference:
        _warned_reference = True
        warnings.warn(
            f"mmha: {reason}; KVCache.step runs the plain-torch reference path (slow)",
            RuntimeWarning,
            stacklevel=3,
        )


def _checked_kv_dtype(dtype: torch.dtype, kv_dtype) -> torch.dtype | str:
    """The caches' format: ``dtype`` when ``kv_dtype`` is None, else ``kv_dtype`` checked (the
    names ``"int8"`` and ``"fp8"`` stand for ``torch.int8`` and ``torch.float8_e4m3fn``)."""
    kv_dtype = dtype if kv_dtype is None else {"int8": torch.int8, "fp8": FP8}.get(kv_dtype, kv_dtype)
    if isinstance(kv_dtype, str) and kv_dtype != INT4:
        raise ValueError(f'kv_dtype must be a torch dtype, "int8", "fp8" or "{INT4}", got {kv_dtype!r}')
    if kv_dtype != INT4:
        dispatch.check_kv_dtype(dtype, kv_dtype)
    return kv_dtype


def _check_kernel_takes(dtype: torch.dtype, kv_dtype) -> None:
    """The formats the GPU kernel does not take (a GPU cache refuses them by name)."""
    if kv_dtype in (torch.int8, INT4) and dtype not in dispatch.FP8_ACTIVATION_DTYPES:
        name = "int8" if kv_dtype == torch.int8 else "int4"
        raise ValueError(f"dtype must be float16 or bfloat16 with an {name} cache on a GPU, got {dtype}")


class KVCache:
    """Preallocated K/V caches for ``num_layers`` layers and ``max_batch`` row slots.

    Parameters
    ----------
    num_layers, max_batch, max_seq_len, num_heads, num_kv_heads, head_dim : sizes.
    dtype : activation dtype (fp16, bf16 or fp32), and the caches' unless ``kv_dtype`` says.
    device : where the caches live; on a CPU (or without the extension) steps use the reference.
    attention : each layer's ``mmha.AttentionSpec`` (one for every layer, or one per layer): rotary,
        scale, sliding window, soft-cap, ALiBi, sinks, output epilogue. Without it every layer gets
        ``rotary_dim`` / ``rotary_theta`` / ``rotary_interleaved`` (``rotary_dim = 0``: none;
        interleaved = GPT-J pairs, else GPT-NeoX halves) and ``scale`` (default ``1 / sqrt(D)``).
    dispatch_on : ``"length"`` plans for the longest current row (eager decoding); ``"capacity"``
        for ``max_seq_len``, so a captured CUDA graph stays right as rows grow.
    kv_dtype : the caches' dtype: ``dtype`` (default) or ``torch.float8_e4m3fn`` (``"fp8"``; under
        fp16 / bf16 activations), with one fp32 scale per layer and kv head for K and one for V
        (``k_scales``, ``v_scales``; ``set_scales``, ``prefill``), or ``torch.int8`` (``"int8"``):
        each token's K and V codes with a scale per token and kv head beside its slot
        (``mmha.quant``; on a GPU under fp16 / bf16 activations, one-token and tree steps), or
        ``"int4"`` (``mmha.int4``: V per token and K per channel over 64-token groups, with zero
        points; the reference path only, so a CPU cache; paged blocks of 64 or 128 slots; ``accept``
        takes list paths).
    paged, block_size, num_blocks : a paged cache (``mmha.paging``): each layer's K/V in one pool of
        ``num_blocks`` blocks of ``block_size`` slots (16, 32, 64 or 128; default enough for every
        row at ``max_seq_len``); ``k_caches[layer]`` is then ``k_pages [num_blocks, Hkv, D/x,
        block_size, x]``, ``v_caches[layer]`` ``v_pages [num_blocks, Hkv, block_size, D]``, and
        ``block_tables [max_batch, ceil(max_seq_len / block_size)]`` int32 says which blocks each
        row owns (allocator ``pool``). Rows own the blocks of their tokens and of the next token's
        slot; ``fork`` shares a prefix's full blocks; released rows take no part in a step.

    Attributes
    ----------
    k_caches[layer] : ``[max_batch, Hkv, D / x, capacity, x]``; v_caches[layer] : ``[max_batch,
        Hkv, capacity, D]``. capacity : ``max_seq_len``, rounded up to a multiple of 64 on a GPU.
    lengths : ``[max_batch]`` int32 on ``device``: tokens cached per row.
    attention : the layers' specs. k_scales, v_scales : ``[num_layers, Hkv]`` fp32 (fp8 caches).
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
        attention: AttentionSpec | Sequence[AttentionSpec] | None = None,
        rotary_dim: int = 0,
        rotary_theta: float = 10000.0,
        rotary_interleaved: bool = False,
        scale: float | None = None,
        dispatch_on: str = "length",
        kv_dtype: torch.dtype | str | None = None,
        paged: bool = False,
        block_size: int = 16,
        num_blocks: int | None = None,
    ) -> None:
        sizes = (num_layers, max_batch, max_seq_len, num_heads, num_kv_heads, head_dim)
        names = ("num_layers", "max_batch", "max_seq_len", "num_heads", "num_kv_heads", "head_dim")
        for name, value in zip(names, sizes, strict=True):
            checks.positive_int(name, value)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
        if dtype not in dispatch.SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {dispatch.SUPPORTED_DTYPES}, got {dtype}")
        kv_dtype = _checked_kv_dtype(dtype, kv_dtype)
        if dispatch_on not in ("length", "capacity"):
            raise ValueError(f"dispatch_on must be 'length' or 'capacity', got {dispatch_on!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if not (isinstance(rotary_dim, int) and 0 <= rotary_dim <= head_dim and rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be even and in [0, {head_dim}], got {rotary_dim!r}")
        rotary = Rotary(rotary_dim, rotary_theta, rotary_interleaved)
        self.attention = layer_specs(attention, num_layers, rotary, scale)
        for i, spec in enumerate(self.attention):
            checks.attention_spec(spec, num_heads, head_dim, self.device, f"attention[{i}]")
        self.num_layers, self.max_batch, self.max_seq_len = num_layers, max_batch, max_seq_len
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype, self.kv_dtype, self.fp8 = dtype, kv_dtype, kv_dtype == FP8
        self.int8, self.int4 = kv_dtype == torch.int8, kv_dtype == INT4
        self.dispatch_on = dispatch_on
        self.use_kernel = self.device.type == "cuda" and extension_available()
        if self.use_kernel:
            _check_kernel_takes(dtype, kv_dtype)
        if self.use_kernel:  # theta's frequency tables made now, before any step is captured in a graph
            for spec in self.attention:
                spec.rotary.kernel_table(self.device)
        if self.use_kernel and head_dim not in dispatch.SUPPORTED_HEAD_DIMS:
            raise ValueError(f"Unsupported head_dim: {head_dim} (supported: {dispatch.SUPPORTED_HEAD_DIMS})")
        workspace_bytes = (max_batch * num_heads + 2 + max_batch) * 4  # counters, status; partials grow later
        shape = (num_layers, max_batch, max_seq_len, num_kv_heads, head_dim, kv_dtype, self.device)
        self.storage = make_storage(shape, dtype, paged, block_size, num_blocks, workspace_bytes)
        self.rows = RowTable(max_batch, max_seq_len, self.device)
        self.scales = Fp8Scales(num_layers, num_kv_heads, self.device) if self.fp8 else None
        self.planner = StepPlanner(
            (max_batch, num_heads, num_kv_heads, head_dim, max_seq_len), dtype, kv_dtype, self.device,
            self.use_kernel, dispatch_on,
        )  # fmt: skip
        backend = KernelBackend if self.use_kernel else ReferenceBackend
        self.backend = backend(num_heads, num_kv_heads)
        self.trees = TreeSteps(self)
        self.storage.reserve(range(max_batch), [0] * max_batch, "KVCache")
        if not self.use_kernel:
            no_gpu = self.device.type != "cuda"
            _warn_reference_once(
                "no CUDA device for this cache" if no_gpu else "the CUDA extension is not built"
            )

    # ----------------------------------------------------------------- the parts' state, by name
    paged = property(lambda self: self.storage.paged)
    capacity = property(lambda self: self.storage.capacity)
    nbytes = property(lambda self: self.storage.nbytes)
    k_caches = property(lambda self: self.storage.k_caches)
    v_caches = property(lambda self: self.storage.v_caches)
    pool = property(lambda self: self.storage.pool)
    block_tables = property(lambda self: self.storage.block_tables)
    lengths = property(lambda self: self.rows.lengths)
    k_scales = property(lambda self: None if self.scales is None else self.scales.k)
    v_scales = property(lambda self: None if self.scales is None else self.scales.v)
    host_lengths = property(
        lambda self: list(self.rows.host), doc="Host copy of the lengths (no device read)."
    )
    active_rows = property(lambda self: self.rows.active_rows)
    free_rows = property(lambda self: self.rows.free_rows)
    attend_rows = property(lambda self: self.rows.attend_rows, doc="The attend-only rows (``attend_only``).")

    @property
    def pass_row_modes(self) -> bool:
        """Hand the kernel the row modes on every step (``mmha.distributed``'s sequence shards)."""
        return self.rows.pass_modes

    @pass_row_modes.setter
    def pass_row_modes(self, on: bool) -> None:
        self.rows.pass_modes = bool(on)

    def attention_of(self, layer: int) -> AttentionSpec:
        """Layer ``layer``'s spec (ValueError naming ``layer`` if out of range)."""
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers - 1}], got {layer!r}")
        return self.attention[layer]

    def scales_of(self, layer: int, batch: int) -> dict:
        """The quantised caches' scales a step of rows ``0 .. batch - 1`` of ``layer`` passes: fp8's
        per kv head, int8's per token (``{}`` otherwise)."""
        if self.int8:
            return self.storage.scales_view(layer, batch)
        return {} if self.scales is None else self.scales.of(layer)

    # ----------------------------------------------------------------- rows
    def attend_only(self, rows: Sequence[int], on: bool = True) -> None:
        """Make active ``rows`` attend-only (``on``) or stepping again. An attend-only row's steps
        attend to its cached tokens and write nothing (the new token is neither stored nor
        attended; q is rotated at the row's length), ``advance`` leaves its length, and that length
        may reach ``max_seq_len``: one shard of a context spread over several caches, whose new
        token another cache appends (``mmha.distributed``). Contiguous caches, one-token steps;
        ``admit``, ``release`` and ``prefill`` make rows stepping again."""
        if self.paged:
            raise ValueError("attend_only needs a contiguous cache (paged=False)")
        self.rows.set_attend(rows, on)

    def release(self, rows: Sequence[int]) -> None:
        """Free rows (their length drops to 0; their cache contents become unused; a paged cache
        takes back their blocks, except those another row shares)."""
        rows = self.rows.check(rows)
        self.storage.release(rows)
        self.rows.set_active(rows, False)
        self.rows.set_lengths(rows, [0] * len(rows))

    def admit(self, rows: Sequence[int] | None = None, count: int | None = None) -> list[int]:
        """Take free rows (given, or the first ``count`` free ones) for new sequences, length 0."""
        if rows is None:
            if count is None:
                raise ValueError("admit needs rows or count")
            free = self.free_rows
            if count > len(free):
                raise ValueError(f"count must be <= the {len(free)} free rows, got {count}")
            rows = free[:count]
        rows = self.rows.check(rows)
        busy = [r for r in rows if self.rows.is_active(r)]
        if busy:
            raise ValueError(f"rows must be free (released) to be admitted, got active rows {busy}")
        self.storage.assign(rows, [0] * len(rows), "admit")
        self.rows.set_lengths(rows, [0] * len(rows))
        self.rows.set_active(rows, True)
        return rows

    def reset(self) -> None:
        """All rows active with length 0."""
        every = list(range(self.max_batch))
        self.storage.release(every)
        self.storage.reserve(every, [0] * self.max_batch, "reset")
        self.rows.set_active(every, True)
        self.rows.set_lengths(every, [0] * self.max_batch)

    def fork(self, src_row: int, dst_rows: Sequence[int]) -> None:
        """Paged caches: free rows ``dst_rows`` become copies of active row ``src_row`` (its length
        and tokens, every layer), sharing its full blocks (reference counted, never written
        again while shared) and each taking a copy of the block that holds its next slot. All or
        nothing: a pool too small for the copies raises ``mmha.paging.PoolExhausted``."""
        if not self.paged:
            raise ValueError("fork needs a paged cache (KVCache(..., paged=True))")
        (src,) = self.rows.check([src_row], "src_row")
        dsts = self.rows.check(dst_rows, "dst_rows")
        if not self.rows.is_active(src):
            raise ValueError(f"src_row must be an active row, got free row {src}")
        if src in dsts:
            raise ValueError(f"dst_rows must not include src_row {src}")
        busy = [r for r in dsts if self.rows.is_active(r)]
        if busy:
            raise ValueError(f"dst_rows must be free (released) rows, got active rows {busy}")
        length = self.rows.host[src]
        self.storage.fork(src, dsts, min(length, self.max_seq_len - 1))
        self.rows.set_active(dsts, True)
        self.rows.set_lengths(dsts, [length] * len(dsts))

    def advance(self) -> None:
        """Every active row's length moves on by one (after the last layer's ``step``); attend-only
        rows keep theirs. Inside CUDA-graph capture only the device update is recorded; call
        ``account_replay()`` after each replay to move the host mirror."""
        if not capturing(self.device):
            self._account(1)
        self.rows.advance_device()

    def account_replay(self, steps: int = 1) -> None:
        """Move the host mirror after ``steps`` replays of a graph that captured ``advance()`` (a
        paged cache also gives rows the block of their next token before the next replay)."""
        self._account(steps)

    def _account(self, steps: int) -> None:
        self.rows.check_advance(steps)
        rows = self.active_rows
        self.storage.reserve(rows, self.rows.next_slot_lengths(rows, steps), "advance")
        self.rows.advance_host(steps)

    def sync_lengths(self) -> None:
        """Read the device lengths into the host mirror (one synchronisation): after replays of a
        graph that captured ``accept`` with tensor paths."""
        self.rows.sync()

    def check(self) -> None:
        """Raise ``mmha.ops.LengthError`` if a step since the last check met a row whose device
        length was outside ``[0, max_seq_len - 1]`` (lengths changed behind the cache's back, or a
        replayed graph ran past the capacity): such a row wrote nothing and its output was NaN;
        ``ScaleError``, ``TreeError`` or ``PageError`` for rows refused for their fp8 scales, tree
        or block table, or for an int8 / int4 cache's new token that was not finite (its scale is
        stored non-finite). The kernel raises a per-row flag instead of failing; this reads the
        flags (one device synchronisation, never inside a step) and clears them. The reference
        path (a CPU cache) keeps the same flags for quantised caches' non-finite tokens."""
        if not self.use_kernel:
            self.backend.check()
        if self.planner.workspace is not None:
            self.planner.workspace.check()

    # ----------------------------------------------------------------- prefill and fp8 scales
    def _prompt_lengths(self, k, v, lengths, rows) -> tuple[list[int], list[int]]:
        """prefill's checks of the prompt tensors, rows and lengths."""
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
        rows = self.rows.check(range(n) if rows is None else rows)
        if len(rows) != n:
            raise ValueError(f"rows must name {n} rows (one per prompt), got {len(rows)}")
        if lengths is None:
            lens = [s] * n
        else:
            lens = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
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
        return rows, lens

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
        """Write prompt K/V ``[n, S, Hkv, D]`` (rotated as the layer's rotary gives them) of ``n``
        rows; row ``i`` keeps its first ``lengths[i]``. Sets those rows' lengths (the same for every
        layer) and marks them active. Everything is checked before anything is written.

        fp8 caches: ``scales="auto"`` sets the layer's scales from this prompt (``amax * margin /
        448`` per kv head over the kept tokens, ``mmha.spec.fp8_scale``) if they were never set
        (by ``set_scales`` or an earlier prefill), and otherwise keeps them; ``"amax"`` always
        sets them from this prompt; ``"keep"`` never does. Scales are shared by every row of a
        layer, so setting them while another active row holds tokens of it is refused (those
        tokens were quantised with the old scales). Values past ``scale * 448`` saturate.
        """
        self.attention_of(layer)
        rows, lens = self._prompt_lengths(k, v, lengths, rows)
        if scales not in ("auto", "amax", "keep"):
            raise ValueError(f"scales must be 'auto', 'amax' or 'keep', got {scales!r}")
        margin = check_margin(scale_margin)
        calibrate = self.fp8 and (scales == "amax" or (scales == "auto" and not self.scales.was_set[layer]))
        if calibrate:
            self.check_scales_unused(layer, rows)
        # The rows' blocks (all or nothing; a no-op when an earlier layer assigned them).
        self.storage.assign(rows, [min(n, self.max_seq_len - 1) for n in lens], "prefill")
        kept = [i for i, n in enumerate(lens) if n]
        if calibrate and kept:
            k_amax = amax_of([k[i, : lens[i]] for i in kept])
            self.scales.calibrate(layer, k_amax, amax_of([v[i, : lens[i]] for i in kept]), margin)
        for i in kept:
            ki, vi = k[i : i + 1, : lens[i]], v[i : i + 1, : lens[i]]
            token_scales = None
            if self.fp8:
                ki, vi = self.scales.quantize(layer, ki, vi)
            elif self.int8:  # per token and kv head, as a step appends (mmha.quant)
                (ki, ks, _), (vi, vs, _) = quant.quantize(ki, 8), quant.quantize(vi, 8)
                token_scales = (ks, vs)
            self.storage.write_prompt(layer, rows[i], ki, vi, token_scales)
        self.rows.set_active(rows, True)
        self.rows.set_lengths(rows, lens)

    def check_scales_unused(self, layer: int, rows: Sequence[int]) -> None:
        """Refuse to change a layer's fp8 scales while rows other than ``rows`` hold its tokens."""
        others = [r for r in self.active_rows if self.rows.host[r] and r not in rows]
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
        self.attention_of(layer)
        if not self.fp8:
            raise ValueError(f"set_scales needs an fp8 cache (kv_dtype={FP8}), got kv_dtype={self.kv_dtype}")
        k_scale, v_scale = self.scales.checked(k_scale, v_scale)
        self.check_scales_unused(layer, [])
        self.scales.set(layer, k_scale, v_scale)

    # ----------------------------------------------------------------- decode
    def plan(
        self, batch: int, variant: str = "auto", window: int | None = None, epilogue: bool = False
    ) -> dispatch.Plan:
        """The dispatch decision for the next step over the first ``batch`` rows (host only); a
        sliding ``window`` bounds the keys a row reads; ``epilogue``: the step has an output epilogue."""
        keys = self.planner.keys(self.rows.longest(batch))
        return self.planner.plan(batch, keys, window, epilogue, variant=variant)

    def check_bias(self, qkv_bias: torch.Tensor | None) -> None:
        width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if qkv_bias is not None and (
            qkv_bias.shape != (width,) or qkv_bias.dtype != self.dtype or qkv_bias.device != self.device
        ):
            raise ValueError(
                f"qkv_bias must have shape [{width}], dtype {self.dtype} and device {self.device}, "
                f"got {tuple(qkv_bias.shape)} {qkv_bias.dtype} {qkv_bias.device}"
            )

    def _checked_step(self, qkv: torch.Tensor, qkv_bias, positions) -> int:
        """step's checks; returns the batch."""
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
        self.check_bias(qkv_bias)
        full = self.rows.full_rows(batch)
        if full:
            raise ValueError(
                f"rows {full} are full: length {self.max_seq_len} == max_seq_len leaves no slot "
                "for the new token; release them or use a larger cache"
            )
        if positions is not None:
            if self.paged:
                raise ValueError("positions needs a contiguous cache (paged=False)")
            if (positions.shape, positions.dtype, positions.device) != ((batch,), torch.int32, self.device):
                raise ValueError(
                    f"positions must be an int32 tensor [{batch}] on {self.device}, got "
                    f"{tuple(positions.shape)} {positions.dtype} {positions.device}"
                )
        return batch

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
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One decode step of ``layer`` for rows ``0..B-1``: append the new K/V, attend, as the
        layer's ``AttentionSpec`` says (rotary, scale, score modifiers, output epilogue).

        ``qkv [B, (Hq + 2 Hkv) D]`` with ``B <= max_batch``. Lengths are not changed: call
        ``advance()`` after the last layer. Returns ``out [B, Hq * D]`` (the epilogue's dtype where
        it quantises) and, with ``return_lse``, fp32 ``lse [B, Hq]``. ``variant``, ``num_splits``,
        ``stages`` and ``tile_source`` override the plan (``mmha.ops.decode_attention``).
        ``positions`` (int32 ``[B]`` on the cache's device): rotary positions of the rows' tokens
        instead of their lengths (a cache holding one shard of a longer context).
        """
        attention = self.attention_of(layer)
        batch = self._checked_step(qkv, qkv_bias, positions)
        k, v = self.storage.view(layer, batch)
        call = StepCall(
            qkv, k, v, self.rows.lengths[:batch], attention, qkv_bias, return_lse,
            self.scales_of(layer, batch), self.rows.modes_for(batch, always=self.paged), positions,
            self.storage.tables(batch),
        )  # fmt: skip
        if self.paged and not self.use_kernel:
            call.active_rows = [r for r in range(batch) if self.rows.is_active(r)]
        if self.backend.needs_plan:
            if num_splits is None or stages is None:
                plan = self.planner.for_layer(
                    batch, self.planner.keys(self.rows.longest(batch)), attention, variant
                )
                num_splits = plan.num_splits if num_splits is None else num_splits
                stages = plan.stages if stages is None else stages
            call.num_splits, call.stages, call.tile_source = num_splits, stages, tile_source
            call.workspace = self.planner.reserve(num_splits)
        return self.backend.step(call)

    def reserve_workspace(self, batch_sizes: Sequence[int], windows: Sequence[int | None] = ()):
        """Size the kernel's workspace for the plans of steps over each of ``batch_sizes`` rows
        (every layer's spec, and each extra sliding window of ``windows``) now, and return it
        (``check()`` reads its flags). CUDA graphs captured for several batch sizes need this
        before the first capture: a workspace that grew later would leave the earlier graphs
        writing to freed memory."""
        extra = [AttentionSpec(window=w) for w in windows if w is not None]
        return self.planner.reserve_for(batch_sizes, [*self.attention, *extra])

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
        must be there already: ``reserve_slots``); free rows take no part (zero output). The
        layer's spec may hold rotary, a scale and an epilogue, no score modifiers. An int8 cache's
        nodes are quantised per token and kv head as one-token steps' new tokens are."""
        return self.trees.step_tree(
            layer, qkv, parents, node_counts, qkv_bias, return_lse, num_splits, stages, tile_source
        )

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
        self.trees.accept(rows, paths)

    def reserve_slots(self, count: int) -> None:
        """Paged caches: every active row gets the blocks of its slots ``length .. length + count
        - 1`` (all or nothing). ``step_tree`` and ``accept`` do this themselves outside CUDA-graph
        capture; a captured tree step of ``count`` nodes (and a captured ``accept``) reads the
        tables as they are, so call this before each replay (after ``sync_lengths()``)."""
        self.trees.reserve_slots(count)
