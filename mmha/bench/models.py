"""The model families on both Hugging Face routes, and the decode speed of two 8B shapes.

For every family of ``mmha.bench.families`` and each route (``graphs``: ``HFDecoder``; ``native``:
``attn_implementation="mmha"`` + ``MmhaCache`` in transformers' ``generate``): whether its fp32
greedy tokens of a left-padded ragged batch equal transformers' own (``tokens_equal``), or the
route's refusal (``refused``). Then, on a GPU, the decode tokens/s of the Llama-3-8B and Qwen-3-8B
shapes at batch 16, contexts 1K and 8K, on both routes and transformers' static cache +
``torch.compile`` (``mmha.bench.hf.measure``). Writes ``models_<gpu>.json`` (``cpu`` without a
GPU: tokens only, the reference path).

Usage::

    python -m mmha.bench.models [--families ...] [--routes graphs native] [--no-speed] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import torch

from .families import FAMILIES, check_family

ROUTES = ("graphs", "native")
SHAPES = ("llama3-8b", "qwen3-8b")
SPEED_METHODS = ("hf_static_compile", "mmha_native", "mmha_graphs")


def gpu_slug() -> str:
    """``h200``, ``h100``, ... from the device name; ``cpu`` without a GPU."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    return next((w for w in name.replace("-", " ").split() if w[:1] in "abhlv" and w[1:2].isdigit()), "gpu")


def header() -> dict:
    import transformers

    return {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    body = [
        [r["family"], r["model_type"], r["route"], "yes" if r["tokens_equal"] else "no", r["refused"] or ""]
        for r in rows
    ]
    return tabulate(body, ["family", "model type", "route", "tokens equal", "refused"], tablefmt="github")


def updated(previous: dict, args) -> dict:
    """``previous`` without the rows this run redoes (a new header, the rest kept)."""
    redo = set() if args.no_families else {(f, r) for f in args.families for r in args.routes}
    rows = [r for r in previous["rows"] if (r["family"], r["route"]) not in redo]
    redo_speed = set() if args.no_speed else set(itertools.product(args.shapes, args.batch, args.context))
    speed = [r for r in previous["speed"] if (r["model"], r["batch"], r["context"]) not in redo_speed]
    return {"header": header(), "rows": rows, "speed": speed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmha.bench.models", description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--no-speed", action="store_true", help="tokens only (no GPU timing)")
    ap.add_argument("--no-families", action="store_true", help="speed rows only (no token checks)")
    ap.add_argument(
        "--update",
        action="store_true",
        help="keep the rows of an existing models_<gpu>.json in --out that this run does not redo",
    )
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    ap.add_argument("--batch", type=int, nargs="+", default=[16])
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--out", type=Path, default=Path("bench_models"))
    args = ap.parse_args(argv)
    import mmha.hf  # noqa: F401  (registers attn_implementation="mmha")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = args.out / f"models_{gpu_slug()}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"header": header(), "rows": [], "speed": []}
    if args.update and out.exists():
        result = updated(json.loads(out.read_text()), args)

    def save(*_) -> None:
        out.write_text(json.dumps(result, indent=1))

    for family in [] if args.no_families else args.families:
        for route in args.routes:
            row = check_family(family, route, device, args.new_tokens)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            save()
    if device == "cuda" and not args.no_speed:
        from .hf import measure

        torch._dynamo.config.cache_size_limit = 64
        for shape in args.shapes:
            rows = measure(shape, SPEED_METHODS, args.batch, args.context, 32, torch.float16)
            # Each row's own date: an --update run keeps rows of earlier runs beside them.
            result["speed"] += [r | {"date": result["header"]["date"]} for r in rows]
            save()
    save()
    print(table(result["rows"]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
