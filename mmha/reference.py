"""The exact semantics of one decode step, in plain torch: the oracle and the CPU fallback.

One step for row ``b`` (with ``pos = lengths[b]`` tokens already cached) under a layer's
``AttentionSpec`` (``mmha.spec`` defines every setting):

1. ``x = qkv[b] + qkv_bias`` in the compute dtype, split into q ``[Hq, D]``, k and v ``[Hkv, D]``;
2. the per-head q/k norm (``attention.qk_norm``, rounding to qkv's dtype as it says), then
   rotary embedding of q and k at position ``pos`` (``attention.rotary``);
3. k and v are rounded to the cache dtype and written to slot ``pos``; an fp8 (e4m3) cache stores
   ``quantize_fp8(k, k_scale)`` and ``quantize_fp8(v, v_scale)``; an int8 cache stores each
   token's k and v symmetric per kv head (``mmha.quant.quantize(x, 8)``: codes in the cache,
   their scales at ``k_scale[b, :, pos]`` / ``v_scale[b, :, pos]``);
4. ``out = softmax(s) . V[0..pos]`` with the scaled, modified logits ``s`` of q against the cache
   (query head ``h`` uses kv head ``h // (Hq // Hkv)``; soft-cap, ALiBi, window and sinks as the
   spec says); ``lse`` is the natural-log log-sum-exp of ``s`` (sinks included). An fp8 cache is
   read as ``cached * scale[h]``, an int8 one as ``code * scale[b, h, slot]`` (dequantised in the
   compute dtype);
5. the output epilogue (``attention.epilogue``) applies to ``out`` rounded to fp32; without one
   ``out`` is rounded to qkv's dtype.

Row modes (``row_active``, as the kernel takes them; ``mmha.spec``): ``ROW_IDLE`` rows take no
part, ``ROW_STEP`` rows do the above, ``ROW_ATTEND`` rows attend to slots ``0 .. pos - 1`` only
(the window and ALiBi still place the query at slot ``pos``; nothing is written, ``pos`` may
equal the capacity, and a row with no slot in reach is idle). ``lengths`` are not changed.
"""

from __future__ import annotations

import math

import torch

from . import checks, layout, quant, tree
from .spec import (
    FP8,
    PLAIN,
    ROW_ATTEND,
    ROW_IDLE,
    ROW_STEP,
    AttentionSpec,
    Rotary,
    dequantize_fp8,
    quantize_fp8,
)


def apply_rotary(x: torch.Tensor, pos: torch.Tensor, rotary: Rotary, inv_freq: torch.Tensor | None = None):
    """Rotate the first ``rotary.dim`` dims of ``x [B, H, D]`` by angles ``pos[B] * inv_freq``.

    ``inv_freq`` (``rotary.frequencies``, on ``x``'s device) may be passed in precomputed, as
    CUDA-graph capture needs: computing it creates a host tensor. cos and sin are multiplied by
    ``rotary.attention_factor``. A table by length (``Rotary.by_length``) gives row ``b`` the
    frequencies of a sequence of ``pos[b] + 1`` tokens."""
    if rotary.dim == 0:
        return x
    # Angles in at least fp32: in a 16-bit dtype position * inv_freq is meaningless past ~2K.
    angle_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = rotary.frequencies(angle_dtype, x.device) if inv_freq is None else inv_freq.to(angle_dtype)
    if inv_freq.dim() == 2:  # rows by the sequence's length
        row = (pos.to(torch.int64) + 1 - rotary.table_start).clamp(0, inv_freq.shape[0] - 1)
        inv_freq = inv_freq[row.to(inv_freq.device)]  # [B, rd/2]
    angle = pos.to(angle_dtype)[:, None] * (inv_freq if inv_freq.dim() == 2 else inv_freq[None, :])
    cos, sin = torch.cos(angle), torch.sin(angle)
    if rotary.attention_factor != 1.0:
        cos, sin = cos * rotary.attention_factor, sin * rotary.attention_factor
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    rot, rest = x[..., : rotary.dim], x[..., rotary.dim :]
    if rotary.interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        half = rotary.dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((out, rest), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, cast_first: bool = True):
    """RMSNorm of ``x [..., C]`` over its last dim, as ``mmha.ops.rms_norm`` computes it:
    ``n = x * rsqrt(mean(x^2) + eps)`` in fp32, then ``n`` rounded to x's dtype times
    ``weight + offset`` (``cast_first``: Llama's ``weight * n.to(dtype)``) or ``n * (weight +
    offset)`` (Gemma's ``n * (1 + weight)``), rounded to x's dtype."""
    v = x.float()
    n = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + offset
    return ((n.to(x.dtype).float() if cast_first else n) * w).to(x.dtype)


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``qkv [B, (Hq + 2 Hkv) D]`` -> q ``[B, Hq, D]``, k ``[B, Hkv, D]``, v ``[B, Hkv, D]``."""
    b = qkv.shape[0]
    q = qkv[:, : num_heads * head_dim].reshape(b, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :]
    return q, k.reshape(b, num_kv_heads, head_dim), v.reshape(b, num_kv_heads, head_dim)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    attention: AttentionSpec = PLAIN,
    pos: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: ``q [Hq, D]``, ``k, v [Hkv, L, D]`` -> out ``[Hq, D]``, lse ``[Hq]``. The keys are
    slots ``0 .. L - 1`` and the query sits at slot ``pos`` (for the spec's score modifiers)."""
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scores = torch.einsum("hd,hld->hl", q, k) * scale
    if not attention.has_mods:
        lse = torch.logsumexp(scores, dim=-1)
        return torch.einsum("hl,hld->hd", torch.softmax(scores, dim=-1), v), lse
    if attention.softcap is not None:
        scores = attention.softcap * torch.tanh(scores / attention.softcap)
    if attention.alibi_slopes is not None:
        slots = torch.arange(k.shape[1], device=q.device, dtype=scores.dtype)
        slopes = attention.alibi_slopes.to(scores.device, scores.dtype)
        scores = scores + slopes[:, None] * (slots - pos)[None, :]
    start = attention.first_slot(pos)
    scores, v = scores[:, start:], v[:, start:]
    if attention.sinks is not None:
        sink = attention.sinks.to(scores.device, scores.dtype)[:, None]
        lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("hl,hld->hd", torch.exp(scores - lse[:, None]), v), lse


def project_tokens(x, pos, num_heads, num_kv_heads, head_dim, attention, act_dtype):
    """Step 2 for tokens ``x [N, W]`` (bias added, compute dtype; qkv of ``act_dtype``) at
    positions ``pos [N]``: q ``[N, Hq, D]``, k and v ``[N, Hkv, D]`` in the compute dtype, after
    the q/k norm and rotary, before any rounding to a cache's format."""
    q, k, v = split_qkv(x, num_heads, num_kv_heads, head_dim)
    if attention.qk_norm is not None:
        q = attention.qk_norm.apply(q, "q", act_dtype)
        k = attention.qk_norm.apply(k, "k", act_dtype)
    return apply_rotary(q, pos, attention.rotary), apply_rotary(k, pos, attention.rotary), v


def new_tokens(x, pos, num_heads, num_kv_heads, head_dim, attention, k_cache, k_scale, v_scale, act_dtype):
    """Steps 2-3 for tokens ``x [N, W]`` (bias added, compute dtype; qkv of ``act_dtype``) at
    positions ``pos [N]``: q ``[N, Hq, D]`` in the compute dtype, k and v ``[N, Hkv, D]`` as the
    caches store them, and for an int8 cache their scales ``(k [N, Hkv], v [N, Hkv])`` fp32
    (else None)."""
    q, k, v = project_tokens(x, pos, num_heads, num_kv_heads, head_dim, attention, act_dtype)
    if k_cache.dtype == FP8:
        return q, quantize_fp8(k, k_scale), quantize_fp8(v, v_scale), None
    if k_cache.dtype == torch.int8:
        (k_codes, k_sc, _), (v_codes, v_sc, _) = quant.quantize(k, 8), quant.quantize(v, 8)
        return q, k_codes, v_codes, (k_sc, v_sc)
    return q, k.to(k_cache.dtype), v.to(k_cache.dtype), None


def store_token(k_cache, v_cache, scales, row: int, slot: int, k, v, token_scales) -> None:
    """Write one token's stored ``k, v [Hkv, D]`` to slot ``slot`` of row ``row`` (and an int8
    cache's ``token_scales`` ``(k [Hkv], v [Hkv])`` into ``scales = (k_scale, v_scale)``)."""
    hkv, d, x = k_cache.shape[1], v_cache.shape[-1], k_cache.shape[-1]
    k_cache[row, :, :, slot, :] = k.reshape(hkv, d // x, x)
    v_cache[row, :, slot, :] = v
    if token_scales is not None:
        scales[0][row, :, slot] = token_scales[0]
        scales[1][row, :, slot] = token_scales[1]


def cached_kv(k_cache, v_cache, row: int, n: int, k_scale, v_scale, compute_dtype):
    """Slots ``0 .. n - 1`` of a row as ``[Hkv, n, D]`` K and V in the compute dtype (fp8 and int8
    dequantised)."""
    keys = layout.unpack_k(k_cache[row : row + 1], n, layout="bhsd")[0]
    values = v_cache[row, :, :n, :]
    if k_cache.dtype == torch.int8:
        return (
            quant.dequantize(keys, k_scale[row, :, :n], None, compute_dtype),
            quant.dequantize(values, v_scale[row, :, :n], None, compute_dtype),
        )
    if k_cache.dtype == FP8:
        return dequantize_fp8(keys, k_scale, compute_dtype), dequantize_fp8(values, v_scale, compute_dtype)
    return keys.to(compute_dtype), values.to(compute_dtype)


def finish(out: torch.Tensor, dtype: torch.dtype, attention: AttentionSpec) -> torch.Tensor:
    """The attention output as a step returns it: rounded to ``dtype``, or through the epilogue."""
    return out.to(dtype) if attention.epilogue is None else attention.epilogue.apply(out, dtype)


def step_positions(lengths, positions, modes, s_max, batch) -> tuple[list[int], list[int]]:
    """Each row's slot (``lengths``, checked against the capacity per its mode) and rotary position."""
    pos_list = [int(p) for p in lengths.tolist()]
    for row, p in enumerate(pos_list):
        if modes[row] == ROW_ATTEND and not 0 <= p <= s_max:
            raise ValueError(
                f"lengths[{row}] must be in [0, {s_max}] (an attend-only row reads slots before it), got {p}"
            )
        if modes[row] == ROW_STEP and not 0 <= p < s_max:
            raise ValueError(f"lengths[{row}] must be in [0, {s_max - 1}] (cache capacity {s_max}), got {p}")
    if positions is not None and positions.shape != (batch,):
        raise ValueError(f"positions must have shape [{batch}], got {tuple(positions.shape)}")
    return pos_list, pos_list if positions is None else [int(p) for p in positions.tolist()]


def decode_step(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    attention: AttentionSpec = PLAIN,
    qkv_bias: torch.Tensor | None = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    row_active: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Append the new K/V to the caches and return ``out [B, Hq * D]`` (and ``lse [B, Hq]``).

    ``qkv [B, (Hq + 2 * Hkv) * D]``; ``k_cache [B, Hkv, D / x, S_max, x]`` and ``v_cache [B, Hkv,
    S_max, D]``, written in place at slot ``lengths[b]`` (``[B]`` int, read, not changed);
    ``attention``: the layer's spec; ``compute_dtype``: fp32 (default) or fp64; ``k_scale``,
    ``v_scale``: for quantised caches only, fp32 ``[Hkv]`` (fp8) or ``[B, Hkv, S_max]`` (int8: a
    scale per token, written at the new slot); ``row_active``: ``[B]`` int row modes
    (default every row ``ROW_STEP``); ``positions``: ``[B]`` int rotary positions (default
    ``lengths``; slots, the window and ALiBi still count from ``lengths``).
    """
    b, hkv, s_max, d = v_cache.shape
    checks.cache_scales(k_cache, v_cache, k_scale, v_scale)
    modes = checks.step_args(qkv, b, d, num_heads, num_kv_heads, attention, row_active)
    pos_list, rot_pos = step_positions(lengths, positions, modes, s_max, b)
    x = qkv.to(compute_dtype)
    if qkv_bias is not None:
        x = x + qkv_bias.to(compute_dtype)
    pos = torch.tensor(rot_pos, device=qkv.device)
    q, k_new, v_new, tok = new_tokens(
        x, pos, num_heads, num_kv_heads, d, attention, k_cache, k_scale, v_scale, qkv.dtype
    )

    def append(row: int, p: int) -> None:
        row_scales = None if tok is None else (tok[0][row], tok[1][row])
        store_token(k_cache, v_cache, (k_scale, v_scale), row, p, k_new[row], v_new[row], row_scales)

    def read(row: int, n: int):
        return cached_kv(k_cache, v_cache, row, n, k_scale, v_scale, compute_dtype)

    out, lse = step_rows(q, pos_list, modes, attention, append, read)
    out = finish(out, qkv.dtype, attention)
    return (out, lse.float()) if return_lse else out


def step_rows(q, pos_list: list[int], modes: list[int], attention: AttentionSpec, append, read):
    """Step 4 of every row: a stepping row appends its token (``append(row, pos)``), then each
    row that takes part attends over its slots (``read(row, n)``: keys and values ``[Hkv, n, D]``);
    the others give zeros and an lse of -inf. ``q [B, Hq, D]``. Returns out ``[B, Hq * D]`` and
    lse ``[B, Hq]`` in q's dtype."""
    num_heads, d = q.shape[1], q.shape[2]
    scale = attention.scale_for(d)
    outs, lses = [], []
    for row, p in enumerate(pos_list):
        keys_end = p + 1 if modes[row] == ROW_STEP else p
        if modes[row] == ROW_IDLE or keys_end <= attention.first_slot(p):  # takes no part
            outs.append(torch.zeros(num_heads * d, dtype=q.dtype, device=q.device))
            lses.append(torch.full((num_heads,), -math.inf, dtype=q.dtype, device=q.device))
            continue
        if modes[row] == ROW_STEP:
            append(row, p)
        keys, values = read(row, keys_end)
        o, lse = attend(q[row], keys, values, scale, attention, p)
        outs.append(o.reshape(-1))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def decode_step_paged(
    qkv: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    return_lse: bool = False,
    **kwargs,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``decode_step`` over a paged cache: row ``b``'s slot ``t`` is slot ``t % block_size`` of
    block ``block_tables[b, t // block_size]`` of ``k_pages [num_blocks, Hkv, D/x, block_size, x]``
    and ``v_pages [num_blocks, Hkv, block_size, D]``. Each row's blocks are gathered into a
    contiguous cache, the step runs there, and the new token is written back to its page."""
    bs = k_pages.shape[3]
    pos = [int(p) for p in lengths.tolist()]
    for row, p in enumerate(pos):
        if p < 0:
            raise ValueError(f"lengths[{row}] must be >= 0, got {p}")
    checks.block_tables(block_tables, pos, k_pages.shape[0], bs)
    tables = block_tables.tolist()
    checks.cache_scales(k_pages, v_pages, kwargs.get("k_scale"), kwargs.get("v_scale"))
    outs, lses = [], []
    for b, p in enumerate(pos):
        blocks = tables[b][: p // bs + 1]
        kc, vc, row_kw = _gather_row(k_pages, v_pages, blocks, kwargs)
        out, lse = decode_step(
            qkv[b : b + 1], kc, vc, lengths[b : b + 1], num_heads=num_heads, num_kv_heads=num_kv_heads,
            return_lse=True, **row_kw,
        )  # fmt: skip
        _put_slot(k_pages, v_pages, kwargs, blocks, p, kc, vc, row_kw)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs)
    return (out, torch.cat(lses)) if return_lse else out


def _gather_row(k_pages, v_pages, blocks: list[int], kwargs: dict) -> tuple:
    """One row's ``blocks`` as a contiguous cache ``(k [1, ...], v [1, ...], kwargs)``, an int8
    pool's per-slot scales gathered into the row's ``k_scale`` / ``v_scale`` ``[1, Hkv, n * bs]``."""
    kc, vc = layout.gather_k(k_pages, blocks), layout.gather_v(v_pages, blocks)
    row_kw = dict(kwargs)
    if k_pages.dtype == torch.int8:
        for name in ("k_scale", "v_scale"):
            row_kw[name] = layout.gather_v(kwargs[name][..., None], blocks)[..., 0]
    return kc, vc, row_kw


def _put_slot(k_pages, v_pages, kwargs: dict, blocks: list[int], t: int, kc, vc, row_kw) -> None:
    """Slot ``t`` of a gathered row (``_gather_row``) back into its page (and its int8 scales)."""
    bs = v_pages.shape[2]
    blk, off = blocks[t // bs], t % bs
    k_pages[blk, :, :, off, :] = kc[0, :, :, t, :]
    v_pages[blk, :, off, :] = vc[0, :, t, :]
    if k_pages.dtype == torch.int8:
        for name in ("k_scale", "v_scale"):
            kwargs[name][blk, :, off] = row_kw[name][0, :, t]


def _tree_row(x, p, par, num_heads, num_kv_heads, attention, k_cache, v_cache, row, k_scale, v_scale, dtypes):
    """One row of ``decode_tree``: append its nodes, return its nodes' out ``[n, Hq * D]`` and lse.
    ``dtypes``: (compute, qkv's)."""
    dtype, act_dtype = dtypes
    d = v_cache.shape[-1]
    n = len(par)
    pos = torch.tensor([p + dep for dep in tree.depths(par)], device=x.device)
    q, k_new, v_new, tok = new_tokens(
        x[:n], pos, num_heads, num_kv_heads, d, attention, k_cache, k_scale, v_scale, act_dtype
    )
    for t in range(n):
        node_scales = None if tok is None else (tok[0][t], tok[1][t])
        store_token(k_cache, v_cache, (k_scale, v_scale), row, p + t, k_new[t], v_new[t], node_scales)
    keys, values = cached_kv(k_cache, v_cache, row, p + n, k_scale, v_scale, dtype)
    return tree_attend(q, keys, values, p, par, attention.scale_for(d))


def tree_attend(q, keys, values, p: int, par: list[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's tree nodes ``q [n, Hq, D]`` against slots ``0 .. p + n - 1`` (``keys, values [Hkv,
    p + n, D]``): node ``t`` sees the ``p`` cached slots and its ancestors' slots ``p + a``, itself
    included. Returns out ``[n, Hq * D]`` and lse ``[n, Hq]``."""
    n = len(par)
    group = q.shape[1] // keys.shape[0]
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    scores = torch.einsum("thd,hld->thl", q, keys) * scale  # [n, Hq, p + n]
    mask = torch.zeros(n, p + n, dtype=torch.bool, device=q.device)
    mask[:, :p] = True
    for t, anc in enumerate(tree.ancestors(par)):
        mask[t, [p + a for a in anc]] = True
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    o = torch.einsum("thl,hld->thd", torch.softmax(scores, dim=-1), values)
    return o.reshape(n, -1), torch.logsumexp(scores, dim=-1)


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
    node_counts: list[int] | None = None,
    qkv_bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A tree-masked multi-token step (``mmha.tree``): ``qkv [B, T, (Hq + 2 Hkv) D]`` for the T
    nodes of ``parents [B, T]``; node ``t`` is appended at slot ``lengths[b] + t`` (rotary at
    ``lengths[b] + depth(t)``, stored as ``decode_step`` stores a token) and attends to slots
    ``0 .. lengths[b] - 1`` and to its ancestors' slots, itself included, with an explicit mask.
    Returns ``out [B, T, Hq * D]`` (zeros for nodes past a row's count; the spec's epilogue
    applies to every node's output, those zeros included) and, with ``return_lse``, fp32 ``lse
    [B, T, Hq]`` (``-inf`` for nodes past the count); lengths are not changed. The spec may not
    hold score modifiers (tree steps take none)."""
    b, _, s_max, d = v_cache.shape
    checks.cache_scales(k_cache, v_cache, k_scale, v_scale)
    width = (num_heads + 2 * num_kv_heads) * d
    if qkv.dim() != 3 or qkv.shape[0] != b or qkv.shape[2] != width:
        raise ValueError(f"qkv must have shape [{b}, T, {width}], got {tuple(qkv.shape)}")
    checks.attention_spec(attention, num_heads, d, qkv.device)
    checks.tree_spec(attention)
    rows = tree.check_parents(parents, b, node_counts)
    if qkv.shape[1] != parents.shape[1]:
        raise ValueError(f"qkv must have T = {parents.shape[1]} nodes (parents' width), got {qkv.shape[1]}")
    pos_list = [int(p) for p in lengths.tolist()]
    for row, p in enumerate(pos_list):
        if p < 0:
            raise ValueError(f"lengths[{row}] must be >= 0, got {p}")
        if p + len(rows[row]) > s_max:
            raise ValueError(
                f"lengths[{row}] + node count must fit the capacity: {p} + {len(rows[row])} > {s_max}"
            )
    x = qkv.to(compute_dtype)
    if qkv_bias is not None:
        x = x + qkv_bias.to(compute_dtype)
    out = torch.zeros(b, qkv.shape[1], num_heads * d, dtype=compute_dtype, device=qkv.device)
    lse = torch.full((b, qkv.shape[1], num_heads), float("-inf"), dtype=compute_dtype, device=qkv.device)
    for row, p in enumerate(pos_list):
        n = len(rows[row])
        out[row, :n], lse[row, :n] = _tree_row(
            x[row], p, rows[row], num_heads, num_kv_heads, attention, k_cache, v_cache, row, k_scale, v_scale,
            (compute_dtype, qkv.dtype),
        )  # fmt: skip
    out = finish(out, qkv.dtype, attention)
    return (out, lse.float()) if return_lse else out


def decode_tree_paged(
    qkv: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    parents: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    node_counts: list[int] | None = None,
    return_lse: bool = False,
    **kwargs,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``decode_tree`` over a paged cache (pages as in ``decode_step_paged``): each row's blocks of
    slots ``0 .. lengths[b] + count - 1`` are gathered into a contiguous cache, the tree step runs
    there, and the nodes' slots are written back to their pages."""
    bs = k_pages.shape[3]
    rows = tree.check_parents(parents, qkv.shape[0], node_counts)
    pos = [int(p) for p in lengths.tolist()]
    for row, p in enumerate(pos):
        if p < 0:
            raise ValueError(f"lengths[{row}] must be >= 0, got {p}")
    last = [p + len(r) - 1 for p, r in zip(pos, rows, strict=True)]  # each row's last slot
    checks.block_tables(block_tables, last, k_pages.shape[0], bs)
    tables = block_tables.tolist()
    checks.cache_scales(k_pages, v_pages, kwargs.get("k_scale"), kwargs.get("v_scale"))
    outs, lses = [], []
    for b, p in enumerate(pos):
        n = len(rows[b])
        blocks = tables[b][: (p + n - 1) // bs + 1]
        kc, vc, row_kw = _gather_row(k_pages, v_pages, blocks, kwargs)
        o, lse = decode_tree(
            qkv[b : b + 1], kc, vc, lengths[b : b + 1], parents[b : b + 1], num_heads=num_heads,
            num_kv_heads=num_kv_heads, node_counts=[n], return_lse=True, **row_kw,
        )  # fmt: skip
        outs.append(o)
        lses.append(lse)
        for t in range(p, p + n):
            _put_slot(k_pages, v_pages, kwargs, blocks, t, kc, vc, row_kw)
    return (torch.cat(outs), torch.cat(lses)) if return_lse else torch.cat(outs)
