"""Can P reach the V product as bytes? An int4 step on integer products (u8 x u8 -> s32, V's
nibbles widened to bytes, `bench/probes/int4_v_rates.cu`) needs P' (the weights times the key's V
scale over v_unit, <= 1) in fixed point. On the CPU in float64: one head over an int4 V cache (per
token, with a zero point, as mmha.int4 stores V), keys and q random, q scaled from nearly flat to
peaked weights; the output with P' as fp16 (the kernel's form), as one byte (round(255 P') / 255),
and as two bytes (hi + lo, 1 / 65,025), each against the same cache's exact output, relative to
the output's largest value; beside it the int4 cache's own error against the 16-bit values.

Fixed point loses every weight under half its unit (round to nearest goes to 0), one-sidedly, so
a long tail of small weights goes missing as a whole. 2026-12-03, the defaults: one byte up to
1.45 / 2.17 of the largest output at 16K / 128K keys (q x 3), two bytes 1.2e-2 / 6.4e-2 there,
fp16 P' 1.0e-4-5.1e-4 everywhere (the int4 cache's own error is 6-10 % of the largest value, but
unbiased and the user's choice; the fixed-point loss grows with the row).

    python bench/probes/fixed_point_p.py [--keys 1024 16384 131072] [--q-scales 0.1 1 3 8]
"""

from __future__ import annotations

import argparse

import torch

D = 128


def errors(keys: int, q_scale: float, seed: int = 0) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(keys, D, generator=g, dtype=torch.float64)
    v = torch.randn(keys, D, generator=g, dtype=torch.float64)
    q = torch.randn(D, generator=g, dtype=torch.float64) * q_scale
    lo = v.min(1, keepdim=True).values
    scale = (v.max(1, keepdim=True).values - lo) / 15
    codes = torch.round((v - lo) / scale).clamp(0, 15)
    s = k @ q / D**0.5
    p = torch.exp(s - s.max())
    l_sum = p.sum()
    v_unit = scale.max()
    pp = p * scale[:, 0] / v_unit  # P' as the kernel weighs it, <= 1

    def out(weights: torch.Tensor) -> torch.Tensor:  # the codes' product plus the zero points' term
        return (weights @ codes * v_unit + (p * lo[:, 0]).sum()) / l_sum

    ref = out(pp)
    top = ref.abs().max().item()
    hi = torch.round(pp * 255) / 255
    two = hi + torch.round((pp - hi) * 255 * 255) / (255 * 255)
    rel = {name: (out(w) - ref).abs().max().item() / top for name, w in
           (("fp16", pp.half().double()), ("u8", hi), ("two u8", two))}  # fmt: skip
    rel["int4 cache"] = (ref - (p @ v) / l_sum).abs().max().item() / top
    return rel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", nargs="+", type=int, default=[1024, 16384, 131072])
    ap.add_argument("--q-scales", nargs="+", type=float, default=[0.1, 1.0, 3.0, 8.0])
    args = ap.parse_args(argv)
    print("keys     q   P' fp16     P' u8  P' two u8  int4 cache  (max |error| / max |output|)")
    for keys in args.keys:
        for q_scale in args.q_scales:
            e = errors(keys, q_scale)
            print(f"{keys:6d} {q_scale:5.1f}  {e['fp16']:.2e}  {e['u8']:.2e}   {e['two u8']:.2e}    {e['int4 cache']:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
