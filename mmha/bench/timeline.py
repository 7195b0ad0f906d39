"""``python -m mmha.bench.timeline``: where a launch's time goes, block by block.

Needs a diagnostic build whose tile loop stamps each block's events (``csrc/kernels/timeline.cuh``):
``MMHA_TIMELINE=1 python setup.py build_ext --inplace`` (any other build refuses, saying so; the
events cost a few stores per block, so time the product with a normal build).

Each row ``B,Hq,Hkv,D,S[@SPLITSxSTAGES]`` (fp16 unless ``--dtype``) runs as the decode timing
runs it: its layers' calls back to back in one CUDA graph, each on its own cache, every output
checked against the fp32 reference first; ``--tree B,CTX,T[@SxT]``: the tree benchmark's
rows (``mmha.bench.tree``, binary trees; with ``--kv int8`` their int8 twins) the same way. Each
launch gets its own event buffer; after
``--replays`` replays, each timed with CUDA events, the last one's events are read. Per replay:
its time by the events against its blocks' time (the first launch's first block start to the
last launch's last block end): what the graph spends outside the blocks. Per launch: its span
(first block's start to last block's end) and the gap to the next launch's first block; per
block, for its first item (``PHASES``): start after the launch's first block, its first
instruction -> start (barriers set up), first instruction -> first item decided (the producer's;
its row's length read), start -> first copies issued -> first tile landed -> last tile landed ->
last tile attended -> combined -> out stored (or the split's partial) -> token appended -> item
done (the split merge), then the block's later items, the same phases of its second item (a
steady state: the first also pays the cold start), and how far apart the blocks end. Printed
as medians over the layers of each launch's median (and slowest) block, and for tree steps the
median over the items that own the new nodes alone (they build and append them: the step's tail);
``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

# Events of timeline.cuh (TimelineEvent in csrc/kernels/mmha_params.h), in order: the block's
# (and its first item's), then the same names for its second item ("second_" + name, kTlSecond + e:
# only its item events are stamped).
FIRST_EVENTS = (
    "entered", "start", "decided", "first_issued", "first_landed", "last_landed", "last_attended", "combined",
    "out_stored", "appended", "item_done", "consumers_done", "producer_done", "header_seen", "q_built",
    "counted", "role", "weighed", "summed", "q_staged", "q_placed", "q_rotated", "nodes_built", "patched",
    "merges_begin",
)  # fmt: skip
EVENTS = FIRST_EVENTS + tuple(f"second_{e}" for e in FIRST_EVENTS)
# Columns that are not a time after the block's start: its first instruction, its first item's role
# (bits, role_summary).
STAMPED_BEFORE_START = ("entered", "role", "second_entered", "second_role")
# (name, from event, to event): a block's phases, all but the first of its first item.
PHASES = (
    ("start after the launch's first block", None, "start"),
    ("entered -> start (barriers set up)", "entered", "start"),
    ("entered -> first item decided", "entered", "decided"),
    ("start -> first copies issued", "start", "first_issued"),
    ("issued -> first tile landed", "first_issued", "first_landed"),
    ("  issued -> consumers see the header", "first_issued", "header_seen"),
    ("  header -> q (and tree nodes) built", "header_seen", "q_built"),
    # Wide items: warp 0's steps of the q build, then the barrier that waits for the other warps.
    ("    header -> q rows staged (wide)", "header_seen", "q_staged"),
    ("    staged -> node positions read", "q_staged", "q_placed"),
    ("    positions -> warp 0's q rotated", "q_placed", "q_rotated"),
    ("    rotated -> every warp's q", "q_rotated", "q_built"),
    # A fused tree's owners: thread 0's share of the nodes, then the barrier that waits for the rest.
    ("    header -> nodes built (owners, thread 0)", "header_seen", "nodes_built"),
    ("  q built -> first tile landed", "q_built", "first_landed"),
    ("first -> last tile landed", "first_landed", "last_landed"),
    ("last tile landed -> attended", "last_landed", "last_attended"),
    # Thread 0's warp: its part of the last tile's new slots from shared memory (a token, a fused
    # tree's nodes; nothing where the tile has none), then the tile's step.
    ("  last tile landed -> new slots patched", "last_landed", "patched"),
    ("  patched -> attended", "patched", "last_attended"),
    ("attended -> combined", "last_attended", "combined"),
    ("combined -> out stored", "combined", "out_stored"),
    ("out stored -> token appended", "out_stored", "appended"),
    ("appended -> item done (merge)", "appended", "item_done"),
    ("  appended -> arrival counted", "appended", "counted"),
    ("  counted -> item done", "counted", "item_done"),
    ("    counted -> weights (merging block)", "counted", "weighed"),
    ("    weights -> first sums", "weighed", "summed"),
    ("    first sums -> item done", "summed", "item_done"),
    ("first item done -> consumers done", "item_done", "consumers_done"),
    # Lean kernels' merges put off until the block's last item (split_merge.cuh, merge_pending).
    ("  merges put off: begin -> consumers done", "merges_begin", "consumers_done"),
    # The block's second item (a steady state: the first one pays the cold start too).
    ("first item done -> second header seen", "item_done", "second_header_seen"),
    ("second: issued -> first tile landed", "second_first_issued", "second_first_landed"),
    ("  second: header -> q built", "second_header_seen", "second_q_built"),
    ("    second: header -> q rows staged (wide)", "second_header_seen", "second_q_staged"),
    ("    second: staged -> positions read", "second_q_staged", "second_q_placed"),
    ("    second: positions -> warp 0's q rotated", "second_q_placed", "second_q_rotated"),
    ("  second: q built -> first tile landed", "second_q_built", "second_first_landed"),
    ("second: first -> last tile landed", "second_first_landed", "second_last_landed"),
    ("second: last tile landed -> attended", "second_last_landed", "second_last_attended"),
    ("second: attended -> combined", "second_last_attended", "second_combined"),
    ("second: combined -> out stored", "second_combined", "second_out_stored"),
    ("second: out stored -> token appended", "second_out_stored", "second_appended"),
    ("second: appended -> item done", "second_appended", "second_item_done"),
)
# Room for every block a launch may have (the persistent grid is at most SMs x blocks per SM).
MAX_BLOCKS = 4096


def launch_summary(events: torch.Tensor) -> dict:
    """Phases of one launch from its event buffer (int64 ns ``[blocks, len(EVENTS)]``; rows of
    blocks that did not run are zero, as are a block's first-item events when its first item
    had nothing to read). Returns ``span_us``, ``start_ns`` / ``end_ns`` (the launch's first
    start, last end), ``blocks``, ``end_spread_us`` (last block end - first block end) and
    ``phases``: name -> ``(median_us, max_us, blocks)`` over the blocks that have both events."""
    e = events.long().cpu()
    col = {name: e[:, i] for i, name in enumerate(EVENTS)}
    ran = col["start"] > 0
    # The buffer is zeroed once before the replays, and some events are a block's in one replay and
    # not the next (the merges put off by the row's last block to arrive, the merging block's
    # weights): a stamp from before the block's start in this launch is an earlier replay's.
    for name in EVENTS:
        if name not in STAMPED_BEFORE_START:
            col[name] = torch.where(col[name] >= col["start"], col[name], 0)
    if not bool(ran.any()):
        raise ValueError("no block of this launch stamped its start: is this a build with MMHA_TIMELINE=1?")
    start = int(col["start"][ran].min())
    ends = torch.maximum(col["consumers_done"], col["producer_done"])[ran]
    return {
        "roles": role_summary(col, ran, start),
        "start_ns": start,
        "end_ns": int(ends.max()),
        "span_us": (int(ends.max()) - start) / 1e3,
        "blocks": int(ran.sum()),
        "end_spread_us": float(ends.max() - ends.min()) / 1e3,
        "phases": block_phases(col, ran, start),
    }


def block_phases(col: dict, sel: torch.Tensor, start: int) -> dict:
    """``PHASES`` over the blocks of ``sel`` that stamped both events: name -> ``(median_us,
    max_us, blocks)``."""
    phases = {}
    for name, a, b in PHASES:
        if a is None:
            got = col[b][sel] - start
        else:
            both = sel & (col[a] > 0) & (col[b] > 0)
            got = col[b][both] - col[a][both]
        if got.numel():
            us = (got.double() / 1e3).tolist()
            phases[name] = (statistics.median(us), max(us), len(us))
    return phases


def role_summary(col: dict, ran: torch.Tensor, start: int) -> dict:
    """Where blocks end by their first item's role (the "role" event): the items that hold the new
    slots (owners) against the rest, and the blocks that merged a split row: name -> (median,
    slowest) of the item's end after the launch's start, us, with the median grains and split of
    the group and its blocks' ``phases`` (``block_phases``)."""
    role = col["role"]
    have = ran & (role > 0) & (col["item_done"] > 0)
    done = (col["item_done"] - start).double() / 1e3
    groups = {
        "owner": have & ((role >> 8) & 1 == 1),
        "other": have & ((role >> 8) & 1 == 0),
        "merged": have & ((role >> 9) & 1 == 1),
    }
    out = {}
    for name, sel in groups.items():
        if not bool(sel.any()):
            continue
        d = done[sel].tolist()
        out[name] = {
            "blocks": int(sel.sum()),
            "done_us": (statistics.median(d), max(d)),
            "grains": statistics.median((role[sel] >> 10).tolist()),
            "split": statistics.median(((role[sel] >> 1) & 0x7F).tolist()),
            "phases": block_phases(col, sel, start),
        }
    return out


def row_summary(launches: list[dict]) -> dict:
    """Medians over a graph's launches (in launch order): span, gap from each launch's last block
    to the next one's first, end spread, each phase's median and slowest block, and where the
    launches have owner items (tree steps), each phase's median over the owners alone."""
    med = statistics.median
    gaps = [(b["start_ns"] - a["end_ns"]) / 1e3 for a, b in zip(launches[:-1], launches[1:], strict=True)]
    names = [n for n, _, _ in PHASES if all(n in x["phases"] for x in launches)]
    owners = [x["roles"]["owner"]["phases"] if "owner" in x["roles"] else {} for x in launches]
    return {
        "launches": len(launches),
        "blocks": med(x["blocks"] for x in launches),
        "span_us": med(x["span_us"] for x in launches),
        "gap_us": med(gaps) if gaps else None,
        "end_spread_us": med(x["end_spread_us"] for x in launches),
        "phases": {n: {"median_us": med(x["phases"][n][0] for x in launches),
                       "max_us": med(x["phases"][n][1] for x in launches),
                       **({"owners_us": med(o[n][0] for o in owners)} if all(n in o for o in owners) else {})}
                   for n in names},
        "roles": {r: {"blocks": med(x["roles"][r]["blocks"] for x in launches),
                      "done_us": [med(x["roles"][r]["done_us"][i] for x in launches) for i in (0, 1)],
                      "grains": med(x["roles"][r]["grains"] for x in launches),
                      "split": med(x["roles"][r]["split"] for x in launches)}
                  for r in ("owner", "other", "merged") if all(r in x["roles"] for x in launches)},
    }  # fmt: skip


def replay_summary(launches: list[dict], replay_us: float) -> dict:
    """A replay's time by CUDA events (``replay_us``) against its blocks' (the first launch's first
    start to the last launch's last end, from ``launch_summary``)."""
    blocks_us = (max(x["end_ns"] for x in launches) - min(x["start_ns"] for x in launches)) / 1e3
    return {"replay_us": replay_us, "blocks_us": blocks_us, "outside_us": replay_us - blocks_us}


def format_row(spec: str, plan: str, decode_us: float, s: dict) -> str:
    gap = "-" if s["gap_us"] is None else f"{s['gap_us']:.2f}"
    lines = [
        f"{spec} plan {plan}: {s['launches']} launches of {s['blocks']:.0f} blocks, decode timing "
        f"{decode_us:.2f} us, span {s['span_us']:.2f} us, gap to the next launch {gap} us, blocks end "
        f"{s['end_spread_us']:.2f} us apart",
        f"  {'phase (first item of each block)':40s} {'median us':>10s} {'slowest us':>11s}"
        + (f" {'owners us':>10s}" if any("owners_us" in v for v in s["phases"].values()) else ""),
    ]
    if "replay" in s:
        r = s["replay"]
        text = (f"  last replay {r['replay_us']:.2f} us by events, its blocks {r['blocks_us']:.2f} us, "
                f"outside them {r['outside_us']:.2f} us (median {s['replay_median_us']:.2f})")  # fmt: skip
        lines.insert(1, text)
    for name, v in s["phases"].items():
        owners = f" {v['owners_us']:10.2f}" if "owners_us" in v else ""
        lines.append(f"  {name:40s} {v['median_us']:10.2f} {v['max_us']:11.2f}{owners}")
    for name, v in s.get("roles", {}).items():
        label = f"{name} items done after the start"
        done, slowest = v["done_us"]
        where = f"({v['blocks']:.0f} blocks, {v['grains']:.0f} grains, split {v['split']:.0f})"
        lines.append(f"  {label:40s} {done:10.2f} {slowest:11.2f}   {where}")
    return "\n".join(lines)


def stamped_summary(spec: str, dtype: str, calls: list, checks: list, replays: int) -> dict:
    """Each of ``calls`` (one per layer) with its own event buffer: every output checked first
    (``checks[i](out)`` is its max error), then the decode timing, then ``replays`` replays of one
    CUDA graph of them all, the last replay's events summarised (``row_summary``)."""
    from mmha._ext import _C

    from . import timing
    from .problems import TOLERANCE

    bufs = [torch.zeros(MAX_BLOCKS, len(EVENTS), dtype=torch.int64, device="cuda") for _ in calls]

    def stamped(call, buf):
        def fn():
            _C.set_timeline(buf)  # read when the call's params are built: captured with the launch
            try:
                return call()
            finally:
                _C.set_timeline(None)

        return fn

    fns = [stamped(c, buf) for c, buf in zip(calls, bufs, strict=True)]
    try:
        for check, fn in zip(checks, fns, strict=True):
            err = check(fn())
            if not err < TOLERANCE[dtype]:
                raise RuntimeError(f"{spec}: max error {err:.3g} against the reference")
        decode_us = timing.decode_us_rounds({"mmha": fns}, rounds=2)["mmha"]["us"]
        graph = timing.capture(fns)
        for buf in bufs:
            buf.zero_()
        times = [timing.one_replay_us(graph) for _ in range(replays)]
        launches = [launch_summary(buf) for buf in bufs]
    finally:
        _C.set_timeline(None)
    summary = row_summary(launches)
    summary["replay"] = replay_summary(launches, times[-1])
    summary["replay_median_us"] = statistics.median(times)
    summary["decode_us"] = decode_us
    return summary


def run_tree_row(spec: str, replays: int, kv: str = "") -> dict:
    """A tree row of ``mmha.bench.tree`` (fp16 activations), ``B,CTX,T[@SPLITSxSTAGES]``, over
    ``kv`` caches ("" fp16, "int8"): its layers' tree steps, each checked against the fp32
    reference (on the first layer) first."""
    from . import tree as tree_bench

    st = tree_bench.spec_steps(spec, kv)
    first = [lambda out: tree_bench.error(out, st.layers[0], st.ref)]
    checks = first + [lambda out: 0.0] * (len(st.layers) - 1)
    summary = stamped_summary(spec, "fp16", st.fns, checks, replays)
    summary.update(row=st.label, kv=kv, plan=st.plan, epilogue=False, block_size=0)
    return summary


def run_row(
    spec: str, dtype: str, replays: int, epilogue: bool = False, block_size: int = 0, kv: str = ""
) -> dict:
    """One row's launches; with ``epilogue``, the int8 epilogue of ``python -m mmha.bench
    --epilogue`` fused into each call (its output checked against the epilogue applied to the
    plain call's, one step allowed); with ``block_size``, the caches as pages of that many slots
    scattered through a pool (``mmha.bench.paged.to_pages``); ``kv``: "fp8" or "int8" caches."""
    from .epilogue import make_epilogue
    from .methods import mmha_fn, row_of_spec
    from .problems import layer_problems

    cfg, plan, _ = row_of_spec(spec, dtype, "timeline", kv)
    probs = layer_problems(cfg, "mmha")
    pages = [None] * len(probs)
    if block_size:
        from .paged import to_pages

        gen = torch.Generator().manual_seed(block_size)
        pages = [to_pages(prob, block_size, gen) for prob in probs]
    calls = [mmha_fn(prob, plan, pages=pg) for prob, pg in zip(probs, pages, strict=True)]
    if epilogue:
        epis = [make_epilogue(cfg.num_heads * cfg.head_dim, i) for i in range(len(probs))]
        fused = [
            mmha_fn(prob, plan, pages=pg, epilogue=e) for prob, pg, e in zip(probs, pages, epis, strict=True)
        ]
        for call, f, e in zip(calls, fused, epis, strict=True):
            want = e.apply(call(), cfg.torch_dtype).int()
            steps = int((f().int() - want).abs().max())
            if steps > 1:
                raise RuntimeError(f"{spec}: the fused epilogue is {steps} steps from the plain call's")
        calls = fused

    checks = [lambda out, prob=prob: 0.0 if epilogue else prob.error(out) for prob in probs]
    summary = stamped_summary(spec, dtype, calls, checks, replays)  # fused: checked above
    summary.update(row=spec, kv=kv, plan=f"{plan.num_splits}x{plan.stages}", epilogue=epilogue,
                   block_size=block_size)  # fmt: skip
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="*", help="B,Hq,Hkv,D,S[@SPLITSxSTAGES]")
    p.add_argument("--tree", nargs="+", default=[], metavar="B,CTX,T[@SxT]",
                   help="mmha.bench.tree's rows' tree steps (binary; --kv int8: int8 twins)")  # fmt: skip
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--replays", type=int, default=20)
    p.add_argument(
        "--epilogue", action="store_true", help="each row also with the int8 output epilogue fused"
    )
    p.add_argument(
        "--paged", type=int, default=0, metavar="BLOCK", help="each row also over pages of BLOCK slots"
    )
    p.add_argument("--kv", default="", choices=["", "fp8", "int8"], help="the caches' format")
    p.add_argument("--json", type=Path, default=None, help="write the summaries here")
    args = p.parse_args(argv)
    if not args.rows and not args.tree:
        p.error("give rows, --tree rows or both")
    if args.tree and args.kv not in ("", "int8"):
        p.error(f"--tree rows take --kv int8 or no --kv, got --kv {args.kv}")
    from mmha._ext import _C

    if _C is None or not _C.timeline_built():
        print("this build has no timeline events: MMHA_TIMELINE=1 python setup.py build_ext --inplace",
              file=sys.stderr)  # fmt: skip
        return 2
    out = []
    variants = [(False, 0)] + [(True, 0)] * args.epilogue + [(False, args.paged)] * bool(args.paged)
    for spec in args.rows:
        for epi, bs in variants:
            s = run_row(spec, args.dtype, args.replays, epi, bs, args.kv)
            out.append(s)
            name = spec + (f" kv={args.kv}" if args.kv else "")
            name += (" int8 epilogue" if epi else "") + (f" pages of {bs}" if bs else "")
            print(format_row(name, s["plan"], s["decode_us"], s), flush=True)
            torch.cuda.empty_cache()
    for spec in args.tree:
        s = run_tree_row(spec, args.replays, args.kv)
        out.append(s)
        print(format_row(s["row"], s["plan"], s["decode_us"], s), flush=True)
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
