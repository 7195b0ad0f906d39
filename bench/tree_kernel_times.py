"""Each kernel's device time in a tree step of the tree benchmark's rows (torch.profiler), so two
builds' steps can be compared kernel by kernel (the check-and-append launch, the attention kernel).
Runs against whichever ``mmha`` is on PYTHONPATH, back to trees of 2026-11-26 (``Row``,
``Layer``, ``mmha_fn`` of ``mmha.bench.tree``).

Usage: PYTHONPATH=/tmp/ab_old python bench/tree_kernel_times.py 16,1024,64 1,1024,64 [--iters 50] [--kv int8]
(rows as B,context,T: Hq 32, Hkv 8, head dim 128, binary trees, fp16 activations; ``--kv int8``
the rows' int8 twins; each row's head line names the dispatcher's plan, splits x stages)
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict

import torch

from mmha.bench import tree as tree_bench


def per_kernel(averages, iters: int) -> dict[str, float]:
    """Mean device microseconds per step of each kernel in a profiler's ``key_averages()`` over
    ``iters`` steps (host-side entries, with no device time of their own, left out)."""
    total: dict[str, float] = defaultdict(float)
    for e in averages:
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        if us > 0:
            total[e.key] += us
    return {name: us / iters for name, us in total.items()}


def kernel_times(fn, iters: int) -> dict[str, float]:
    """Mean device microseconds per step of each kernel ``fn`` launches."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return per_kernel(prof.key_averages(), iters)


def row_of(spec: str, kv: str = "") -> tree_bench.Row:
    """B,context,T as the tree benchmark's row (Hq 32, Hkv 8, D 128, a binary tree) over ``kv``."""
    try:
        b, ctx, t = (int(x) for x in spec.split(","))
    except ValueError:
        raise SystemExit(f"rows: give B,context,T (three integers), got {spec!r}") from None
    row = tree_bench.Row(b, 32, 8, 128, ctx, t, "binary")
    return dataclasses.replace(row, kv=kv) if kv else row


def plan_label(row: tree_bench.Row) -> str:
    """The dispatcher's splits x stages for the row (trees older than ``plan_of`` say so)."""
    plan_of = getattr(tree_bench, "plan_of", None)
    if plan_of is None:
        return "plan ?"
    plan = plan_of(row)
    return f"plan {plan.num_splits}x{plan.stages}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="+", help="B,context,T")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--kv", default="", choices=["", "int8"], help="the caches' format (fp16 when empty)")
    args = ap.parse_args()
    for row in [row_of(spec, args.kv) for spec in args.rows]:
        times = kernel_times(tree_bench.mmha_fn(tree_bench.Layer(row, 0)), args.iters)
        head = f"B={row.batch} context={row.context} T={row.nodes}{' kv=' + row.kv if row.kv else ''}, {plan_label(row)}"
        print(f"{head}: {sum(times.values()):.1f} us of kernels per step")
        for name, us in sorted(times.items(), key=lambda kv: -kv[1]):
            print(f"  {us:8.2f} us  {name[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
