"""Decode a long context on several GPUs: ``torchrun --nproc-per-node 2 -m mmha.distributed.demo``.

A Llama-8B-shaped stack (hidden 4096, 32 query heads and 8 kv heads of 128, MLP 14336, 32
layers) with random weights, replicated on every rank, decodes ``--steps`` tokens after a
``--context``-token context (random K/V, as a long prompt's prefill would leave) held in a
``ShardedKVCache``: by sequence (each rank a share of every row's tokens) or by heads. On GPUs
each step's layers (attention with its collectives, MLPs) replay as one CUDA graph and
``advance`` follows on the host (``--eager``: every op launched from Python). Prints tokens/s,
the time per step and the memory per GPU. Without GPUs it runs on gloo with the reference path
(use ``--preset tiny``).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .cache import MODES, ShardedKVCache


@dataclass(frozen=True)
class Shape:
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int


PRESETS = {
    "llama-8b": Shape(4096, 32, 32, 8, 128, 14336),
    "tiny": Shape(128, 2, 4, 2, 32, 256),
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class Stack:
    """Random weights for ``shape.layers`` pre-norm attention + SwiGLU blocks, made on ``device``
    from one seed (the same on every rank). ``weight_sets`` distinct sets of weights serve the
    layers in turn (default: one per layer); fewer sets leave room for a longer context on a
    smaller GPU and change no step's work (every layer still reads a set of weights larger than
    the L2)."""

    def __init__(self, shape: Shape, device, dtype, seed: int = 0, weight_sets: int | None = None):
        g = torch.Generator(device=device).manual_seed(seed)
        qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim

        def w(out_f, in_f):
            return (torch.randn(out_f, in_f, generator=g, device=device) / in_f**0.5).to(dtype)

        sets = shape.layers if weight_sets is None else weight_sets
        if not 1 <= sets <= shape.layers:
            raise ValueError(f"weight_sets must be in [1, {shape.layers}], got {sets}")
        self.shape = shape
        distinct = [
            (w(qkv, shape.dim), w(shape.dim, shape.heads * shape.head_dim), w(2 * shape.ffn, shape.dim),
             w(shape.dim, shape.ffn))
            for _ in range(sets)
        ]  # fmt: skip
        self.layers = [distinct[i % sets] for i in range(shape.layers)]

    @torch.no_grad()
    def layers_step(self, x: torch.Tensor, cache: ShardedKVCache) -> torch.Tensor:
        """Every layer of one decode step (lengths unchanged: ``cache.advance()`` follows)."""
        for i, (wqkv, wo, w_in, w_out) in enumerate(self.layers):
            h = F.rms_norm(x, (x.shape[-1],))
            x = x + F.linear(cache.step(i, F.linear(h, wqkv), output="full"), wo)  # weights replicated
            gate, up = F.linear(F.rms_norm(x, (x.shape[-1],)), w_in).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w_out)
        return x


class GraphStep:
    """``stack.layers_step`` captured once in a CUDA graph (its collectives too), replayed per
    step on a static input; ``cache.advance()`` runs after each replay, outside the graph (the
    sequence shards' row modes change in place, which the captured steps read)."""

    def __init__(self, stack: Stack, cache: ShardedKVCache, x: torch.Tensor):
        self.cache = cache
        self.x = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the first step's work, repeated by the first replay
            stack.layers_step(self.x, cache)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.y = stack.layers_step(self.x, cache)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.x.copy_(x)
        self.graph.replay()
        self.cache.advance()
        return self.y


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mmha.distributed.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=MODES, default="sequence")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama-8b")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the preset's)")
    ap.add_argument("--context", type=int, default=131072, help="tokens already in the cache per row")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    ap.add_argument("--block", type=int, default=256, help="tokens per block of sequence sharding")
    ap.add_argument("--eager", action="store_true", help="no CUDA graph: every op launched from Python")
    ap.add_argument(
        "--weight-sets", type=int, default=None,
        help="distinct sets of random weights, used by the layers in turn (default: one per layer); "
        "fewer leave room for a longer context",
    )  # fmt: skip
    return ap


def _context(cache, shape, args, device, dtype, g) -> None:
    """The context: the same random K/V on every rank, each keeping its part."""
    for layer in range(shape.layers):
        kv = [
            torch.randn(args.batch, args.context, shape.kv_heads, shape.head_dim, generator=g, device=device,
                        dtype=dtype)
            for _ in range(2)
        ]  # fmt: skip
        cache.prefill(layer, kv[0], kv[1])
        del kv


def _decode(stack, cache, args, shape, device, dtype, g, say) -> torch.Tensor:
    """The timed decode steps (one CUDA graph each on a GPU unless ``--eager``), reported."""
    cuda = device.type == "cuda"

    def eager(x):
        x = stack.layers_step(x, cache)
        cache.advance()
        return x

    x = torch.randn(args.batch, shape.dim, generator=g, device=device).to(dtype)
    x = eager(x)  # warm-up (plans, workspace, NCCL communicators)
    step, how = eager, "eager"
    if cuda and not args.eager:
        step, how = GraphStep(stack, cache, x), "one CUDA graph per step"
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps - 1):
        x = step(x)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    cache.check()
    n = max(args.steps - 1, 1)
    mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    mems = [None] * dist.get_world_size()
    dist.all_gather_object(mems, mem)
    say(f"decode ({how}): {elapsed / n * 1e3:.2f} ms per step, {args.batch * n / elapsed:.1f} tokens/s "
        f"({n} steps, final length {cache.host_lengths[0]})")  # fmt: skip
    say("peak memory per GPU (GiB): " + ", ".join(f"rank {r}: {m:.2f}" for r, m in enumerate(mems)))
    # the graph's collectives hold the communicator: the graph goes first, on every rank
    del step
    return x


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dtype = DTYPES[args.dtype] if cuda else torch.float32
    shape = PRESETS[args.preset]
    if args.layers is not None:
        shape = Shape(shape.dim, args.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn)
    say = print if rank == 0 else (lambda *a, **k: None)
    where = "NCCL on " + torch.cuda.get_device_name() if cuda else "gloo, CPU"
    say(f"mmha.distributed.demo: {world} ranks ({where}), "
        f"mode {args.mode}, {shape.layers} layers, Hq {shape.heads} Hkv {shape.kv_heads} D {shape.head_dim}, "
        f"batch {args.batch}, context {args.context}, {args.dtype if cuda else 'fp32'}, "
        f"{args.weight_sets or shape.layers} weight sets")  # fmt: skip
    stack = Stack(shape, device, dtype, weight_sets=args.weight_sets)
    cache = ShardedKVCache(
        shape.layers, args.batch, args.context + args.steps + 1, shape.heads, shape.kv_heads, shape.head_dim,
        dtype, device, mode=args.mode, block=args.block, rotary_dim=shape.head_dim, rotary_theta=500000.0,
    )  # fmt: skip
    g = torch.Generator(device=device).manual_seed(1)
    t0 = time.perf_counter()
    _context(cache, shape, args, device, dtype, g)
    if cuda:
        torch.cuda.synchronize()
    say(f"context written in {time.perf_counter() - t0:.1f} s; cache per rank {cache.nbytes / 2**30:.2f} GiB")
    x = _decode(stack, cache, args, shape, device, dtype, g, say)
    if not torch.isfinite(x.float()).all():
        raise SystemExit("non-finite activations")
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
