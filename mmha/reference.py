"""The exact semantics of one decode step, in plain torch: the oracle and the CPU fallback.

One step for row ``b`` (with ``pos = lengths[b]`` tokens already cached):

1. ``x = qkv[b] + qkv_bias`` in the compute dtype, split into q ``[Hq, D]``, k and v ``[Hkv, D]``;
2. rotary embedding of q and k at position ``pos`` on the first ``rotary_dim`` dims
   (GPT-NeoX halves, or GPT-J interleaved pairs), with ``inv_freq = 1 / theta ** (2i / rd)``;
3. k and v are rounded to the cache dtype and written to slot ``pos``; an fp8 (e4m3) cache stores
   ``quantize_fp8(k, k_scale)``: ``k / k_scale[h]`` in fp32, saturated to +-448 and rounded to the
   nearest e4m3 (ties to even), and likewise v with ``v_scale``;
4. ``out = softmax(q . K[0..pos] * scale) . V[0..pos]`` over the cache contents, query head ``h``
   using kv head ``h // (Hq // Hkv)``; ``lse`` is the natural-log log-sum-exp of the scaled logits.
   An fp8 cache is read as ``K = cached * k_scale[h]``, ``V = cached * v_scale[h]`` (dequantised
   in the compute dtype).

Score modifiers (``ScoreMods``), applied in this order to the scaled logit ``s`` of query head
``h`` and slot ``t`` (the new token is at slot ``pos``): soft-cap ``s = cap * tanh(s / cap)``;
ALiBi ``s += slope[h] * (t - pos)``; sliding window: only slots ``t > pos - window`` are attended
(``window`` slots, the new token's included); attention sink: ``exp(sink[h])`` joins the softmax's
denominator (``lse`` includes it, and the weights sum to less than one).

Row modes (``row_active``, as the kernel takes them): ``ROW_IDLE`` rows take no part (nothing
written, zero output, lse ``-inf``); ``ROW_STEP`` rows do the above; ``ROW_ATTEND`` rows attend to
slots ``0 .. pos - 1`` only (the window and ALiBi still place the query at slot ``pos``; nothing
is written, ``pos`` may equal the capacity, and a row with no slot in reach is idle): one shard
of a context spread over several caches (``mmha.distributed``).

An output epilogue (``mmha.epilogue.OutEpilogue``: shift, smooth, int8 / e4m3 quantisation)
applies to ``out`` rounded to fp32 (``epilogue=``); without one ``out`` is rounded to qkv's dtype.

``lengths`` are not changed (the cache manager advances them once per step).
"""

from __future__ import annotations

import math

import torch

from . import layout
from .epilogue import OutEpilogue, check_epilogue

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value

# Row modes (row_active).
ROW_IDLE, ROW_STEP, ROW_ATTEND = 0, 1, 2
ROW_MODES = (ROW_IDLE, ROW_STEP, ROW_ATTEND)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., Hkv, D]`` (any float dtype) -> e4m3 of ``x / scale[h]`` computed in fp32,
    saturated to +-448, rounded to nearest (ties to even). ``scale [Hkv]`` fp32."""
    y = x.float() / scale.float()[:, None]
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x [Hkv, ..., D]`` e4m3 -> ``x * scale[h]`` in ``dtype``."""
    shape = (-1,) + (1,) * (x.dim() - 1)
    return x.to(dtype) * scale.to(dtype).reshape(shape)


def _check_fp8_scales(k_cache: torch.Tensor, k_scale, v_scale) -> None:
    """An fp8 cache's scales are given exactly when the cache is fp8."""
    if (k_cache.dtype == FP8) != (k_scale is not None and v_scale is not None):
        raise ValueError("k_scale and v_scale must be given for float8_e4m3fn caches, and only for them")


def fp8_scale(amax: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
    """Per-head scales that map ``amax * margin`` to 448 (1 where ``amax`` is 0 or not finite),
    fp32 on ``amax``'s device; computed on the host in fp64, so every device gives the same bits."""
    s = (amax.detach().double().cpu() * margin / FP8_MAX).float()
    s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
    return s.to(amax.device)


def rotary_inv_freq(rotary_dim: int, theta: float, dtype: torch.dtype, device) -> torch.Tensor:
    """``[rotary_dim // 2]``: ``1 / theta ** (2i / rotary_dim)``."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=dtype, device=device) / rotary_dim
    return 1.0 / torch.pow(torch.tensor(theta, dtype=dtype, device=device), exponent)


def apply_rotary(
    x: torch.Tensor,
    pos: torch.Tensor,
    rotary_dim: int,
    theta: float,
    interleaved: bool,
    inv_freq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dims of ``x [B, H, D]`` by angles ``pos[B] * inv_freq``.

    ``inv_freq`` (from ``rotary_inv_freq``, on ``x``'s device) may be passed in precomputed, as
    CUDA-graph capture needs: computing it creates a host tensor."""
    if rotary_dim == 0:
        return x
    # Angles in at least fp32: in a 16-bit dtype position * inv_freq is meaningless past ~2K.
    angle_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    if inv_freq is None:
        inv_freq = rotary_inv_freq(rotary_dim, theta, angle_dtype, x.device)
    inv_freq = inv_freq.to(angle_dtype)
    angle = pos.to(angle_dtype)[:, None] * inv_freq[None, :]  # [B, rd/2]
    cos = torch.cos(angle)[:, None, :].to(x.dtype)
    sin = torch.sin(angle)[:, None, :].to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        half = rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((out, rest), dim=-1)


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``qkv [B, (Hq + 2 Hkv) D]`` -> q ``[B, Hq, D]``, k ``[B, Hkv, D]``, v ``[B, Hkv, D]``."""
    b = qkv.shape[0]
    q = qkv[:, : num_heads * head_dim].reshape(b, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :]
    return q, k.reshape(b, num_kv_heads, head_dim), v.reshape(b, num_kv_heads, head_dim)


class ScoreMods:
    """The score modifiers of a step, checked: ``window`` (int >= 1), ``softcap`` (finite > 0),
    ``alibi_slopes`` and ``sinks`` (fp32 ``[num_heads]``, finite; on the activations' device).
    ``check_values=False`` skips reading the tensors' values (a host synchronisation for GPU
    tensors), for callers that checked them already."""

    def __init__(
        self, num_heads: int, device, window=None, softcap=None, alibi_slopes=None, sinks=None,
        check_values: bool = True,
    ):  # fmt: skip
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ValueError(
                f"window must be an int >= 1 (slots attended, the new token's included), got {window!r}"
            )
        if softcap is not None and not (
            isinstance(softcap, (int, float))
            and not isinstance(softcap, bool)
            and math.isfinite(softcap)
            and softcap > 0
        ):
            raise ValueError(f"softcap must be a finite number > 0, got {softcap!r}")
        for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (num_heads,):
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"{name} must be a float32 tensor of shape [{num_heads}] (one per query head), got {got}"
                )
            if t.device != torch.device(device):
                raise ValueError(f"{name} must be on {torch.device(device)}, got {t.device}")
            if check_values and not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} must be finite, got {t.tolist()}")
        self.window, self.softcap, self.alibi_slopes, self.sinks = window, softcap, alibi_slopes, sinks

    @property
    def any(self) -> bool:
        return any(x is not None for x in (self.window, self.softcap, self.alibi_slopes, self.sinks))

    def kernel_args(self) -> dict:
        """The raw operator's arguments (each off at its zero)."""
        return dict(window=self.window or 0, softcap=float(self.softcap or 0.0),
                    alibi_slopes=self.alibi_slopes, sinks=self.sinks)  # fmt: skip

    def first_slot(self, pos: int) -> int:
        """The first slot the query at ``pos`` attends to."""
        return 0 if self.window is None else max(0, pos - self.window + 1)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The standard ALiBi slopes (Press et al.; BLOOM's and MPT's): ``2^(-8 i / n)`` for
    ``i = 1 .. n`` when ``n`` is a power of two, else those of the next lower power of two followed
    by every other slope of the next higher one. fp32 ``[num_heads]``."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-8.0 / closest)
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest < num_heads:
        extra = 2.0 ** (-4.0 / closest)
        slopes += [extra ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mods: ScoreMods | None = None,
    pos: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: ``q [Hq, D]``, ``k, v [Hkv, L, D]`` -> out ``[Hq, D]``, lse ``[Hq]``. With ``mods``,
    the keys are slots ``0 .. L - 1`` and the query sits at slot ``pos``."""
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scores = torch.einsum("hd,hld->hl", q, k) * scale
    if mods is not None and mods.any:
        if mods.softcap is not None:
            scores = mods.softcap * torch.tanh(scores / mods.softcap)
        slots = torch.arange(k.shape[1], device=q.device, dtype=scores.dtype)
        if mods.alibi_slopes is not None:
            scores = (
                scores + mods.alibi_slopes.to(scores.device, scores.dtype)[:, None] * (slots - pos)[None, :]
            )
        start = mods.first_slot(pos)
        scores, v = scores[:, start:], v[:, start:]
        if mods.sinks is not None:
            sink = mods.sinks.to(scores.device, scores.dtype)[:, None]
            lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)
        else:
            lse = torch.logsumexp(scores, dim=-1)
        out = torch.einsum("hl,hld->hd", torch.exp(scores - lse[:, None]), v)
        return out, lse
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hl,hld->hd", torch.softmax(scores, dim=-1), v)
    return out, lse


def _new_tokens(x, pos, num_heads, num_kv_heads, d, rotary, k_cache, v_cache, k_scale, v_scale):
    """Steps 2-3 for tokens ``x [N, W]`` (bias added, compute dtype) at positions ``pos [N]``:
    q ``[N, Hq, D]`` in the compute dtype, and k, v ``[N, Hkv, D]`` as the caches store them."""
    q, k, v = split_qkv(x, num_heads, num_kv_heads, d)
    q = apply_rotary(q, pos, *rotary)
    k = apply_rotary(k, pos, *rotary)
    if k_cache.dtype == FP8:
        return q, quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
    return q, k.to(k_cache.dtype), v.to(v_cache.dtype)


def _cached_kv(k_cache, v_cache, row: int, n: int, k_scale, v_scale, compute_dtype):
    """Slots ``0 .. n - 1`` of a row as ``[Hkv, n, D]`` K and V in the compute dtype (fp8 dequantised)."""
    keys = layout.unpack_k(k_cache[row : row + 1], n, layout="bhsd")[0]
    values = v_cache[row, :, :n, :]
    if k_cache.dtype == FP8:
        return dequantize_fp8(keys, k_scale, compute_dtype), dequantize_fp8(values, v_scale, compute_dtype)
    return keys.to(compute_dtype), values.to(compute_dtype)


def decode_step(
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
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    epilogue: OutEpilogue | None = None,
    row_active: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Append the new K/V to the caches and return ``out [B, Hq * D]`` (and ``lse [B, Hq]``).

    Parameters
    ----------
    qkv : ``[B, (Hq + 2 * Hkv) * D]`` in the cache dtype.
    k_cache : ``[B, Hkv, D / x, S_max, x]``, updated in place at slot ``lengths[b]``.
    v_cache : ``[B, Hkv, S_max, D]``, updated in place at slot ``lengths[b]``.
    lengths : ``[B]`` int, tokens already cached per row (read, not changed).
    compute_dtype : ``torch.float32`` (default) or ``torch.float64``.
    k_scale, v_scale : ``[Hkv]`` fp32, for float8_e4m3fn caches only.
    window, softcap, alibi_slopes, sinks : score modifiers (module docstring; ``ScoreMods``).
    epilogue : the output epilogue (``mmha.epilogue.OutEpilogue``); ``out`` then has its dtype.
    row_active : ``[B]`` int row modes (``ROW_IDLE``, ``ROW_STEP``, ``ROW_ATTEND``; module
        docstring), default every row ``ROW_STEP``.
    positions : ``[B]`` int: the rotary position of each row's token (default ``lengths``; slots,
        the window and ALiBi still count from ``lengths``).
    """
    b, hkv, s_max, d = v_cache.shape
    _check_fp8_scales(k_cache, k_scale, v_scale)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    if qkv.shape != (b, (num_heads + 2 * num_kv_heads) * d):
        raise ValueError(
            f"qkv must have shape [{b}, {(num_heads + 2 * num_kv_heads) * d}], got {tuple(qkv.shape)}"
        )
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    mods = ScoreMods(num_heads, qkv.device, window, softcap, alibi_slopes, sinks)
    check_epilogue(epilogue, num_heads, d, qkv.device)
    pos_list = [int(p) for p in lengths.tolist()]
    modes = check_row_modes(row_active, b)
    for row, p in enumerate(pos_list):
        if modes[row] == ROW_ATTEND and not 0 <= p <= s_max:
            raise ValueError(
                f"lengths[{row}] must be in [0, {s_max}] (an attend-only row reads slots before it), got {p}"
            )
        if modes[row] == ROW_STEP and not 0 <= p < s_max:
            raise ValueError(f"lengths[{row}] must be in [0, {s_max - 1}] (cache capacity {s_max}), got {p}")
    x = qkv.to(compute_dtype)
    if qkv_bias is not None:
        x = x + qkv_bias.to(compute_dtype)
    rotary = (rotary_dim, rotary_theta, rotary_interleaved)
    if positions is not None and positions.shape != (b,):
        raise ValueError(f"positions must have shape [{b}], got {tuple(positions.shape)}")
    rot_pos = pos_list if positions is None else [int(p) for p in positions.tolist()]
    pos = torch.tensor(rot_pos, device=qkv.device)
    q, k_new, v_new = _new_tokens(
        x, pos, num_heads, num_kv_heads, d, rotary, k_cache, v_cache, k_scale, v_scale
    )
    x_elems = k_cache.shape[-1]
    outs, lses = [], []
    for row, p in enumerate(pos_list):
        keys_end = p + 1 if modes[row] == ROW_STEP else p
        if modes[row] == ROW_IDLE or keys_end <= mods.first_slot(p):  # takes no part
            outs.append(torch.zeros(num_heads * d, dtype=compute_dtype, device=qkv.device))
            lses.append(torch.full((num_heads,), -math.inf, dtype=compute_dtype, device=qkv.device))
            continue
        if modes[row] == ROW_STEP:
            k_cache[row, :, :, p, :] = k_new[row].reshape(hkv, d // x_elems, x_elems)
            v_cache[row, :, p, :] = v_new[row]
        keys, values = _cached_kv(k_cache, v_cache, row, keys_end, k_scale, v_scale, compute_dtype)
        o, lse = attend(q[row], keys, values, scale, mods, p)
        outs.append(o.reshape(-1))
        lses.append(lse)
    out = _finish(torch.stack(outs), qkv.dtype, epilogue)
    if return_lse:
        return out, torch.stack(lses).float()
    return out


def check_row_modes(row_active: torch.Tensor | None, batch: int, tree: bool = False) -> list[int]:
    """The host list of ``row_active``'s modes (every row ``ROW_STEP`` without it), checked: shape
    ``[batch]`` and values in ``ROW_MODES`` (a tree step's rows idle or stepping)."""
    if row_active is None:
        return [ROW_STEP] * batch
    if not isinstance(row_active, torch.Tensor) or row_active.shape != (batch,):
        got = tuple(row_active.shape) if isinstance(row_active, torch.Tensor) else type(row_active).__name__
        raise ValueError(f"row_active must have shape [{batch}], got {got}")
    modes = [int(m) for m in row_active.tolist()]
    allowed = (ROW_IDLE, ROW_STEP) if tree else ROW_MODES
    for row, m in enumerate(modes):
        if m not in allowed:
            raise ValueError(f"row_active[{row}] must be one of {allowed} (row modes), got {m}")
    return modes


def _finish(out: torch.Tensor, dtype: torch.dtype, epilogue: OutEpilogue | None) -> torch.Tensor:
    """The attention output as a step returns it: rounded to ``dtype``, or through the epilogue."""
    if epilogue is None:
        return out.to(dtype)
    return epilogue.apply(out, dtype)


def check_block_tables(
    block_tables: torch.Tensor, lengths: list[int], num_blocks: int, block_size: int
) -> None:
    """Every row's table holds the blocks of slots ``0 .. lengths[b]``: enough entries, each in
    ``[0, num_blocks)``, none repeated within the row. Raises ValueError naming ``block_tables``."""
    if block_tables.dim() != 2 or block_tables.shape[0] != len(lengths):
        raise ValueError(
            f"block_tables must have shape [{len(lengths)}, max_blocks], got {tuple(block_tables.shape)}"
        )
    host = block_tables.tolist()
    for b, n in enumerate(lengths):
        need = n // block_size + 1
        if need > len(host[b]):
            raise ValueError(
                f"block_tables must hold {need} blocks for row {b} (length {n}, block_size {block_size}), "
                f"got {len(host[b])} per row"
            )
        row = host[b][:need]
        for i, blk in enumerate(row):
            if not 0 <= blk < num_blocks:
                raise ValueError(f"block_tables[{b}, {i}] must be in [0, {num_blocks - 1}], got {blk}")
        if len(set(row)) != len(row):
            dup = next(blk for blk in row if row.count(blk) > 1)
            raise ValueError(f"block_tables[{b}] must not repeat a block within a row, got block {dup} twice")


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
    check_block_tables(block_tables, pos, k_pages.shape[0], bs)
    tables = block_tables.tolist()
    outs, lses = [], []
    for b, p in enumerate(pos):
        blocks = tables[b][: p // bs + 1]
        kc, vc = layout.gather_k(k_pages, blocks), layout.gather_v(v_pages, blocks)
        out, lse = decode_step(
            qkv[b : b + 1], kc, vc, lengths[b : b + 1], num_heads=num_heads, num_kv_heads=num_kv_heads,
            return_lse=True, **kwargs,
        )  # fmt: skip
        blk, off = blocks[p // bs], p % bs
        k_pages[blk, :, :, off, :] = kc[0, :, :, p, :]
        v_pages[blk, :, off, :] = vc[0, :, p, :]
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs)
    return (out, torch.cat(lses)) if return_lse else out


def decode_tree(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    parents: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    node_counts: list[int] | None = None,
    qkv_bias: torch.Tensor | None = None,
    scale: float | None = None,
    rotary_dim: int = 0,
    rotary_theta: float = 10000.0,
    rotary_interleaved: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    epilogue: OutEpilogue | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A tree-masked multi-token step (``mmha.tree``): ``qkv [B, T, (Hq + 2 Hkv) D]`` for the T
    nodes of ``parents [B, T]``; node ``t`` is appended at slot ``lengths[b] + t`` (rotary at
    ``lengths[b] + depth(t)``, stored as ``decode_step`` stores a token) and attends to slots
    ``0 .. lengths[b] - 1`` and to its ancestors' slots, itself included, with an explicit mask.
    Returns ``out [B, T, Hq * D]`` (zeros for nodes past a row's count; an ``epilogue`` applies to
    every node's output, those zeros included) and, with ``return_lse``, fp32 ``lse [B, T, Hq]``
    (the natural-log log-sum-exp of each node's scaled logits over the keys it sees; ``-inf`` for
    nodes past the count); lengths are not changed."""
    from . import tree

    b, hkv, s_max, d = v_cache.shape
    _check_fp8_scales(k_cache, k_scale, v_scale)
    width = (num_heads + 2 * num_kv_heads) * d
    if qkv.dim() != 3 or qkv.shape[0] != b or qkv.shape[2] != width:
        raise ValueError(f"qkv must have shape [{b}, T, {width}], got {tuple(qkv.shape)}")
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
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    check_epilogue(epilogue, num_heads, d, qkv.device)
    x = qkv.to(compute_dtype)
    if qkv_bias is not None:
        x = x + qkv_bias.to(compute_dtype)
    x_elems = k_cache.shape[-1]
    out = torch.zeros(b, qkv.shape[1], num_heads * d, dtype=compute_dtype, device=qkv.device)
    lse = torch.full((b, qkv.shape[1], num_heads), float("-inf"), dtype=compute_dtype, device=qkv.device)
    group = num_heads // num_kv_heads
    for row, p in enumerate(pos_list):
        par = rows[row]
        n = len(par)
        pos = torch.tensor([p + dep for dep in tree.depths(par)], device=qkv.device)
        q, k_new, v_new = _new_tokens(
            x[row, :n], pos, num_heads, num_kv_heads, d, (rotary_dim, rotary_theta, rotary_interleaved),
            k_cache, v_cache, k_scale, v_scale,
        )  # fmt: skip
        for t in range(n):
            k_cache[row, :, :, p + t, :] = k_new[t].reshape(hkv, d // x_elems, x_elems)
            v_cache[row, :, p + t, :] = v_new[t]
        keys, values = _cached_kv(k_cache, v_cache, row, p + n, k_scale, v_scale, compute_dtype)
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        scores = torch.einsum("thd,hld->thl", q, keys) * scale  # [n, Hq, p + n]
        mask = torch.zeros(n, p + n, dtype=torch.bool, device=qkv.device)
        mask[:, :p] = True
        for t, anc in enumerate(tree.ancestors(par)):
            mask[t, [p + a for a in anc]] = True
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        o = torch.einsum("thl,hld->thd", torch.softmax(scores, dim=-1), values)
        out[row, :n] = o.reshape(n, -1)
        lse[row, :n] = torch.logsumexp(scores, dim=-1)
    out = _finish(out, qkv.dtype, epilogue)
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
    there, and the nodes' slots are written back to their pages. ``return_lse`` as in
    ``decode_tree``."""
    from . import tree

    bs = k_pages.shape[3]
    rows = tree.check_parents(parents, qkv.shape[0], node_counts)
    pos = [int(p) for p in lengths.tolist()]
    for row, p in enumerate(pos):
        if p < 0:
            raise ValueError(f"lengths[{row}] must be >= 0, got {p}")
    last = [p + len(r) - 1 for p, r in zip(pos, rows, strict=True)]  # each row's last slot
    check_block_tables(block_tables, last, k_pages.shape[0], bs)
    tables = block_tables.tolist()
    outs, lses = [], []
    for b, p in enumerate(pos):
        n = len(rows[b])
        blocks = tables[b][: (p + n - 1) // bs + 1]
        kc, vc = layout.gather_k(k_pages, blocks), layout.gather_v(v_pages, blocks)
        o, lse = decode_tree(
            qkv[b : b + 1], kc, vc, lengths[b : b + 1], parents[b : b + 1], num_heads=num_heads,
            num_kv_heads=num_kv_heads, node_counts=[n], return_lse=True, **kwargs,
        )  # fmt: skip
        outs.append(o)
        lses.append(lse)
        for t in range(p, p + n):
            blk, off = blocks[t // bs], t % bs
            k_pages[blk, :, :, off, :] = kc[0, :, :, t, :]
            v_pages[blk, :, off, :] = vc[0, :, t, :]
    return (torch.cat(outs), torch.cat(lses)) if return_lse else torch.cat(outs)
