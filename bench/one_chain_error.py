"""The kernel's error over one long item: int8 / int4 caches (or 16-bit) of one row of S keys,
attended with ``num_splits=1`` (one item per kv head, so the V sums run in one mma chain over the
whole row) and with the default plan, against the float64 oracle of the same stored cache. A
small q makes the weights nearly flat and the output small, so a bias the chain's one-sided
rounding leaves in the sums shows against it (docs/experiments.md, 2026-12-03, later).

Usage (a GPU and the built extension): python bench/one_chain_error.py --kv int4 int8 fp16 \\
           --keys 8192 32768 131072 --q-scales 0.02 1.0
Prints one row per (kv, keys, q scale, plan): max |err|, mean err, max |ref|, their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from mmha import int4, layout, ops, quant, reference
from mmha._ext import extension_available

HQ, HKV, D = 8, 2, 128


def _qkv(g: torch.Generator, q_scale: float) -> torch.Tensor:
    qkv = torch.randn(1, (HQ + 2 * HKV) * D, generator=g)
    qkv[:, : HQ * D] *= q_scale
    return qkv.half().cuda()


def int4_rows(s: int, q_scale: float, seed: int):
    """(ref, out with one item, out with the default plan) over an int4 cache of s keys."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(HKV, s, D, generator=g).half().cuda()
    v = torch.randn(HKV, s, D, generator=g).half().cuda()
    qkv = _qkv(g, q_scale)
    cache = int4.Int4Cache.empty(1, HKV, (s + 64) // 64 * 64, D, torch.float16, "cuda")  # whole groups
    cache.prefill(0, k, v)
    lengths = torch.tensor([s], dtype=torch.int32, device="cuda")

    def fresh():
        return int4.Int4Cache(**{f.name: getattr(cache, f.name).clone() for f in dataclasses.fields(cache)})

    kw = dict(num_heads=HQ, num_kv_heads=HKV)
    ref = int4.decode_step(qkv, fresh(), lengths, compute_dtype=torch.float64, **kw)
    outs = [ops.decode_attention_int4(qkv, fresh(), lengths, num_splits=n, **kw) for n in (1, None)]
    return ref, *outs


def int8_rows(s: int, q_scale: float, seed: int):
    """The same over an int8 cache (a scale per token and kv head)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, HKV, s + 64, D, generator=g).cuda()  # [B, Hkv, S, D], as quantize takes them
    v = torch.randn(1, HKV, s + 64, D, generator=g).cuda()
    qkv = _qkv(g, q_scale)
    (kc, ks, _), (vc, vs, _) = quant.quantize(k, 8), quant.quantize(v, 8)
    k_cache, v_cache = layout.pack_k(kc, layout="bhsd"), vc.contiguous()
    lengths = torch.tensor([s], dtype=torch.int32, device="cuda")
    kw = dict(num_heads=HQ, num_kv_heads=HKV)

    def run(fn, **extra):
        caches = (k_cache.clone(), v_cache.clone())
        return fn(qkv, *caches, lengths, k_scale=ks.clone(), v_scale=vs.clone(), **kw, **extra)

    ref = run(reference.decode_step, compute_dtype=torch.float64)
    outs = [run(ops.decode_attention, num_splits=n) for n in (1, None)]
    return ref, *outs


def fp16_rows(s: int, q_scale: float, seed: int):
    """The same over a 16-bit cache."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, s + 64, HKV, D, generator=g).half().cuda()
    v = torch.randn(1, s + 64, HKV, D, generator=g).half().cuda()
    qkv = _qkv(g, q_scale)
    k_cache, v_cache = layout.pack_k(k), layout.pack_v(v)
    lengths = torch.tensor([s], dtype=torch.int32, device="cuda")
    kw = dict(num_heads=HQ, num_kv_heads=HKV)

    def caches():
        return k_cache.clone(), v_cache.clone()

    ref = reference.decode_step(qkv, *caches(), lengths, compute_dtype=torch.float64, **kw)
    outs = [ops.decode_attention(qkv, *caches(), lengths, num_splits=n, **kw) for n in (1, None)]
    return ref, *outs


ROWS = {"int4": int4_rows, "int8": int8_rows, "fp16": fp16_rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", nargs="+", choices=sorted(ROWS), default=["int4", "int8", "fp16"])
    ap.add_argument("--keys", nargs="+", type=int, default=[8192, 32768, 131072])
    ap.add_argument("--q-scales", nargs="+", type=float, default=[0.02, 1.0])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not extension_available():
        print("one_chain_error.py: needs a CUDA GPU and the built extension")
        return 2
    head = ("kv", "keys", "q", "plan", "max|err|", "mean err", "max|ref|", "ratio")
    print("{:5s} {:>7s} {:>5s} {:8s} {:>10s} {:>11s} {:>10s} {:>9s}".format(*head))
    for kv in args.kv:
        for s in args.keys:
            for q_scale in args.q_scales:
                ref, *outs = ROWS[kv](s, q_scale, seed=s)
                torch.cuda.synchronize()
                top = ref.double().abs().max().item()
                for plan, out in zip(("one item", "default"), outs, strict=True):
                    d = out.double() - ref.double()
                    big = d.abs().max().item()
                    print(f"{kv:5s} {s:7d} {q_scale:5.2f} {plan:8s} {big:10.3e} {d.mean().item():+11.3e} "
                          f"{top:10.3e} {big / top:9.3e}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
