"""Decode across GPUs against one GPU: ``torchrun --nproc-per-node 2 -m mmha.bench.distributed``.

Per-layer decode time of a ``ShardedKVCache`` step (the kernel on each rank's shard, the
collective and the merge) against ``KVCache.step`` on one GPU holding the same total cache:
sequence mode on B 1 and 16 with 1-8 GB of K/V per layer, heads mode on canonical B 16 and B 64
rows (Hq 32, Hkv 8, D 128, fp16). Each row: ``world_size``, ``mode``, ``mmha_decode_us`` (rank
0's median over CUDA-event-timed steps, every rank in step), ``local_step_us`` (the same ranks'
kernel step alone), ``merge_share`` (1 - local / whole), ``single_gpu_decode_us`` (rank 0 alone)
and ``speedup``. Lengths do not move between timed steps (each rewrites the same slot), so
every step reads the same bytes. ``--tiny`` runs small rows on gloo without GPUs (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

from ..cache import KVCache
from ..distributed import ShardedKVCache

HQ, HKV, D = 32, 8, 128
SEQUENCE_ROWS = [(1, gb) for gb in (1, 2, 4, 8)] + [(16, gb) for gb in (1, 2, 4, 8)]
HEADS_ROWS = [(16, 2048), (16, 8192), (16, 32768), (64, 1024), (64, 4096)]


def seq_for(batch: int, gb: float) -> int:
    """Tokens per row for ``gb`` GB (10^9 bytes) of fp16 K and V per layer."""
    return int(gb * 1e9) // (batch * 2 * HKV * D * 2)


def _time(fn, iters: int, cuda: bool) -> float:
    """Median microseconds of ``fn`` over ``iters`` calls (CUDA events, or the host clock)."""
    import time

    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _fill(cache, batch: int, seq: int, device, dtype, hkv: int, d: int) -> None:
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(batch, seq, hkv, d, generator=g, device=device).to(dtype)
    v = torch.randn(batch, seq, hkv, d, generator=g, device=device).to(dtype)
    cache.prefill(0, k, v)


def run_row(mode, batch, seq, device, dtype, iters, hq=HQ, hkv=HKV, d=D, block=256) -> dict:
    cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    cache = ShardedKVCache(1, batch, seq + 1, hq, hkv, d, dtype, device, mode=mode, block=block)
    _fill(cache, batch, seq, device, dtype, hkv, d)
    g = torch.Generator(device=device).manual_seed(1)
    qkv = torch.randn(batch, (hq + 2 * hkv) * d, generator=g, device=device).to(dtype)
    out = "full" if mode == "sequence" else "heads"
    dist.barrier()
    whole = _time(lambda: cache.step(0, qkv, output=out), iters, cuda)
    local_qkv = cache._local_qkv(qkv, "qkv") if mode == "heads" else qkv
    pos = cache.lengths[:batch] if mode == "sequence" else None
    dist.barrier()
    local = _time(lambda: cache.local.step(0, local_qkv, return_lse=True, positions=pos), iters, cuda)
    cache.check()
    bytes_per_rank = cache.nbytes
    cache = None  # its memory back before the one-GPU cache
    single = None
    if rank == 0:
        one = KVCache(1, batch, seq + 1, hq, hkv, d, dtype, device)
        _fill(one, batch, seq, device, dtype, hkv, d)
        single = _time(lambda: one.step(0, qkv), iters, cuda)
        one.check()
        one = None
    if cuda:
        torch.cuda.empty_cache()
    dist.barrier()
    return dict(
        world_size=world, mode=mode, batch=batch, seq=seq, num_heads=hq, num_kv_heads=hkv, head_dim=d,
        dtype=str(dtype).replace("torch.", ""), kv_gb_per_layer=round(2 * batch * seq * hkv * d * 2 / 1e9, 3),
        kv_bytes_per_rank=bytes_per_rank, mmha_decode_us=round(whole, 2), local_step_us=round(local, 2),
        merge_share=round(1 - local / whole, 3),
        single_gpu_decode_us=None if single is None else round(single, 2),
        speedup=None if single is None else round(single / whole, 3),
    )  # fmt: skip


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
    results = []
    for mode, batch, seq, kw in rows:
        row = run_row(mode, batch, seq, device, dtype, args.iters, **kw)
        if dist.get_rank() == 0:
            row["device"] = torch.cuda.get_device_name() if cuda else "cpu"
            results.append(row)
            print(
                f"{mode:8s} B={batch:<3d} S={seq:<8d} {row['kv_gb_per_layer']:6.2f} GB/layer: "
                f"{row['mmha_decode_us']:9.1f} us on {row['world_size']} (kernel {row['local_step_us']:.1f}, "
                f"merge {100 * row['merge_share']:.0f} %), one GPU {row['single_gpu_decode_us']:9.1f} us, "
                f"{row['speedup']:.2f}x",
                flush=True,
            )
    if dist.get_rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": results}, f, indent=1)
        print(f"wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
