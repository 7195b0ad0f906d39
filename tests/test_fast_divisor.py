"""The item index's division (FastDivisor in csrc/kernels/mmha_params.h, fast_div in work_items.cuh):
n / d as (umulhi(n, mul) + n) >> shift with the extension's own (mul, shift) (``_C.fast_divisor``),
the device's 32-bit arithmetic in Python, exact for every divisor a launch can have and every n below
2^31 tried (each divisor's multiples and their neighbours, the ends of the range, random n)."""

from __future__ import annotations

import random

import pytest

from mmha._ext import _C

pytestmark = pytest.mark.skipif(_C is None, reason="the extension is not built")


def make_fast_divisor(d: int) -> tuple[int, int]:
    mul, shift = _C.fast_divisor(d)
    assert 0 < mul < (1 << 32) and (1 << shift) >= d and (shift == 0 or (1 << (shift - 1)) < d)
    return mul, shift


def fast_div(n: int, mul: int, shift: int) -> int:
    hi = (n * mul) >> 32
    total = hi + n
    assert total < (1 << 32)  # the device adds in 32 bits
    return total >> shift


DIVISORS = list(range(1, 300)) + [511, 512, 513, 1000, 4095, 4096, 4097, 65535, 65536, 16 * 65535,
                                  (1 << 20) - 1, (1 << 20) + 1, (1 << 31) - 1]  # fmt: skip


@pytest.mark.parametrize("d", DIVISORS)
def test_fast_division_is_exact(d):
    mul, shift = make_fast_divisor(d)
    rng = random.Random(d)
    top = (1 << 31) - 1
    ns = {0, 1, d - 1, d, d + 1, top, top - 1, top - d}
    for q in [1, 2, 3, 7, 100, rng.randrange(1, max(2, top // d))]:
        ns.update({q * d - 1, q * d, q * d + 1})
    ns.update(rng.randrange(0, top + 1) for _ in range(200))
    for n in ns:
        if 0 <= n <= top:
            assert fast_div(n, mul, shift) == n // d, (n, d)
