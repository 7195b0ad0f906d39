"""The tolerance rule's logit spread (helpers.logit_spread), on the CPU."""

import torch
from helpers import FLOOR, logit_spread, make_case, run_reference


def near_tie(**kw):
    """The fuzzed fp32 row whose two largest weights nearly tie at logits near 235."""
    args = dict(seed=953, device="cpu", bias=True, rotary_dim=80, value_scale=8.0)
    args.update(kw)
    return make_case(3, 3, 1, 80, [179, 0, 0], 375, torch.float32, **args)


def test_spread_is_negligible_on_a_typical_row():
    case = make_case(4, 32, 8, 128, [5, 300, 1000, 17], 1024, torch.float32, device="cpu", rotary_dim=128)
    assert logit_spread(case) < 0.5 * FLOOR[torch.float32]  # under the floor's smallest value


def test_spread_covers_fp32_rounding_of_a_near_tie():
    case = near_tie()
    ref, _, _, _ = run_reference(case, torch.float64)
    low, _, _, _ = run_reference(case, torch.float32)
    torch32 = (low.double() - ref.double()).abs().max().item()
    spread = logit_spread(case)
    # torch's fp32 on the CPU is one draw of rounding (7.7e-4 here); the spread bounds any order's.
    assert torch32 > 1e-4  # far past fp32's unit roundoff times the outputs (~36)
    assert spread > torch32
    assert logit_spread(near_tie(value_scale=1.0)) < 1e-5  # the same row, logits 64x smaller


def test_spread_is_zero_with_score_modifiers():
    case = near_tie()
    case.mods = {"softcap": 30.0}
    assert logit_spread(case) == 0.0
