"""``python -m mmha.bench``: decode attention, mmha next to the peers, on one GPU.

``--grid canonical`` runs the grid of ``shared/BENCHMARK.md`` in fp16 and bf16 (plus head dims
64 and 256 and the small-head rows in fp16); ``--quick`` a short subset;
``--batch/--heads/--kv-heads/--head-dim/--seq/--dtype`` a custom sweep; ``--mods`` the score
modifiers' rows (``mmha.bench.mods``); ``--tree`` tree steps (``mmha.bench.tree``); ``--paged``
paged caches (``mmha.bench.paged``); ``--epilogue`` the fused output epilogue
(``mmha.bench.epilogue``). Every method is checked against an fp32 reference before it is timed.
The primary time is the decode timing (one layer of a decode step: ``mmha.bench.timing``), next
to the read floor timed the same way; the cold-L2 single call and a repeated-call graph are
secondary (mmha and the best peer). Output: a short
table (``--full``: every peer and the secondary times), bench.json / bench.csv / bench.md, and
PNG plots where matplotlib is present.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from . import report
from .args import parse_args
from .methods import PEERS
from .problems import DTYPES, build_configs
from .runner import gpu_header, progress, run_config, write_outputs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--mods" in argv:  # score modifiers: rows and peers of their own (mmha.bench.mods)
        from . import mods

        return mods.main([a for a in argv if a != "--mods"])
    if "--paged" in argv:  # paged caches against contiguous ones (mmha.bench.paged)
        from . import paged

        return paged.main([a for a in argv if a != "--paged"])
    if "--epilogue" in argv:  # the output epilogue fused against plain and separate (mmha.bench.epilogue)
        from . import epilogue

        return epilogue.main([a for a in argv if a != "--epilogue"])
    if "--tree" in argv:  # tree steps: rows and peers of their own (mmha.bench.tree)
        from . import tree

        return tree.main([a for a in argv if a != "--tree"])
    p = argparse.ArgumentParser(prog="python -m mmha.bench", description=__doc__.split("\n")[0])
    p.add_argument("--grid", choices=["canonical", "quick", "custom"], default="custom")
    p.add_argument("--quick", action="store_true", help="a short subset (same as --grid quick)")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, nargs="+", default=[32])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--dtype", choices=list(DTYPES), nargs="+")
    p.add_argument("--peers", nargs="*", choices=list(PEERS), default=list(PEERS), help="peers to time")
    p.add_argument("--no-secondary", action="store_true", help="skip the cold-L2 and repeated-graph times")
    p.add_argument("--no-extras", action="store_true", help="canonical grid without the extra rows")
    p.add_argument("--fp8", action="store_true",
                   help="each 16-bit row of head dim 128 also with an fp8 (e4m3) cache")  # fmt: skip
    p.add_argument("--int8", action="store_true",
                   help="each 16-bit row of head dim 128 also with an int8 cache (token scales)")  # fmt: skip
    p.add_argument("--int4", action="store_true",
                   help="each 16-bit row of head dim 128 also with an int4 cache (mmha.int4)")  # fmt: skip
    p.add_argument("--full", action="store_true", help="print every column (the files always have them)")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parse_args(p, argv)
    if args.quick:
        args.grid = "quick"
    if not torch.cuda.is_available():
        print("mmha.bench: no CUDA GPU here; nothing to time (the reference path runs on the CPU).")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("mmha.bench needs triton (the read floor's kernel and do_bench)")
        return 1
    custom = (args.batch, args.seq, args.heads, args.kv_heads, args.head_dim)
    cfgs = build_configs(args.grid, args.dtype, not args.no_extras, custom, args.fp8, args.int8, args.int4)
    header = {**gpu_header(), "grid": args.grid}
    print(report.header_line(header), flush=True)
    rows, floors, done = [], {}, {}
    for cfg in progress(cfgs, "mmha.bench"):
        twin = done.get(cfg.same_shape()) if cfg.kv else None
        res = run_config(cfg, peers=args.peers, secondary=not args.no_secondary, floors=floors, twin=twin)
        done[cfg] = res
        rows.append(report.summarize(res, header["ceiling_gbs"]))
    write_outputs(rows, header, args.out)
    print()
    print(report.table(rows, full=args.full))
    line = report.skipped_line(rows)
    if line:
        print(line)
    if args.grid == "canonical":
        misses = report.bar(rows)
        print("speed bar: " + ("holds on every canonical row" if not misses else f"{len(misses)} misses"))
        for m in misses:
            print("  " + m)
    if args.fp8:
        misses = report.fp8_bar(rows)
        print("fp8 bar: " + ("holds on every fp8 row" if not misses else f"{len(misses)} misses"))
        for m in misses:
            print("  " + m)
    if args.int8:
        misses = report.int8_bar(rows)
        print("int8 bar: " + ("holds on every int8 row" if not misses else f"{len(misses)} misses"))
        for m in misses:
            print("  " + m)
    if args.int4:
        misses = report.int4_bar(rows)
        print("int4 bar: " + ("holds on every int4 row" if not misses else f"{len(misses)} misses"))
        for m in misses:
            print("  " + m)
    print(f"wrote {args.out}/bench.json, bench.csv, bench.md", end="")
    paths = report.plot(rows, header, args.out)
    print("".join(f", {p.name}" for p in paths))
    return 0
