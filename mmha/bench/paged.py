"""``python -m mmha.bench --paged``: decode attention over a paged cache against the same step on a
contiguous cache, under the decode timing.

Rows: the canonical grid (fp16, Hq 32, D 128; every row's length is its context, the new token
the last key) with block sizes 16 and 64. Each layer's pages are the contiguous cache's, scattered
at random through a pool with spare blocks (as in a server that has run for a while); the paged
call takes the contiguous call's plan. Columns: ``mmha_decode_us`` (paged), ``contiguous_decode_us``
(mmha on the contiguous caches, same run) and ``best_peer_decode_us`` (SDPA's cuDNN kernel on
contiguous K/V: the best peer of every canonical row in the main benchmark); the paged output is
checked against the contiguous one (bit for bit) and the fp32 reference before it is timed.
The memory section holds a mixed-length batch in a page pool (``mmha.paging.PagePool``) against a
contiguous cache of the same capacity. Writes bench_paged.json and bench_paged.md to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from .. import ops, paging
from .args import parse_args
from .methods import MMHA, mmha_fn
from .problems import CANONICAL, QUICK, TOLERANCE, Config, layer_problems
from .runner import gpu_header, print_report, time_method

BLOCK_SIZES = (16, 64)
TARGET = 1.03  # paged / contiguous
PEER = "sdpa_cudnn"
SPARE = 0.25  # pool blocks beyond what the rows hold, as a fraction


def to_pages(prob, block_size: int, gen: torch.Generator):
    """A problem's contiguous caches as pages at random blocks of a pool with spare blocks (copied
    a row at a time: no second copy of a whole cache)."""
    k, v = prob.k_cache, prob.v_cache  # [B, Hkv, D/x, S, x], [B, Hkv, S, D]
    b, hkv, dx, s, x = k.shape
    d = v.shape[-1]
    nblk = s // block_size
    num_blocks = b * nblk + max(1, int(b * nblk * SPARE))
    ids = torch.randperm(num_blocks, generator=gen)[: b * nblk].cuda().view(b, nblk)
    kp = torch.empty((num_blocks, hkv, dx, block_size, x), dtype=k.dtype, device="cuda")
    vp = torch.empty((num_blocks, hkv, block_size, d), dtype=v.dtype, device="cuda")
    for r in range(b):
        kp[ids[r]] = k[r].view(hkv, dx, nblk, block_size, x).permute(2, 0, 1, 3, 4)
        vp[ids[r]] = v[r].view(hkv, nblk, block_size, d).permute(1, 0, 2, 3)
    return kp, vp, ids.to(torch.int32)


def run_row(cfg: Config, block_sizes, contiguous: dict) -> list[dict]:
    from . import timing

    plan = ops.plan_for("cuda", cfg.batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.seq_len,
                        cfg.torch_dtype)  # fmt: skip
    key = cfg.label
    if key not in contiguous:  # mmha contiguous and the peer, once per row
        res = {"decode": {}, "errors": {}, "skipped": {}}
        time_method(cfg, MMHA, plan, res)
        time_method(cfg, PEER, plan, res)
        contiguous[key] = res
    base = contiguous[key]
    out = []
    for bs in block_sizes:
        row = {"group": cfg.group, "batch": cfg.batch, "num_kv_heads": cfg.num_kv_heads,
               "seq_len": cfg.seq_len, "block_size": bs, "layers": cfg.layers,
               "plan": f"{plan.num_splits}x{plan.stages}", "errors": {},
               "skipped": dict(base["skipped"])}  # fmt: skip
        probs = fns = pages = None
        try:
            gen = torch.Generator().manual_seed(bs)
            probs = layer_problems(cfg, "mmha")
            pages, fns = [], []
            for i, p in enumerate(probs):  # each layer's contiguous caches freed once in pages
                pages.append(to_pages(p, bs, gen))
                fns.append(mmha_fn(p, plan, pages=pages[-1]))
                if i == 0:  # the check: the first layer against its contiguous call and the reference
                    got = fns[0]().clone()
                    want = mmha_fn(p, plan)()
                    torch.cuda.synchronize()
                    row["bit_equal_contiguous"] = bool(torch.equal(got, want))
                    err = p.error(got)
                    del got, want
                p.k_cache = p.v_cache = None
                torch.cuda.empty_cache()
            row["errors"][MMHA] = err
            if not math.isfinite(err) or err > TOLERANCE[cfg.dtype] or not row["bit_equal_contiguous"]:
                row["skipped"][MMHA] = (
                    f"wrong result: max error {err:.3g}, bit-equal {row['bit_equal_contiguous']}"
                )
            else:
                row["mmha_decode_us"] = timing.decode_us(fns)["us"]
        except Exception as exc:
            row["skipped"][MMHA] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120]}"
        finally:
            del probs, fns, pages
            torch.cuda.empty_cache()
        if MMHA in base["decode"]:
            row["contiguous_decode_us"] = base["decode"][MMHA]["us"]
        if PEER in base["decode"]:
            row["best_peer_decode"], row["best_peer_decode_us"] = PEER, base["decode"][PEER]["us"]
        if "mmha_decode_us" in row and "contiguous_decode_us" in row:
            row["vs_contiguous"] = row["mmha_decode_us"] / row["contiguous_decode_us"]
        if "mmha_decode_us" in row and "best_peer_decode_us" in row:
            row["ratio"] = row["mmha_decode_us"] / row["best_peer_decode_us"]
        out.append(row)
    return out


def memory(block_size: int, batch: int = 16, capacity: int = 32768, seed: int = 0) -> dict:
    """A batch of mixed lengths (uniform in [1, capacity - 1]) held in a page pool: blocks taken
    through PagePool, against a contiguous cache of the same capacity (Hkv 8, D 128, fp16, per layer)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, capacity, (batch,), generator=g).tolist()
    max_blocks = capacity // block_size
    pool = paging.PagePool(batch * max_blocks, block_size, batch, max_blocks, "cuda")
    pool.ensure(range(batch), lengths)
    pool.check()
    slot_bytes = 2 * 8 * 128 * 2  # K and V of one slot
    held = (pool.num_blocks - pool.free_blocks) * block_size * slot_bytes
    contiguous = batch * capacity * slot_bytes
    tokens = sum(lengths)
    return {"block_size": block_size, "batch": batch, "capacity": capacity, "tokens": tokens,
            "paged_bytes": held, "contiguous_bytes": contiguous, "tokens_bytes": tokens * slot_bytes,
            "paged_over_contiguous": held / contiguous}  # fmt: skip


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    def us(r, k):
        return f"{r[k]:.1f}" if k in r else "-"

    def ratio(r, k):
        return f"{r[k]:.3f}" if k in r else "-"

    body = [[r["group"], r["batch"], r["num_kv_heads"], r["seq_len"], r["block_size"],
             us(r, "mmha_decode_us"), us(r, "contiguous_decode_us"), ratio(r, "vs_contiguous"),
             us(r, "best_peer_decode_us"), ratio(r, "ratio")] for r in rows]  # fmt: skip
    cols = ["group", "B", "Hkv", "S", "block", "paged us", "contiguous us", "paged/contiguous",
            f"{PEER} us", "paged/peer"]  # fmt: skip
    return tabulate(body, headers=cols, tablefmt="github", disable_numparse=True)


def misses(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        label = f"B={r['batch']} Hkv={r['num_kv_heads']} S={r['seq_len']} block {r['block_size']}"
        if "vs_contiguous" not in r:
            out.append(f"{label}: not timed ({r['skipped'].get(MMHA, '')})")
        elif r["vs_contiguous"] > TARGET:
            out.append(f"{label}: {r['vs_contiguous']:.3f}x contiguous > {TARGET}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmha.bench --paged", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few rows")
    ap.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES))
    ap.add_argument("--rows", type=int, nargs="+", help="indices into the canonical grid (default: all)")
    ap.add_argument("--out", type=Path, default=Path("bench_paged"))
    args = parse_args(ap, argv)
    if not torch.cuda.is_available():
        print("python -m mmha.bench --paged needs a CUDA GPU")
        return 1
    for bs in args.block_sizes:
        paging.check_block_size(bs)
    header = {**gpu_header(), "timing": "decode", "target_vs_contiguous": TARGET}
    args.out.mkdir(parents=True, exist_ok=True)
    results, contiguous = [], {}
    mem = [memory(bs) for bs in args.block_sizes]
    grid = QUICK if args.quick else CANONICAL
    if args.rows:
        grid = [CANONICAL[i] for i in args.rows]
    for group, b, hkv, s in grid:
        cfg = Config(group, b, 32, hkv, 128, s, "fp16")
        for row in run_row(cfg, args.block_sizes, contiguous):
            results.append(row)
            brief = {
                k: v for k, v in row.items() if k.endswith("_us") or k in ("seq_len", "block_size", "batch")
            }
            print(json.dumps(brief), flush=True)
        (args.out / "bench_paged.json").write_text(
            json.dumps({"header": header, "rows": results, "memory": mem}, indent=1)
        )
    notes = [
        f"memory, block {m['block_size']}: {m['batch']} rows of mixed length ({m['tokens']} tokens) in "
        f"{m['paged_bytes'] / 2**20:.0f} MiB of pages against {m['contiguous_bytes'] / 2**20:.0f} MiB "
        f"contiguous at capacity {m['capacity']} ({m['paged_over_contiguous']:.3f}x)"
        for m in mem
    ]
    print_report(args.out / "bench_paged.md", header, table(results), misses(results), notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
