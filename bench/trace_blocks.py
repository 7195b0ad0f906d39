"""Where a launch's time goes, block by block (diagnostic; needs a build with -DMMHA_EXP_TRACE,
which bench/trace.sh makes on the device).

With MMHA_EXP_TRACE, thread 0 of every block stamps %globaltimer at kernel entry (e0), after the
prologue (e1: q and the new K/V in shared memory), after the main loop and the block combine
(e2), after the block's output or partial is written (e3), and, in the block that merges a split
row, after the merge (e4), with its SM id. The stamps go into the workspace past the split
partials. This script runs each row after a cold-L2 flush, several times, and prints the spread
of each phase in us, relative to the first block's entry, for the run with the median end.

    python bench/trace_blocks.py 16,8,2048@2 1,8,4096@16x16 [--runs 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from quick_rows import parse_row

from mmha import ops
from mmha.bench import Problem


def trace_once(prob: Problem, splits: int, warps: int, flush: torch.Tensor) -> torch.Tensor:
    cfg = prob.cfg
    base = cfg.batch * cfg.num_heads * splits * (cfg.head_dim + 2)  # the kernel counts from here
    blocks = splits * cfg.num_heads * cfg.batch
    partials = torch.zeros(base + blocks * 12, dtype=torch.float32, device="cuda")
    counters = torch.zeros(cfg.batch * cfg.num_heads, dtype=torch.int32, device="cuda")
    out = torch.empty(cfg.batch, cfg.num_heads * cfg.head_dim, dtype=cfg.torch_dtype, device="cuda")
    lse = torch.empty(cfg.batch, cfg.num_heads, dtype=torch.float32, device="cuda")
    flush.zero_()
    torch.cuda.synchronize()
    torch.ops.mmha.decode_attention.default(
        prob.qkv, prob.k_cache, prob.v_cache, prob.lengths, None, out, lse, partials, counters,
        cfg.num_heads, cfg.num_kv_heads, prob.scale, 0, 10000.0, False, splits, False, warps,
    )  # fmt: skip
    torch.cuda.synchronize()
    rec = partials[base:].view(torch.int32).view(-1, 12).to(torch.int64).cpu()
    stamps = (rec[:, 0:10:2] & 0xFFFFFFFF) | (rec[:, 1:10:2] << 32)  # [blocks, 5] ns
    started = stamps[:, 0] > 0
    return stamps[started], rec[started, 11]


def pct(x: torch.Tensor, q: float) -> float:
    return float(torch.quantile(x.double(), q))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rows", nargs="+")
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--dump", action="store_true", help="also write each block's SM and stamps (median run) to the jsonl"
    )
    args = p.parse_args()
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    results = []
    for spec in args.rows:
        shape, _, forced_s = spec.partition("@")
        forced, _, warps_s = forced_s.partition("x")
        cfg = parse_row(shape, args.dtype)
        prob = Problem(cfg)
        plan = ops.plan_for(
            "cuda", cfg.batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.seq_len, cfg.torch_dtype
        )
        splits = int(forced) if forced else plan.num_splits
        warps = int(warps_s) if warps_s else (4 if forced else plan.warps)
        runs = []
        for _ in range(args.runs + 2):
            stamps, sm = trace_once(prob, splits, warps, flush)
            t0 = stamps[:, 0].min()
            rel = (stamps - t0).double() / 1e3  # us from the first block's entry
            rel[stamps == 0] = float("nan")
            runs.append((rel, sm))
        runs = runs[2:]
        # The run with the median end time stands for the row.
        ends = [float(torch.nan_to_num(r[:, 3:5], nan=0.0).max()) for r, _ in runs]
        order = sorted(range(len(runs)), key=lambda i: ends[i])
        rel, sm = runs[order[len(order) // 2]]
        loop = rel[:, 2] - rel[:, 1]
        row = {
            "row": spec,
            "splits": splits,
            "warps": warps,
            "blocks": int(rel.shape[0]),
            "sms_used": int(torch.unique(sm).numel()),
            "end_us_median_run": ends[order[len(order) // 2]],
            "end_us_min_run": ends[order[0]],
            "entry_us": [pct(rel[:, 0], q) for q in (0.5, 0.9, 1.0)],
            "prologue_done_us": [pct(rel[:, 1], q) for q in (0.0, 0.5, 1.0)],
            "loop_us": [pct(loop, q) for q in (0.0, 0.5, 1.0)],
            "loop_done_us": [pct(rel[:, 2], q) for q in (0.0, 0.1, 0.5, 0.9, 1.0)],
            "written_us": [pct(rel[:, 3], q) for q in (0.5, 1.0)],
        }
        if args.dump:
            row["blocks_sm"] = sm.tolist()
            row["blocks_us"] = [[round(float(x), 3) for x in r] for r in rel.nan_to_num(-1.0)]
        merged = rel[:, 4][~torch.isnan(rel[:, 4])]
        if merged.numel():
            row["merge_done_us"] = [pct(merged, q) for q in (0.0, 0.5, 1.0)]
        results.append(row)
        fmt = lambda v: "/".join(f"{x:.1f}" for x in v)  # noqa: E731
        parts = [
            f"{spec:>18} splits {splits} warps {warps} blocks {row['blocks']} SMs {row['sms_used']}",
            f"end {row['end_us_median_run']:.1f} (min run {row['end_us_min_run']:.1f})",
            f"entry p50/p90/max {fmt(row['entry_us'])}",
            f"prologue done min/p50/max {fmt(row['prologue_done_us'])}",
            f"loop min/p50/max {fmt(row['loop_us'])}",
            f"loop done min/p10/p50/p90/max {fmt(row['loop_done_us'])}",
            f"written p50/max {fmt(row['written_us'])}",
        ]
        if merged.numel():
            parts.append(f"merged min/p50/max {fmt(row['merge_done_us'])}")
        print(
            " | ".join(parts),
            flush=True,
        )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "trace_blocks.jsonl", "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
