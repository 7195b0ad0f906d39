"""What a pure streaming read of N bytes costs under the benchmark's own timing (diagnostic).

For each size, searches the streaming-sum kernel's program shapes for the fastest cold-L2 time
(``triton.testing.do_bench``: the L2 is flushed by writing a buffer before every call), then
times that shape two more ways: after a flush that only reads (so the L2 holds no dirty lines
that the timed call must write back), and as CUDA-graph replay (back-to-back calls, no flush).
The launch floor is a one-element add under the same cold-L2 harness. Prints one line per size
and the % of the read ceiling each time stands for; writes DIR/read_floor.json with --out.

    python bench/read_floor.py 16.8 134.2 268.4 [--out DIR]    # sizes in MB
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mmha.bench import fastest_sum, graph_time_us, launch_floor_us, read_ceiling_gbs

SHAPES = [(b, i, w) for b in (1024, 2048, 4096, 8192) for i in (1, 2, 4, 8) for w in (4, 8)]


def read_flush_time_us(fn, flush: torch.Tensor, reps: int = 100) -> float:
    """Median time of fn after an L2 flush that reads (sums) a buffer instead of writing it."""
    times = []
    sink = torch.empty((), device="cuda")
    for _ in range(reps + 10):
        torch.sum(flush, 0, out=sink)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times = sorted(times[10:])
    return times[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sizes_mb", nargs="+", type=float)
    p.add_argument("--ceiling", type=float, default=0.0, help="read ceiling in GB/s (measured if 0)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    ceiling = args.ceiling or read_ceiling_gbs()[0]
    launch_us = launch_floor_us()
    print(f"read ceiling {ceiling:.0f} GB/s; launch floor (one-element add, cold L2) {launch_us:.1f} us")
    flush = torch.ones(256 * 2**20 // 4, device="cuda")  # same size as do_bench's write flush
    rows = []
    for mb in args.sizes_mb:
        nbytes = int(mb * 1e6) // 4096 * 4096
        ideal_us = nbytes / (ceiling * 1e3)
        cold_us, shape, fn = fastest_sum(nbytes, SHAPES)
        read_flush_us = read_flush_time_us(fn, flush)
        graph_us = graph_time_us(fn)
        row = {
            "mb": nbytes / 1e6, "shape": shape, "ideal_us": ideal_us, "cold_us": cold_us,
            "read_flush_us": read_flush_us, "graph_us": graph_us, "launch_us": launch_us,
            "ceiling_gbs": ceiling,
        }  # fmt: skip
        rows.append(row)
        pct = {k: 100 * ideal_us / row[k] for k in ("cold_us", "read_flush_us", "graph_us")}
        print(
            f"{row['mb']:8.1f} MB  at ceiling {ideal_us:7.1f} us | cold L2 (write flush) {cold_us:7.1f} us "
            f"({pct['cold_us']:4.1f} %) | read flush {read_flush_us:7.1f} ({pct['read_flush_us']:4.1f} %) | "
            f"graph {graph_us:7.1f} ({pct['graph_us']:4.1f} %) | shape {shape}",
            flush=True,
        )
        del fn
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "read_floor.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
