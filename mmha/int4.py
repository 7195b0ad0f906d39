"""The int4 K/V cache format and its reference step (plain torch): the oracle an int4 kernel is
checked against.

The format (chosen by the accuracy numbers in ``docs/status.md``, "INT8 / INT4 caches"):

- **V per token**, asymmetric: each appended token's value vector of one kv head is stored as 4-bit
  codes with a scale and a zero point of its own (``mmha.quant.quantize(v, 4, symmetric=False)``:
  ``scale = (max - min) / 15``, ``zero = min``, read back as ``code * scale + zero``).
- **K per channel over groups of ``GROUP`` (64) tokens**, asymmetric (KIVI): slots ``64 g .. 64 g
  + 63`` of a kv head share, per channel, one scale and one zero point over those 64 tokens, so an
  outlier channel costs only its own range. A group is quantised once it is full, by the append
  that writes its last slot; until then the row's partial group lives in a **residual** of
  ``GROUP`` slots per (row, kv head), rounded to the activations' dtype, and attention reads those
  slots from it. The group is quantised from the residual's values (so a kernel that quantises
  from its 16-bit residual gives the same codes).
- Codes two a byte, the even channel in the low nibble: V ``[B, Hkv, S_max, D / 2]``; K in the
  x-layout's 16-byte chunks, 32 channels a chunk: ``[B, Hkv, D / 32, S_max, 16]``.
- Scales and zero points fp32 beside the slots: K ``[B, Hkv, S_max / 64, D]`` each, V ``[B, Hkv,
  S_max]`` each. Capacities are whole groups (``S_max`` a multiple of 64), head dims whole chunks
  (a multiple of 32).

At every committed length ``L`` of a row: groups ``0 .. L // 64 - 1`` hold codes, the residual's
first ``L % 64`` entries hold slots ``64 (L // 64) .. L - 1``. Non-finite K or V reads back
non-finite (a non-finite value makes its scale non-finite, ``mmha.quant``); nothing saturates.

This module holds one-token steps over contiguous caches (``decode_step``) and the prompt's write
(``Int4Cache.prefill``), equal to appending the prompt one token at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import checks, quant, reference
from .spec import PLAIN, ROW_IDLE, ROW_STEP, AttentionSpec

GROUP = 64  # K tokens sharing a channel's scale and zero point (a tile of the kernel's loop)
CHUNK = 32  # channels in one 16-byte chunk of the K layout
LEVELS = 15  # the largest 4-bit code
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``codes [..., D]`` (integers in ``[0, 15]``) -> uint8 ``[..., D / 2]``, channel ``2 i`` in the
    low nibble of byte ``i`` and ``2 i + 1`` in its high nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``pack_nibbles``'s inverse: uint8 ``[..., D / 2]`` -> uint8 codes ``[..., D]``."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


@dataclass
class Int4Cache:
    """An int4 cache's tensors (shapes in the module docstring); ``dtype`` is the residual's (the
    activations'). Build one with ``Int4Cache.empty``."""

    k_codes: torch.Tensor  # uint8 [B, Hkv, D / 32, S_max, 16]
    v_codes: torch.Tensor  # uint8 [B, Hkv, S_max, D / 2]
    k_scale: torch.Tensor  # fp32 [B, Hkv, S_max / 64, D]
    k_zero: torch.Tensor  # fp32 [B, Hkv, S_max / 64, D]
    v_scale: torch.Tensor  # fp32 [B, Hkv, S_max]
    v_zero: torch.Tensor  # fp32 [B, Hkv, S_max]
    k_residual: torch.Tensor  # [B, Hkv, 64, D] in the activations' dtype

    @classmethod
    def empty(cls, batch: int, num_kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> Int4Cache:  # fmt: skip
        """Zeroed tensors for ``batch`` rows of ``max_seq_len`` slots (a multiple of 64) and head dim
        ``head_dim`` (a multiple of 32); ``dtype``: the activations' (fp16, bf16 or fp32)."""
        for name, value in (("batch", batch), ("num_kv_heads", num_kv_heads), ("max_seq_len", max_seq_len),
                            ("head_dim", head_dim)):  # fmt: skip
            checks.positive_int(name, value)
        if max_seq_len % GROUP:
            raise ValueError(f"max_seq_len must be a multiple of {GROUP} for an int4 cache (whole K groups), "
                             f"got {max_seq_len}")  # fmt: skip
        if head_dim % CHUNK:
            raise ValueError(f"head_dim must be a multiple of {CHUNK} for an int4 cache (16-byte chunks of "
                             f"4-bit codes), got {head_dim}")  # fmt: skip
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
        b, h, s, d = batch, num_kv_heads, max_seq_len, head_dim
        f32 = {"dtype": torch.float32, "device": device}
        return cls(
            k_codes=torch.zeros(b, h, d // CHUNK, s, CHUNK // 2, dtype=torch.uint8, device=device),
            v_codes=torch.zeros(b, h, s, d // 2, dtype=torch.uint8, device=device),
            k_scale=torch.zeros(b, h, s // GROUP, d, **f32),
            k_zero=torch.zeros(b, h, s // GROUP, d, **f32),
            v_scale=torch.zeros(b, h, s, **f32),
            v_zero=torch.zeros(b, h, s, **f32),
            k_residual=torch.zeros(b, h, GROUP, d, dtype=dtype, device=device),
        )

    @property
    def batch(self) -> int:
        return self.v_codes.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.v_codes.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.v_codes.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_residual.shape[-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_residual.dtype

    def store_v(self, row: int, slots: slice, v: torch.Tensor) -> None:
        """Values ``v [Hkv, n, D]`` of slots ``slots`` of ``row``, quantised per token."""
        codes, scale, zero = quant.quantize(v, 4, symmetric=False)
        self.v_codes[row, :, slots] = pack_nibbles(codes)
        self.v_scale[row, :, slots] = scale
        self.v_zero[row, :, slots] = zero

    def store_k_group(self, row: int, group: int, k: torch.Tensor) -> None:
        """Keys ``k [Hkv, 64, D]`` (the activations' dtype) of group ``group`` of ``row``, quantised
        per channel over the group's tokens."""
        codes, scale, zero = quant.quantize(k.transpose(-1, -2), 4, symmetric=False)  # over tokens
        h, d = k.shape[0], k.shape[-1]
        packed = pack_nibbles(codes.transpose(-1, -2))  # [Hkv, 64, D / 2]
        chunks = packed.reshape(h, GROUP, d // CHUNK, CHUNK // 2).permute(0, 2, 1, 3)
        self.k_codes[row, :, :, group * GROUP : (group + 1) * GROUP, :] = chunks
        self.k_scale[row, :, group] = scale
        self.k_zero[row, :, group] = zero

    def append(self, row: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """One token's ``k, v [Hkv, D]`` (after rotary, any float dtype) at ``slot`` of ``row``: V
        quantised, K into the residual, and the group quantised when ``slot`` is its last."""
        self.store_v(row, slice(slot, slot + 1), v[:, None, :])
        self.k_residual[row, :, slot % GROUP] = k.to(self.dtype)
        if slot % GROUP == GROUP - 1:
            self.store_k_group(row, slot // GROUP, self.k_residual[row])

    def prefill(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A prompt's ``k, v [Hkv, n, D]`` (after rotary) as slots ``0 .. n - 1`` of ``row``: the same
        codes, scales and residual as ``append`` of each token in turn."""
        n = k.shape[1]
        if not 0 <= n <= self.max_seq_len:
            raise ValueError(f"a prompt of {n} tokens does not fit max_seq_len {self.max_seq_len}")
        self.store_v(row, slice(0, n), v)
        rounded = k.to(self.dtype)
        full = n // GROUP
        for g in range(full):
            self.store_k_group(row, g, rounded[:, g * GROUP : (g + 1) * GROUP])
        self.k_residual[row, :, : n - full * GROUP] = rounded[:, full * GROUP :]

    def read(self, row: int, n: int, compute_dtype: torch.dtype = torch.float32):
        """Slots ``0 .. n - 1`` of ``row`` as attention reads them, ``(keys, values)`` ``[Hkv, n, D]``
        in ``compute_dtype``: whole groups and V dequantised, the partial group from the residual."""
        h, d = self.num_kv_heads, self.head_dim
        full = n // GROUP * GROUP
        chunks = self.k_codes[row, :, :, :full, :]  # [Hkv, D / 32, full, 16]
        codes = unpack_nibbles(chunks.permute(0, 2, 1, 3).reshape(h, full, d // 2)).to(compute_dtype)
        groups = full // GROUP
        k_scale = self.k_scale[row, :, :groups].to(compute_dtype).repeat_interleave(GROUP, dim=1)
        k_zero = self.k_zero[row, :, :groups].to(compute_dtype).repeat_interleave(GROUP, dim=1)
        keys = torch.cat(
            (codes * k_scale + k_zero, self.k_residual[row, :, : n - full].to(compute_dtype)), dim=1
        )
        values = quant.dequantize(
            unpack_nibbles(self.v_codes[row, :, :n]), self.v_scale[row, :, :n], self.v_zero[row, :, :n],
            compute_dtype,
        )  # fmt: skip
        return keys, values


def decode_step(
    qkv: torch.Tensor,
    cache: Int4Cache,
    lengths: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    attention: AttentionSpec = PLAIN,
    qkv_bias: torch.Tensor | None = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    row_active: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``mmha.reference.decode_step`` over an int4 cache: append each stepping row's new K/V at slot
    ``lengths[b]`` (``Int4Cache.append``) and attend to slots ``0 .. lengths[b]`` as
    ``Int4Cache.read`` gives them. Arguments and row modes as there; every check runs before
    anything is written."""
    b, hkv, s_max, d = cache.batch, cache.num_kv_heads, cache.max_seq_len, cache.head_dim
    if num_kv_heads != hkv:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must equal the cache's kv heads ({hkv})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    if qkv.shape != (b, (num_heads + 2 * num_kv_heads) * d):
        raise ValueError(
            f"qkv must have shape [{b}, {(num_heads + 2 * num_kv_heads) * d}], got {tuple(qkv.shape)}"
        )
    if qkv.dtype != cache.dtype:
        raise ValueError(f"qkv must have the cache's activation dtype {cache.dtype}, got {qkv.dtype}")
    checks.attention_spec(attention, num_heads, d, qkv.device)
    modes = checks.row_modes(row_active, b)
    pos_list, rot_pos = reference.step_positions(lengths, positions, modes, s_max, b)
    x = qkv.to(compute_dtype)
    if qkv_bias is not None:
        x = x + qkv_bias.to(compute_dtype)
    pos = torch.tensor(rot_pos, device=qkv.device)
    q, k, v = reference.project_tokens(x, pos, num_heads, num_kv_heads, d, attention, qkv.dtype)
    scale = attention.scale_for(d)
    outs, lses = [], []
    for row, p in enumerate(pos_list):
        keys_end = p + 1 if modes[row] == ROW_STEP else p
        if modes[row] == ROW_IDLE or keys_end <= attention.first_slot(p):  # takes no part
            outs.append(torch.zeros(num_heads * d, dtype=compute_dtype, device=qkv.device))
            lses.append(torch.full((num_heads,), -math.inf, dtype=compute_dtype, device=qkv.device))
            continue
        if modes[row] == ROW_STEP:
            cache.append(row, p, k[row], v[row])
        keys, values = cache.read(row, keys_end, compute_dtype)
        o, lse = reference.attend(q[row], keys, values, scale, attention, p)
        outs.append(o.reshape(-1))
        lses.append(lse)
    out = reference.finish(torch.stack(outs), qkv.dtype, attention)
    return (out, torch.stack(lses).float()) if return_lse else out
