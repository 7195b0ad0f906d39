"""The int4 K/V cache format and its reference step (plain torch): the oracle an int4 kernel is
checked against.

The format (chosen by the accuracy numbers in ``docs/status.md``, "INT8 / INT4 caches"):

- **V per token**, asymmetric: each appended token's value vector of one kv head is stored as 4-bit
  codes with a scale and a zero point of its own (``mmha.quant.quantize(v, 4, symmetric=False)``:
  ``scale = (max - min) / 15``, ``zero = min``, read back as ``code * scale + zero``).
- **K per channel over groups of ``GROUP`` (64) tokens**, asymmetric (KIVI): slots ``64 g .. 64 g
  + 63`` of a kv head share, per channel, one scale and one zero point over those 64 tokens, so an
  outlier channel costs only its own range. A group is quantised once it is full and committed:
  by the one-token step that writes its last slot, or by the ``accept`` of a tree step whose kept
  nodes reach it. Until then its keys live in a **residual** of ``RESIDUAL`` (two groups) slots
  per (row, kv head), rounded to the activations' dtype: slot ``s`` at entry ``s % 128``, so the
  row's partial group and a tree step's up to 64 nodes past it fit without moving anything.
  Attention reads those slots from it. A group is quantised from the residual's values (so a
  kernel that quantises from its 16-bit residual gives the same codes).
- Codes two a byte: V ``[B, Hkv, S_max, D / 2]``, the even channel in the low nibble; K in the
  x-layout's 16-byte chunks, 32 channels a chunk: ``[B, Hkv, D / 32, S_max, 16]``, each 4-byte
  word of a chunk holding 8 channels with their nibbles (low to high) in the order ``K_NIBBLES``
  (0, 4, 2, 6, 1, 5, 3, 7): one mask of a word then gives the kernel channels ``2 i, 2 i + 1``
  side by side, the pairs its scales, zero points and q lie in (``pack_k`` / ``unpack_k``).
- Scales and zero points fp16 (``SCALE_DTYPE``) beside the slots: K ``[B, Hkv, S_max / 64, D]``
  each, V ``[B, Hkv, S_max]`` each; each is rounded to fp16 before the codes are chosen with it
  (``quant.quantize(..., scale_dtype=)``). With fp32 ones the format would move 0.297 of a 16-bit
  cache's bytes at head dim 128 (K's scales and zero points alone D / 8 bytes a token), against
  the 0.30 the kernel is asked to reach; fp16 ones make it 0.273 and measured as fp32's in the
  accuracy study (``docs/status.md``, item 3). Capacities are whole groups (``S_max`` a multiple of
  64), head dims whole chunks (a multiple of 32).

At every committed length ``L`` of a row: groups ``0 .. L // 64 - 1`` hold codes, the residual
holds slots ``64 (L // 64) .. L - 1`` (and a tree step's nodes, ``L ..``, until ``accept``).
Non-finite K or V reads back non-finite (a non-finite value makes its scale non-finite,
``mmha.quant``), and so does a finite value past fp16's largest (65504: its token's V scale, or
its K group's channel scale, is stored infinite, the format's range); the steps flag both
(``mmha.backends``); nothing saturates.

This module holds one-token steps (``decode_step``) and tree steps (``decode_tree``, then
``Int4Cache.accept``) over contiguous caches, and the prompt's write (``Int4Cache.prefill``),
equal to appending the prompt one token at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import checks, quant, reference, tree
from ._constants import MAX_TREE_NODES
from .spec import PLAIN, AttentionSpec

INT4 = "int4"  # the name a cache takes it by: KVCache(kv_dtype="int4")
GROUP = 64  # K tokens sharing a channel's scale and zero point (a tile of the kernel's loop)
RESIDUAL = GROUP + MAX_TREE_NODES  # 16-bit K slots per (row, kv head): the partial group, a tree's nodes
CHUNK = 32  # channels in one 16-byte chunk of the K layout
LEVELS = 15  # the largest 4-bit code
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCALE_DTYPE = torch.float16  # scales and zero points (K's per group and channel, V's per token)
SCALE_MAX = torch.finfo(SCALE_DTYPE).max  # a K or V value past it reads back non-finite


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``codes [..., D]`` (integers in ``[0, 15]``) -> uint8 ``[..., D / 2]``, channel ``2 i`` in the
    low nibble of byte ``i`` and ``2 i + 1`` in its high nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``pack_nibbles``'s inverse: uint8 ``[..., D / 2]`` -> uint8 codes ``[..., D]``."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# A K word's 8 nibbles, low to high: the channels (of its 8) they hold. Nibbles 2 j and 4 + 2 j of a
# word (one mask of it shifted by 8 j) are channels 2 j, 2 j + 1, nibbles 2 j + 1 and 5 + 2 j
# channels 2 j + 4, 2 j + 5 (j = 0, 1): byte b holds channels b' and b' + 4, b' = 0, 2, 1, 3.
K_NIBBLES = (0, 4, 2, 6, 1, 5, 3, 7)
_K_PLACES = tuple(K_NIBBLES.index(c) for c in range(8))  # channel -> its nibble in the word


def pack_k(codes: torch.Tensor) -> torch.Tensor:
    """K's codes ``[..., D]`` (integers in ``[0, 15]``, D a multiple of 8) -> uint8 ``[..., D / 2]``
    in K's nibble order (``K_NIBBLES`` in each 4 bytes)."""
    d = codes.shape[-1]
    order = torch.tensor(K_NIBBLES, device=codes.device)
    return pack_nibbles(codes.reshape(*codes.shape[:-1], d // 8, 8)[..., order].reshape(codes.shape))


def unpack_k(packed: torch.Tensor) -> torch.Tensor:
    """``pack_k``'s inverse: uint8 ``[..., D / 2]`` -> uint8 codes ``[..., D]`` in channel order."""
    codes = unpack_nibbles(packed)
    d = codes.shape[-1]
    places = torch.tensor(_K_PLACES, device=packed.device)
    return codes.reshape(*codes.shape[:-1], d // 8, 8)[..., places].reshape(codes.shape)


@dataclass
class Int4Cache:
    """An int4 cache's tensors (shapes in the module docstring); ``dtype`` is the residual's (the
    activations'). Build one with ``Int4Cache.empty``."""

    k_codes: torch.Tensor  # uint8 [B, Hkv, D / 32, S_max, 16]
    v_codes: torch.Tensor  # uint8 [B, Hkv, S_max, D / 2]
    k_scale: torch.Tensor  # fp16 [B, Hkv, S_max / 64, D]
    k_zero: torch.Tensor  # fp16 [B, Hkv, S_max / 64, D]
    v_scale: torch.Tensor  # fp16 [B, Hkv, S_max]
    v_zero: torch.Tensor  # fp16 [B, Hkv, S_max]
    k_residual: torch.Tensor  # [B, Hkv, 128, D] in the activations' dtype, slot s at s % 128

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
        f16 = {"dtype": SCALE_DTYPE, "device": device}
        return cls(
            k_codes=torch.zeros(b, h, d // CHUNK, s, CHUNK // 2, dtype=torch.uint8, device=device),
            v_codes=torch.zeros(b, h, s, d // 2, dtype=torch.uint8, device=device),
            k_scale=torch.zeros(b, h, s // GROUP, d, **f16),
            k_zero=torch.zeros(b, h, s // GROUP, d, **f16),
            v_scale=torch.zeros(b, h, s, **f16),
            v_zero=torch.zeros(b, h, s, **f16),
            k_residual=torch.zeros(b, h, RESIDUAL, d, dtype=dtype, device=device),
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
        codes, scale, zero = quant.quantize(v, 4, symmetric=False, scale_dtype=SCALE_DTYPE)
        self.v_codes[row, :, slots] = pack_nibbles(codes)
        self.v_scale[row, :, slots] = scale
        self.v_zero[row, :, slots] = zero

    def store_k_group(self, row: int, group: int, k: torch.Tensor) -> None:
        """Keys ``k [Hkv, 64, D]`` (the activations' dtype) of group ``group`` of ``row``, quantised
        per channel over the group's tokens."""
        codes, scale, zero = quant.quantize(k.transpose(-1, -2), 4, symmetric=False, scale_dtype=SCALE_DTYPE)
        h, d = k.shape[0], k.shape[-1]
        packed = pack_k(codes.transpose(-1, -2))  # [Hkv, 64, D / 2]
        chunks = packed.reshape(h, GROUP, d // CHUNK, CHUNK // 2).permute(0, 2, 1, 3)
        self.k_codes[row, :, :, group * GROUP : (group + 1) * GROUP, :] = chunks
        self.k_scale[row, :, group] = scale
        self.k_zero[row, :, group] = zero

    def write(self, row: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """One token's ``k, v [Hkv, D]`` (after rotary, any float dtype) at ``slot`` of ``row``: V
        quantised, K into the residual (uncommitted: ``commit`` quantises its group)."""
        self.store_v(row, slice(slot, slot + 1), v[:, None, :])
        self.k_residual[row, :, slot % RESIDUAL] = k.to(self.dtype)

    def commit(self, row: int, start: int, end: int) -> None:
        """Slots ``start .. end - 1`` of ``row`` become part of its sequence (its length goes from
        ``start`` to ``end``): every group whose last slot is among them is quantised from the
        residual."""
        for g in range(start // GROUP, end // GROUP):
            first = g * GROUP % RESIDUAL
            self.store_k_group(row, g, self.k_residual[row, :, first : first + GROUP])

    def append(self, row: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A one-token step's append: ``write`` then ``commit`` of that slot (the group is quantised
        when ``slot`` is its last)."""
        self.write(row, slot, k, v)
        self.commit(row, slot, slot + 1)

    def accept(self, row: int, length: int, path: list[int]) -> None:
        """After a tree step at ``length``: the nodes of ``path`` (increasing node indices, root
        first, as a tree's root-to-leaf paths are) move to slots ``length .. length + len(path) -
        1``, V's codes, scales and zero points and K's residual entries, then those slots are
        committed. The row's length becomes ``length + len(path)`` (kept by the caller)."""
        if any(t < j for j, t in enumerate(path)):  # checked before anything moves
            raise ValueError(f"path must hold increasing node indices from the root, got {path}")
        for j, t in enumerate(path):
            src, dst = length + t, length + j
            for plane in (self.v_codes, self.v_scale, self.v_zero):
                plane[row, :, dst] = plane[row, :, src]
            self.k_residual[row, :, dst % RESIDUAL] = self.k_residual[row, :, src % RESIDUAL]
        self.commit(row, length, length + len(path))

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
        for s in range(full * GROUP, n):  # the partial group, at its ring entries
            self.k_residual[row, :, s % RESIDUAL] = rounded[:, s]

    def read(
        self, row: int, n: int, compute_dtype: torch.dtype = torch.float32, committed: int | None = None
    ):
        """Slots ``0 .. n - 1`` of ``row`` as attention reads them, ``(keys, values)`` ``[Hkv, n, D]``
        in ``compute_dtype``: V dequantised, K of the groups below ``committed`` (the row's length;
        default ``n``) dequantised, the rest from the residual."""
        h, d = self.num_kv_heads, self.head_dim
        full = (n if committed is None else committed) // GROUP * GROUP
        chunks = self.k_codes[row, :, :, :full, :]  # [Hkv, D / 32, full, 16]
        codes = unpack_k(chunks.permute(0, 2, 1, 3).reshape(h, full, d // 2)).to(compute_dtype)
        groups = full // GROUP
        k_scale = self.k_scale[row, :, :groups].to(compute_dtype).repeat_interleave(GROUP, dim=1)
        k_zero = self.k_zero[row, :, :groups].to(compute_dtype).repeat_interleave(GROUP, dim=1)
        ring = torch.arange(full, n, device=self.k_residual.device) % RESIDUAL
        recent = self.k_residual[row][:, ring].to(compute_dtype)
        keys = torch.cat((codes * k_scale + k_zero, recent), dim=1)
        values = quant.dequantize(
            unpack_nibbles(self.v_codes[row, :, :n]), self.v_scale[row, :, :n], self.v_zero[row, :, :n],
            compute_dtype,
        )  # fmt: skip
        return keys, values


def check_step(qkv, batch: int, cache_heads: int, head_dim: int, dtype, num_heads: int, num_kv_heads: int,
               attention: AttentionSpec, row_active) -> list[int]:  # fmt: skip
    """A one-token step's checks of its arguments against a cache of ``batch`` rows, ``cache_heads``
    kv heads, ``head_dim`` and activation ``dtype``: raises ValueError naming the argument; returns
    the row modes."""
    if num_kv_heads != cache_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must equal the cache's kv heads ({cache_heads})")
    if qkv.dtype != dtype:
        raise ValueError(f"qkv must have the cache's activation dtype {dtype}, got {qkv.dtype}")
    return checks.step_args(qkv, batch, head_dim, num_heads, num_kv_heads, attention, row_active)


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
    b, s_max, d = cache.batch, cache.max_seq_len, cache.head_dim
    modes = check_step(
        qkv, b, cache.num_kv_heads, d, cache.dtype, num_heads, num_kv_heads, attention, row_active
    )
    pos_list, rot_pos = reference.step_positions(lengths, positions, modes, s_max, b)
    x = qkv.to(compute_dtype)
    if qkv_bias is not None:
        x = x + qkv_bias.to(compute_dtype)
    pos = torch.tensor(rot_pos, device=qkv.device)
    q, k, v = reference.project_tokens(x, pos, num_heads, num_kv_heads, d, attention, qkv.dtype)
    out, lse = reference.step_rows(
        q, pos_list, modes, attention, lambda row, p: cache.append(row, p, k[row], v[row]),
        lambda row, n: cache.read(row, n, compute_dtype),
    )  # fmt: skip
    out = reference.finish(out, qkv.dtype, attention)
    return (out, lse.float()) if return_lse else out


def decode_tree(
    qkv: torch.Tensor,
    cache: Int4Cache,
    lengths: torch.Tensor,
    parents: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    attention: AttentionSpec = PLAIN,
    node_counts: list[int] | None = None,
    qkv_bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``mmha.reference.decode_tree`` over an int4 cache: node ``t`` of row ``b`` is written at slot
    ``lengths[b] + t`` (``Int4Cache.write``: V quantised, K in the residual, nothing committed)
    and attends to the committed slots and its ancestors' as ``Int4Cache.read`` gives them;
    ``Int4Cache.accept`` then keeps a path. Arguments as there; every check runs before anything
    is written."""
    b, s_max, d = cache.batch, cache.max_seq_len, cache.head_dim
    if num_kv_heads != cache.num_kv_heads:
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) must equal the cache's kv heads ({cache.num_kv_heads})"
        )
    width = (num_heads + 2 * num_kv_heads) * d
    if qkv.dim() != 3 or qkv.shape[0] != b or qkv.shape[2] != width:
        raise ValueError(f"qkv must have shape [{b}, T, {width}], got {tuple(qkv.shape)}")
    if qkv.dtype != cache.dtype:
        raise ValueError(f"qkv must have the cache's activation dtype {cache.dtype}, got {qkv.dtype}")
    checks.attention_spec(attention, num_heads, d, qkv.device)
    checks.tree_spec(attention)
    rows = tree.check_parents(parents, b, node_counts)  # at most MAX_TREE_NODES: the residual holds them
    if qkv.shape[1] != parents.shape[1]:
        raise ValueError(f"qkv must have T = {parents.shape[1]} nodes (parents' width), got {qkv.shape[1]}")
    pos_list = [int(p) for p in lengths.tolist()]
    for row, p in enumerate(pos_list):
        if not 0 <= p <= s_max - len(rows[row]):
            raise ValueError(
                f"lengths[{row}] + node count must fit the capacity: {p} + {len(rows[row])} > {s_max}"
                if p >= 0 else f"lengths[{row}] must be >= 0, got {p}"
            )  # fmt: skip
    x = qkv.to(compute_dtype)
    if qkv_bias is not None:
        x = x + qkv_bias.to(compute_dtype)
    out = torch.zeros(b, qkv.shape[1], num_heads * d, dtype=compute_dtype, device=qkv.device)
    lse = torch.full((b, qkv.shape[1], num_heads), -math.inf, dtype=compute_dtype, device=qkv.device)
    for row, p in enumerate(pos_list):
        par = rows[row]
        n = len(par)
        pos = torch.tensor([p + depth for depth in tree.depths(par)], device=qkv.device)
        q, k, v = reference.project_tokens(x[row, :n], pos, num_heads, num_kv_heads, d, attention, qkv.dtype)
        for t in range(n):
            cache.write(row, p + t, k[t], v[t])
        keys, values = cache.read(row, p + n, compute_dtype, committed=p)
        out[row, :n], lse[row, :n] = reference.tree_attend(q, keys, values, p, par, attention.scale_for(d))
    out = reference.finish(out, qkv.dtype, attention)
    return (out, lse.float()) if return_lse else out
