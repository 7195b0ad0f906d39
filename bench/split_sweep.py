"""Measure mmha on the canonical grid at every split count and block size, next to the
dispatcher's pick.

This is the table the dispatcher's thresholds are checked against (docs/design.md quotes it).
Blocks of 4 warps run at every split count; on the tensor-core loop, blocks of 8 and 16 warps
run at the split counts whose grid fits one wave of them (more would leave a partial second
wave). Plans read ``S`` (4 warps) or ``SxW`` (S splits of W-warp blocks). Every plan is checked
against the fp32 reference before it is timed; times are cold-L2 medians
(``triton.testing.do_bench``), as in ``mmha.bench``. ``--extras`` adds head_dim 64 rows.

    python bench/split_sweep.py --out DIR [--dtype fp16] [--extras]

Writes DIR/split_sweep.json and DIR/split_sweep.md and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tabulate import tabulate

from mmha import dispatch, ops
from mmha.bench import CANONICAL, TOLERANCE, Config, Problem, mmha_fn, plan_str

SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 33, 48, 64)
# Rows off the canonical grid (B, Hq, Hkv, D, S): head_dim 64, GQA and MHA.
EXTRAS = ((16, 32, 8, 64, 2048), (16, 16, 16, 64, 1024), (1, 16, 16, 64, 16384), (4, 16, 16, 64, 4096))


def plans(cfg: Config, shape: tuple) -> list[dispatch.Plan]:
    """Every (splits, warps) to time on this row, the dispatcher's own pick included."""
    base = dispatch.base_blocks(cfg.batch, cfg.num_heads, cfg.num_kv_heads)
    sms = ops.num_sms(torch.cuda.current_device())
    tc = dispatch.uses_tensor_cores(cfg.head_dim, cfg.torch_dtype)
    out = [ops.plan_for(*shape)]
    for w in dispatch.WARP_CHOICES if tc else (dispatch.WARPS,):
        wave = sms * ops.blocks_per_sm(*shape[:1], cfg.torch_dtype, cfg.head_dim, cfg.num_heads,
                                       cfg.num_kv_heads, w)  # fmt: skip
        for s in SPLITS:
            if s > 1 and cfg.seq_len // s < 16:
                continue
            if w != dispatch.WARPS and base * s > wave:
                continue
            out.append(dispatch.Plan("single_pass" if s == 1 else "split", s, w))
    return list(dict.fromkeys(out))


def sweep_row(cfg: Config) -> dict:
    from triton.testing import do_bench

    prob = Problem(cfg)
    shape = ("cuda", cfg.batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.seq_len, cfg.torch_dtype)
    plan = ops.plan_for(*shape)
    ref = prob.reference([0, cfg.batch - 1])
    times = {}
    for pl in plans(cfg, shape):
        fn = mmha_fn(prob, pl.num_splits, pl.warps)
        err = (fn()[[0, cfg.batch - 1]].float() - ref).abs().max().item()
        if not err < TOLERANCE[cfg.dtype]:
            raise RuntimeError(f"{cfg}: plan {pl}, max error {err}")
        times[key(pl)] = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    best = min(times, key=times.get)
    del prob
    torch.cuda.empty_cache()
    return {
        "batch": cfg.batch, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "seq_len": cfg.seq_len, "kv_mb": cfg.kv_bytes / 1e6,
        "plan": key(plan), "plan_us": times[key(plan)], "best": best, "best_us": times[best],
        "times_us": times,
    }  # fmt: skip


def key(plan: dispatch.Plan) -> str:
    """A plan as the sweep names it: ``S`` or ``SxW``."""
    return plan_str(plan).split("/")[1]


def render(data: dict) -> str:
    """The sweep as a github table (also used by bench/make_docs.py)."""
    table = [
        [r["batch"], r["num_heads"], r["num_kv_heads"], r["head_dim"], r["seq_len"], f"{r['kv_mb']:.0f}",
         r["plan"], f"{r['plan_us']:.1f}", r["best"], f"{r['best_us']:.1f}",
         f"{r['plan_us'] / r['best_us']:.2f}",
         " ".join(f"{k}:{v:.1f}" for k, v in r["times_us"].items())]
        for r in data["rows"]
    ]  # fmt: skip
    headers = ["B", "Hq", "Hkv", "D", "S", "KV MB", "plan", "plan us", "best", "best us", "plan/best",
               "us by splits (xW: W warps per block)"]  # fmt: skip
    md = tabulate(table, headers, tablefmt="github")
    h = data["header"]
    return f"{h['gpu']} ({h['sms']} SMs), torch {h['torch']}, {h['dtype']}, cold L2\n\n{md}\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("split_sweep_out"))
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--extras", action="store_true", help="also the head_dim 64 rows (EXTRAS)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cfgs = [Config(group, b, 32, hkv, 128, s, args.dtype) for group, b, hkv, s in CANONICAL]
    if args.extras:
        cfgs += [Config("extra", b, hq, hkv, d, s, args.dtype) for b, hq, hkv, d, s in EXTRAS]
    rows = []
    for cfg in cfgs:
        rows.append(sweep_row(cfg))
        r = rows[-1]
        print(
            f"B={cfg.batch} Hq={cfg.num_heads} Hkv={cfg.num_kv_heads} D={cfg.head_dim} S={cfg.seq_len}: "
            f"plan {r['plan']} {r['plan_us']:.1f} us, best {r['best']} {r['best_us']:.1f} us",
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
