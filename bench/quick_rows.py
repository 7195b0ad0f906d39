"""Time mmha (as dispatched) on a few rows, fast: for comparing kernel variants in one device call.

Each row is B,Hkv,S (Hq 32, D 128) or B,Hq,Hkv,D,S, optionally followed by @N to force N
splits on that row, or @NxW for N splits of W-warp blocks (``--splits`` forces N on every row).
Every row is checked against the fp32 reference first; times are cold-L2 medians
(``triton.testing.do_bench``), as in ``mmha.bench``.
``--peer`` also times SDPA's cuDNN backend on the same row.

    python bench/quick_rows.py 16,8,32768 1,32,1024 --tag base --out DIR [--peer] [--ceiling GBS]

Prints one line per row and appends them to DIR/quick_rows.jsonl.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mmha import dispatch, layout, ops
from mmha.bench import (
    TOLERANCE,
    Config,
    Problem,
    backend_context,
    graph_time_us,
    launch_floor_us,
    mmha_fn,
    plan_str,
    read_ceiling_gbs,
    read_floor,
    sdpa_fn,
)


def parse_row(spec: str, dtype: str) -> Config:
    v = [int(x) for x in spec.split(",")]
    if len(v) == 3:
        b, hkv, s = v
        hq, d = 32, 128
    else:
        b, hq, hkv, d, s = v
    return Config("quick", b, hq, hkv, d, s, dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rows", nargs="+")
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--tag", default="")
    p.add_argument("--peer", action="store_true", help="also time SDPA (cuDNN backend)")
    p.add_argument("--ceiling", type=float, default=0.0, help="read ceiling in GB/s (measured if 0)")
    p.add_argument(
        "--floor",
        action="store_true",
        help="also time a one-element add (launch floor) and, per row, the fastest streaming read of"
        " the row's K/V bytes (read floor) under the same cold-L2 harness",
    )
    p.add_argument("--graph", action="store_true", help="also time CUDA-graph replay (per call)")
    p.add_argument("--no-check", action="store_true", help="skip the reference check (diagnostic builds)")
    p.add_argument("--splits", type=int, default=0, help="force this split count (0: as dispatched)")
    p.add_argument(
        "--pad", type=int, default=0, help="cache capacity S_max = S + PAD (unused slots hold NaN)"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from triton.testing import do_bench

    ceiling = args.ceiling or read_ceiling_gbs()[0]
    if args.floor:
        floor_us = launch_floor_us()
        print(f"{args.tag:>10} launch floor (one-element add, cold L2): {floor_us:.1f} us", flush=True)
    for spec in args.rows:
        shape, _, row_splits = spec.partition("@")
        cfg = parse_row(shape, args.dtype)
        prob = Problem(cfg)
        if args.pad:
            pad = torch.full_like(prob.k[:, :, : args.pad], float("nan"))
            prob.k_cache = layout.pack_k(torch.cat([prob.k, pad], 2), layout="bhsd")
            prob.v_cache = layout.pack_v(torch.cat([prob.v, pad], 2), layout="bhsd")
        plan = ops.plan_for("cuda", cfg.batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                            cfg.seq_len, cfg.torch_dtype)  # fmt: skip
        splits_s, _, warps_s = row_splits.partition("x")
        forced = int(splits_s) if splits_s else args.splits
        if forced:
            plan = dispatch.Plan("single_pass" if forced == 1 else "split", forced, int(warps_s or 4))
        fn = mmha_fn(prob, plan.num_splits, plan.warps)
        rows = [0, cfg.batch - 1]
        err = float("nan")
        if not args.no_check:
            err = (fn()[rows].float() - prob.reference(rows)).abs().max().item()
            if not err < TOLERANCE[args.dtype]:
                raise SystemExit(f"{spec}: max error {err} at plan {plan}")
        us = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
        rec = {
            "tag": args.tag, "row": spec, "pad": args.pad, "dtype": args.dtype, "kv_mb": cfg.kv_bytes / 1e6,
            "plan": plan_str(plan), "us": us,
            "pct_ceiling": 100 * cfg.step_bytes / (us * 1e-6) / 1e9 / ceiling, "max_err": err,
        }  # fmt: skip
        if args.graph:
            rec["graph_us"] = graph_time_us(fn)
        if args.floor:
            floor = read_floor(cfg.kv_bytes, graphs=False)
            rec["read_floor_us"], rec["read_floor_shape"] = floor["us"], floor["shape"]
        if args.peer:
            with backend_context("sdpa_cudnn"):
                rec["cudnn_us"] = do_bench(sdpa_fn(prob), warmup=25, rep=100, return_mode="median") * 1e3
        line = (f"{args.tag:>10} {spec:>16} {rec['kv_mb']:8.1f} MB {rec['plan']:>14} {us:8.1f} us "
                f"{rec['pct_ceiling']:5.1f} %")  # fmt: skip
        if args.peer:
            line += f"  cudnn {rec['cudnn_us']:8.1f}"
        if args.graph:
            line += f"  graph {rec['graph_us']:8.1f}"
        if args.floor:
            line += f"  read floor {rec['read_floor_us']:6.1f} ({rec['read_floor_shape']})"
        print(line, flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            with open(args.out / "quick_rows.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
        del prob, fn
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
