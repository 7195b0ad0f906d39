"""Per-step latency of a whole decode step (every layer, lm_head included) of the demo model at a
fixed context length: mmha (eager and one CUDA graph per step) against the SDPA path that users
run without mmha (eager and CUDA graph).

The SDPA path keeps static caches ``[B, Hkv, S_max, D]``, applies rotary in torch, writes the
new K/V at each row's length (one ``index_put_`` each) and attends with
``F.scaled_dot_product_attention(enable_gqa=True)`` over a fixed window of slots (the context
plus the steps measured) with a per-row length mask, as a static-cache server runs it: a CUDA
graph cannot change the slice it reads, and in eager mode a slice that grows every step makes
the cuDNN backend rebuild its plan each step (measured: 40-65 ms per step on an H200).

Before timing, the first step's logits of both paths are compared. Usage::

    python -m mmha.bench.step [--model medium] [--batch 8] [--contexts 1024 8192 32768] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models.generate import DTYPES
from ..models.llama import PRESETS, TinyLlama


class SdpaDecoder:
    """The model's decode step through torch SDPA over static caches (no mmha)."""

    def __init__(self, model: TinyLlama, batch: int, max_seq_len: int):
        c = model.cfg
        p = next(model.parameters())
        shape = (batch, c.num_kv_heads, max_seq_len, c.head_dim)
        self.model = model
        self.k = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(c.num_layers)]
        self.v = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(c.num_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=p.device)
        self.rows = torch.arange(batch, device=p.device)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Attend over the whole static cache with a per-row length mask."""
        m, pos = self.model, self.lengths
        b = tokens.shape[0]
        slots = torch.arange(self.k[0].shape[2], device=pos.device)
        mask = (slots[None, :] <= pos[:, None])[:, None, None, :]
        x = m.embed(tokens)
        for i, blk in enumerate(m.layers):
            q, k, v = m._split(blk.wqkv(blk.attn_norm(x)))
            q, k = m._rope(q, pos), m._rope(k, pos)
            self.k[i][self.rows, :, pos] = k
            self.v[i][self.rows, :, pos] = v
            att = F.scaled_dot_product_attention(
                q[:, :, None], self.k[i], self.v[i], attn_mask=mask, enable_gqa=True
            )
            x = x + blk.wo(att.reshape(b, -1))
            x = x + blk.mlp(x)
        self.lengths += 1
        return m.lm_head(m.norm(x)).float()


def _events_ms(fn, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _capture(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up outside the graph (allocations, workspace)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


@torch.no_grad()
def measure(model: TinyLlama, batch: int, context: int, steps: int, warmup: int = 5) -> list[dict]:
    """Rows for mmha eager / graph and SDPA eager / graph at ``context`` cached tokens per row."""
    c = model.cfg
    p = next(model.parameters())
    dev, dtype = p.device, p.dtype
    # Every measurement below runs warmup + steps decode steps (the graph ones one more for the
    # warm-up before capture); lengths grow by that many, the window must hold them all.
    total = 2 * (warmup + steps + 1) + 2
    window = context + total
    g = torch.Generator(device=dev).manual_seed(0)
    tokens = torch.randint(0, c.vocab_size, (batch,), generator=g, device=dev)

    cache = model.new_cache(batch, window, dev, dtype, dispatch_on="length")
    sdpa = SdpaDecoder(model, batch, window)
    for layer in range(c.num_layers):
        k = torch.randn(batch, context, c.num_kv_heads, c.head_dim, generator=g, device=dev).to(dtype)
        v = torch.randn(batch, context, c.num_kv_heads, c.head_dim, generator=g, device=dev).to(dtype)
        cache.prefill(layer, k, v, [context] * batch)
        sdpa.k[layer][:, :, :context] = k.transpose(1, 2)
        sdpa.v[layer][:, :, :context] = v.transpose(1, 2)
        del k, v
    sdpa.lengths.fill_(context)

    # Same inputs, same model: the two paths' first-step logits must agree.
    lm = model.decode_step(tokens, cache)
    ls = sdpa.step(tokens)
    err = (lm - ls).abs().max().item()
    rel = err / max(1e-6, ls.abs().max().item())
    if not rel < 5e-2:
        raise RuntimeError(f"mmha and SDPA step logits differ: max |diff| {err:.3g} ({rel:.2%} of max)")

    def row(method: str, ms: list[float]) -> dict:
        med = statistics.median(ms)
        p90 = sorted(ms)[min(len(ms) - 1, int(0.9 * len(ms)))]
        return dict(model_layers=c.num_layers, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                    head_dim=c.head_dim, dtype=str(dtype).replace("torch.", ""), batch=batch,
                    context=context, method=method, median_ms=med, p90_ms=p90,
                    tokens_per_s=batch / (med / 1e3), first_step_max_logit_diff=err)  # fmt: skip

    out = []
    # mmha eager (dispatch on the row lengths, as KVCache.step does by default)
    _events_ms(lambda: model.decode_step(tokens, cache), warmup)
    out.append(row("mmha eager", _events_ms(lambda: model.decode_step(tokens, cache), steps)))
    # mmha CUDA graph: dispatch on capacity, so the captured launch serves any length
    cache.dispatch_on = "capacity"
    graph = _capture(lambda: model.decode_step(tokens, cache))

    def replay():
        graph.replay()
        cache.account_replay()

    _events_ms(replay, warmup)
    out.append(row("mmha graph", _events_ms(replay, steps)))
    # SDPA eager and CUDA graph, over the window with a length mask
    _events_ms(lambda: sdpa.step(tokens), warmup)
    out.append(row("sdpa eager", _events_ms(lambda: sdpa.step(tokens), steps)))
    graph = _capture(lambda: sdpa.step(tokens))
    _events_ms(graph.replay, warmup)
    out.append(row("sdpa graph", _events_ms(graph.replay, steps)))
    return out


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    head = ["model", "batch", "context", "method", "median ms", "p90 ms", "tokens/s", "vs sdpa graph"]
    best = {(r["model_layers"], r["num_heads"], r["batch"], r["context"]): r["median_ms"]
            for r in rows if r["method"] == "sdpa graph"}  # fmt: skip
    body = []
    for r in rows:
        key = (r["model_layers"], r["num_heads"], r["batch"], r["context"])
        name = f"L{r['model_layers']} Hq{r['num_heads']}/{r['num_kv_heads']} D{r['head_dim']} {r['dtype']}"
        ref = best.get(key)
        body.append([name, r["batch"], r["context"], r["method"], f"{r['median_ms']:.3f}",
                     f"{r['p90_ms']:.3f}", f"{r['tokens_per_s']:.0f}",
                     f"{ref / r['median_ms']:.2f}x" if ref else "-"])  # fmt: skip
    return tabulate(body, head, tablefmt="github")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmha.bench.step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", choices=list(PRESETS), default=["small", "medium"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp16")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None, help="write step_bench.json there")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("mmha.bench.step: no CUDA GPU here; nothing to measure.")
        return 0
    rows = []
    for name in args.model:
        model = TinyLlama(PRESETS[name]).to("cuda", DTYPES[args.dtype]).eval()
        for ctx in args.contexts:
            rows += measure(model, args.batch, ctx, args.steps)
            torch.cuda.empty_cache()
            print(f"{name} context {ctx}: done", file=sys.stderr)
    text = table(rows)
    header = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    print(header)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step_bench.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
