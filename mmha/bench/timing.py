"""How the benchmark times a call.

- ``decode_us`` (primary): one layer of a decode step. ``layers`` calls, each on its own tensors
  (cache, qkv, output; mmha's calls share one lengths tensor, as the layers of a step share
  ``KVCache.lengths``), are captured back to back in one CUDA graph; the per-call time is the
  median replay time over ``layers`` (>= 20 replays). No call finds its cache in L2 (the caches
  together are >= 1 GiB), none pays a flush's write-back, none waits on the CPU, and nothing
  overlaps across calls.
- ``cold_us`` (secondary): ``triton.testing.do_bench``, which flushes the L2 by writing a buffer
  before each call, so each call also pays that buffer's write-back.
- ``repeat_graph_us`` (secondary): 20 calls of the same function in one graph (a cache smaller
  than the L2 stays there).
- ``decode_us_rounds``: the decode timing of methods held against each other (fused against
  plain), in rounds of alternating order, so that the machine drifting during the run does not
  decide a ratio of two close times.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

REPLAYS = 25
# Replays before timing: the first plan timed right after its caches were allocated ran ~13 %
# slower than the same plan timed later in the same process (H200, B=1 Hkv=32 S=65536, 2 layers
# of 1 GB: 282 against 249 us after 3 warm-up replays), so warm up for at least WARMUP_MS.
WARMUP_REPLAYS = 3
WARMUP_MS = 100.0


def capture(fns: list[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    """One graph of the calls back to back, after one eager round (plans, workspaces)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return graph


def one_replay_us(graph: torch.cuda.CUDAGraph) -> float:
    """One replay of ``graph``, us by CUDA events (waits for it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def replay_us(
    graph: torch.cuda.CUDAGraph, calls: int, replays: int = REPLAYS, agree: Callable[[int], int] | None = None
) -> dict:
    """Per-call us of a graph of ``calls`` calls: median, 20th and 80th percentile of replays.
    ``agree`` maps this process's count of warm-up replays to the one used (processes whose graphs
    hold collectives must replay them equally often)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(WARMUP_REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    per_replay = max(start.elapsed_time(end) / WARMUP_REPLAYS, 1e-3)
    warm = min(1000, int(WARMUP_MS / per_replay))
    for _ in range(warm if agree is None else agree(warm)):
        graph.replay()
    torch.cuda.synchronize()
    times = [one_replay_us(graph) / calls for _ in range(replays)]
    q = statistics.quantiles(times, n=5)
    return {"us": statistics.median(times), "p20": q[0], "p80": q[3]}


def decode_us(fns: list[Callable[[], object]], replays: int = REPLAYS) -> dict:
    """Decode timing of calls that each work on their own tensors (see the module docstring)."""
    graph = capture(fns)
    try:
        return {**replay_us(graph, len(fns), replays), "layers": len(fns)}
    finally:
        del graph


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The order of each round: forward, then backward, alternating (A B C, C B A, A B C, ...), so
    that a drift of the machine's speed over a run weighs on every method alike."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(rounds)]


def decode_us_rounds(
    methods: dict[str, list[Callable[[], object]]], rounds: int = 4, replays: int = REPLAYS
) -> dict[str, dict]:
    """Decode timing of methods compared with each other in one run (a fused call against the
    plain one): each method's calls captured once, then replayed in ``rounds`` rounds of
    alternating order (``round_orders``). Per method: ``us``, the median of its rounds' medians
    (with an even count of rounds a linear drift cancels out of the differences, and one round
    slowed as a whole, as H200 runs showed by 2-6 % on a 1-4 ms row, does not move it), and
    ``rounds_us``."""
    graphs = {name: capture(fns) for name, fns in methods.items()}
    try:
        got: dict[str, list[float]] = {name: [] for name in methods}
        for order in round_orders(list(methods), rounds):
            for name in order:
                got[name].append(replay_us(graphs[name], len(methods[name]), replays)["us"])
        return {
            name: {"us": statistics.median(us), "rounds_us": us, "layers": len(methods[name])}
            for name, us in got.items()
        }
    finally:
        graphs.clear()


def cold_us(fn: Callable[[], object]) -> float:
    """Median us of single calls after an L2 flush (``do_bench``)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def repeat_graph_us(fn: Callable[[], object], calls: int = 20) -> float:
    """Median per-call us of ``calls`` calls of the same function in one graph."""
    graph = capture([fn] * calls)
    try:
        return replay_us(graph, calls)["us"]
    finally:
        del graph
