"""Decode tokens/s of a Hugging Face Llama-shaped model (random weights from a config, nothing
downloaded) through four routes, greedy, after the prefill:

- ``hf_dynamic``: ``model.generate()`` with transformers' default dynamic cache (SDPA, eager);
- ``hf_static_compile``: ``generate(cache_implementation="static")``, which transformers compiles
  (``torch.compile``, mode ``reduce-overhead``: CUDA graphs) for the decode steps;
- ``mmha_native``: ``generate(past_key_values=MmhaCache(...))`` with ``attn_implementation="mmha"``,
  compiled by transformers the same way;
- ``mmha_graphs``: ``HFDecoder.generate``, each decode step one CUDA graph, host reads every 16.

Every row has ``batch`` prompts of ``context`` random tokens and generates ``--new-tokens``
tokens (no end-of-sequence). A decode step's time is measured from the host's receipt of the
first new token (after the prefill) to its receipt of the last: transformers' routes through a
streamer (``generate`` synchronises every step anyway, to test for the end), mmha's own loop
around its decode alone. Each route runs once untimed first (compilation, graph capture).
For ``mmha_graphs`` the attention share is the decode timing of the model's L kernel calls on its
cache (one CUDA graph of them) over the step time. A row whose caches would not fit in the
GPU's memory is recorded as skipped, with the bytes it needs.

Usage::

    python -m mmha.bench.hf [--batch 1 16 64] [--context 1024 8192 32768] [--new-tokens 32] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

METHODS = ("hf_dynamic", "hf_static_compile", "mmha_native", "mmha_graphs")
# The model of the comparison: hidden 2048, 16 layers, GQA 32 / 8 heads of 128 (a 1B-class Llama).
MODEL = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=65536,
    bos_token_id=None, eos_token_id=None, pad_token_id=0,
)  # fmt: skip
# Memory a row may plan to use, as a fraction of the GPU's (weights, caches, the dynamic cache's
# step copies, prefill activations).
MEMORY_FRACTION = 0.85


def build_model(dtype: torch.dtype, attn: str, seed: int = 0, **over):
    import transformers

    config = transformers.LlamaConfig(**{**MODEL, **over})
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    with torch.no_grad():  # weights of the size a trained model has: no overflow, no ties
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02)
    return model.eval()


class StepClock:
    """A ``generate`` streamer that notes when the host receives each step's tokens."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def per_step_ms(self) -> float:
        # times[0]: the prompt (before the prefill); times[1]: the first new token.
        t = self.times[1:]
        return (t[-1] - t[0]) * 1e3 / (len(t) - 1)


def cache_bytes(batch: int, tokens: int, model: dict, elem: int = 2) -> int:
    """K and V bytes of every layer for batch x tokens."""
    per_token = 2 * model["num_hidden_layers"] * model["num_key_value_heads"] * model["head_dim"] * elem
    return batch * tokens * per_token


def needed_bytes(method: str, batch: int, context: int, new: int, model: dict, weights: int) -> int:
    """What a route holds at its peak (a planning estimate): the dynamic cache concatenates, so
    it holds two copies of a layer's cache at a step, and its prefill holds the prompt's K/V of
    every layer; mmha's own loop copies the prompt's K/V from transformers' prefill cache."""
    kv = cache_bytes(batch, context + new, model)
    prefill_kv = cache_bytes(min(batch, max(1, 32768 // context)), context, model)
    extra = {"hf_dynamic": kv // model["num_hidden_layers"], "mmha_graphs": prefill_kv}.get(method, 0)
    return weights + kv + extra + (2 << 30)


def _hf_generate(model, ids, new: int, **kw) -> float:
    clock = StepClock()
    model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
        streamer=clock, **kw,
    )  # fmt: skip
    return clock.per_step_ms()


def run_method(method: str, model, batch: int, context: int, new: int, seed: int) -> dict:
    """Per-step ms of one route on one row (after an untimed run of the same shapes)."""
    from ..hf import HFDecoder, MmhaCache

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, model.config.vocab_size, (batch, context), generator=g)
    ids = prompts.cuda()
    res: dict = {}
    if method == "hf_dynamic":
        _hf_generate(model, ids, 4)
        res["step_ms"] = _hf_generate(model, ids, new)
    elif method == "hf_static_compile":
        _hf_generate(model, ids, new, cache_implementation="static")
        res["step_ms"] = _hf_generate(model, ids, new, cache_implementation="static")
    elif method == "mmha_native":
        cache = MmhaCache(model, batch, context + new + 1)
        _hf_generate(model, ids, new, past_key_values=cache)
        cache.reset()
        res["step_ms"] = _hf_generate(model, ids, new, past_key_values=cache)
        cache.kv.check()
    else:
        dec = HFDecoder(model, batch, context + new + 1)
        rows = prompts.tolist()
        dec.generate(rows, new, eos_token_id=[])
        dec.cache.release(range(batch))
        first = dec.prefill(rows).argmax(-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dec._decode(first, new, [], 16)
        res["step_ms"] = (time.perf_counter() - t0) * 1e3 / (new - 1)
        res["attention_ms"] = attention_ms(dec, batch)
        res["attention_share"] = res["attention_ms"] / res["step_ms"]
        dec.cache.check()
    res["decode_tok_s"] = batch * 1e3 / res["step_ms"]
    return res


def attention_ms(dec, batch: int) -> float:
    """The decode timing of the model's L attention calls on the decoder's cache (rows at their
    lengths after generation), in one CUDA graph: ms per step."""
    from .timing import decode_us

    c = dec.cache
    width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    qkvs = [torch.randn(batch, width, device="cuda", dtype=c.dtype) for _ in range(c.num_layers)]
    fns = [lambda i=i: c.step(i, qkvs[i]) for i in range(c.num_layers)]
    return decode_us(fns)["us"] * c.num_layers / 1e3


def header() -> dict:
    import transformers

    dev = torch.cuda.current_device()
    return {
        "gpu": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": MODEL,
    }


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    body = []
    for r in rows:
        if "decode_tok_s" in r:
            share = f"{100 * r['attention_share']:.0f} %" if "attention_share" in r else ""
            ratio = f"{r['vs_hf_static_compile']:.2f}" if "vs_hf_static_compile" in r else ""
            body.append([r["batch"], r["context"], r["method"], f"{r['decode_tok_s']:.0f}",
                         f"{r['step_ms']:.3f}", ratio, share])  # fmt: skip
        else:
            body.append([r["batch"], r["context"], r["method"], "", "", "", r.get("skipped", "")])
    cols = ["batch", "context", "method", "decode tok/s", "step ms", "x hf static+compile", "attention share"]
    return tabulate(body, cols, tablefmt="github", disable_numparse=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmha.bench.hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"])
    ap.add_argument("--out", type=Path, default=Path("bench_hf"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m mmha.bench.hf needs a CUDA GPU")
        return 1
    import mmha.hf  # noqa: F401  (registers attn_implementation="mmha")

    torch._dynamo.config.cache_size_limit = 64  # every row's shapes compile once
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    model_cfg = {**MODEL, "num_hidden_layers": args.layers}
    hdr = header() | {"model": model_cfg, "dtype": args.dtype, "new_tokens": args.new_tokens}
    total = torch.cuda.get_device_properties(0).total_memory
    rows: list[dict] = []
    args.out.mkdir(parents=True, exist_ok=True)
    for method in args.methods:
        attn = "mmha" if method == "mmha_native" else "sdpa"
        model = build_model(dtype, attn, num_hidden_layers=args.layers)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        for context in args.context:
            for batch in args.batch:
                row = {"batch": batch, "context": context, "method": method}
                need = needed_bytes(method, batch, context, args.new_tokens, model_cfg, weights)
                if need > MEMORY_FRACTION * total:
                    row["skipped"] = f"needs ~{need / 2**30:.0f} GiB of {total / 2**30:.0f}"
                else:
                    try:
                        row |= run_method(method, model, batch, context, args.new_tokens, context + batch)
                    except torch.OutOfMemoryError:
                        row["skipped"] = "out of memory"
                rows.append(row)
                print(json.dumps(row), flush=True)
                gc.collect()
                torch.cuda.empty_cache()
                (args.out / "bench_hf.json").write_text(json.dumps({"header": hdr, "rows": rows}, indent=1))
        del model
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    base = {(r["batch"], r["context"]): r for r in rows if r["method"] == "hf_static_compile"}
    for r in rows:
        b = base.get((r["batch"], r["context"]))
        if b is not None and "step_ms" in b and "step_ms" in r:
            r["vs_hf_static_compile"] = b["step_ms"] / r["step_ms"]
    (args.out / "bench_hf.json").write_text(json.dumps({"header": hdr, "rows": rows}, indent=1))
    text = table(rows)
    (args.out / "bench_hf.md").write_text(text + "\n")
    print(f"GPU: {hdr['gpu']} | torch {hdr['torch']} | transformers {hdr['transformers']} | {args.dtype}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
