"""Decode across GPUs against one GPU: ``torchrun --nproc-per-node 2 -m mmha.bench.distributed``.

Per-layer decode time of a ``ShardedKVCache`` step (the kernel on each rank's shard, the
collective and the merge) against ``KVCache.step`` on one GPU holding the same total cache:
sequence mode on B 1 and 16 with 1-8 GB of K/V per layer, heads mode on canonical B 16 and B 64
rows (Hq 32, Hkv 8, D 128, fp16).

Timing (BENCHMARK.md's decode timing, with the collectives inside): ``L`` layers' steps, each on
its own cache, captured back to back in one CUDA graph on every rank (``L = max(2, min(32,
ceil(1 GiB / a rank's bytes per layer)))``), the same number of replays on every rank, rank 0's
median replay over ``L``. Each row: ``world_size``, ``mode``, ``layers``, ``mmha_decode_us`` (the
sharded step), ``local_step_us`` (the same ranks' kernel step alone, timed the same way),
``merge_share`` (1 - local / whole), ``eager_decode_us`` (the ``L`` steps called eagerly, back to
back, per step),
``single_gpu_decode_us`` (``KVCache.step`` on rank 0 alone, decode timing) and ``speedup``.
Lengths do not move between timed steps (each rewrites the same slot), so every step reads the
same bytes. ``--tiny`` runs small rows on gloo without GPUs (host clock, no graphs; a smoke test).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import torch
import torch.distributed as dist

from ..cache import KVCache
from ..distributed import ShardedKVCache
from . import timing

HQ, HKV, D = 32, 8, 128
# Targets of sequence mode on two or more GPUs: speedup over one GPU from this many GB per layer.
SEQUENCE_TARGETS = ((4.0, 1.8), (1.0, 1.6))
SEQUENCE_ROWS = [(1, gb) for gb in (1, 2, 4, 8)] + [(16, gb) for gb in (1, 2, 4, 8)]
HEADS_ROWS = [(16, 2048), (16, 8192), (16, 32768), (64, 1024), (64, 4096)]


def seq_for(batch: int, gb: float) -> int:
    """Tokens per row for ``gb`` GB (10^9 bytes) of fp16 K and V per layer."""
    return int(gb * 1e9) // (batch * 2 * HKV * D * 2)


def _time(fn, iters: int, cuda: bool) -> float:
    """Microseconds per call of ``fn`` called ``iters`` times back to back, as an eager decode loop
    calls it (CUDA events around the loop; the host clock without a GPU), median of 5 loops."""
    import time

    for _ in range(3):
        fn()
    times = []
    for _ in range(5):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(times)


def layers_for(nbytes: int) -> int:
    """Layers of a decode timing whose caches of ``nbytes`` each do not fit in the L2 together."""
    return max(2, min(32, math.ceil((1 << 30) / max(nbytes, 1))))


def _most(count: int) -> int:
    """The largest of every rank's ``count``."""
    t = torch.tensor([count], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def graph_us(fns) -> float:
    """Decode timing of ``fns`` (one call per layer) on every rank in step: one graph each, the
    same number of warm-up replays everywhere (a collective in the graph pairs the ranks'
    replays), rank-local median per call."""
    graph = timing.capture(fns)
    try:
        return timing.replay_us(graph, len(fns), agree=_most)["us"]
    finally:
        del graph


def _fill(cache, batch: int, seq: int, device, dtype, hkv: int, d: int) -> None:
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(batch, seq, hkv, d, generator=g, device=device).to(dtype)
    v = torch.randn(batch, seq, hkv, d, generator=g, device=device).to(dtype)
    for layer in range(cache.num_layers):
        cache.prefill(layer, k, v)


def run_row(mode, batch, seq, device, dtype, iters, hq=HQ, hkv=HKV, d=D, block=256) -> dict:
    cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    total_bytes = 2 * batch * seq * hkv * d * torch.finfo(dtype).bits // 8  # one layer, every rank
    layers = layers_for(total_bytes // world) if cuda else 1
    cache = ShardedKVCache(layers, batch, seq + 1, hq, hkv, d, dtype, device, mode=mode, block=block)
    _fill(cache, batch, seq, device, dtype, hkv, d)
    g = torch.Generator(device=device).manual_seed(1)
    width = (hq + 2 * hkv) * d
    qkvs = [torch.randn(batch, width, generator=g, device=device).to(dtype) for _ in range(layers)]
    out = "full" if mode == "sequence" else "heads"
    dist.barrier()
    local_qkvs = [cache._local_qkv(q, "qkv") for q in qkvs] if mode == "heads" else qkvs
    pos = cache.lengths[:batch] if mode == "sequence" else None
    whole_fns = [lambda i=i: cache.step(i, qkvs[i], output=out) for i in range(layers)]
    local_fns = [
        lambda i=i: cache.local.step(i, local_qkvs[i], return_lse=True, positions=pos) for i in range(layers)
    ]
    dist.barrier()
    eager = _time(lambda: [fn() for fn in whole_fns], iters, cuda) / layers
    dist.barrier()
    if cuda:
        whole, local = graph_us(whole_fns), graph_us(local_fns)
    else:
        whole, local = eager, _time(local_fns[0], iters, cuda)
    cache.check()
    bytes_per_rank = cache.nbytes // layers
    cache = None  # its memory back before the one-GPU cache
    single = None
    if rank == 0:
        one_layers = layers_for(total_bytes) if cuda else 1
        one = KVCache(one_layers, batch, seq + 1, hq, hkv, d, dtype, device)
        _fill(one, batch, seq, device, dtype, hkv, d)
        one_fns = [lambda i=i: one.step(i, qkvs[i % layers]) for i in range(one_layers)]
        single = timing.decode_us(one_fns)["us"] if cuda else _time(one_fns[0], iters, cuda)
        one.check()
        one = None
    if cuda:
        torch.cuda.empty_cache()
    dist.barrier()
    return dict(
        world_size=world, mode=mode, batch=batch, seq=seq, num_heads=hq, num_kv_heads=hkv, head_dim=d,
        dtype=str(dtype).replace("torch.", ""), kv_gb_per_layer=round(total_bytes / 1e9, 3),
        kv_bytes_per_rank=bytes_per_rank, layers=layers, mmha_decode_us=round(whole, 2),
        local_step_us=round(local, 2), merge_share=round(1 - local / whole, 3),
        eager_decode_us=round(eager, 2),
        single_gpu_decode_us=None if single is None else round(single, 2),
        speedup=None if single is None else round(single / whole, 3),
    )  # fmt: skip


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    def us(v):
        return "-" if v is None else f"{v:.1f}"

    body = [[r["mode"], r["batch"], r["seq"], f"{r['kv_gb_per_layer']:.2f}", r["world_size"], r["layers"],
             us(r["mmha_decode_us"]), us(r["local_step_us"]), f"{100 * r['merge_share']:.0f} %",
             us(r["eager_decode_us"]), us(r["single_gpu_decode_us"]),
             "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"] for r in rows]  # fmt: skip
    cols = ["mode", "B", "S", "GB/layer", "GPUs", "L", "sharded us", "kernel us", "merge", "eager us",
            "one GPU us", "speedup"]  # fmt: skip
    return tabulate(body, headers=cols, tablefmt="github", disable_numparse=True)


def misses(rows: list[dict]) -> list[str]:
    """Sequence rows on two or more GPUs under their speedup target (SEQUENCE_TARGETS)."""
    out = []
    for r in rows:
        if r["mode"] != "sequence" or r["world_size"] < 2 or r["speedup"] is None:
            continue
        target = next((t for gb, t in SEQUENCE_TARGETS if r["kv_gb_per_layer"] >= gb * 0.99), None)
        if target is not None and r["speedup"] < target:
            out.append(
                f"sequence B={r['batch']} {r['kv_gb_per_layer']:.2f} GB/layer on {r['world_size']} GPUs: "
                f"{r['speedup']:.2f}x one GPU (target {target}x)"
            )
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m mmha.bench.distributed", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="one row per mode and batch at the smallest size")
    ap.add_argument("--tiny", action="store_true", help="small rows on gloo / CPU (a smoke test)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None, help="JSON file (rank 0)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dtype = torch.float16 if cuda else torch.float32
    if args.tiny:
        rows = [
            ("sequence", 1, 600, dict(hq=4, hkv=2, d=32, block=16)),
            ("heads", 2, 200, dict(hq=4, hkv=2, d=32)),
        ]
    else:
        seq_rows = SEQUENCE_ROWS[:1] + SEQUENCE_ROWS[4:5] if args.quick else SEQUENCE_ROWS
        heads_rows = HEADS_ROWS[:1] if args.quick else HEADS_ROWS
        rows = [("sequence", b, seq_for(b, gb), {}) for b, gb in seq_rows]
        rows += [("heads", b, s, {}) for b, s in heads_rows]
    header = {"world_size": dist.get_world_size(), "backend": dist.get_backend()}
    if cuda and dist.get_rank() == 0:
        from .runner import gpu_header

        header.update(gpu_header())
    results = []
    for mode, batch, seq, kw in rows:
        row = run_row(mode, batch, seq, device, dtype, args.iters, **kw)
        if dist.get_rank() == 0:
            row["device"] = torch.cuda.get_device_name() if cuda else "cpu"
            results.append(row)
            if args.out:  # after every row: a run cut short keeps the rows it timed
                with open(args.out, "w") as f:
                    json.dump({"header": header, "rows": results}, f, indent=1)
            print(
                f"{mode:8s} B={batch:<3d} S={seq:<8d} {row['kv_gb_per_layer']:6.2f} GB/layer: "
                f"{row['mmha_decode_us']:9.1f} us on {row['world_size']} (kernel {row['local_step_us']:.1f}, "
                f"merge {100 * row['merge_share']:.0f} %, eager {row['eager_decode_us']:.1f}), "
                f"one GPU {row['single_gpu_decode_us']:9.1f} us, "
                f"{row['speedup']:.2f}x",
                flush=True,
            )
    if dist.get_rank() == 0 and args.out:
        print(f"wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
