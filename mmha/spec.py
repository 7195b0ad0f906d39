"""What a layer's attention is: one frozen, checked ``AttentionSpec`` per layer, and the storage
semantics every path shares (fp8 quantisation, row modes).

The kernel path (``mmha.ops``), the cache (``mmha.KVCache``), the distributed cache and the
oracle (``mmha.reference``) all take the same ``AttentionSpec``, built and checked once (its
tensors' values are read here, one host read each) and then reused by every step, so a step
takes no per-call list of settings and reads nothing on the host.

The semantics, for the scaled logit ``s`` of query head ``h`` at slot ``t`` of a row whose new
token sits at slot ``pos`` (``mmha.reference`` computes exactly this):

- ``qk_norm`` (``QKNorm``): q and the new k normed per head (RMSNorm) before rotary;
- rotary (``Rotary``): q and the new k are rotated at their position on the first ``dim`` dims,
  GPT-NeoX halves or GPT-J interleaved pairs, by the angle ``position * inv_freq[i]`` (fp32), with
  ``inv_freq`` a table (any rotary variant: linear, llama3, YaRN, ...) or ``1 / theta ** (2i /
  dim)``, and cos and sin times ``attention_factor`` (YaRN's, 1 by default);
- ``scale``: ``s = q . k * scale`` (default ``1 / sqrt(head_dim)``);
- ``softcap``: ``s = softcap * tanh(s / softcap)``;
- ``alibi_slopes`` (fp32 ``[Hq]``): ``s += slope[h] * (t - pos)``;
- ``window``: only slots ``t > pos - window`` are attended (``window`` slots, the new one's included);
- ``sinks`` (fp32 ``[Hq]``): ``exp(sink[h])`` joins the softmax's denominator with no value;
- ``epilogue`` (``mmha.epilogue.OutEpilogue``): shift, smooth and quantisation of the output.

fp8 (e4m3) caches store ``saturate(x / scale[h])`` rounded to nearest (ties to even) and are read
as ``cached * scale[h]``. Row modes (``row_active``): ``ROW_IDLE`` rows take no part (nothing
written, zero output, lse ``-inf``), ``ROW_STEP`` rows append and attend, ``ROW_ATTEND`` rows
attend to slots ``0 .. pos - 1`` only and write nothing.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from ._constants import FP8_MAX, ROW_ATTEND, ROW_IDLE, ROW_STEP
from .epilogue import FP8, OutEpilogue

ROW_MODES = (ROW_IDLE, ROW_STEP, ROW_ATTEND)

__all__ = [
    "FP8",
    "FP8_MAX",
    "PLAIN",
    "QKNorm",
    "ROW_ATTEND",
    "ROW_IDLE",
    "ROW_MODES",
    "ROW_STEP",
    "AttentionSpec",
    "Rotary",
    "alibi_slopes",
    "dequantize_fp8",
    "layer_specs",
    "fp8_scale",
    "quantize_fp8",
]


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True, eq=False)
class Rotary:
    """Rotary embedding on the first ``dim`` dims of q and k (``dim = 0``: none): angle
    ``position * inv_freq[i]`` in fp32, with ``inv_freq`` the given table (fp32 ``[dim // 2]``,
    finite; transformers' ``rotary_emb.inv_freq`` for any of its variants) or ``1 / theta ** (2i /
    dim)``; cos and sin are multiplied by ``attention_factor`` (transformers'
    ``attention_scaling``: YaRN's, longrope's). ``interleaved`` rotates GPT-J pairs ``(2i, 2i +
    1)``, else GPT-NeoX halves ``(i, i + dim / 2)``.

    A table of several rows, ``[rows, dim // 2]``, follows the sequence's length (transformers'
    dynamic NTK and longrope, whose frequencies change with it): a step whose new token sits at
    position ``p`` (a sequence of ``n = p + 1`` tokens) rotates by row ``min(max(n - table_start,
    0), rows - 1)``. One-token steps only (a tree step's nodes have no one length)."""

    dim: int = 0
    theta: float = 10000.0
    interleaved: bool = False
    inv_freq: torch.Tensor | None = None
    attention_factor: float = 1.0
    table_start: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0 or self.dim % 2:
            raise ValueError(f"rotary dim must be an even int >= 0, got {self.dim!r}")
        if not (_is_number(self.theta) and math.isfinite(self.theta) and self.theta > 0):
            raise ValueError(f"rotary theta must be a finite number > 0, got {self.theta!r}")
        if not isinstance(self.interleaved, bool):
            raise ValueError(f"rotary interleaved must be a bool, got {self.interleaved!r}")
        f = self.attention_factor
        if not (_is_number(f) and math.isfinite(f) and f > 0):
            raise ValueError(f"rotary attention_factor must be a finite number > 0, got {f!r}")
        start = self.table_start
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < 2**31:
            raise ValueError(f"rotary table_start must be an int in [0, 2^31), got {start!r}")
        t = self.inv_freq
        if t is not None:
            ok = isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() in (1, 2)
            if not ok or t.shape[-1] != self.dim // 2 or (t.dim() == 2 and t.shape[0] == 0):
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"rotary inv_freq must be a float32 tensor [dim // 2 = {self.dim // 2}] or [rows, "
                    f"{self.dim // 2}], got {got}"
                )
            if not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                raise ValueError(f"rotary inv_freq must be finite, got {bad} non-finite of {t.numel()}")
            object.__setattr__(self, "inv_freq", t.contiguous())

    @property
    def by_length(self) -> bool:
        """Whether the frequencies follow the sequence's length (a table of several rows)."""
        return self.inv_freq is not None and self.inv_freq.dim() == 2 and self.inv_freq.shape[0] > 1

    def same(self, other: Rotary) -> bool:
        """The same rotation (tables compared by value)."""
        if (self.dim, self.theta, self.interleaved, self.attention_factor, self.table_start) != (
            other.dim, other.theta, other.interleaved, other.attention_factor, other.table_start,
        ):  # fmt: skip
            return False
        a, b = self.inv_freq, other.inv_freq
        if a is None or b is None:
            return a is None and b is None
        return a.shape == b.shape and torch.equal(a.cpu(), b.cpu())

    def kernel_table(self, device) -> torch.Tensor | None:
        """The fp32 ``[dim // 2]`` table the kernel reads on ``device``: the given one, or theta's
        frequencies as ``frequencies`` forms them (made once per dim, theta and device, so the
        kernel and the reference rotate by the same fp32 values). None without rotary, or for a
        theta not yet tabled while a CUDA graph is being captured (the kernel then forms theta's
        frequencies itself)."""
        if self.dim == 0:
            return None
        if self.inv_freq is not None:
            return self.inv_freq
        key = (self.dim, self.theta, device)  # as given: a lookup per step and layer, kept cheap
        table = _THETA_TABLES.get(key)
        if table is None:  # the same table for every spelling of the device ("cuda", "cuda:0", ...)
            dev = torch.device(device)
            if dev.type == "cuda" and dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            table = _THETA_TABLES.get((self.dim, self.theta, dev))
            if table is None:
                if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    return None  # a tensor made here would live in the graph's pool
                table = Rotary(self.dim, self.theta).frequencies(torch.float32, dev)
                _THETA_TABLES[(self.dim, self.theta, dev)] = table
            _THETA_TABLES[key] = table
        return table

    def frequencies(self, dtype: torch.dtype, device) -> torch.Tensor:
        """``[dim // 2]`` (or the table's ``[rows, dim // 2]``) in ``dtype`` on ``device``: the
        table, or ``1 / theta ** (2i / dim)``."""
        if self.inv_freq is not None:
            return self.inv_freq.to(device=device, dtype=dtype)
        exponent = torch.arange(0, self.dim, 2, dtype=dtype, device=device) / self.dim
        return 1.0 / torch.pow(torch.tensor(self.theta, dtype=dtype, device=device), exponent)


# Theta's fp32 frequency tables on each device (``Rotary.kernel_table``), by (dim, theta, device).
_THETA_TABLES: dict[tuple, torch.Tensor] = {}


@dataclass(frozen=True, eq=False)
class QKNorm:
    """Per-head RMSNorm of q and of the new k, after ``qkv_bias`` and before rotary (Qwen 3's and
    Gemma 3's ``q_norm`` / ``k_norm``): each head's ``head_dim`` values ``x`` (fp32) become ``n = x
    * rsqrt(mean(x^2) + eps)``, then ``T(T(n) * w)`` (``cast_first``: Llama-style ``weight *
    n.to(dtype)``) or ``T(n * w)`` (Gemma-style ``n * (1 + weight)``), with ``T`` qkv's dtype and
    ``w = weight + offset`` in fp32: what ``mmha.ops.rms_norm`` leaves in the qkv row. ``q_weight``
    and ``k_weight``: ``[head_dim]`` float tensors shared by every head (None: that side as it
    is; at least one given), finite; kept as fp32 ``weight + offset`` (``q_table``,
    ``k_table``), the values the kernel reads."""

    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 1e-6
    offset: float = 0.0
    cast_first: bool = True
    q_table: torch.Tensor | None = field(init=False, default=None, repr=False)
    k_table: torch.Tensor | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.q_weight is None and self.k_weight is None:
            raise ValueError("QKNorm needs q_weight or k_weight (or both), got neither")
        if not (_is_number(self.eps) and math.isfinite(self.eps) and self.eps >= 0):
            raise ValueError(f"QKNorm eps must be a finite number >= 0, got {self.eps!r}")
        if not (_is_number(self.offset) and math.isfinite(self.offset)):
            raise ValueError(f"QKNorm offset must be a finite number, got {self.offset!r}")
        if not isinstance(self.cast_first, bool):
            raise ValueError(f"QKNorm cast_first must be a bool, got {self.cast_first!r}")
        for name in ("q_weight", "k_weight"):
            w = getattr(self, name)
            if w is None:
                object.__setattr__(self, name.replace("weight", "table"), None)
                continue
            if not isinstance(w, torch.Tensor) or w.dim() != 1 or not w.dtype.is_floating_point:
                got = f"{w.dtype} {tuple(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
                raise ValueError(f"QKNorm {name} must be a 1-D float tensor [head_dim], got {got}")
            table = w.detach().float() + float(self.offset)
            if not bool(torch.isfinite(table).all()):
                bad = int((~torch.isfinite(table)).sum())
                raise ValueError(
                    f"QKNorm {name} (+ offset) must be finite, got {bad} non-finite of {w.numel()}"
                )
            object.__setattr__(self, name.replace("weight", "table"), table.contiguous())

    def check_for(self, head_dim: int, device, name: str) -> None:
        for side in ("q", "k"):
            t = getattr(self, f"{side}_table")
            if t is None:
                continue
            if t.numel() != head_dim:
                raise ValueError(
                    f"{name}.qk_norm.{side}_weight must have shape [{head_dim}] (head_dim), "
                    f"got {tuple(t.shape)}"
                )
            if t.device != device:
                raise ValueError(f"{name}.qk_norm.{side}_weight must be on {device}, got {t.device}")

    def apply(self, x: torch.Tensor, side: str, dtype: torch.dtype) -> torch.Tensor:
        """``x [..., head_dim]`` (the compute dtype) normed as the kernel norms side ``"q"`` or
        ``"k"`` for activations of ``dtype`` (unchanged without that side's weight)."""
        t = getattr(self, f"{side}_table")
        if t is None:
            return x
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.cast_first:
            n = n.to(dtype).to(x.dtype)
        return (n * t.to(device=x.device, dtype=x.dtype)).to(dtype).to(x.dtype)


def _checked_head_tensor(name: str, t) -> torch.Tensor | None:
    """A per-query-head fp32 tensor, contiguous and finite (its values read once, here)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 1-D float32 tensor [num_heads] (one per query head), got {got}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must be finite, got {t.tolist()}")
    return t.contiguous()


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """One layer's attention (module docstring): ``rotary`` (a ``Rotary``), ``qk_norm`` (a
    ``QKNorm`` or None), ``scale`` (None:
    ``1 / sqrt(head_dim)``), ``window`` (int >= 1 or None), ``softcap`` (finite > 0 or None),
    ``alibi_slopes`` and ``sinks`` (fp32 ``[Hq]`` or None), ``epilogue`` (``OutEpilogue`` or
    None). Checked when built (the tensors' values are read once); ``check_for`` checks that it
    fits a layer's heads and device. The tensors must not change afterwards."""

    rotary: Rotary = field(default_factory=Rotary)
    scale: float | None = None
    window: int | None = None
    softcap: float | None = None
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    epilogue: OutEpilogue | None = None
    qk_norm: QKNorm | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rotary, Rotary):
            raise ValueError(f"rotary must be a mmha.Rotary, got {type(self.rotary).__name__}")
        if self.qk_norm is not None and not isinstance(self.qk_norm, QKNorm):
            raise ValueError(f"qk_norm must be a mmha.spec.QKNorm or None, got {type(self.qk_norm).__name__}")
        if self.scale is not None and not (_is_number(self.scale) and math.isfinite(self.scale)):
            raise ValueError(f"scale must be a finite number or None, got {self.scale!r}")
        w = self.window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(
                f"window must be an int >= 1 (slots attended, the new token's included), got {w!r}"
            )
        cap = self.softcap
        if cap is not None and not (_is_number(cap) and math.isfinite(cap) and cap > 0):
            raise ValueError(f"softcap must be a finite number > 0, got {cap!r}")
        object.__setattr__(self, "alibi_slopes", _checked_head_tensor("alibi_slopes", self.alibi_slopes))
        object.__setattr__(self, "sinks", _checked_head_tensor("sinks", self.sinks))
        if self.epilogue is not None and not isinstance(self.epilogue, OutEpilogue):
            raise ValueError(
                f"epilogue must be a mmha.epilogue.OutEpilogue or None, got {type(self.epilogue).__name__}"
            )

    # ------------------------------------------------------------------ queries
    @property
    def has_mods(self) -> bool:
        """Whether any score modifier (window, soft-cap, ALiBi, sinks) is set."""
        return any(x is not None for x in (self.window, self.softcap, self.alibi_slopes, self.sinks))

    def scale_for(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim) if self.scale is None else float(self.scale)

    def first_slot(self, pos: int) -> int:
        """The first slot the query at ``pos`` attends to."""
        return 0 if self.window is None else max(0, pos - self.window + 1)

    def check_for(self, num_heads: int, head_dim: int, device, name: str = "attention") -> None:
        """The spec fits a layer of ``num_heads`` query heads of ``head_dim`` on ``device``
        (ValueError naming ``name`` and the field otherwise)."""
        device = torch.device(device)
        if self.rotary.dim > head_dim:
            raise ValueError(f"{name}.rotary.dim must be <= head_dim ({head_dim}), got {self.rotary.dim}")
        table = self.rotary.inv_freq
        if table is not None and table.device != device:
            raise ValueError(f"{name}.rotary.inv_freq must be on {device}, got {table.device}")
        if self.qk_norm is not None:
            self.qk_norm.check_for(head_dim, device, name)
        for field_name in ("alibi_slopes", "sinks"):
            t = getattr(self, field_name)
            if t is None:
                continue
            if t.shape != (num_heads,):
                raise ValueError(
                    f"{name}.{field_name} must have shape [{num_heads}] (one per query head), "
                    f"got {tuple(t.shape)}"
                )
            if t.device != device:
                raise ValueError(f"{name}.{field_name} must be on {device}, got {t.device}")
        if self.epilogue is not None:
            try:
                self.epilogue.check_for(num_heads, head_dim, device)
            except ValueError as e:
                raise ValueError(f"{name}.{e}") from None

    # ------------------------------------------------------------------ derived specs
    def replace(self, **changes) -> AttentionSpec:
        """A copy with ``changes`` (checked as a new spec)."""
        return dataclasses.replace(self, **changes)

    def select_heads(self, first: int, last: int, head_dim: int) -> AttentionSpec:
        """The spec of query heads ``first .. last - 1`` alone (their ALiBi slopes, sinks and
        epilogue channels): what a rank holding those heads computes."""
        epilogue = (
            None if self.epilogue is None else self.epilogue.channels_of(first * head_dim, last * head_dim)
        )
        return self.replace(
            alibi_slopes=None if self.alibi_slopes is None else self.alibi_slopes[first:last],
            sinks=None if self.sinks is None else self.sinks[first:last],
            epilogue=epilogue,
        )

    def kernel_args(self, head_dim: int, device) -> dict:
        """The raw operator's arguments for this spec on ``device`` (each modifier off at its
        zero; the rotation always as a frequency table, ``Rotary.kernel_table``)."""
        r = self.rotary
        args = dict(
            scale=self.scale_for(head_dim), rotary_dim=r.dim, rotary_theta=float(r.theta),
            rotary_interleaved=r.interleaved, window=self.window or 0, softcap=float(self.softcap or 0.0),
            alibi_slopes=self.alibi_slopes, sinks=self.sinks,
            rotary_inv_freq=r.kernel_table(device), rotary_factor=float(r.attention_factor),
            rotary_table_start=r.table_start,
        )  # fmt: skip
        if self.qk_norm is not None:
            n = self.qk_norm
            args.update(q_norm_weight=n.q_table, k_norm_weight=n.k_table, qk_norm_eps=float(n.eps),
                        qk_norm_cast_first=n.cast_first)  # fmt: skip
        if self.epilogue is not None:
            args.update(self.epilogue.kernel_args())
        return args


PLAIN = AttentionSpec()


def layer_specs(attention, num_layers: int, rotary: Rotary, scale=None) -> tuple[AttentionSpec, ...]:
    """One spec per layer: ``attention`` (one for every layer, or a sequence of ``num_layers``), or,
    without it, one built from a cache's ``rotary`` and ``scale`` arguments."""
    if attention is None:
        return (AttentionSpec(rotary=rotary, scale=scale),) * num_layers
    if not rotary.same(Rotary()) or scale is not None:
        raise ValueError(
            "rotary_dim, rotary_theta, rotary_interleaved and scale must be left out with attention="
        )
    if isinstance(attention, AttentionSpec):
        return (attention,) * num_layers
    specs = tuple(attention)
    if len(specs) != num_layers:
        raise ValueError(
            f"attention must be one AttentionSpec or {num_layers} (one per layer), got {len(specs)}"
        )
    return specs


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


# ---------------------------------------------------------------------- fp8 storage
def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., Hkv, D]`` (any float dtype) -> e4m3 of ``x / scale[h]`` computed in fp32,
    saturated to +-448, rounded to nearest (ties to even). ``scale [Hkv]`` fp32."""
    y = x.float() / scale.float()[:, None]
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x [Hkv, ..., D]`` e4m3 -> ``x * scale[h]`` in ``dtype``."""
    shape = (-1,) + (1,) * (x.dim() - 1)
    return x.to(dtype) * scale.to(dtype).reshape(shape)


def fp8_scale(amax: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
    """Per-head scales that map ``amax * margin`` to 448 (1 where ``amax`` is 0 or not finite),
    fp32 on ``amax``'s device; computed on the host in fp64, so every device gives the same bits."""
    s = (amax.detach().double().cpu() * margin / FP8_MAX).float()
    s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
    return s.to(amax.device)
