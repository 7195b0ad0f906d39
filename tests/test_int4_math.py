"""The int4 consumer's math (attend_int4.cuh), modelled in torch: over a tile of 64 keys (one K
group), K's per-channel scale folds into q (``q'_c = fp16(q_c s_c)``, the codes the mma's other
operand as 1024 + code or 64 + code by the channel's place in K's word) and its zero point into one
bias per tile and column (``q . z``, fp32 sums of fp16 products, less the codes' offsets times
q'); V's per-token scale goes on the probability over the largest V scale so far (``v_unit``, as
for int8) and its zero point adds ``sum_j p_j z_j`` to every output channel. Equal to attention
over what ``mmha.int4.Int4Cache`` reads back within fp16's rounding of q' and of the
probabilities, whatever the scales' spread (within fp16's range).

Also the kernel's earlier math (``dequant_consumer``: K dequantised to fp16 per value) and an
integer form (``integer_consumer``: q' as int8 parts, P' as int8 per 32 keys), compared over rows
with outlier channels: which operand precisions keep its error."""

import math

import pytest
import torch

from mmha import int4

GROUP = 64
BIAS = 1024.0  # the halves 0x6400 | code: 1024 + code, exact in fp16


def code_offsets(d):
    """The offset each channel's codes reach the mma with: 1024 (0x6400 | code) for channels 0-3
    of each 8 (a word's even nibbles, mmha.int4.K_NIBBLES), 64 (0x5400 | code << 4) for 4-7."""
    return torch.where(torch.arange(d) % 8 < 4, BIAS, 64.0)


def consumer(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid):
    """One head over a row of whole groups: ``q [D]`` fp32 (log2 domain), codes ``[S, D]`` (0..15),
    K's ``scale`` / ``zero`` ``[S / 64, D]``, V's ``[S]``, ``valid [S]`` (masked keys: score -inf,
    their V scale and zero point zeroed as for int8). Returns the output ``[D]`` (float64), as the
    kernel's accumulators would give it: fp32 products of fp16 operands, fp32 running sums."""
    m, total, unit = -math.inf, 0.0, 0.0
    acc = torch.zeros(v_codes.shape[1], dtype=torch.float32)
    z_sum = torch.zeros((), dtype=torch.float64)  # sum_j p_j z_j in value units (fp32 in the kernel)
    qh = q.half().float()  # q as one fp16 part
    offsets = code_offsets(k_codes.shape[1])
    for g0 in range(0, k_codes.shape[0], GROUP):
        sl, g = slice(g0, g0 + GROUP), g0 // GROUP
        qp = (qh * k_scale[g].float()).to(torch.float16).float()  # q' for this tile (hmul2)
        # The tile's bias, one per column: q . z (fp32 sums of fp16 products) less q' . offsets.
        tile_bias = (qh * k_zero[g].float()).sum() - (offsets * qp).sum()
        raw = (k_codes[sl].float() + offsets) @ qp  # the mma: fp32 sums of fp16 products
        s = (raw + tile_bias).double()
        s = torch.where(valid[sl], s, torch.full_like(s, -math.inf))
        mx = s.max().item()
        if mx > m:
            alpha = 1.0 if m == -math.inf else 2.0 ** (m - mx)
            total, acc, z_sum, m = total * alpha, acc * alpha, z_sum * alpha, mx
        vs = torch.where(valid[sl], v_scale[sl].double(), torch.zeros(GROUP, dtype=torch.float64))
        vz = torch.where(valid[sl], v_zero[sl].double(), torch.zeros(GROUP, dtype=torch.float64))
        vmax = vs.max().item()
        if vmax > unit:
            acc = acc * (unit / vmax)
            unit = vmax
        p = torch.exp2(s - m)
        total += p.sum().item()
        p16 = (p * vs / unit if unit > 0 else torch.zeros_like(p)).to(torch.float16).float()
        acc = acc + p16 @ (v_codes[sl].float() - 8.0)  # V's codes exact, less 8 (centred)
        z_sum = z_sum + (p * (vz + 8.0 * vs)).sum()  # the zero points with the codes' centre
    out = acc.double() * unit + z_sum
    return out / total


def case(seed, s, d, spread):
    """A cache of ``s`` slots (whole groups) written through ``Int4Cache`` from K/V whose tokens'
    magnitudes spread over ``10^±spread``, and a query; returns the cache's planes for one head
    and the oracle's attention (float64, over what the cache reads back)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, s, d, generator=g, dtype=torch.float64)
    out_ch = [5, d // 2 + 5]
    k[..., out_ch] = k[..., out_ch] * 20 + 3  # outlier channels with an offset
    mag = 10.0 ** ((torch.rand(s, generator=g, dtype=torch.float64) * 2 - 1) * spread)
    v = torch.randn(1, s, d, generator=g, dtype=torch.float64) * mag[None, :, None] + 0.5
    c = int4.Int4Cache.empty(1, 1, s, d, torch.float32)
    c.prefill(0, k.float(), v.float())
    q = (torch.randn(d, generator=g) * 0.2).float()
    codes_k = int4.unpack_k(c.k_codes[0, 0].permute(1, 0, 2).reshape(s, d // 2)).long()
    codes_v = int4.unpack_nibbles(c.v_codes[0, 0]).long()
    planes = (codes_k, c.k_scale[0, 0], c.k_zero[0, 0], codes_v, c.v_scale[0, 0], c.v_zero[0, 0])
    return q, planes, c


def oracle(q, c, s, valid):
    keys, values = c.read(0, s, torch.float64)
    scores = keys[0] @ q.double()
    p = torch.softmax(torch.where(valid, scores, torch.full_like(scores, -math.inf)) * math.log(2), 0)
    return p @ values[0], p, values[0]


@pytest.mark.parametrize("spread", [0.0, 2.0, 4.0])  # 10^±4: within the fp16 scales' range (int4.SCALE_MAX)
@pytest.mark.parametrize("seed", range(3))
def test_folded_scales_and_zero_points_equal_attention_over_the_format(spread, seed):
    s, d = 512, 64
    q, planes, c = case(seed, s, d, spread)
    valid = torch.ones(s, dtype=torch.bool)
    valid[-9:] = False  # the last tile's keys past the row's end
    got = consumer(q, *planes, valid)
    want, p, values = oracle(q, c, s, valid)
    # q' in fp16 moves each score by 2^-11 of sum |q_c s_c code|; P' in fp16 each probability by
    # 2^-11 of its V term: bound the output by both shares (scores: through the softmax, e * dS).
    codes_k, k_scale = planes[0], planes[1]
    score_err = 2.0**-11 * ((q.abs().double() * k_scale.double().repeat_interleave(GROUP, 0)) * codes_k).sum(
        1
    )
    v_terms = (p[:, None] * values.abs()).sum(0)
    bound = (2.0**-11 * v_terms + (p * score_err * math.log(2))[:, None].mul(values.abs()).sum(0) * 2).max()
    err = (got - want).abs().max().item()
    assert err <= bound.item() + 1e-9, f"error {err:.3e} > {bound.item():.3e}"
    assert torch.isfinite(got).all()


def test_all_zero_tokens_and_masked_keys_add_nothing():
    """A token of all-zero V (scale 0: codes 0, zero point 0) and masked keys with finite planes."""
    s, d = 128, 32
    q, planes, c = case(11, s, d, 1.0)
    codes_k, ks, kz, codes_v, vs, vz = planes
    vs, vz, codes_v = vs.clone(), vz.clone(), codes_v.clone()
    vs[3], vz[3], codes_v[3] = 0.0, 0.0, 0
    c.v_scale[0, 0, 3], c.v_zero[0, 0, 3], c.v_codes[0, 0, 3] = 0.0, 0.0, 0
    valid = torch.ones(s, dtype=torch.bool)
    valid[100:] = False
    got = consumer(q, codes_k, ks, kz, codes_v, vs, vz, valid)
    want, _, _ = oracle(q, c, s, valid)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------------------------------------
# The kernel's earlier math, and an integer form (docs/status.md): which operand precisions keep
# the error at the fp16 path's.


def dequant_consumer(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid):
    """The kernel's K before its scales folded into q (to 2026-12-02): each K value dequantised to
    fp16 (``code * scale + zero`` by hfma2), q one fp16 part, fp32 sums; P' in fp16 against V's
    exact codes."""
    m, total, unit = -math.inf, 0.0, 0.0
    acc = torch.zeros(v_codes.shape[1], dtype=torch.float32)
    z_sum = 0.0
    qh = q.half().float()
    for g0 in range(0, k_codes.shape[0], GROUP):
        sl, g = slice(g0, g0 + GROUP), g0 // GROUP
        kh = (k_codes[sl].half() * k_scale[g].half() + k_zero[g].half()).float()
        s = torch.where(valid[sl], (kh @ qh).double(), torch.tensor(-math.inf, dtype=torch.float64))
        m, total, acc, z_sum, unit, p, vs, vz = _update(s, m, total, acc, z_sum, unit, v_scale[sl], v_zero[sl],
                                                        valid[sl])  # fmt: skip
        p16 = (p * vs / unit if unit > 0 else torch.zeros_like(p)).to(torch.float16).float()
        acc = acc + p16 @ v_codes[sl].float()
    return (acc.double() * unit + z_sum) / total


def integer_consumer(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, valid, q_parts=2, p_block=32):
    """An integer form: q times the group's channel scales as ``q_parts`` int8 parts per tile and
    column (the second holding the first's rounding, times 254), the codes as bytes, exact integer
    sums (``mma.s8``); P' as int8 per ``p_block`` keys (its largest at 127) against V's codes."""
    m, total, unit = -math.inf, 0.0, 0.0
    acc = torch.zeros(v_codes.shape[1], dtype=torch.float64)
    z_sum = 0.0
    for g0 in range(0, k_codes.shape[0], GROUP):
        sl, g = slice(g0, g0 + GROUP), g0 // GROUP
        qp = q.double() * k_scale[g].double()
        sig = qp.abs().max().item() / 127 or 1.0
        hi = torch.round(qp / sig).clamp(-127, 127)
        parts = hi if q_parts == 1 else hi + torch.round((qp / sig - hi) * 254).clamp(-127, 127) / 254
        s = sig * (k_codes[sl].double() @ parts) + (q.double() * k_zero[g].double()).sum()
        s = torch.where(valid[sl], s, torch.tensor(-math.inf, dtype=torch.float64))
        m, total, acc, z_sum, unit, p, vs, vz = _update(s, m, total, acc, z_sum, unit, v_scale[sl], v_zero[sl],
                                                        valid[sl])  # fmt: skip
        pp = p * vs / unit if unit > 0 else torch.zeros_like(p)
        for b0 in range(0, GROUP, p_block):
            blk = pp[b0 : b0 + p_block]
            sp = blk.max().item() / 127 or 1.0
            acc = acc + sp * (torch.round(blk / sp) @ v_codes[sl][b0 : b0 + p_block].double())
    return (acc * unit + z_sum) / total


def _update(s, m, total, acc, z_sum, unit, v_scale, v_zero, valid):
    """The online softmax and v_unit of one tile (both consumers): rescaled running values, this
    tile's P and its keys' V scales and zero points (masked keys' zeroed), z_sum grown by P * zero."""
    mx = s.max().item()
    if mx > m:
        alpha = 1.0 if m == -math.inf else 2.0 ** (m - mx)
        total, acc, z_sum, m = total * alpha, acc * alpha, z_sum * alpha, mx
    vs = torch.where(valid, v_scale.double(), torch.zeros_like(v_scale, dtype=torch.float64))
    vz = torch.where(valid, v_zero.double(), torch.zeros_like(v_zero, dtype=torch.float64))
    vmax = vs.max().item()
    if vmax > unit:
        acc = acc * (unit / vmax)
        unit = vmax
    p = torch.exp2(s - m)
    return m, total + p.sum().item(), acc, z_sum + (p * vz).sum().item(), unit, p, vs, vz


def test_integer_operands_need_q_in_two_parts():
    """Over long rows with outlier K channels and a sharp softmax: the built kernel's fp16 path
    stays within fp16's share of the error; an integer path matches it only with q in two int8
    parts (one part: up to hundreds of times its error, as large as the int4 format's own on some
    rows), P' in int8 per 32 keys costing little."""
    one, two, fp16 = [], [], []
    for spread in (0.0, 2.0):
        for seed in range(4):
            s, d = 1024, 128
            q, planes, c = case(seed, s, d, spread)
            q = q * 8  # scores of a trained model's spread
            valid = torch.ones(s, dtype=torch.bool)
            want, _, _ = oracle(q, c, s, valid)
            fp16.append((dequant_consumer(q, *planes, valid) - want).abs().max().item())
            one.append((integer_consumer(q, *planes, valid, q_parts=1) - want).abs().max().item())
            two.append((integer_consumer(q, *planes, valid, q_parts=2) - want).abs().max().item())
    print("fp16 path", [f"{e:.1e}" for e in fp16], "\nint8 q", [f"{e:.1e}" for e in one],
          "\nint8 q x2", [f"{e:.1e}" for e in two])  # fmt: skip
    assert all(t <= 3 * f + 5e-3 for t, f in zip(two, fp16, strict=True))
    assert max(o / f for o, f in zip(one, fp16, strict=True)) > 50


def test_folded_scales_keep_the_dequantised_paths_error():
    """The kernel's folded K (q' = q * scale in fp16, the bias per tile) against its earlier
    dequantised K, over long rows with outlier channels and a sharp softmax: within a small factor
    of the earlier error on every row."""
    folded, fp16 = [], []
    for spread in (0.0, 2.0):
        for seed in range(4):
            s, d = 1024, 128
            q, planes, c = case(seed, s, d, spread)
            q = q * 8
            valid = torch.ones(s, dtype=torch.bool)
            want, _, _ = oracle(q, c, s, valid)
            fp16.append((dequant_consumer(q, *planes, valid) - want).abs().max().item())
            folded.append((consumer(q, *planes, valid) - want).abs().max().item())
    print("dequantised", [f"{e:.1e}" for e in fp16], "\nfolded", [f"{e:.1e}" for e in folded])
    assert all(f <= 3 * e + 1e-4 for f, e in zip(folded, fp16, strict=True))
