"""``python -m mmha.bench --epilogue``: the int8 output epilogue fused into the step, against the
plain step and against the plain step followed by the same epilogue as a separate torch op, under
the decode timing.

Rows: the canonical batch-16 and batch-64 rows (fp16, Hq 32, D 128; the new token the last key).
Each layer has its own epilogue (``mmha.epilogue.OutEpilogue``: shift and smooth per channel, one
scale, int8 half to even within [-127, 127], as a SmoothQuant-style W8A8 layer feeds its int8
``o_proj``). Columns: ``mmha_decode_us`` (fused), ``plain_decode_us`` (no epilogue, same run) and
``unfused_decode_us`` (the plain call, then the epilogue as one ``torch.compile``d elementwise
kernel). The fused output is checked against the epilogue of the plain output (the plain output
is the fp32 attention rounded to fp16, so values may differ by one step; their share is reported)
and the plain output against the fp32 reference, before anything is timed. The three are timed
in four rounds, plain / fused / unfused then the reverse, twice (``timing.decode_us_rounds``),
each column the median of its rounds (``*_rounds_us``). Writes bench_epilogue.json and
bench_epilogue.md to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from .. import ops
from ..epilogue import OutEpilogue
from .args import parse_args
from .methods import mmha_fn
from .problems import CANONICAL, TOLERANCE, Config, layer_problems
from .runner import gpu_header, print_report

TARGET = 1.02  # fused / plain
SCALE = 40.0  # int8 steps per unit of (x + shift) * smooth


def rows(quick: bool = False) -> list[Config]:
    picked = [r for r in CANONICAL if r[1] in (16, 64)]
    if quick:
        picked = [r for r in picked if r[3] in (512, 2048, 1024)][:3]
    return [Config(g, b, 32, hkv, 128, s, "fp16") for g, b, hkv, s in picked]


def make_epilogue(channels: int, seed: int) -> OutEpilogue:
    g = torch.Generator().manual_seed(seed)
    shift = (torch.randn(channels, generator=g) * 0.1).cuda()
    smooth = (torch.rand(channels, generator=g) + 0.5).cuda()
    return OutEpilogue(shift, smooth, SCALE)


@torch.compile(dynamic=False)
def separate(out: torch.Tensor, shift: torch.Tensor, smooth: torch.Tensor, scale: float) -> torch.Tensor:
    """The same epilogue as its own kernel (compiled): fp16 out -> int8 (half to even, +-127)."""
    y = (out.float() + shift) * smooth * scale
    return torch.round(y).clamp(-127, 127).to(torch.int8)


def run_row(cfg: Config, tile_source: str = "auto") -> dict:
    from . import timing

    plan = ops.plan_for("cuda", cfg.batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.seq_len,
                        cfg.torch_dtype)  # fmt: skip
    row = {"group": cfg.group, "batch": cfg.batch, "num_kv_heads": cfg.num_kv_heads, "seq_len": cfg.seq_len,
           "layers": cfg.layers, "plan": f"{plan.num_splits}x{plan.stages}", "epilogue": "int8 shift smooth",
           "skipped": {}}  # fmt: skip
    probs = None
    try:
        probs = layer_problems(cfg, "mmha")
        channels = cfg.num_heads * cfg.head_dim
        epis = [make_epilogue(channels, i) for i in range(len(probs))]
        plain = [mmha_fn(p, plan, tile_source) for p in probs]
        eplan = ops.plan_for("cuda", cfg.batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.seq_len,
                             cfg.torch_dtype, epilogue=True)  # fmt: skip
        row["epilogue_plan"] = f"{eplan.num_splits}x{eplan.stages}"
        fused = [mmha_fn(p, eplan, tile_source, epilogue=e) for p, e in zip(probs, epis, strict=True)]
        unfused = [
            lambda f=f, e=e: separate(f(), e.shift, e.smooth, float(e.scale))
            for f, e in zip(plain, epis, strict=True)
        ]
        # Checks (each call appends the same token at slot S - 1: repeated calls are identical).
        x = plain[0]().clone()
        q = fused[0]().clone()
        u = unfused[0]().clone()
        torch.cuda.synchronize()
        row["plain_error"] = err = probs[0].error(x)
        want = epis[0].apply(x, cfg.torch_dtype)
        steps = (q.int() - want.int()).abs()
        row["fused_max_steps"] = int(steps.max())
        row["fused_one_step_share"] = float((steps > 0).float().mean())
        row["unfused_equal_definition"] = bool(torch.equal(u, want))
        if not math.isfinite(err) or err > TOLERANCE[cfg.dtype] or row["fused_max_steps"] > 1:
            row["skipped"]["mmha"] = f"wrong result: plain error {err:.3g}, {row['fused_max_steps']} steps"
            return row
        t = timing.decode_us_rounds({"plain": plain, "mmha": fused, "unfused": unfused})
        for name, got in t.items():
            row[f"{name}_decode_us"] = got["us"]
            row[f"{name}_rounds_us"] = got["rounds_us"]
        row["vs_plain"] = row["mmha_decode_us"] / row["plain_decode_us"]
        row["vs_unfused"] = row["mmha_decode_us"] / row["unfused_decode_us"]
    except Exception as exc:
        row["skipped"]["mmha"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120]}"
    finally:
        del probs
        torch.cuda.empty_cache()
    return row


def table(results: list[dict]) -> str:
    from tabulate import tabulate

    def f(r, k, fmt):
        return format(r[k], fmt) if k in r else "-"

    body = [[r["group"], r["batch"], r["num_kv_heads"], r["seq_len"], f(r, "mmha_decode_us", ".1f"),
             f(r, "plain_decode_us", ".1f"), f(r, "unfused_decode_us", ".1f"), f(r, "vs_plain", ".3f"),
             f(r, "vs_unfused", ".3f"), f(r, "fused_one_step_share", ".2e")] for r in results]  # fmt: skip
    cols = ["group", "B", "Hkv", "S", "fused us", "plain us", "plain + torch us", "fused/plain",
            "fused/unfused", "one-step share"]  # fmt: skip
    return tabulate(body, headers=cols, tablefmt="github", disable_numparse=True)


def misses(results: list[dict]) -> list[str]:
    out = []
    for r in results:
        label = f"B={r['batch']} Hkv={r['num_kv_heads']} S={r['seq_len']}"
        if "vs_plain" not in r:
            out.append(f"{label}: not timed ({r['skipped'].get('mmha', '')})")
            continue
        if r["vs_plain"] > TARGET:
            out.append(f"{label}: {r['vs_plain']:.3f}x the plain call > {TARGET}")
        if r["vs_unfused"] >= 1:
            out.append(f"{label}: {r['vs_unfused']:.3f}x plain + separate epilogue")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmha.bench --epilogue", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few rows")
    ap.add_argument("--tile-source", choices=list(ops.TILE_SOURCES), default="auto", help="of every call")
    ap.add_argument("--out", type=Path, default=Path("bench_epilogue"))
    args = parse_args(ap, argv)
    if not torch.cuda.is_available():
        print("python -m mmha.bench --epilogue needs a CUDA GPU")
        return 1
    header = {**gpu_header(), "timing": "decode", "target_vs_plain": TARGET, "scale": SCALE,
              "tile_source": args.tile_source}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for cfg in rows(args.quick):
        results.append(run_row(cfg, args.tile_source))
        torch._dynamo.reset()
        brief = {k: v for k, v in results[-1].items() if k.endswith("_us") or k in ("batch", "seq_len")}
        print(json.dumps(brief), flush=True)
        (args.out / "bench_epilogue.json").write_text(
            json.dumps({"header": header, "rows": results}, indent=1)
        )
    print_report(args.out / "bench_epilogue.md", header, table(results), misses(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
