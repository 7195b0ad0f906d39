"""Typed wrappers around ``torch.ops.mmha.*`` and their fake (meta) registrations.

The operators write into caller-allocated tensors; these wrappers allocate them, plan the launch
(``mmha.dispatch.choose_variant`` with this GPU's numbers) and provide the workspace. A layer's
attention (rotary, scale, score modifiers, output epilogue) is one ``mmha.AttentionSpec``.

Arguments common to ``decode_attention`` and ``decode_tree``:

- ``k_cache [B, Hkv, D / x, S_max, x]`` and ``v_cache [B, Hkv, S_max, D]`` in qkv's dtype, or
  ``torch.float8_e4m3fn`` (x = 16) under fp16 / bf16 qkv with ``k_scale`` / ``v_scale`` (fp32
  ``[Hkv]`` on the GPU; a scale that is not finite and positive refuses the step on the device:
  nothing written, NaN output, ``workspace.check()`` raises ``ScaleError``), or ``torch.int8``
  (x = 16) under fp16 / bf16 qkv with ``k_scale`` / ``v_scale`` fp32 ``[B, Hkv, S_max]`` (paged
  ``[num_blocks, Hkv, bs]``): a scale per token and kv head, the new token's written with its
  codes (``mmha.quant.quantize``; a non-finite one flags the row: ``ScaleError``); one-token
  steps only;
- ``block_tables``: a paged cache (``mmha.paging``): int32 ``[B, max_blocks]``, row ``b``'s slot
  ``t`` in block ``block_tables[b, t // bs]`` of the pools ``k_cache [num_blocks, Hkv, D/x, bs,
  x]`` and ``v_cache [num_blocks, Hkv, bs, D]`` (bs 16, 32, 64 or 128; S_max = max_blocks * bs).
  Checked on the host when validating; otherwise a row whose table names a block outside the
  pool writes nothing, gets NaN output and raises ``PageError`` at ``workspace.check()``;
- ``row_active``: int32 ``[B]`` row modes (``mmha.spec.ROW_*``): idle rows take no part (zero
  output, lse -inf), stepping rows append and attend, attend-only rows read the slots before
  ``lengths[b]`` only;
- ``variant`` (``"auto"``, ``"single_pass"``, ``"split"``), ``num_splits``, ``stages``: override the
  plan; ``tile_source``: ``"auto"`` (bulk tensor copies on sm_90 where the head dim allows, else
  cp.async), ``"cp_async"`` or ``"tma"``; ``max_len``: the longest row the caller knows of (for
  dispatch; default the capacity);
- ``workspace``: reused scratch (``Workspace.allocate``), whose status flags record rows the
  device-side guard refused (``workspace.check()`` raises for them).
"""

from __future__ import annotations

import functools

import torch

from . import checks, dispatch
from ._constants import (  # noqa: F401  (STATUS_*: the bits of Workspace.status)
    STATUS_LENGTH,
    STATUS_PAGES,
    STATUS_SCALE,
    STATUS_TREE,
    TILE_SOURCE_AUTO,
    TILE_SOURCE_CP_ASYNC,
    TILE_SOURCE_TMA,
)
from ._ext import _C, IMPORT_ERROR
from .spec import PLAIN, ROW_ATTEND, AttentionSpec
from .workspace import (  # noqa: F401  (part of this module's API)
    LengthError,
    PageError,
    ScaleError,
    StepError,
    TreeError,
    Workspace,
    tree_counters,
)

if _C is not None:

    @torch.library.register_fake("mmha::decode_attention")
    def _decode_attention_fake(
        qkv, k_cache, v_cache, lengths, qkv_bias, out, lse, partials, counters, status, num_heads,
        num_kv_heads, scale, rotary_dim, rotary_theta, rotary_interleaved, num_splits,
        check_lengths=True, stages=2, tile_source=0, k_scale=None, v_scale=None, window=0, softcap=0.0,
        alibi_slopes=None, sinks=None, parents=None, node_counts=None, block_tables=None, row_active=None,
        out_shift=None, out_smooth=None, out_scales=None, out_scale=0.0, out_round=0, out_min=-127,
        positions=None, rotary_inv_freq=None, rotary_factor=1.0, rotary_table_start=0, q_norm_weight=None,
        k_norm_weight=None, qk_norm_eps=0.0, qk_norm_cast_first=True, k_zero=None, v_zero=None,
        k_residual=None, wide_pairs=False,
    ):  # fmt: skip
        return None


# tile_source argument of the raw operator.
TILE_SOURCES = {"auto": TILE_SOURCE_AUTO, "cp_async": TILE_SOURCE_CP_ASYNC, "tma": TILE_SOURCE_TMA}


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
    epilogue: bool = False, nodes: int = 0,
) -> dispatch.Plan:  # fmt: skip
    """``dispatch.choose_variant`` with this device's numbers."""
    return dispatch.choose_variant(
        batch, num_heads, num_kv_heads, head_dim, seq_len, dtype, device_spec(_device_index(device)), variant,
        kv_dtype, tree, epilogue, nodes,
    )  # fmt: skip


def _require_extension() -> None:
    if _C is None:
        raise RuntimeError(
            "mmha's CUDA extension is not built or failed to import "
            f"({IMPORT_ERROR}); run `python -m mmha info` for details"
        )


def rms_norm(x, out, weights, layout, eps, offset: float = 0.0, cast_first: bool = True) -> torch.Tensor:
    """RMSNorm of segments of each row of ``x [rows, width]`` into ``out`` (``x`` itself for in
    place) in one launch; returns ``out``. Segment ``s`` is ``layout[3s : 3s + 3]`` = (col_offset,
    heads, cols) with ``weights[s]`` (``[cols]`` or ``[heads, cols]``) and ``eps[s]``: each of its
    heads normalises its ``cols`` values as ``mmha.reference.rms_norm`` does (``offset`` added to
    the weight: Gemma's 1; ``cast_first``: Llama's rounding). Columns outside every segment are
    not written. CUDA tensors only."""
    _require_extension()
    layout, eps = [int(v) for v in layout], [float(e) for e in eps]
    torch.ops.mmha.rms_norm(x, out, list(weights), layout, eps, float(offset), bool(cast_first))
    return out


def _extent(v_cache: torch.Tensor, block_tables) -> tuple[int, int]:
    """``(batch, S_max)`` of a contiguous cache, or of a paged one through its block tables."""
    if block_tables is None:
        return v_cache.shape[0], v_cache.shape[-2]
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2:
        got = tuple(block_tables.shape) if isinstance(block_tables, torch.Tensor) else type(block_tables)
        raise ValueError(f"block_tables must be an int32 tensor [B, max_blocks], got {got}")
    return block_tables.shape[0], block_tables.shape[1] * v_cache.shape[-2]


def _launch(
    qkv, k_cache, v_cache, lengths, num_heads, num_kv_heads, attention, shape, plan, check, kw
) -> tuple:
    """Allocate ``out`` and ``lse`` of ``shape`` (rows, heads), fit the workspace and run the raw
    operator; ``kw``: its remaining arguments."""
    batch, nodes = shape
    num_splits, stages, tile_source, workspace = plan
    head_dim = kw.pop("head_dim", v_cache.shape[-1])
    if tile_source not in TILE_SOURCES:
        raise ValueError(f"tile_source must be one of {tuple(TILE_SOURCES)}, got {tile_source!r}")
    if workspace is None or not workspace.fits(batch, num_heads, head_dim, num_splits, nodes):
        workspace = Workspace.allocate(qkv.device, batch, num_heads, head_dim, num_splits, nodes)
    epilogue = attention.epilogue
    out_dtype = qkv.dtype if epilogue is None else epilogue.out_dtype(qkv.dtype)
    rows = (batch,) if nodes == 1 and qkv.dim() == 2 else (batch, nodes)
    out = torch.empty((*rows, num_heads * head_dim), dtype=out_dtype, device=qkv.device)
    lse = torch.empty((*rows, num_heads), dtype=torch.float32, device=qkv.device)
    torch.ops.mmha.decode_attention(
        qkv, k_cache, v_cache, lengths, kw.pop("qkv_bias"), out, lse, workspace.partials, workspace.counters,
        workspace.status, num_heads, num_kv_heads, num_splits=num_splits, check_lengths=check, stages=stages,
        tile_source=TILE_SOURCES[tile_source], **attention.kernel_args(head_dim, qkv.device), **kw,
    )  # fmt: skip
    return out, lse


def decode_attention(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    attention: AttentionSpec = PLAIN,
    qkv_bias: torch.Tensor | None = None,
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
    block_tables: torch.Tensor | None = None,
    row_active: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused append + attention for one decode step on the GPU (``mmha.reference.decode_step``
    defines it; the module docstring describes the common arguments).

    ``qkv [B, (Hq + 2 * Hkv) * D]`` (rows may be strided); the new k and v go to slot
    ``lengths[b]`` (int32 ``[B]`` on the GPU, read, not changed); ``attention``: the layer's spec;
    ``positions`` (int32 ``[B]``): rotary positions instead of ``lengths`` (a cache holding one
    shard of a longer context; the window and ALiBi still count slots from ``lengths``).
    ``validate_lengths``: read ``lengths`` (and block tables, row modes) on the host and reject
    rows outside the cache (one synchronisation; skipped inside CUDA-graph capture); callers that
    track lengths themselves (``KVCache``) pass ``False`` and rely on the status flags.

    Returns ``out [B, Hq * D]`` in qkv's dtype (the epilogue's dtype where it quantises) and, with
    ``return_lse``, fp32 ``lse [B, Hq]``.
    """
    _require_extension()
    check = validate_lengths and not torch.cuda.is_current_stream_capturing()
    head_dim = v_cache.shape[-1]
    checks.attention_spec(attention, num_heads, head_dim, qkv.device)
    if k_cache.dtype in (dispatch.FP8, torch.int8) and qkv.dtype not in dispatch.FP8_ACTIVATION_DTYPES:
        raise ValueError(
            f"qkv must have dtype float16 or bfloat16 with a {k_cache.dtype} cache, got {qkv.dtype}"
        )
    batch, max_seq_len = _extent(v_cache, block_tables)
    if check:
        _check_pages(qkv, lengths, block_tables, row_active, v_cache, batch)
    shape = (batch, num_heads, num_kv_heads, head_dim, max_seq_len if max_len is None else max_len)
    num_splits, stages = _one_token_plan(qkv, shape, attention, variant, k_cache.dtype, num_splits, stages)
    kw = dict(qkv_bias=qkv_bias, k_scale=k_scale, v_scale=v_scale, block_tables=block_tables,
              row_active=row_active, positions=positions)  # fmt: skip
    out, lse = _launch(
        qkv, k_cache, v_cache, lengths, num_heads, num_kv_heads, attention, (batch, 1),
        (num_splits, stages, tile_source, workspace), check, kw,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def _one_token_plan(qkv, shape, attention, variant, kv_dtype, num_splits, stages) -> tuple[int, int]:
    """A one-token step's ``(num_splits, stages)``: those given, the rest from the dispatcher's plan
    for ``shape = (batch, Hq, Hkv, D, longest row)``."""
    if num_splits is None or stages is None:
        batch, num_heads, num_kv_heads, head_dim, keys = shape
        plan = plan_for(
            qkv.device, batch, num_heads, num_kv_heads, head_dim, dispatch.keys_read(keys, attention.window),
            qkv.dtype, variant, kv_dtype, epilogue=attention.epilogue is not None,
        )  # fmt: skip
        num_splits = plan.num_splits if num_splits is None else num_splits
        stages = plan.stages if stages is None else stages
    return num_splits, stages


def _check_pages(qkv, lengths, block_tables, row_active, v_cache, batch) -> None:
    """A paged step's block tables on the host (validating): the blocks of the slots each row
    reads and writes, through lengths[b] or before it (attend only), inside the pool."""
    if block_tables is None or qkv.shape[0] != batch or lengths.shape != (batch,):
        return
    modes, host = checks.row_modes(row_active, batch), lengths.tolist()
    need = {r: host[r] - (modes[r] == ROW_ATTEND) for r in range(batch) if modes[r]}
    rows = [r for r, n in need.items() if n >= 0]
    if rows:
        checks.block_tables(block_tables[rows], [need[r] for r in rows], v_cache.shape[0], v_cache.shape[-2])


def decode_attention_int4(
    qkv: torch.Tensor,
    cache,
    lengths: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    attention: AttentionSpec = PLAIN,
    qkv_bias: torch.Tensor | None = None,
    variant: str = "auto",
    num_splits: int | None = None,
    stages: int | None = None,
    max_len: int | None = None,
    return_lse: bool = False,
    workspace: Workspace | None = None,
    validate_lengths: bool = True,
    row_active: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    tile_source: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``decode_attention`` over an int4 cache on the GPU (``cache``: an ``mmha.int4.Int4Cache`` of
    contiguous rows, or with ``block_tables`` an ``mmha.int4_pages.Int4Pages`` pool of 64- or
    128-slot blocks, whose residual rows 0 .. B - 1 the step's rows use; on qkv's device, fp16 /
    bf16 activations; ``mmha.int4.decode_step`` / ``int4_pages.decode_step_paged`` define the
    step): the new token's V quantised per token at slot ``lengths[b]``, its K into the residual,
    and the group it completes (slot ``lengths[b] % 64 == 63``) quantised per channel and
    committed, in the same launch. One-token steps without an output epilogue. ``tile_source``:
    ``"auto"`` (tiles by bulk tensor copies through the int4 maps on sm_90, else by 16-byte
    cp.async) or ``"cp_async"``; ``"tma"`` (the 16-bit caches' source) is refused. A new K or V
    value that is not finite, or past fp16's range, flags its row (``ScaleError`` at
    ``workspace.check()``); a paged row whose table names a block outside the pool writes nothing
    (``PageError``). Other arguments as ``decode_attention``'s."""
    _require_extension()
    check = validate_lengths and not torch.cuda.is_current_stream_capturing()
    head_dim, act_dtype = cache.k_residual.shape[-1], cache.k_residual.dtype  # (Int4Cache or Int4Pages)
    checks.attention_spec(attention, num_heads, head_dim, qkv.device)
    if attention.epilogue is not None:
        raise ValueError(
            "attention.epilogue must be None with an int4 cache (the kernel has no int4 epilogue)"
        )
    if act_dtype != qkv.dtype:
        raise ValueError(f"qkv must have the cache's activation dtype {act_dtype}, got {qkv.dtype}")
    if qkv.dtype not in dispatch.FP8_ACTIVATION_DTYPES:
        raise ValueError(f"qkv must have dtype float16 or bfloat16 with an int4 cache, got {qkv.dtype}")
    if tile_source not in ("auto", "cp_async"):
        raise ValueError(
            f"tile_source must be 'auto' or 'cp_async' with an int4 cache (its bulk copies are 'auto'), "
            f"got {tile_source!r}"
        )
    batch, max_seq_len = _extent(cache.v_codes, block_tables)
    residual = cache.k_residual if block_tables is None else cache.k_residual[:batch]
    if check:
        _check_pages(qkv, lengths, block_tables, row_active, cache.v_codes, batch)
    shape = (batch, num_heads, num_kv_heads, head_dim, max_seq_len if max_len is None else max_len)
    num_splits, stages = _one_token_plan(
        qkv, shape, attention, variant, dispatch.INT4_CODES, num_splits, stages
    )
    kw = dict(qkv_bias=qkv_bias, k_scale=cache.k_scale, v_scale=cache.v_scale, k_zero=cache.k_zero,
              v_zero=cache.v_zero, k_residual=residual, row_active=row_active, positions=positions,
              block_tables=block_tables, head_dim=head_dim)  # fmt: skip
    out, lse = _launch(
        qkv, cache.k_codes, cache.v_codes, lengths, num_heads, num_kv_heads, attention, (batch, 1),
        (num_splits, stages, tile_source, workspace), check, kw,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def _check_tree_tensors(parents, node_counts, device) -> None:
    if not isinstance(parents, torch.Tensor) or parents.device != device or parents.dtype != torch.int32:
        got = (
            f"{parents.dtype} on {parents.device}"
            if isinstance(parents, torch.Tensor)
            else type(parents).__name__
        )
        raise ValueError(f"parents must be an int32 tensor on {device}, got {got}")
    if node_counts is not None and (
        not isinstance(node_counts, torch.Tensor)
        or node_counts.device != device
        or node_counts.dtype != torch.int32
    ):
        raise ValueError(f"node_counts must be None or an int32 tensor on {device}")


def _validate_tree(parents, node_counts, lengths, block_tables, row_active, v_cache, batch) -> None:
    """A tree step's host checks: the trees, the row modes and the blocks of every node's slot."""
    from . import tree

    active = None
    if row_active is not None and row_active.shape == (batch,):
        active = [bool(a) for a in checks.row_modes(row_active, batch, tree=True)]
    trees = tree.check_parents(parents, batch, None if node_counts is None else node_counts.tolist())
    if block_tables is not None and lengths.shape == (batch,):
        host = lengths.tolist()
        rows = [r for r in range(batch) if active is None or active[r]]
        if rows:
            last = [host[r] + len(trees[r]) - 1 for r in rows]
            checks.block_tables(block_tables[rows], last, v_cache.shape[0], v_cache.shape[-2])


def decode_tree(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    parents: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    attention: AttentionSpec = PLAIN,
    node_counts: torch.Tensor | None = None,
    qkv_bias: torch.Tensor | None = None,
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
    wide_pairs: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A tree-masked multi-token step on the GPU (``mmha.tree``; ``mmha.reference.decode_tree``
    defines it): ``qkv [B, T, (Hq + 2 Hkv) D]`` for the T <= 64 nodes of ``parents`` (int32 ``[B,
    T]`` on the GPU); node ``t`` is appended at slot ``lengths[b] + t`` (rotary at ``lengths[b] +
    depth(t)``) and attends to the cached slots and its root path. ``node_counts`` (int32 ``[B]``
    on the GPU) for rows that use fewer nodes; their other nodes' output is zero. Two launches: the
    trees' check and append, then the attention, whose K/V tiles serve every node an item holds.
    ``attention`` may hold rotary, a scale and an epilogue, no score modifiers.

    ``validate`` reads ``parents``, ``node_counts`` and ``lengths`` on the host and raises
    ``ValueError`` naming the entry (one synchronisation; skipped inside CUDA-graph capture).
    Without it a row that breaks the rules writes nothing, gets NaN output and raises its status
    flag (``workspace.check()``: ``TreeError``, ``LengthError`` or ``PageError``). ``max_len`` is
    the longest ``lengths[b] + T`` the caller knows of. ``wide_pairs``: wide items two to a block
    (``dispatch.pair_wide_items`` decides by default; either way only where the kernels can: 16-bit
    caches at head dims 64 and 128 on sm_90; the results are the same bits). Returns ``out [B, T,
    Hq * D]`` (and fp32 ``lse [B, T, Hq]``)."""
    from . import tree

    _require_extension()
    check = validate and not torch.cuda.is_current_stream_capturing()
    head_dim = v_cache.shape[-1]
    checks.attention_spec(attention, num_heads, head_dim, qkv.device)
    checks.tree_spec(attention)
    _check_tree_tensors(parents, node_counts, qkv.device)
    batch, max_seq_len = _extent(v_cache, block_tables)
    if check:
        _validate_tree(parents, node_counts, lengths, block_tables, row_active, v_cache, batch)
    if parents.dim() != 2 or not 1 <= parents.shape[1] <= tree.MAX_NODES:
        raise ValueError(
            f"parents must have shape [{batch}, T <= {tree.MAX_NODES}], got {tuple(parents.shape)}"
        )
    nodes = parents.shape[1]
    keys = max_seq_len if max_len is None else min(max_len, max_seq_len)
    if num_splits is None or stages is None:
        # An item's columns are (node, head) pairs: plan as for nodes * Hq heads over the same keys.
        plan = plan_for(
            qkv.device, batch, num_heads * nodes, num_kv_heads, head_dim, keys, qkv.dtype, variant,
            k_cache.dtype, epilogue=attention.epilogue is not None, nodes=nodes,
        )  # fmt: skip
        num_splits = plan.num_splits if num_splits is None else num_splits
        stages = plan.stages if stages is None else stages
    if wide_pairs is None:
        wide_pairs = dispatch.pair_wide_items(
            batch, num_heads, num_kv_heads, nodes, head_dim, keys, num_splits,
            device_spec(_device_index(qkv.device)).num_sms, k_cache.dtype != torch.float32,
            attention.epilogue is not None,
        )  # fmt: skip
    kw = dict(qkv_bias=qkv_bias, k_scale=k_scale, v_scale=v_scale, parents=parents, node_counts=node_counts,
              block_tables=block_tables, row_active=row_active, wide_pairs=bool(wide_pairs))  # fmt: skip
    out, lse = _launch(
        qkv, k_cache, v_cache, lengths, num_heads, num_kv_heads, attention, (batch, nodes),
        (num_splits, stages, tile_source, workspace), check, kw,
    )  # fmt: skip
    return (out, lse) if return_lse else out
