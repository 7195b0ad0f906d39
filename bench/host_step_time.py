"""Host time of an eager ``KVCache.step`` call: the Python and launch overhead a decode step pays
per layer when the GPU is not the bottleneck (one short row, one kv head, so the kernel takes a
few microseconds and the host's work is what the wall clock shows).

Runs on any mmha that has ``KVCache`` (the layer's settings go to the cache as an
``AttentionSpec`` where mmha has one, else to each step as keywords), so one device call can time
two trees: ``PYTHONPATH=TREE python bench/host_step_time.py --out FILE``. Prints and writes the
median and spread of the microseconds per call over repeated rounds, for a plain layer and for a
layer with a sliding window, sinks and an output epilogue.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import mmha
from mmha.epilogue import OutEpilogue

LAYERS, BATCH, HQ, HKV, D, PROMPT = 8, 1, 8, 1, 128, 100


def build(kind: str):
    """A cache whose layers are all of ``kind``, and the per-call keywords of the older API."""
    mods = {}
    if kind == "modified":
        mods = dict(
            window=64,
            sinks=torch.linspace(-1.0, 1.0, HQ, device="cuda"),
            epilogue=OutEpilogue(torch.zeros(HQ * D, device="cuda"), torch.ones(HQ * D, device="cuda")),
        )
    kw = {}
    if hasattr(mmha, "AttentionSpec"):
        kw["attention"] = mmha.AttentionSpec(rotary=mmha.Rotary(D), **mods)
        per_call = {}
    else:
        kw["rotary_dim"] = D
        per_call = mods
    cache = mmha.KVCache(LAYERS, BATCH, 1024, HQ, HKV, D, torch.float16, "cuda", **kw)
    k = torch.randn(BATCH, PROMPT, HKV, D, device="cuda", dtype=torch.float16)
    for layer in range(LAYERS):
        cache.prefill(layer, k, k)
    return cache, per_call


def time_calls(kind: str, rounds: int, calls: int) -> list[float]:
    cache, per_call = build(kind)
    qkv = torch.randn(BATCH, (HQ + 2 * HKV) * D, device="cuda", dtype=torch.float16)
    for layer in range(LAYERS):  # warm-up: plans, workspace, sinks' values read (older API)
        cache.step(layer, qkv, **per_call)
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(calls):
            cache.step(i % LAYERS, qkv, **per_call)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "mmha": mmha.__file__}
    for kind in ("plain", "modified"):
        us = time_calls(kind, args.rounds, args.calls)
        med = statistics.median(us)
        res[kind] = {"median_us": med, "min_us": min(us), "max_us": max(us), "rounds_us": us}
        print(f"{kind:9s} step: median {med:.2f} us per call (min {min(us):.2f}, max {max(us):.2f})")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
