"""Decode tokens/s of a Hugging Face model of a given shape (``--model``: a 1B-class Llama, Llama 3
8B, Qwen 3 8B; random weights from a config, nothing downloaded) through four routes, greedy,
after the prefill:

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
For ``mmha_graphs`` and ``mmha_native`` the attention share is the decode timing of the model's L
kernel calls on its cache (one CUDA graph of them) over the step time. With ``--forward``, for
the two compiled ``generate`` routes, ``forward_ms`` is the compiled decode step alone: one decode
step of one more ``generate`` repeated back to back (no ``generate`` loop between the repeats, so
no host synchronisation per step); ``loop_ms = step_ms - forward_ms`` is what ``generate``'s own
loop adds to a step. A row whose
caches would not fit in the GPU's memory is recorded as skipped, with the bytes it needs.

Usage::

    python -m mmha.bench.hf [--model llama-1b|llama3-8b|qwen3-8b] [--batch 1 16 64]
        [--context 1024 8192 32768] [--new-tokens 32] [--forward] [--out DIR]
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
# Model shapes ``--model`` picks: (transformers config class, config). Random weights.
MODELS = {
    "llama-1b": ("LlamaConfig", MODEL),
    "llama3-8b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )),
    "qwen3-8b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )),
}  # fmt: skip
# Memory a row may plan to use, as a fraction of the GPU's (weights, caches, the dynamic cache's
# step copies, prefill activations).
MEMORY_FRACTION = 0.85


def build_model(dtype: torch.dtype, attn: str, seed: int = 0, model: str = "llama-1b", **over):
    import transformers

    config_class, base = MODELS[model]
    config = getattr(transformers, config_class)(**{**base, **over})
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


REPLAYS = 8  # timed calls of the compiled step alone, after two untimed ones
TIMED_CALL = 4  # which call of a generate's compiled step is repeated (a decode step)


def _step_timer(model, out: dict) -> bool:
    """Wrap the compiled call transformers keeps for ``generate`` (``get_compiled_call`` caches
    it as ``model._compiled_call``) so that inside the next ``generate`` its ``TIMED_CALL``-th call
    (a decode step) runs 2 + ``REPLAYS`` times back to back with the same inputs, the last
    ``REPLAYS`` timed: ``out["forward_ms"]``, the step without ``generate``'s loop between steps.
    The last call's result is returned (a CUDA graph's earlier outputs are overwritten by the
    next replay). False when ``generate`` did not compile. Inside ``generate``, not after it: the
    compiled step's guards hold only there (after it, a call recompiles)."""
    compiled = getattr(model, "_compiled_call", None)
    if compiled is None:
        return False
    calls = [0]

    def timer(*args, **kwargs):
        calls[0] += 1
        if calls[0] != TIMED_CALL:
            return compiled(*args, **kwargs)
        for _ in range(2):
            compiled(*args, **kwargs)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            result = compiled(*args, **kwargs)
        end.record()
        end.synchronize()
        out["forward_ms"] = start.elapsed_time(end) / REPLAYS
        return result

    model._compiled_call = timer
    out["_unwrap"] = lambda: setattr(model, "_compiled_call", compiled)
    return True


def _forward_row(res: dict, model, ids, **generate_kw) -> dict:
    """``forward_ms`` (``_step_timer``, in one more ``generate`` of ``TIMED_CALL + 2`` tokens) and
    ``loop_ms = step_ms - forward_ms`` into ``res``."""
    out: dict = {}
    if _step_timer(model, out):
        try:
            _hf_generate(model, ids, TIMED_CALL + 2, **generate_kw)
        finally:
            out.pop("_unwrap")()
    if "forward_ms" in out:
        res["forward_ms"] = out["forward_ms"]
        res["loop_ms"] = res["step_ms"] - out["forward_ms"]
    return res


def run_method(
    method: str, model, batch: int, context: int, new: int, seed: int, forward: bool = False
) -> dict:
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
        if forward:  # the static cache rewrites the timed step's slot at each call
            _forward_row(res, model, ids, cache_implementation="static")
    elif method == "mmha_native":
        # Room for the timed step's repeats (each appends a token).
        cache = MmhaCache(model, batch, context + max(new, TIMED_CALL + 2) + 3 + REPLAYS)
        _hf_generate(model, ids, new, past_key_values=cache)
        cache.reset()
        res["step_ms"] = _hf_generate(model, ids, new, past_key_values=cache)
        if forward:
            cache.reset()
            _forward_row(res, model, ids, past_key_values=cache)
        res["attention_ms"] = attention_ms(cache.kv, batch)
        res["attention_share"] = res["attention_ms"] / res["step_ms"]
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
        res["attention_ms"] = attention_ms(dec.cache, batch)
        res["attention_share"] = res["attention_ms"] / res["step_ms"]
        dec.cache.check()
    res["decode_tok_s"] = batch * 1e3 / res["step_ms"]
    return res


def attention_ms(c, batch: int) -> float:
    """The decode timing of the model's L attention calls on a route's ``KVCache`` (rows at their
    lengths after generation), in one CUDA graph: ms per step."""
    from .timing import decode_us

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
            fwd = f"{r['forward_ms']:.3f}" if "forward_ms" in r else ""
            body.append([r["batch"], r["context"], r["method"], f"{r['decode_tok_s']:.0f}",
                         f"{r['step_ms']:.3f}", fwd, ratio, share])  # fmt: skip
        else:
            body.append([r["batch"], r["context"], r["method"], "", "", "", "", r.get("skipped", "")])
    cols = ["batch", "context", "method", "decode tok/s", "step ms", "forward ms", "x hf static+compile",
            "attention share"]  # fmt: skip
    return tabulate(body, cols, tablefmt="github", disable_numparse=True)


def measure(
    shape: str,
    methods,
    batches,
    contexts,
    new_tokens: int,
    dtype: torch.dtype,
    layers: int | None = None,
    progress=None,
    forward: bool = False,
) -> list[dict]:
    """Rows of ``run_method`` for every method x context x batch on a model of ``shape`` (a row
        that would not fit the GPU's memory records why it was skipped), each with its speed-up over
        ``hf_static_compile`` where that ran. ``progress(rows)`` after each row; ``forward``: also the
    compiled routes' ``forward_ms`` / ``loop_ms`` (``run_method``)."""
    base = MODELS[shape][1]
    layers = layers or base["num_hidden_layers"]
    model_cfg = {**base, "num_hidden_layers": layers}
    total = torch.cuda.get_device_properties(0).total_memory
    rows: list[dict] = []
    for method in methods:
        attn = "mmha" if method == "mmha_native" else "sdpa"
        model = build_model(dtype, attn, model=shape, num_hidden_layers=layers)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        for context in contexts:
            for batch in batches:
                row = {"model": shape, "batch": batch, "context": context, "method": method}
                need = needed_bytes(method, batch, context, new_tokens, model_cfg, weights)
                if need > MEMORY_FRACTION * total:
                    row["skipped"] = f"needs ~{need / 2**30:.0f} GiB of {total / 2**30:.0f}"
                else:
                    try:
                        row |= run_method(method, model, batch, context, new_tokens, context + batch, forward)
                    except torch.OutOfMemoryError:
                        row["skipped"] = "out of memory"
                rows.append(row)
                print(json.dumps(row), flush=True)
                gc.collect()
                torch.cuda.empty_cache()
                if progress is not None:
                    progress(rows)
        del model
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    static = {(r["batch"], r["context"]): r for r in rows if r["method"] == "hf_static_compile"}
    for r in rows:
        b = static.get((r["batch"], r["context"]))
        if b is not None and "step_ms" in b and "step_ms" in r:
            r["vs_hf_static_compile"] = b["step_ms"] / r["step_ms"]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmha.bench.hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--model", choices=list(MODELS), default="llama-1b", help="the model's shape")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the shape's)")
    ap.add_argument("--out", type=Path, default=Path("bench_hf"))
    ap.add_argument(
        "--forward", action="store_true", help="also time the compiled routes' decode step alone (forward_ms)"
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m mmha.bench.hf needs a CUDA GPU")
        return 1
    import mmha.hf  # noqa: F401  (registers attn_implementation="mmha")

    torch._dynamo.config.cache_size_limit = 64  # every row's shapes compile once
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    base = MODELS[args.model][1]
    layers = args.layers or base["num_hidden_layers"]
    model_cfg = {**base, "num_hidden_layers": layers}
    hdr = header() | {
        "model_name": args.model,
        "model": model_cfg,
        "dtype": args.dtype,
        "new_tokens": args.new_tokens,
    }
    args.out.mkdir(parents=True, exist_ok=True)

    def save(rows: list[dict]) -> None:
        (args.out / "bench_hf.json").write_text(json.dumps({"header": hdr, "rows": rows}, indent=1))

    rows = measure(
        args.model, args.methods, args.batch, args.context, args.new_tokens, dtype, layers, save, args.forward
    )
    save(rows)
    text = table(rows)
    (args.out / "bench_hf.md").write_text(text + "\n")
    print(f"GPU: {hdr['gpu']} | torch {hdr['torch']} | transformers {hdr['transformers']} | {args.dtype}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
