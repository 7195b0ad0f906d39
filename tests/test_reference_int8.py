"""``mmha.reference`` over int8 caches (K and V per token and kv head, ``mmha.quant``): what a
step stores (codes and scales at the slot, nothing else), what it reads back, its error against the
16-bit step, paged and tree steps equal to the contiguous one-token step, non-finite K/V read back
non-finite, scales checked by name."""

from __future__ import annotations

import pytest
import torch

from mmha import layout, quant, reference
from mmha.spec import AttentionSpec, Rotary

B, HQ, HKV, D, S = 3, 8, 2, 32, 48
LENGTHS = [0, 7, 40]


def _setup(seed: int = 0):
    """fp32 qkv; an int8 cache holding quantised random K/V before each row's length
    (scales NaN past it, so a slot read before it is written shows)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, (HQ + 2 * HKV) * D, generator=g)
    k = torch.randn(B, S, HKV, D, generator=g)
    v = torch.randn(B, S, HKV, D, generator=g)
    (kc, ks, _), (vc, vs, _) = quant.quantize(k, 8), quant.quantize(v, 8)
    past = torch.arange(S)[None, :, None] >= torch.tensor(LENGTHS)[:, None, None]
    ks, vs = ks.masked_fill(past, float("nan")), vs.masked_fill(past, float("nan"))
    caches = (
        layout.pack_k(kc),
        layout.pack_v(vc),
        ks.transpose(1, 2).contiguous(),
        vs.transpose(1, 2).contiguous(),
    )
    return qkv, caches, (k, v)


def _step(qkv, caches, **kw):
    k_cache, v_cache, k_scale, v_scale = (t.clone() for t in caches)
    out = reference.decode_step(
        qkv, k_cache, v_cache, torch.tensor(LENGTHS), num_heads=HQ, num_kv_heads=HKV, k_scale=k_scale,
        v_scale=v_scale, **kw,
    )  # fmt: skip
    return out, (k_cache, v_cache, k_scale, v_scale)


def test_the_step_stores_codes_and_scales_at_the_slot_only():
    qkv, caches, _ = _setup()
    spec = AttentionSpec(rotary=Rotary(D))
    _, after = _step(qkv, caches, attention=spec)
    x = qkv.float()
    _, k_new, v_new = reference.split_qkv(x, HQ, HKV, D)
    k_new = reference.apply_rotary(k_new, torch.tensor(LENGTHS), spec.rotary)
    for b, n in enumerate(LENGTHS):
        codes, scale, _ = quant.quantize(k_new[b], 8)
        assert torch.equal(layout.unpack_k(after[0][b : b + 1], S, layout="bhsd")[0][:, n], codes)
        assert torch.equal(after[2][b, :, n], scale)
        codes, scale, _ = quant.quantize(v_new[b], 8)
        assert torch.equal(after[1][b, :, n], codes) and torch.equal(after[3][b, :, n], scale)
    # Every other slot as it was (NaN scales compared by their bits).
    for new, old in zip(after, caches, strict=True):
        mask = torch.ones_like(old, dtype=torch.bool)
        for b, n in enumerate(LENGTHS):
            if old.dim() == 5:
                mask[b, :, :, n] = False
            else:
                mask[b, :, n] = False
        assert torch.equal(new[mask].view(torch.uint8 if new.dtype == torch.int8 else torch.int32),
                           old[mask].view(torch.uint8 if old.dtype == torch.int8 else torch.int32))  # fmt: skip


def test_the_step_attends_to_the_values_read_back():
    """Against the 16-bit step over the dequantised caches (the new token dequantised too)."""
    qkv, caches, _ = _setup(1)
    out, after = _step(qkv, caches)
    k_cache, v_cache, k_scale, v_scale = after
    keys = quant.dequantize(layout.unpack_k(k_cache, S, layout="bhsd"), k_scale.nan_to_num(0), None)
    values = quant.dequantize(v_cache, v_scale.nan_to_num(0), None)
    plain = reference.decode_step(
        qkv, layout.pack_k(keys.transpose(1, 2)), values.clone(), torch.tensor(LENGTHS), num_heads=HQ,
        num_kv_heads=HKV,
    )  # fmt: skip
    # The plain step writes its own (unquantised) new token over the dequantised one: the only
    # difference is that token's rounding.
    assert torch.allclose(out, plain, atol=0.05, rtol=0.05)


def test_int8_is_close_to_the_16_bit_cache():
    qkv, _, (k, v) = _setup(2)
    (kc, ks, _), (vc, vs, _) = quant.quantize(k, 8), quant.quantize(v, 8)
    caches = (
        layout.pack_k(kc),
        layout.pack_v(vc),
        ks.transpose(1, 2).contiguous(),
        vs.transpose(1, 2).contiguous(),
    )
    out, _ = _step(qkv, caches)
    full = reference.decode_step(
        qkv, layout.pack_k(k), layout.pack_v(v), torch.tensor(LENGTHS), num_heads=HQ, num_kv_heads=HKV
    )
    err = (out - full).abs().max() / full.abs().max()
    assert 0 < err < 0.03, err


def test_paged_and_tree_steps_equal_the_one_token_step():
    qkv, caches, _ = _setup(3)
    out, after = _step(qkv, caches)
    bs, blocks_per_row = 16, S // 16
    perm = torch.randperm(B * blocks_per_row, generator=torch.Generator().manual_seed(0))
    tables = perm.view(B, blocks_per_row).to(torch.int32)
    k_cache, v_cache, k_scale, v_scale = caches
    k_pages = torch.empty(B * blocks_per_row, HKV, D // 16, bs, 16, dtype=torch.int8)
    v_pages = torch.empty(B * blocks_per_row, HKV, bs, D, dtype=torch.int8)
    ks_pages = torch.empty(B * blocks_per_row, HKV, bs)
    vs_pages = torch.empty(B * blocks_per_row, HKV, bs)
    for b in range(B):
        for j in range(blocks_per_row):
            blk, sl = int(tables[b, j]), slice(j * bs, (j + 1) * bs)
            k_pages[blk], v_pages[blk] = k_cache[b, :, :, sl], v_cache[b, :, sl]
            ks_pages[blk], vs_pages[blk] = k_scale[b, :, sl], v_scale[b, :, sl]
    paged = reference.decode_step_paged(
        qkv, k_pages, v_pages, tables, torch.tensor(LENGTHS), num_heads=HQ, num_kv_heads=HKV, k_scale=ks_pages,
        v_scale=vs_pages,
    )  # fmt: skip
    assert torch.equal(paged, out)
    for b, n in enumerate(LENGTHS):
        blk, off = int(tables[b, n // bs]), n % bs
        assert torch.equal(ks_pages[blk, :, off], after[2][b, :, n])
        assert torch.equal(vs_pages[blk, :, off], after[3][b, :, n])
    k_cache, v_cache, k_scale, v_scale = (t.clone() for t in caches)
    tree = reference.decode_tree(
        qkv[:, None], k_cache, v_cache, torch.tensor(LENGTHS), torch.full((B, 1), -1), num_heads=HQ,
        num_kv_heads=HKV, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    assert torch.equal(tree[:, 0], out) and torch.equal(k_scale.nan_to_num(7), after[2].nan_to_num(7))


def test_non_finite_k_reads_back_non_finite():
    qkv, caches, _ = _setup(4)
    qkv[1, HQ * D + 3] = float("inf")  # row 1's new k, kv head 0
    out, after = _step(qkv, caches)
    assert not torch.isfinite(after[2][1, 0, LENGTHS[1]])
    assert not torch.isfinite(out[1, : (HQ // HKV) * D]).all()
    assert torch.isfinite(out[[0, 2]]).all()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(k_scale=None), r"k_scale must be a float32 tensor \[3, 2, 48\] \(a scale per token and kv head\)"),
        (dict(v_scale=torch.ones(HKV)), r"v_scale must be a float32 tensor \[3, 2, 48\].*got torch.float32 \(2,\)"),
        (dict(k_scale=torch.ones(B, HKV, S, dtype=torch.float16)), r"k_scale must be a float32 tensor"),
    ],
)  # fmt: skip
def test_scales_are_checked_by_name(change, match):
    qkv, caches, _ = _setup()
    kw = {"k_scale": caches[2], "v_scale": caches[3], **change}
    with pytest.raises(ValueError, match=match):
        reference.decode_step(
            qkv, caches[0], caches[1], torch.tensor(LENGTHS), num_heads=HQ, num_kv_heads=HKV, **kw
        )
