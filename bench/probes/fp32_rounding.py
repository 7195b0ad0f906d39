"""How far fp32 rounding alone moves one fuzzed case's output: the case that `MMHA_FUZZ_SEED=1
MMHA_FUZZ_EXAMPLES=10 pytest tests/test_fuzz.py -k kernel_matches` finds past the tolerance rule
(fp32, B=3 Hq=3 Hkv=1 D=80, row 0 at length 179, bias, NeoX rotary over all dims, values 8x,
case seed 953). On the CPU: the fp64 reference of row 0, torch's fp32 logits (q.k * scale), and
the tile loop's CUDA-core arithmetic emulated step by step (the rotation as `rotated()` rounds it,
each lane's 5 chunks of 4 dims by FMA, the pairwise sum of 4 lanes, times fp32(scale) *
fp32(log2 e), exp2), each against the fp64 output, per head, with the head's largest weights.

    PYTHONPATH=. python bench/probes/fp32_rounding.py
"""

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from helpers import make_case  # noqa: E402

from mmha import reference  # noqa: E402
from mmha.spec import AttentionSpec, Rotary  # noqa: E402

D, ROT, THETA, POS, TPK, CPT, VEC = 80, 80, 10000.0, 179, 4, 5, 4


def f32(x: torch.Tensor) -> torch.Tensor:
    return x.float().double()


def fma(a, b, c):  # one rounding of a * b + c (the fp32 product is exact in fp64)
    return f32(a.double() * b.double() + c.double())


def rotated(row: torch.Tensor) -> torch.Tensor:
    """new_token.cuh's rotated() for every dim of a NeoX row (fp32 in, fp32 values out)."""
    out = torch.empty(D, dtype=torch.float64)
    half = ROT // 2
    for d in range(D):
        i, partner, sign = (d, d + half, -1.0) if d < half else (d - half, d - half, 1.0)
        expo = torch.tensor(2.0 * i, dtype=torch.float32) / torch.tensor(float(ROT), dtype=torch.float32)
        inv = 1.0 / torch.pow(torch.tensor(THETA, dtype=torch.float32), expo)
        angle = torch.tensor(float(POS), dtype=torch.float32) * inv
        prod = (torch.tensor(sign, dtype=torch.float32) * row[partner]) * torch.sin(angle)
        out[d] = fma(row[d], torch.cos(angle), prod)
    return out


def kernel_logits(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Base-2 logits as the CUDA-core loop sums them (attend_simt.cuh, fp32, D = 80: 4 lanes a key)."""
    lanes = []
    for ti in range(TPK):
        acc = torch.zeros(keys.shape[0], dtype=torch.float64)
        for c in range(CPT):
            for e in range(VEC):
                d = (c * TPK + ti) * VEC + e
                acc = fma(q[d].expand(keys.shape[0]), keys[:, d], acc)
        lanes.append(acc)
    dot = f32(f32(lanes[0] + lanes[1]) + f32(lanes[2] + lanes[3]))
    scale = torch.tensor(1 / math.sqrt(D), dtype=torch.float32)
    return f32(dot * (scale * torch.tensor(math.log2(math.e), dtype=torch.float32)).double())


def main() -> None:
    case = make_case(3, 3, 1, D, [POS, 0, 0], 375, torch.float32, seed=953, device="cpu", bias=True,
                     rotary_dim=ROT, value_scale=8.0)  # fmt: skip
    bias = case.kwargs()["qkv_bias"]
    x64 = case.qkv.double() + bias.double()
    rows = (x64, torch.tensor([POS, 0, 0]), 3, 1, D, AttentionSpec(rotary=Rotary(ROT, THETA)))
    q64, k_new, v_new, _ = reference.new_tokens(*rows, case.k_cache.double(), None, None, torch.float32)
    keys = case.k_cache.double()[0, 0].permute(1, 0, 2).reshape(-1, D)[: POS + 1].clone()
    values = case.v_cache.double()[0, 0][: POS + 1].clone()
    keys[POS], values[POS] = k_new[0].reshape(D), v_new[0].reshape(D)
    x32 = case.qkv.float() + bias.float()
    keys_kernel = keys.clone()
    keys_kernel[POS] = rotated(x32[0, 3 * D : 4 * D])
    for h in range(3):
        logits = keys @ q64[0, h].double() / math.sqrt(D)
        weights = torch.softmax(logits, 0)
        want = weights @ values
        torch32 = torch.softmax(
            (keys.float() @ q64[0, h].float()) * torch.tensor(1 / math.sqrt(D), dtype=torch.float32), 0
        ).double()
        base2 = kernel_logits(rotated(x32[0, h * D : (h + 1) * D]), keys_kernel)
        p = torch.exp2(base2 - base2.max())
        top = [round(w, 4) for w in torch.topk(weights, 2).values.tolist()]
        print(f"head {h}: largest logit {logits.max():.1f}, largest weights {top}; error against fp64: "
              f"torch fp32 {((torch32 @ values) - want).abs().max():.2e}, kernel arithmetic "
              f"{(((p / p.sum()) @ values) - want).abs().max():.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
