"""The int8 consumer's math, modelled in torch (``attend_tiles.cuh``, ``TileConsumer::steps`` for
int8 caches): a warp's keys in slices of 16, each key's K scale on its score after the product
with the codes, its V scale on its probability over ``v_unit`` (the largest V scale so far) with
the probability rounded to fp16 for the V product, the accumulator rescaled when ``v_unit`` grows
and multiplied back at the end. Equal to attention over the dequantised cache within fp16's
rounding of the probabilities, whatever the scales' spread (no fp16 overflow, no loss to
underflow that shows in the output), with zero-scale keys (masked or zero-filled) contributing
nothing."""

import math

import pytest
import torch

SLACK = 8.0  # kRescaleSlack: the reference max trails the running max by up to 2^8


BIAS = 1152.0  # kInt8Bias: the mmas take 1152 + code


def consumer(q, codes_k, k_scale, codes_v, v_scale, valid, biased=False):
    """One head over keys in slices of 16: ``q [D]`` (fp32, log2 domain), codes ``[S, D]``,
    scales ``[S]``, ``valid [S]`` (masked keys: score -inf, their scales zero as the kernel's
    zero-filled copies leave them). Returns ``(acc, m, sum)`` as the kernel's combine would see
    them (acc back in value units). ``biased``: as the kernel computes it, the products of
    1152 + code accumulated in fp32, the bias taken off the scores (1152 times the sum of q's fp16
    values) and at the end off acc (1152 times the sum of the fp16 P' values, rescaled with acc)."""
    m, total, unit = -math.inf, 0.0, 0.0
    wide = torch.float32 if biased else torch.float64
    acc = torch.zeros(codes_v.shape[1], dtype=wide)
    p_sum = torch.zeros((), dtype=wide)
    qh = q.to(torch.float16).to(wide)
    k_bias = BIAS * qh.sum()
    bias = BIAS if biased else 0.0
    for k0 in range(0, codes_k.shape[0], 16):
        sl = slice(k0, k0 + 16)
        raw = (codes_k[sl].to(wide) + bias) @ qh
        s = ((raw - k_bias) if biased else raw).double() * k_scale[sl].double()
        s = torch.where(valid[sl], s, torch.full_like(s, -math.inf))
        mx = s.max().item()
        if mx > m + SLACK:
            m_new = max(m, mx)
            alpha = 1.0 if m_new == -math.inf else 2.0 ** (m - m_new)
            total, acc, p_sum, m = total * alpha, acc * alpha, p_sum * alpha, m_new
        vs = torch.where(valid[sl], v_scale[sl].double(), torch.zeros(16, dtype=torch.float64))
        vmax = vs.max().item()
        if vmax > unit:
            acc, p_sum = acc * (unit / vmax), p_sum * (unit / vmax)
            unit = vmax
        inv = 1.0 / unit if unit > 0 else 0.0
        p = torch.exp2(s - (0.0 if m == -math.inf else m))
        total += p.sum().item()
        p16 = (p * vs * inv).to(torch.float16).to(wide)  # P^T to the V mma in fp16
        acc = acc + p16 @ (codes_v[sl].to(wide) + bias)
        p_sum = p_sum + p16.sum()
    if biased:
        acc = acc - BIAS * p_sum
    return acc.double() * unit, m, total


def case(seed, s, d, v_spread):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(d, generator=g) * 0.3
    codes_k = torch.randint(-127, 128, (s, d), generator=g)
    codes_v = torch.randint(-127, 128, (s, d), generator=g)
    k_scale = torch.rand(s, generator=g) * 0.02 + 0.005
    v_scale = (torch.rand(s, generator=g) + 0.5) * 10.0 ** ((torch.rand(s, generator=g) * 2 - 1) * v_spread)
    return q, codes_k, k_scale, codes_v, v_scale


@pytest.mark.parametrize("v_spread", [0.0, 3.0, 8.0])
@pytest.mark.parametrize("seed", range(4))
def test_units_keep_attention_within_fp16_rounding_of_p(v_spread, seed):
    s, d = 256, 64
    q, ck, ks, cv, vs = case(seed, s, d, v_spread)
    valid = torch.ones(s, dtype=torch.bool)
    valid[-7:] = False  # the tile's keys past the row's end
    acc, _, total = consumer(q, ck, ks, cv, vs, valid)
    out = acc / total
    scores = (ck[:-7].double() @ q.to(torch.float16).double()) * ks[:-7].double()
    p = torch.softmax(scores * math.log(2), 0)
    want = p @ (cv[:-7].double() * vs[:-7].double()[:, None])
    # Each P' is fp16 (2^-11 relative): the output moves by at most that share of sum |p v|.
    bound = 2.0**-11 * (p @ (cv[:-7].double() * vs[:-7].double()[:, None]).abs()).max().item()
    err = (out - want).abs().max().item()
    assert err <= bound * 1.01, f"error {err:.3e} > {bound:.3e}"
    assert torch.isfinite(out).all()


def test_unit_grows_late_and_small_values_early_are_not_lost():
    """Tokens whose V scales grow by 10^6 along the row: the early tokens' share, rescaled into
    the later unit, stays within fp16's rounding of what it was."""
    s, d = 128, 32
    q, ck, ks, cv, _ = case(7, s, d, 0.0)
    vs = 10.0 ** torch.linspace(-3, 3, s)
    valid = torch.ones(s, dtype=torch.bool)
    acc, _, total = consumer(q, ck, ks, cv, vs, valid)
    scores = (ck.double() @ q.to(torch.float16).double()) * ks.double()
    p = torch.softmax(scores * math.log(2), 0)
    want = p @ (cv.double() * vs.double()[:, None])
    bound = 2.0**-11 * (p @ (cv.double() * vs.double()[:, None]).abs()).max().item()
    assert (acc / total - want).abs().max().item() <= bound * 1.01


@pytest.mark.parametrize("v_spread", [0.0, 3.0, 8.0])
@pytest.mark.parametrize("seed", range(4))
def test_the_codes_bias_costs_less_than_fp16_rounding_of_p(v_spread, seed):
    """The kernel's biased operands (1152 + code, the bias taken off in fp32) against the same
    consumer on the codes themselves in float64: within a tenth of what fp16 P' already allows,
    over a 4K-key row."""
    s, d = 4096, 128
    q, ck, ks, cv, vs = case(seed, s, d, v_spread)
    valid = torch.ones(s, dtype=torch.bool)
    valid[-7:] = False
    exact, m, total = consumer(q, ck, ks, cv, vs, valid)
    got, m_b, total_b = consumer(q, ck, ks, cv, vs, valid, biased=True)
    scores = (ck[:-7].double() @ q.to(torch.float16).double()) * ks[:-7].double()
    p = torch.softmax(scores * math.log(2), 0)
    bound = 2.0**-11 * (p @ (cv[:-7].double() * vs[:-7].double()[:, None]).abs()).max().item()
    err = (got / total_b - exact / total).abs().max().item()
    assert err <= 0.1 * bound, f"bias error {err:.3e} > {0.1 * bound:.3e}"
