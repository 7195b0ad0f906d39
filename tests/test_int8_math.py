"""The int8 consumer's math, modelled in torch (``attend_tiles.cuh``, ``TileConsumer::steps`` for
int8 caches): a warp's keys in slices of 16, each key's score the product of its codes with q in
two int8 parts (``TileConsumer::init_q8``: integer sums, exact) times q's unit and the key's K
scale, its V scale on its probability over ``v_unit`` (the largest V scale so far) with the
probability rounded to fp16 for the V product, the accumulator rescaled when ``v_unit`` grows and
multiplied back at the end. Equal to attention over the dequantised cache within fp16's rounding
of the probabilities, whatever the scales' spread (no fp16 overflow, no loss to underflow that
shows in the output), with zero-scale keys (masked or zero-filled) contributing nothing; q's two
parts score as close to the exact q as q in fp16 does, or closer."""

import math

import pytest
import torch

SLACK = 8.0  # kRescaleSlack: the reference max trails the running max by up to 2^8


BIAS = 1152.0  # kInt8Bias: the V mma takes 1152 + code
ROUND = 12582912.0  # 1.5 * 2^23: init_q8 rounds by adding it


def q8_parts(q):
    """q ``[D]`` (fp32) as ``TileConsumer::init_q8`` splits it: ``(hi, lo, unit)``, hi and lo int8
    codes, q ~ unit / 254 * (254 hi + lo), unit = the head's largest |q| / 127, each step in fp32
    as the kernel rounds it."""
    q = q.float()
    hmax = q.abs().max()
    unit = hmax * torch.tensor(1 / 127, dtype=torch.float32)
    inv = torch.tensor(127.0, dtype=torch.float32) / hmax
    hi = (q * inv + ROUND) - ROUND
    r = q - hi * unit
    lo = (r * inv * 254.0 + ROUND) - ROUND
    return hi.to(torch.int32), lo.to(torch.int32), unit.item()


def q8_scores(q, codes):
    """The scores (before the K scale) of ``codes [S, D]`` as the kernel forms them: int32 sums of
    each part, 254 S_hi + S_lo to fp32, times unit / 254."""
    hi, lo, unit = q8_parts(q)
    s = 254 * (codes.long() @ hi.long()) + codes.long() @ lo.long()
    return s.float() * (unit / 254)


def consumer(q, codes_k, k_scale, codes_v, v_scale, valid, biased=False):
    """One head over keys in slices of 16: ``q [D]`` (fp32, log2 domain), codes ``[S, D]``,
    scales ``[S]``, ``valid [S]`` (masked keys: score -inf, their scales zero as the kernel's
    zero-filled copies leave them). Returns ``(acc, m, sum)`` as the kernel's combine would see
    them (acc back in value units). ``biased``: as the kernel computes it, the V products of
    1152 + code accumulated in fp32 and the bias taken off acc at the end (1152 times the sum of
    the fp16 P' values, rescaled with acc); else in float64 on the codes."""
    m, total, unit = -math.inf, 0.0, 0.0
    wide = torch.float32 if biased else torch.float64
    acc = torch.zeros(codes_v.shape[1], dtype=wide)
    p_sum = torch.zeros((), dtype=wide)
    bias = BIAS if biased else 0.0
    for k0 in range(0, codes_k.shape[0], 16):
        sl = slice(k0, k0 + 16)
        s = q8_scores(q, codes_k[sl]).double() * k_scale[sl].double()
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
    scores = q8_scores(q, ck[:-7]).double() * ks[:-7].double()
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
    scores = q8_scores(q, ck).double() * ks.double()
    p = torch.softmax(scores * math.log(2), 0)
    want = p @ (cv.double() * vs.double()[:, None])
    bound = 2.0**-11 * (p @ (cv.double() * vs.double()[:, None]).abs()).max().item()
    assert (acc / total - want).abs().max().item() <= bound * 1.01


@pytest.mark.parametrize("v_spread", [0.0, 3.0, 8.0])
@pytest.mark.parametrize("seed", range(4))
def test_the_codes_bias_costs_less_than_fp16_rounding_of_p(v_spread, seed):
    """The kernel's biased V operands (1152 + code, the bias taken off in fp32) against the same
    consumer on the codes themselves in float64: within a tenth of what fp16 P' already allows,
    over a 4K-key row."""
    s, d = 4096, 128
    q, ck, ks, cv, vs = case(seed, s, d, v_spread)
    valid = torch.ones(s, dtype=torch.bool)
    valid[-7:] = False
    exact, m, total = consumer(q, ck, ks, cv, vs, valid)
    got, m_b, total_b = consumer(q, ck, ks, cv, vs, valid, biased=True)
    scores = q8_scores(q, ck[:-7]).double() * ks[:-7].double()
    p = torch.softmax(scores * math.log(2), 0)
    bound = 2.0**-11 * (p @ (cv[:-7].double() * vs[:-7].double()[:, None]).abs()).max().item()
    err = (got / total_b - exact / total).abs().max().item()
    assert err <= 0.1 * bound, f"bias error {err:.3e} > {0.1 * bound:.3e}"


@pytest.mark.parametrize("outliers", [0, 1, 8])
@pytest.mark.parametrize("seed", range(8))
def test_q_in_two_int8_parts_against_q_in_fp16(outliers, seed):
    """q's two int8 parts (every code within [-127, 127]) against q rounded to fp16 (the other
    one-byte consumers' form), over 512 keys of random codes at head dim 128, with q's channels
    alike or a few of them 100x the rest (outlier channels). The parts' step is the head's largest
    |q| / 64,516 for every value, fp16's 2^-12 of each value: on alike channels the scores' largest
    error is ~8x smaller than fp16's; with outliers the small channels' values lose that edge and
    the two are within 2x of each other either way. Both stay under 5 % of what K's own int8
    rounding may move a score (half a code a value: sum |q| / 2 in code units)."""
    g = torch.Generator().manual_seed(100 + seed)
    d = 128
    q = torch.randn(d, generator=g) * 0.2
    q[torch.randperm(d, generator=g)[:outliers]] *= 100.0
    codes = torch.randint(-127, 128, (512, d), generator=g)
    hi, lo, _ = q8_parts(q)
    assert hi.abs().max().item() <= 127 and lo.abs().max().item() <= 127
    exact = codes.double() @ q.double()
    err_q8 = (q8_scores(q, codes).double() - exact).abs().max().item()
    err_fp16 = (codes.double() @ q.to(torch.float16).double() - exact).abs().max().item()
    k_rounding = 0.5 * q.abs().sum().item()
    assert err_q8 < 0.05 * k_rounding, f"two int8 parts {err_q8:.3e} against K's rounding {k_rounding:.3e}"
    factor = 0.5 if outliers == 0 else 2.0
    assert err_q8 < factor * err_fp16, f"two int8 parts {err_q8:.3e} against fp16 {err_fp16:.3e}"


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e4, 3e37])
def test_q_parts_at_every_magnitude(scale):
    """The parts depend on q's size only through the unit: the same codes at every magnitude
    (fp32's normal range), and q read back within unit / 508 of each value."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(64, generator=g)
    hi1, lo1, _ = q8_parts(base)
    hi, lo, unit = q8_parts(base * scale)
    assert torch.equal(hi, hi1) and (lo - lo1).abs().max().item() <= 1
    back = (254 * hi.double() + lo.double()) * (unit / 254)
    assert ((back - (base * scale).double()).abs() <= unit / 508 * 1.001).all()
