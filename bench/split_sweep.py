"""Measure mmha on the canonical grid at every split count, next to the dispatcher's pick.

This is the table the dispatcher's thresholds are checked against (docs/design.md quotes it).
Each row is checked against the fp32 reference at the dispatched plan first; times are cold-L2
medians (``triton.testing.do_bench``), as in ``mmha.bench``.

    python bench/split_sweep.py --out DIR [--dtype fp16]

Writes DIR/split_sweep.json and DIR/split_sweep.md and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tabulate import tabulate

from mmha import ops
from mmha.bench import CANONICAL, TOLERANCE, Config, Problem, mmha_fn

SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def sweep_row(cfg: Config) -> dict:
    from triton.testing import do_bench

    prob = Problem(cfg)
    shape = ("cuda", cfg.batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.seq_len, cfg.torch_dtype)
    plan = ops.plan_for(*shape)
    ref = prob.reference([0, cfg.batch - 1])
    times = {}
    for s in sorted(set(SPLITS) | {plan.num_splits}):
        if s > 1 and cfg.seq_len // s < 16:
            continue
        fn = mmha_fn(prob, s)
        err = (fn()[[0, cfg.batch - 1]].float() - ref).abs().max().item()
        if not err < TOLERANCE[cfg.dtype]:
            raise RuntimeError(f"{cfg}: {s} splits, max error {err}")
        times[s] = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    best = min(times, key=times.get)
    del prob
    torch.cuda.empty_cache()
    return {
        "batch": cfg.batch, "num_kv_heads": cfg.num_kv_heads, "seq_len": cfg.seq_len,
        "kv_mb": cfg.kv_bytes / 1e6, "plan_splits": plan.num_splits,
        "plan_us": times[plan.num_splits], "best_splits": best, "best_us": times[best],
        "times_us": {str(k): v for k, v in times.items()},
    }  # fmt: skip


def render(data: dict) -> str:
    """The sweep as a github table (also used by bench/make_docs.py)."""
    table = [
        [r["batch"], r["num_kv_heads"], r["seq_len"], f"{r['kv_mb']:.0f}", r["plan_splits"],
         f"{r['plan_us']:.1f}", r["best_splits"], f"{r['best_us']:.1f}", f"{r['plan_us'] / r['best_us']:.2f}",
         " ".join(f"{k}:{v:.1f}" for k, v in r["times_us"].items())]
        for r in data["rows"]
    ]  # fmt: skip
    md = tabulate(table, ["B", "Hkv", "S", "KV MB", "plan", "plan us", "best", "best us", "plan/best",
                          "us by split count"], tablefmt="github")  # fmt: skip
    h = data["header"]
    return f"{h['gpu']} ({h['sms']} SMs), torch {h['torch']}, {h['dtype']}, cold L2\n\n{md}\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("split_sweep_out"))
    p.add_argument("--dtype", default="fp16")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for group, b, hkv, s in CANONICAL:
        rows.append(sweep_row(Config(group, b, 32, hkv, 128, s, args.dtype)))
        print(
            f"B={b} Hkv={hkv} S={s}: plan {rows[-1]['plan_splits']} best {rows[-1]['best_splits']}",
            flush=True,
        )
    dev = torch.cuda.get_device_properties(0)
    header = {
        "gpu": dev.name,
        "sms": dev.multi_processor_count,
        "torch": torch.__version__,
        "dtype": args.dtype,
    }
    (args.out / "split_sweep.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    md = render({"header": header, "rows": rows})
    (args.out / "split_sweep.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
