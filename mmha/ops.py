"""Typed wrappers around ``torch.ops.mmha.*`` and their fake (meta) registrations.

The operators write into caller-allocated tensors; these wrappers allocate them, plan the launch
(``mmha.dispatch.choose_variant`` with this GPU's numbers) and provide the workspace.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import dispatch, reference
from ._ext import _C, IMPORT_ERROR
from .epilogue import OutEpilogue, check_epilogue

if _C is not None:

    @torch.library.register_fake("mmha::decode_attention")
    def _decode_attention_fake(
        qkv, k_cache, v_cache, lengths, qkv_bias, out, lse, partials, counters, status, num_heads,
        num_kv_heads, scale, rotary_dim, rotary_theta, rotary_interleaved, num_splits,
        check_lengths=True, stages=2, tile_source=0, k_scale=None, v_scale=None, window=0, softcap=0.0,
        alibi_slopes=None, sinks=None, parents=None, node_counts=None, block_tables=None, row_active=None,
        out_shift=None, out_smooth=None, out_scales=None, out_scale=0.0, out_round=0, out_min=-127,
        positions=None,
    ):  # fmt: skip
        return None


# tile_source argument of the raw operator.
TILE_SOURCES = {"auto": 0, "cp_async": 1, "tma": 2}


@functools.cache
def device_spec(device_index: int) -> dispatch.Device:
    """The dispatcher's view of a GPU (asked once per device)."""
    return dispatch.Device.of(torch.cuda.get_device_properties(device_index))


def _device_index(device) -> int:
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def plan_for(
    device, batch: int, num_heads: int, num_kv_heads: int, head_dim: int, seq_len: int,
    dtype: torch.dtype, variant: str = "auto", kv_dtype: torch.dtype | None = None, tree: bool = False,
    epilogue: bool = False,
) -> dispatch.Plan:  # fmt: skip
    """``dispatch.choose_variant`` with this device's numbers."""
    return dispatch.choose_variant(
        batch, num_heads, num_kv_heads, head_dim, seq_len, dtype, device_spec(_device_index(device)), variant,
        kv_dtype, tree, epilogue,
    )  # fmt: skip


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
    the kernel ran: the step wrote nothing to the caches and returned NaN for every row."""


class PageError(StepError):
    """A paged cache's block table named a block outside the pool for a slot a row needed when
    the kernel ran: the row wrote nothing to the caches and returned NaN."""


# Bits of Workspace.status (kStatus* in csrc/kernels/mmha_params.h).
STATUS_LENGTH = 1
STATUS_SCALE = 2
STATUS_TREE = 4
STATUS_PAGES = 8


def tree_counters(batch: int, num_heads: int, nodes: int) -> int:
    """int32 counters a tree step of ``nodes`` nodes per row needs (csrc/mmha_ops.cpp's
    tree_workspace; more than a one-token step's ``B * Hq + 2``): merge counters and the work
    counter, then the trees' masks, depths and row counts."""
    anc = (batch * nodes * num_heads + 3) // 2 * 2
    return anc + 3 * batch * nodes + batch


@dataclass
class Workspace:
    """Scratch of the operator: fp32 split partials, int32 counters (``[B * Hq]`` merge arrivals and
    the tile loop's work counter ``[2]``; zero between launches) and the int32 per-row status flags
    the kernel raises for out-of-range lengths.

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
            batch * nodes * num_heads * num_splits * (head_dim + 2) if num_splits > 1 else 0,
            dtype=torch.float32,
            device=device,
        )
        counters = torch.zeros(tree_counters(batch, num_heads, nodes), dtype=torch.int32, device=device)
        status = torch.zeros(batch, dtype=torch.int32, device=device)
        return cls(partials, counters, status, num_splits, nodes)

    def fits(self, batch: int, num_heads: int, head_dim: int, num_splits: int, nodes: int = 1) -> bool:
        need = batch * nodes * num_heads * num_splits * (head_dim + 2) if num_splits > 1 else 0
        return (
            self.partials.numel() >= need
            and self.counters.numel() >= tree_counters(batch, num_heads, nodes)
            and self.status.numel() >= batch
        )

    def check(self) -> None:
        """Raise ``LengthError`` naming the rows whose length was out of range in a launch since
        the last check (or ``ScaleError`` for rows refused for an fp8 scale that was not finite
        and positive), and clear the flags. One device synchronisation."""
        status = self.status.tolist()
        if any(status):
            self.status.zero_()
            lengths = [r for r, v in enumerate(status) if v & STATUS_LENGTH]
            scales = [r for r, v in enumerate(status) if v & STATUS_SCALE]
            trees = [r for r, v in enumerate(status) if v & STATUS_TREE]
            pages = [r for r, v in enumerate(status) if v & STATUS_PAGES]
            if lengths:
                raise LengthError(
                    f"lengths of rows {lengths} were outside [0, S_max - 1] (a tree step: [0, S_max - "
                    "node count]) when the kernel ran: nothing was written to their cache slots and their "
                    "output is NaN"
                )
            if trees:
                raise TreeError(
                    f"parents or node_counts of rows {trees} broke mmha.tree's rules when the kernel ran: "
                    "nothing was written to their cache slots and their output is NaN"
                )
            if pages:
                raise PageError(
                    f"block tables of rows {pages} named a block outside the page pool when the kernel ran: "
                    "nothing was written to their cache slots and their output is NaN"
                )
            raise ScaleError(
                f"k_scale / v_scale held a value that is not finite and positive when the kernel ran: "
                f"rows {scales} wrote nothing to the caches and their output is NaN"
            )


def _require_extension() -> None:
    if _C is None:
        raise RuntimeError(
            "mmha's CUDA extension is not built or failed to import "
            f"({IMPORT_ERROR}); run `python -m mmha info` for details"
        )


def decode_attention(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    qkv_bias: torch.Tensor | None = None,
    scale: float | None = None,
    rotary_dim: int = 0,
    rotary_theta: float = 10000.0,
    rotary_interleaved: bool = False,
    variant: str = "auto",
    num_splits: int | None = None,
    stages: int | None = None,
    tile_source: str = "auto",
    max_len: int | None = None,
    return_lse: bool = False,
    workspace: Workspace | None = None,
    validate_lengths: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    row_active: torch.Tensor | None = None,
    epilogue: OutEpilogue | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused append + attention for one decode step on the GPU.

    Parameters
    ----------
    qkv : ``[B, (Hq + 2 * Hkv) * D]``; rows may be strided (a view into a larger buffer).
    k_cache : ``[B, Hkv, D / x, S_max, x]``, new k written at slot ``lengths[b]``; qkv's dtype,
        or ``torch.float8_e4m3fn`` (x = 16) under fp16 / bf16 qkv.
    v_cache : ``[B, Hkv, S_max, D]``, new v written at slot ``lengths[b]``.
    block_tables : a paged cache (``mmha.paging``): int32 ``[B, max_blocks]`` on the GPU, row
        ``b``'s slot ``t`` in block ``block_tables[b, t // bs]`` of the pools ``k_cache [num_blocks,
        Hkv, D/x, bs, x]`` and ``v_cache [num_blocks, Hkv, bs, D]`` (bs 16, 32, 64 or 128; S_max =
        max_blocks * bs); tiles by either source. With ``validate_lengths`` the tables are read and
        checked on the host (``mmha.reference.check_block_tables``); without, a row whose table
        names a block outside the pool for a slot it needs writes nothing, gets NaN output and
        raises its status flag (``workspace.check()``: ``PageError``).
    row_active : int32 ``[B]`` row modes on the GPU (``mmha.reference.ROW_*``): 0 (idle) takes no
        part (nothing read or written, zero output, lse -inf), e.g. released rows of a paged cache,
        which own no blocks; 1 steps (the default); 2 attends to slots ``0 .. lengths[b] - 1``
        only, with q rotated at ``lengths[b]`` (nothing written; ``lengths[b]`` may equal S_max;
        with no slot in reach the row is idle): one shard of a context spread over caches.
        Checked on the host with ``validate_lengths``.
    positions : int32 ``[B]`` on the GPU: q and the new k are rotated at ``positions[b]`` instead of
        ``lengths[b]`` (a cache that holds one shard of a longer context); window and ALiBi still
        count slots from ``lengths[b]``.
    k_scale, v_scale : fp8 caches only, fp32 ``[Hkv]`` on the GPU: the cache stores
        ``saturate(k / k_scale[h])`` rounded to e4m3 (``mmha.reference.quantize_fp8``); scores
        use ``K * k_scale``, the output ``V * v_scale``. Values are checked by the kernel: a scale
        that is not finite and positive refuses the step (nothing written, NaN output, and
        ``workspace.check()`` raises ``ScaleError``).
    window, softcap, alibi_slopes, sinks : score modifiers (``mmha.reference.ScoreMods``): a row
        attends to its last ``window`` slots (its own included; bytes before are not read),
        scores become ``softcap * tanh(score / softcap)``, then get ``alibi_slopes[h] * (slot -
        pos)`` added (fp32 ``[Hq]``), and ``sinks`` (fp32 ``[Hq]``) join each head's softmax sum
        with no value. The tensors' values are checked on the host with ``validate_lengths``.
    lengths : ``[B]`` int32 on the GPU: tokens already cached; not modified.
    variant : ``"auto"``, ``"single_pass"`` or ``"split"``; ``num_splits`` overrides the count.
    stages : shared-memory stages of the tile loop (fp16 / bf16); by default the plan's.
    tile_source : ``"auto"`` (bulk tensor copies on sm_90 where the head dim is a multiple of
        64, else cp.async), ``"cp_async"`` or ``"tma"``.
    max_len : longest ``lengths[b] + 1`` the caller knows of (for dispatch); default capacity.
    workspace : reused scratch (``Workspace.allocate``); its ``status`` flags record rows whose
        length was out of range (``workspace.check()`` raises for them).
    validate_lengths : the operator reads ``lengths`` on the host and rejects values outside
        ``[0, S_max - 1]``, and the score modifiers' tensors for values that are not finite (one
        sync; skipped inside CUDA-graph capture); callers that track lengths themselves
        (``KVCache``) pass ``False`` and rely on the status flags.

    epilogue : the output epilogue (``mmha.epilogue.OutEpilogue``): shift and smooth per output
        channel and, with a scale, the output quantised to int8 or e4m3 in the same kernel (a
        split's merge applies it once, after the rescale).

    Returns
    -------
    out ``[B, Hq * D]`` in the input dtype (the epilogue's dtype where it quantises), and with
    ``return_lse`` the fp32 ``lse [B, Hq]``.
    """
    _require_extension()
    check = validate_lengths and not torch.cuda.is_current_stream_capturing()
    mods = reference.ScoreMods(
        num_heads, qkv.device, window, softcap, alibi_slopes, sinks, check_values=check
    )
    if tile_source not in TILE_SOURCES:
        raise ValueError(f"tile_source must be one of {tuple(TILE_SOURCES)}, got {tile_source!r}")
    if k_cache.dtype == dispatch.FP8 and qkv.dtype not in dispatch.FP8_ACTIVATION_DTYPES:
        raise ValueError(
            f"qkv must have dtype float16 or bfloat16 with a float8_e4m3fn cache, got {qkv.dtype}"
        )
    batch, head_dim, max_seq_len = v_cache.shape[0], v_cache.shape[-1], v_cache.shape[-2]
    if block_tables is not None:
        if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2:
            got = tuple(block_tables.shape) if isinstance(block_tables, torch.Tensor) else type(block_tables)
            raise ValueError(f"block_tables must be an int32 tensor [B, max_blocks], got {got}")
        batch, max_seq_len = block_tables.shape[0], block_tables.shape[1] * v_cache.shape[-2]
        if check and qkv.shape[0] == batch and lengths.shape == (batch,):
            modes = reference.check_row_modes(row_active, batch)
            host = lengths.tolist()
            # Blocks of the slots a row reads and writes: through lengths[b], or before it (attend only).
            need = {r: host[r] - (modes[r] == reference.ROW_ATTEND) for r in range(batch) if modes[r]}
            rows = [r for r, n in need.items() if n >= 0]
            if rows:
                reference.check_block_tables(
                    block_tables[rows], [need[r] for r in rows], v_cache.shape[0], v_cache.shape[-2]
                )
    if num_splits is None or stages is None:
        plan = plan_for(
            qkv.device, batch, num_heads, num_kv_heads, head_dim,
            dispatch.keys_read(max_seq_len if max_len is None else max_len, window), qkv.dtype, variant,
            k_cache.dtype, epilogue=epilogue is not None,
        )  # fmt: skip
        num_splits = plan.num_splits if num_splits is None else num_splits
        stages = plan.stages if stages is None else stages
    if workspace is None or not workspace.fits(batch, num_heads, head_dim, num_splits):
        workspace = Workspace.allocate(qkv.device, batch, num_heads, head_dim, num_splits)
    out_args = _epilogue_args(epilogue, num_heads, head_dim, qkv)
    out_dtype = qkv.dtype if epilogue is None else epilogue.out_dtype(qkv.dtype)
    out = torch.empty((batch, num_heads * head_dim), dtype=out_dtype, device=qkv.device)
    lse = torch.empty((batch, num_heads), dtype=torch.float32, device=qkv.device)
    torch.ops.mmha.decode_attention(
        qkv, k_cache, v_cache, lengths, qkv_bias, out, lse, workspace.partials,
        workspace.counters, workspace.status, num_heads, num_kv_heads,
        1.0 / math.sqrt(head_dim) if scale is None else scale,
        rotary_dim, rotary_theta, rotary_interleaved, num_splits, check, stages,
        TILE_SOURCES[tile_source], k_scale, v_scale, **mods.kernel_args(), block_tables=block_tables,
        row_active=row_active, **out_args, positions=positions,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def decode_tree(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    parents: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    node_counts: torch.Tensor | None = None,
    qkv_bias: torch.Tensor | None = None,
    scale: float | None = None,
    rotary_dim: int = 0,
    rotary_theta: float = 10000.0,
    rotary_interleaved: bool = False,
    variant: str = "auto",
    num_splits: int | None = None,
    stages: int | None = None,
    tile_source: str = "auto",
    max_len: int | None = None,
    return_lse: bool = False,
    workspace: Workspace | None = None,
    validate: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    row_active: torch.Tensor | None = None,
    epilogue: OutEpilogue | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A tree-masked multi-token step on the GPU (``mmha.tree``; ``mmha.reference.decode_tree``
    defines it): ``qkv [B, T, (Hq + 2 Hkv) D]`` for the T <= 64 nodes of ``parents`` (int32 ``[B,
    T]`` on the GPU); node ``t`` is appended at slot ``lengths[b] + t`` (rotary at ``lengths[b] +
    depth(t)``) and attends to the cached slots and its root path. ``node_counts`` (int32 ``[B]``
    on the GPU) for rows that use fewer nodes; their other nodes' output is zero. Two launches: the
    trees' check and append, then the attention, whose K/V tiles serve every node an item holds.

    ``validate`` reads ``parents``, ``node_counts`` and ``lengths`` on the host and raises
    ``ValueError`` naming the entry (one synchronisation; skipped inside CUDA-graph capture).
    Without it a row that breaks the rules writes nothing, gets NaN output and raises its status
    flag (``workspace.check()``: ``TreeError`` or ``LengthError``). A paged cache
    (``block_tables``) must hold the blocks of slots ``0 .. lengths[b] + count - 1`` (checked on
    the host with ``validate``; without, a row whose table names a block outside the pool writes
    nothing, gets NaN output and raises ``PageError``). Other arguments as in
    ``decode_attention``; ``max_len`` is the longest ``lengths[b] + T`` the caller knows of.
    ``epilogue`` applies to every node's output (``mmha.epilogue``). Returns ``out [B, T, Hq * D]``
    (and fp32 ``lse [B, T, Hq]``)."""
    from . import tree

    _require_extension()
    check = validate and not torch.cuda.is_current_stream_capturing()
    if tile_source not in TILE_SOURCES:
        raise ValueError(f"tile_source must be one of {tuple(TILE_SOURCES)}, got {tile_source!r}")
    if not isinstance(parents, torch.Tensor) or parents.device != qkv.device or parents.dtype != torch.int32:
        got = type(parents).__name__
        if isinstance(parents, torch.Tensor):
            got = f"{parents.dtype} on {parents.device}"
        raise ValueError(f"parents must be an int32 tensor on {qkv.device}, got {got}")
    if node_counts is not None and (
        not isinstance(node_counts, torch.Tensor)
        or node_counts.device != qkv.device
        or node_counts.dtype != torch.int32
    ):
        raise ValueError(f"node_counts must be None or an int32 tensor on {qkv.device}")
    batch, head_dim, max_seq_len = v_cache.shape[0], v_cache.shape[-1], v_cache.shape[-2]
    if block_tables is not None:
        if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2:
            got = tuple(block_tables.shape) if isinstance(block_tables, torch.Tensor) else type(block_tables)
            raise ValueError(f"block_tables must be an int32 tensor [B, max_blocks], got {got}")
        batch, max_seq_len = block_tables.shape[0], block_tables.shape[1] * v_cache.shape[-2]
    active = None
    if check and row_active is not None and row_active.shape == (batch,):
        active = [bool(a) for a in reference.check_row_modes(row_active, batch, tree=True)]
    if check:
        counts = None if node_counts is None else node_counts.tolist()
        trees = tree.check_parents(parents, batch, counts)
        if block_tables is not None and lengths.shape == (batch,):
            host = lengths.tolist()
            rows = [r for r in range(batch) if active is None or active[r]]
            if rows:
                reference.check_block_tables(
                    block_tables[rows], [host[r] + len(trees[r]) - 1 for r in rows], v_cache.shape[0],
                    v_cache.shape[-2],
                )  # fmt: skip
    if parents.dim() != 2 or not 1 <= parents.shape[1] <= tree.MAX_NODES:
        raise ValueError(
            f"parents must have shape [{batch}, T <= {tree.MAX_NODES}], got {tuple(parents.shape)}"
        )
    nodes = parents.shape[1]
    if num_splits is None or stages is None:
        # An item's columns are (node, head) pairs: plan as for nodes * Hq heads over the same keys.
        keys = max_seq_len if max_len is None else min(max_len, max_seq_len)
        plan = plan_for(
            qkv.device, batch, num_heads * nodes, num_kv_heads, head_dim, keys, qkv.dtype,
            variant, k_cache.dtype, tree=nodes > 1, epilogue=epilogue is not None,
        )  # fmt: skip
        num_splits = plan.num_splits if num_splits is None else num_splits
        stages = plan.stages if stages is None else stages
    if workspace is None or not workspace.fits(batch, num_heads, head_dim, num_splits, nodes):
        workspace = Workspace.allocate(qkv.device, batch, num_heads, head_dim, num_splits, nodes)
    out_args = _epilogue_args(epilogue, num_heads, head_dim, qkv)
    out_dtype = qkv.dtype if epilogue is None else epilogue.out_dtype(qkv.dtype)
    out = torch.empty((batch, nodes, num_heads * head_dim), dtype=out_dtype, device=qkv.device)
    lse = torch.empty((batch, nodes, num_heads), dtype=torch.float32, device=qkv.device)
    torch.ops.mmha.decode_attention(
        qkv, k_cache, v_cache, lengths, qkv_bias, out, lse, workspace.partials,
        workspace.counters, workspace.status, num_heads, num_kv_heads,
        1.0 / math.sqrt(head_dim) if scale is None else scale,
        rotary_dim, rotary_theta, rotary_interleaved, num_splits, check, stages,
        TILE_SOURCES[tile_source], k_scale, v_scale, 0, 0.0, None, None, parents, node_counts,
        block_tables=block_tables, row_active=row_active, **out_args,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def _epilogue_args(epilogue: OutEpilogue | None, num_heads: int, head_dim: int, qkv: torch.Tensor) -> dict:
    """The raw operator's epilogue arguments, after checking the epilogue fits the step."""
    check_epilogue(epilogue, num_heads, head_dim, qkv.device)
    return {} if epilogue is None else epilogue.kernel_args()
