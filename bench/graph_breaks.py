"""Where torch.compile breaks the native route's decode step (``attn_implementation="mmha"`` with an
``MmhaCache``, as transformers' ``generate`` compiles it). Each break splits the step into several
graphs, each replayed as its own CUDA graph, with Python between them. At short contexts the
graphs route (``HFDecoder``, one CUDA graph a step) does not spend that time. Prints
``torch._dynamo.explain``'s graph and break counts, then each break's reason and the frame where it
happened, for one decode step of a family's small random-weight model.

Meaningful on a GPU with the extension built. On the CPU the reference path reads the host and
breaks by design.

With ``--generate N``, also runs transformers' own ``generate`` for N tokens with the cache (which
transformers compiles with CUDA graphs, as the benchmark's native route does) with torch's
``perf_hints`` and ``recompiles`` logs on: a step that skips CUDA graphs (mutated inputs, host
reads) says so there.

Usage: python bench/graph_breaks.py [--family qwen3] [--generate 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mmha.hf  # noqa: E402,F401  (registers the "mmha" attention)
from mmha._ext import extension_available  # noqa: E402
from mmha.bench.families import FAMILIES, build_family, left_padded, prompts  # noqa: E402
from mmha.hf import MmhaCache  # noqa: E402


def explain_decode_step(family: str, device: str, dtype: torch.dtype):
    """``torch._dynamo.explain`` of one decode step after a prefill of the family's prompts."""
    model = build_family(family, device, dtype)
    model.set_attn_implementation("mmha")
    ps = prompts(model.config.vocab_size)
    cache = MmhaCache(model, len(ps), 256)
    ids, mask = left_padded(ps, device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(ids, position_ids=pos, past_key_values=cache).logits[:, -1]
        tok, nxt = logits.argmax(-1, keepdim=True), pos[:, -1:] + 1
        torch._dynamo.reset()
        return torch._dynamo.explain(model)(tok, position_ids=nxt, past_key_values=cache)


def compiled_generate(family: str, device: str, dtype: torch.dtype, new: int) -> list[list[int]]:
    """transformers' ``generate`` of ``new`` tokens on the native route, as the benchmark runs it
    (compiled by transformers for a compileable cache), with torch's perf hints and recompile
    logs on. Returns the tokens."""
    torch._logging.set_logs(perf_hints=True, recompiles=True, graph_breaks=True, cudagraphs=True)
    model = build_family(family, device, dtype)
    model.set_attn_implementation("mmha")
    ps = prompts(model.config.vocab_size)
    ids, mask = left_padded(ps, device)
    cache = MmhaCache(model, len(ps), ids.shape[1] + new + 1)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, min_new_tokens=new,
            do_sample=False,
        )  # fmt: skip
    torch._logging.set_logs()
    return out[:, ids.shape[1] :].tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="qwen3", choices=sorted(FAMILIES))
    ap.add_argument("--generate", type=int, default=0, help="also run compiled generate for N tokens")
    args = ap.parse_args(argv)
    on_gpu = torch.cuda.is_available() and extension_available()
    device, dtype = ("cuda", torch.float16) if on_gpu else ("cpu", torch.float32)
    if not on_gpu:
        print("no GPU with the extension: the reference path's breaks (host reads) are expected below")
    ex = explain_decode_step(args.family, device, dtype)
    print(f"{args.family} on {device}: {ex.graph_count} graphs, {ex.graph_break_count} breaks")
    for i, b in enumerate(ex.break_reasons):
        frame = b.user_stack[-1] if b.user_stack else None
        where = f"{frame.filename}:{frame.lineno} ({frame.name})" if frame is not None else "?"
        print(f"break {i}: {b.reason.splitlines()[0][:200]}\n    at {where}")
    if args.generate:
        print(f"compiled generate, {args.generate} tokens (logs above and below are torch's):", flush=True)
        print(compiled_generate(args.family, device, dtype, args.generate))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
