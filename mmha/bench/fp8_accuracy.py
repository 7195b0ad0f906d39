"""``python -m mmha.bench.fp8_accuracy``: what an fp8 (e4m3) cache costs in accuracy, on a GPU.

1. Attention error per head dim: N(0, 1) q, K, V (1024 cached keys, Hq 8, Hkv 2), per-kv-head
   scales from the absolute maxima; mmha's output with an fp8 cache and with an fp16 cache,
   each against fp64 attention over the unquantised fp16 cache (max and mean absolute error),
   and the worst-case bound from e4m3's 3-bit mantissa that tests/test_fp8_gpu.py asserts.
2. Generation (where transformers is importable): the HF adapter on a random-weight Llama config,
   fp8 cache against fp16 cache, teacher-forced for 256 steps (``mmha.models.hf.compare_kv_dtypes``).
Prints a table and writes fp8_accuracy.json under --out.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from .. import layout, ops, reference, spec

E4M3_REL, E4M3_SUB = 2.0**-4, 2.0**-10


def bound(q, k, v, ks: float, vs: float, scale: float) -> float:
    """Worst case of |out_fp8 - out| for one head (see tests/fp8_cases.e4m3_error_bound)."""
    dk = E4M3_REL * k.abs() + E4M3_SUB * ks
    dv = E4M3_REL * v.abs() + E4M3_SUB * vs
    eps = scale * (q.abs()[None, :] * dk).sum(-1).max().item()
    return dv.max().item() + math.expm1(2 * eps) * (v.abs() + dv).max().item()


def attention_errors(head_dim: int, length: int = 1024, hq: int = 8, hkv: int = 2, seed: int = 0) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt, dev = torch.float16, "cuda"
    qkv = torch.randn(1, (hq + 2 * hkv) * head_dim, generator=g).to(dt).to(dev)
    k = torch.randn(1, length + 1, hkv, head_dim, generator=g).to(dt).to(dev)
    v = torch.randn(1, length + 1, hkv, head_dim, generator=g).to(dt).to(dev)
    q, k_new, v_new = reference.split_qkv(qkv.double(), hq, hkv, head_dim)
    keys = torch.cat([k[0, :length].transpose(0, 1).double(), k_new[0][:, None]], 1)
    values = torch.cat([v[0, :length].transpose(0, 1).double(), v_new[0][:, None]], 1)
    scale = 1 / math.sqrt(head_dim)
    exact, _ = reference.attend(q[0], keys, values, scale)
    ks = spec.fp8_scale(keys.abs().amax(dim=(1, 2)).float())
    vs = spec.fp8_scale(values.abs().amax(dim=(1, 2)).float())
    lengths = torch.tensor([length], dtype=torch.int32, device=dev)
    kc16, vc16 = layout.pack_k(k, length + 1), layout.pack_v(v, length + 1)
    out16 = ops.decode_attention(qkv, kc16, vc16, lengths, num_heads=hq, num_kv_heads=hkv)
    kq, vq = spec.quantize_fp8(k, ks), spec.quantize_fp8(v, vs)  # [1, S, Hkv, D]
    kc8 = layout.pack_k(kq.view(torch.uint8), length + 1).view(torch.float8_e4m3fn)
    vc8 = layout.pack_v(vq.view(torch.uint8), length + 1).view(torch.float8_e4m3fn)
    out8 = ops.decode_attention(
        qkv, kc8, vc8, lengths, num_heads=hq, num_kv_heads=hkv, k_scale=ks, v_scale=vs
    )
    e8 = (out8.double().reshape(hq, head_dim) - exact).abs()
    e16 = (out16.double().reshape(hq, head_dim) - exact).abs()
    group = hq // hkv
    bounds = [
        bound(
            q[0, h].float(),
            keys[h // group].float(),
            values[h // group].float(),
            ks[h // group].item(),
            vs[h // group].item(),
            scale,
        )
        for h in range(hq)
    ]
    return {
        "head_dim": head_dim,
        "keys": length + 1,
        "fp8_max_abs_err": e8.max().item(),
        "fp8_mean_abs_err": e8.mean().item(),
        "fp16_max_abs_err": e16.max().item(),
        "fp16_mean_abs_err": e16.mean().item(),
        "e4m3_bound_min_over_heads": min(bounds),
        "within_bound": all(e8[h].max().item() <= bounds[h] for h in range(hq)),
        "out_abs_max": exact.abs().max().item(),
    }


def hf_comparison(dtype: torch.dtype, steps: int = 256) -> dict | None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    from ..models.hf import compare_kv_dtypes
    from .families import build, prompts

    # The tests' small Llama (2 layers, 8 / 2 heads of 32) and prompts of 5, 23, 11 and 40 tokens.
    model = build("llama", "cuda", dtype)
    res = compare_kv_dtypes(model, prompts(model.config.vocab_size), steps, torch.float8_e4m3fn)
    res["dtype"] = str(dtype).replace("torch.", "")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmha.bench.fp8_accuracy", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("mmha.bench.fp8_accuracy: no CUDA GPU here")
        return 0
    from tabulate import tabulate

    rows = [attention_errors(d) for d in (32, 64, 80, 96, 128, 256)]
    print(
        tabulate(
            [
                [
                    r["head_dim"],
                    f"{r['fp8_max_abs_err']:.2e}",
                    f"{r['fp8_mean_abs_err']:.2e}",
                    f"{r['fp16_max_abs_err']:.2e}",
                    f"{r['fp16_mean_abs_err']:.2e}",
                    f"{r['e4m3_bound_min_over_heads']:.2e}",
                    r["within_bound"],
                ]
                for r in rows
            ],
            headers=[
                "head dim",
                "fp8 max err",
                "fp8 mean err",
                "fp16 max err",
                "fp16 mean err",
                "e4m3 bound (min)",
                "within bound",
            ],
            tablefmt="github",
        )
    )
    hf = [r for r in (hf_comparison(torch.float16), hf_comparison(torch.bfloat16)) if r is not None]
    for r in hf:
        print(
            f"HF adapter, {r['dtype']} model, fp8 vs {r['dtype']} cache, {r['rows']} rows x {r['steps']} "
            f"steps "
            f"teacher-forced: max |logit diff| {r['max_logit_diff']:.3g} (mean of per-step max "
            f"{r['mean_step_max_logit_diff']:.3g}; logits up to {r['logit_scale']:.3g}), "
            f"top-1 flips {r['top1_flips']}, decisive mismatches {r['decisive_mismatches']}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_accuracy.json").write_text(json.dumps({"attention": rows, "hf": hf}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
