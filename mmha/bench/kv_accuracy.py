"""``python -m mmha.bench.kv_accuracy``: what each K/V cache format costs in attention accuracy,
before any kernel reads it (the formats' semantics: ``mmha.quant``, ``mmha.spec.quantize_fp8``).

For one decode query against a cache of S tokens (Hq 32, Hkv 8, D 128), the attention output with
K (or V) stored in each format and the other tensor 16-bit, against attention in fp64 over the
16-bit cache: the relative
error ``|out_q - out| / |out|`` per query head (mean and max over heads and seeds). Two kinds of
K/V:

- ``random``: q, K, V ~ N(0, 1);
- ``outliers``: what trained models' keys look like: a per-channel offset, six channel pairs
  (rotary's halves) 10x the rest; V with two channels 8x.

Formats: ``fp8`` (e4m3, one scale per kv head from the first half's absolute maxima, as
``KVCache`` calibrates it), ``int8`` / ``int4`` with a scale per token and kv head (symmetric) or
a scale and zero point (``asym``), K ``smooth`` (``mmha.quant.smoothing_factors`` of the first
half, alpha 0.5, folded into q), or K per channel (KIVI: a scale and zero point per channel over
each group of 64 tokens, the last partial group kept in 16 bits: ``channels``); a last word
``fp16`` / ``bf16``: the scales and zero points stored in that dtype, not fp32. Runs on the CPU or
a GPU (the same numbers up to fp64 rounding); writes kv_accuracy.json under --out.

``--model NAME`` (a ``mmha.bench.hf`` shape, random weights at trained scale, fp16, on a GPU)
adds the formats on that model, teacher-forced (``mmha.bench.kv_formats_model``): agreement of
the greedy picks with the 16-bit cache and the mean KL divergence, after prompts of
``--model-contexts`` tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

from .. import quant, spec

HQ, HKV, D = 32, 8, 128
# The formats of each tensor, by the name ``store`` takes; the other tensor stays 16-bit.
K_FORMATS = ["fp8", "int8", "int8 smooth", "int8 channels", "int4", "int4 asym", "int4 asym smooth",
             "int4 channels", "int4 channels fp16", "int4 channels bf16"]  # fmt: skip
V_FORMATS = ["fp8", "int8", "int4", "int4 asym", "int4 asym fp16", "int4 asym bf16"]
# A format name's last word, where it names how its scales and zero points are stored (else fp32).
SCALE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
GROUP = 64  # tokens per group of the per-channel K formats


def store(kind: str, x: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """``x [S, Hkv, D]`` (16-bit values) stored as ``kind`` and read back in fp64."""
    if kind == "fp8":
        scale = spec.fp8_scale(prompt.abs().amax(dim=(0, 2)).float())
        return (
            spec.dequantize_fp8(spec.quantize_fp8(x, scale).transpose(0, 1), scale).transpose(0, 1).double()
        )
    bits = 8 if kind.startswith("int8") else 4
    scale_dtype = SCALE_DTYPES.get(kind.split()[-1])
    if "channels" in kind:
        return quant.roundtrip_channels(x, bits, GROUP, scale_dtype).double()
    smooth = quant.smoothing_factors(prompt) if "smooth" in kind else None
    return quant.roundtrip(
        x, bits, symmetric="asym" not in kind, smoothing=smooth, scale_dtype=scale_dtype
    ).double()


def make(kind: str, seq_len: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[Hq, D]``, K and V ``[S, Hkv, D]`` rounded to fp16, as fp64."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(seq_len, HKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(seq_len, HKV, D, generator=g, dtype=torch.float64)
    if kind == "outliers":
        offset = torch.randn(HKV, D, generator=g, dtype=torch.float64) * 1.5
        k = k + offset
        gain = torch.ones(HKV, D, dtype=torch.float64)
        for h in range(HKV):
            pairs = torch.randperm(D // 2, generator=g)[:6]
            gain[h, pairs] = gain[h, pairs + D // 2] = 10.0
        k = k * gain
        vgain = torch.ones(HKV, D, dtype=torch.float64)
        vgain[:, torch.randperm(D, generator=g)[:2]] = 8.0
        v = v * vgain
    half = lambda t: t.half().double().to(device)  # noqa: E731
    return half(q), half(k), half(v)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp64 attention of ``q [Hq, D]`` over ``k, v [S, Hkv, D]`` (GQA groups) -> ``[Hq, D]``."""
    kh = k.transpose(0, 1).repeat_interleave(HQ // HKV, 0)  # [Hq, S, D]
    vh = v.transpose(0, 1).repeat_interleave(HQ // HKV, 0)
    p = torch.softmax(torch.einsum("hd,hsd->hs", q, kh) / math.sqrt(D), -1)
    return torch.einsum("hs,hsd->hd", p, vh)


def errors(kind: str, seq_len: int, seeds: int, device) -> list[dict]:
    """Per tensor and format: mean and max relative error over heads and seeds."""
    rel: dict[tuple[str, str], list[torch.Tensor]] = {}
    for seed in range(seeds):
        q, k, v = make(kind, seq_len, seed, device)
        exact = attend(q, k, v)
        prompt_k, prompt_v = k[: seq_len // 2], v[: seq_len // 2]
        for fmt in K_FORMATS:
            out = attend(q, store(fmt, k, prompt_k), v)
            rel.setdefault(("K", fmt), []).append((out - exact).norm(dim=-1) / exact.norm(dim=-1))
        for fmt in V_FORMATS:
            out = attend(q, k, store(fmt, v, prompt_v))
            rel.setdefault(("V", fmt), []).append((out - exact).norm(dim=-1) / exact.norm(dim=-1))
    return [
        {
            "tensor": t,
            "format": f,
            "mean_rel_err": float(torch.cat(r).mean()),
            "max_rel_err": float(torch.cat(r).max()),
        }
        for (t, f), r in rel.items()
    ]


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    body = [[r["kv"], r["context"], r["tensor"], r["format"], f"{r['mean_rel_err']:.2e}",
             f"{r['max_rel_err']:.2e}"] for r in rows]  # fmt: skip
    cols = ["K/V", "context", "quantised", "format", "mean rel. error", "max rel. error"]
    return tabulate(body, cols, tablefmt="github", disable_numparse=True)


def model_table(rows: list[dict]) -> str:
    from tabulate import tabulate

    body = [[r["context"], r["format"], f"{r['agreement']:.3f}", f"{r['mean_kl']:.2e}", f"{r['max_kl']:.2e}"]
            for r in rows]  # fmt: skip
    cols = ["context", "format", "greedy agreement", "mean KL", "max KL"]
    return tabulate(body, cols, tablefmt="github", disable_numparse=True)


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.split("\n\n")[0]
    ap = argparse.ArgumentParser(prog="python -m mmha.bench.kv_accuracy", description=doc)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=Path("bench_kv_accuracy"))
    ap.add_argument("--model", help="a mmha.bench.hf shape (llama-1b, llama3-8b, qwen3-8b): the model rows")
    ap.add_argument("--model-contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--model-steps", type=int, default=128)
    args = ap.parse_args(argv)
    rows = []
    for kind in ("random", "outliers"):
        for seq_len in args.contexts:
            for e in errors(kind, seq_len, args.seeds, args.device):
                rows.append({"kv": kind, "context": seq_len, **e})
                print(json.dumps(rows[-1]), flush=True)
    header = {
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "heads": [HQ, HKV, D], "seeds": args.seeds,
    }  # fmt: skip
    model_rows = []
    if args.model:
        from .hf import build_model
        from .kv_formats_model import compare

        model = build_model(torch.float16, "sdpa", model=args.model)
        header["model"] = args.model
        for context in args.model_contexts:
            model_rows += compare(model, context, args.model_steps)
            print(json.dumps(model_rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"header": header, "rows": rows, "model_rows": model_rows}
    (args.out / "kv_accuracy.json").write_text(json.dumps(result, indent=1))
    print(table(rows))
    if model_rows:
        print(model_table(model_rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
