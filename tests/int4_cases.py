"""Random int4 caches for the GPU tests and the sanitizer cases: rows prefilled through the oracle
(``mmha.int4.Int4Cache.prefill``), everything the rows do not hold poisoned (codes 0xFF, NaN
scales and zero points, NaN residual entries), so a kernel that reads past a row's committed
state or past its length shows it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmha import int4
from mmha.spec import AttentionSpec, Rotary


@dataclass
class Int4Case:
    qkv: torch.Tensor
    cache: int4.Int4Cache
    lengths: torch.Tensor
    num_heads: int
    num_kv_heads: int
    bias: torch.Tensor | None = None
    rotary: dict = field(default_factory=dict)
    mods: dict = field(default_factory=dict)

    def kwargs(self) -> dict:
        spec = AttentionSpec(rotary=Rotary(**self.rotary), **self.mods)
        return dict(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, qkv_bias=self.bias, attention=spec
        )


def clone(cache: int4.Int4Cache) -> int4.Int4Cache:
    return int4.Int4Cache(**{name: getattr(cache, name).clone() for name in PLANES})


PLANES = ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero", "k_residual")


def int4_case(batch, num_heads, num_kv_heads, head_dim, lengths, max_seq_len, dtype, *, seed=0, bias=False,
              rotary_dim=0, rotary_interleaved=False, outliers=True, value_scale=1.0, **mods):  # fmt: skip
    """Rows of ``lengths`` tokens (random K with outlier channels offset by up to 8, V scaled by
    ``value_scale``) and a random step's qkv."""
    g = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(batch, width, generator=g).to(dtype).cuda()
    cache = int4.Int4Cache.empty(batch, num_kv_heads, max_seq_len, head_dim, dtype, "cuda")
    for row, n in enumerate(lengths):
        k = torch.randn(num_kv_heads, n, head_dim, generator=g)
        if outliers:
            k = k + (torch.rand(num_kv_heads, 1, head_dim, generator=g) < 0.1) * 8.0 * torch.randn(
                num_kv_heads, 1, head_dim, generator=g
            )
        v = torch.randn(num_kv_heads, n, head_dim, generator=g) * value_scale
        cache.prefill(row, k.to(dtype).cuda(), v.to(dtype).cuda())
        poison(cache, row, n)
    return Int4Case(
        qkv=qkv,
        cache=cache,
        lengths=torch.tensor(lengths, dtype=torch.int32, device="cuda"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        bias=torch.randn(width, generator=g).to(dtype).cuda() if bias else None,
        rotary=dict(dim=rotary_dim, interleaved=rotary_interleaved) if rotary_dim else {},
        mods=mods,
    )


def poison(cache: int4.Int4Cache, row: int, n: int) -> None:
    """What row ``row`` of length ``n`` does not hold: codes past n 0xFF, the scales and zero points
    of groups not committed and of V slots past n NaN, residual entries outside its partial group NaN."""
    full = n // int4.GROUP
    cache.k_codes[row, :, :, n:] = 0xFF
    cache.v_codes[row, :, n:] = 0xFF
    cache.k_scale[row, :, full:] = float("nan")
    cache.k_zero[row, :, full:] = float("nan")
    cache.v_scale[row, :, n:] = float("nan")
    cache.v_zero[row, :, n:] = float("nan")
    held = {s % int4.RESIDUAL for s in range(full * int4.GROUP, n)}
    for e in range(int4.RESIDUAL):
        if e not in held:
            cache.k_residual[row, :, e] = float("nan")


def to_pages(cache: int4.Int4Cache, block_size: int, seed: int, spare: int = 3):
    """The contiguous ``cache``'s rows as blocks of ``block_size`` slots at random places of a pool
    (``mmha.int4_pages.Int4Pages``, its spare blocks poisoned as unused slots are); returns
    ``(pages, block_tables)``."""
    from mmha.int4_pages import Int4Pages

    b, s = cache.batch, cache.max_seq_len
    max_blocks = s // block_size
    nb = b * max_blocks + spare
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(nb, generator=g)[: b * max_blocks].reshape(b, max_blocks)
    pages = Int4Pages.empty(nb, block_size, b, cache.num_kv_heads, cache.head_dim, cache.dtype, "cuda")
    for t in (pages.k_codes, pages.v_codes):
        t.fill_(0xFF)
    for t in (pages.k_scale, pages.k_zero, pages.v_scale, pages.v_zero, pages.k_residual):
        t.fill_(float("nan"))
    for row in range(b):
        one = int4.Int4Cache(**{name: getattr(cache, name)[row : row + 1] for name in PLANES})
        pages.scatter(row, order[row].tolist(), one)
    return pages, order.to(torch.int32).cuda()
