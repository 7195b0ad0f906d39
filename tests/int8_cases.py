"""int8 decode cases: a random case whose caches hold codes with a scale per token and kv head
(``mmha.quant``), unused slots poisoned, and its pages."""

from __future__ import annotations

import dataclasses

import torch
from helpers import make_case

from mmha import layout, quant

STRAY = 77  # the code left in slots past a row's length (their scales are NaN)


def int8_case(
    batch, num_heads, num_kv_heads, head_dim, lengths, max_seq_len, dtype, *, seed=0, v_spread=0.0, **kw
):
    """A random case with its caches quantised per token and kv head; slots at or past each row's
    length hold code STRAY and NaN scales. ``v_spread``: V tokens scaled by 10^u, u uniform in
    [-v_spread, v_spread] (their scales spread as far). Returns ``(case, k_scale, v_scale)``."""
    case = make_case(
        batch, num_heads, num_kv_heads, head_dim, lengths, max_seq_len, dtype, seed=seed, unused_fill=0.0, **kw
    )  # fmt: skip
    k = layout.unpack_k(case.k_cache, max_seq_len, layout="bhsd").float()
    v = case.v_cache.float()
    if v_spread:
        g = torch.Generator().manual_seed(seed + 2)
        exp = (torch.rand(batch, num_kv_heads, max_seq_len, 1, generator=g) * 2 - 1) * v_spread
        v = v * (10.0**exp).to(v.device)
    (kc, ks, _), (vc, vs, _) = quant.quantize(k, 8), quant.quantize(v, 8)
    past = torch.arange(max_seq_len, device=k.device)[None, None, :] >= case.lengths[:, None, None].long()
    kc = kc.masked_fill(past[..., None], STRAY)
    vc = vc.masked_fill(past[..., None], STRAY)
    ks, vs = ks.masked_fill(past, float("nan")), vs.masked_fill(past, float("nan"))
    k_cache = layout.pack_k(kc, layout="bhsd")
    case = dataclasses.replace(case, k_cache=k_cache, v_cache=vc.contiguous())
    return case, ks.contiguous(), vs.contiguous()


def to_pages(case, ks, vs, block_size, seed):
    """The case's rows as pages at random blocks of a pool (spare blocks: stray codes, NaN scales)."""
    b, hkv, dx, s, x = case.k_cache.shape
    d = case.v_cache.shape[-1]
    max_blocks, spare = s // block_size, 3
    nb = b * max_blocks + spare
    g = torch.Generator().manual_seed(seed)
    tables = torch.randperm(nb, generator=g)[: b * max_blocks].reshape(b, max_blocks).to(torch.int32)
    kp = torch.full((nb, hkv, dx, block_size, x), STRAY, dtype=torch.int8, device="cuda")
    vp = torch.full((nb, hkv, block_size, d), STRAY, dtype=torch.int8, device="cuda")
    ksp = torch.full((nb, hkv, block_size), float("nan"), device="cuda")
    vsp = torch.full((nb, hkv, block_size), float("nan"), device="cuda")
    for row in range(b):
        for j in range(max_blocks):
            blk, part = int(tables[row, j]), slice(j * block_size, (j + 1) * block_size)
            kp[blk] = case.k_cache[row, :, :, part]
            vp[blk] = case.v_cache[row, :, part]
            ksp[blk], vsp[blk] = ks[row, :, part], vs[row, :, part]
    return kp, vp, ksp, vsp, tables.cuda()
