"""``python -m mmha.bench.kernel_times``: each kernel's device time in mmha's tree steps.

A tree step whose tree is not small is two launches, the trees' check and append
(``tree_prepare_kernel``) and then the attention; the decode timing (``mmha.bench.tree``) gives
their sum as a CUDA graph replays it, the attention's start overlapping the check's end. A change
that moves work from one launch to the other can leave that sum where it was while each side
moves, so this prints each side: a row's tree step runs ``--calls`` times eagerly under the torch
profiler (which serialises the launches) and each mmha kernel's mean device time per launch is
printed, with the launches a step makes of it. Beside them, the step's decode timing as the tree
benchmark takes it (its layers' steps replayed in a CUDA graph, the launches overlapping again).

Rows ``B,CTX,T[@SPLITSxSTAGES]`` as ``mmha.bench.timeline --tree`` takes them (the tree
benchmark's rows, binary trees; ``--kv int8`` their int8 twins). Any build (no diagnostic build
needed). ``--json`` writes the rows.

    python -m mmha.bench.kernel_times 1,1024,64 16,1024,64 16,1024,16 [--kv int8] [--calls 50]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def kernel_name(key: str) -> str:
    """A profiler kernel's name without its return type, namespace and parameter list:
    ``void mmha::tree_prepare_kernel<__half, __half, 128>(mmha::MmhaParams)`` ->
    ``tree_prepare_kernel<__half, __half, 128>``."""
    name = key.strip().removeprefix("void ").strip()
    depth = 0
    for i, ch in enumerate(name):  # the parameter list: the first "(" outside the template brackets
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0:
            name = name[:i]
            break
    return name.removeprefix("mmha::")


def per_kernel(events, calls: int) -> list[dict]:
    """The mmha kernels among the profiler's averages (objects with ``key``, ``count`` and
    ``device_time_total`` in us), in launch-count order then by name: each one's name, its launches
    a step (``count / calls``) and its mean device time a launch."""
    out = [
        {"kernel": kernel_name(e.key), "per_step": e.count / calls, "us": e.device_time_total / e.count}
        for e in events
        if "mmha::" in e.key and e.count > 0 and e.device_time_total > 0
    ]
    return sorted(out, key=lambda r: (-r["per_step"], r["kernel"]))


def run_row(spec: str, calls: int, kv: str = "") -> dict:
    """A tree row's step (checked against the fp32 reference first): its decode timing over the
    row's layers, then its first layer's step under the profiler: {row, plan, decode_us, kernels}."""
    from torch.profiler import ProfilerActivity, profile

    from . import tree as tree_bench
    from .problems import TOLERANCE
    from .timing import decode_us

    st = tree_bench.spec_steps(spec, kv)
    err = tree_bench.error(st.fns[0](), st.layers[0], st.ref)
    tol = TOLERANCE["fp16"]
    if not err <= tol:
        raise RuntimeError(f"tree {spec}: error {err:.3e} against the reference (tolerance {tol})")
    decode = decode_us(st.fns)["us"]
    fn = st.fns[0]
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = per_kernel(prof.key_averages(), calls)
    return {"row": st.label, "plan": st.plan, "decode_us": decode, "kernels": kernels}


def format_row(r: dict) -> str:
    lines = [f"{r['row']} plan {r['plan']}: decode timing {r['decode_us']:.2f} us; under the profiler:"]
    lines += [f"  {k['us']:8.2f} us  x{k['per_step']:g}  {k['kernel']}" for k in r["kernels"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="+", metavar="B,CTX,T[@SxT]", help="mmha.bench.tree's rows (binary trees)")
    p.add_argument("--kv", default="", choices=["", "int8"], help="the rows' int8 twins")
    p.add_argument("--calls", type=int, default=50, help="steps timed and profiled per row")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = p.parse_args(argv)
    if args.calls < 1:
        p.error(f"--calls must be at least 1, got {args.calls}")
    from . import tree as tree_bench

    for spec in args.rows:  # every row's spelling checked before anything runs
        try:
            tree_bench.spec_row(spec, args.kv)
        except ValueError as e:
            p.error(str(e))
    if not torch.cuda.is_available():
        print("kernel_times needs a GPU", file=sys.stderr)
        return 2
    out = []
    for spec in args.rows:
        r = run_row(spec, args.calls, args.kv)
        out.append(r)
        print(format_row(r), flush=True)
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
