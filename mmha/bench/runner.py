"""Timing one benchmark row (each method after its reference check), the read floor beside it,
and what every benchmark prints and writes: the GPU header, the output files, a secondary
benchmark's closing report. ``mmha.bench.cli`` and the other benchmarks (``--mods``, ``--paged``,
``--tree``, ``--epilogue``) share these."""

from __future__ import annotations

import csv
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from .. import ops
from . import floor, report, timing
from .methods import MMHA, PEERS, kind, make_fn, method_context, plan_str, unavailable
from .problems import TOLERANCE, Config, Problem, layer_problems


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]


def time_method(cfg: Config, method: str, plan, res: dict) -> None:
    """Decode timing of one method on ``cfg.layers`` distinct problems, after a reference check."""
    probs = fns = None
    try:
        with method_context(method):
            probs = layer_problems(cfg, kind(method))
            fns = [make_fn(method, p, plan) for p in probs]
            out = fns[0]()
            torch.cuda.synchronize()
            err = probs[0].error(out)
            res["errors"][method] = err
            if not math.isfinite(err) or err > TOLERANCE[cfg.dtype]:
                res["skipped"][method] = f"wrong result: max error {err:.3g} > {TOLERANCE[cfg.dtype]}"
                return
            res["decode"][method] = timing.decode_us(fns)
    except Exception as exc:  # a peer backend that does not support this shape
        res["skipped"][method] = _first_line(exc)
    finally:
        del probs, fns
        torch.cuda.empty_cache()


def time_secondary(cfg: Config, method: str, plan, res: dict) -> None:
    """Cold-L2 single call and repeated-call graph of one problem."""
    try:
        with method_context(method):
            prob = Problem(cfg, kind(method))
            fn = make_fn(method, prob, plan)
            res["cold"][method] = timing.cold_us(fn)
            res["graph"][method] = timing.repeat_graph_us(fn)
    except Exception as exc:
        res["skipped"].setdefault(f"{method} (secondary)", _first_line(exc))
    finally:
        prob = fn = None
        torch.cuda.empty_cache()


def run_config(
    cfg: Config, peers=PEERS, secondary: bool = True, floors: dict | None = None, twin: dict | None = None
) -> dict:
    """Every method's timings on one configuration, and the read floor of its K/V bytes (kept in
    ``floors`` by size, so rows of one cache size share one measurement). ``twin``: the result of
    the same shape with 16-bit caches, whose peer timings an fp8 or int8 row takes over (the peers
    have no such cache)."""
    floors = {} if floors is None else floors
    res = {"config": cfg, "decode": {}, "errors": {}, "skipped": {}, "cold": {}, "graph": {}}
    if twin is not None:  # 16-bit peers from the twin; FlashInfer runs its fp8 decode on an fp8 row
        fp8_peers = tuple(m for m in peers if m == "flashinfer" and cfg.kv == "fp8")
        for key in ("decode", "errors", "skipped", "cold", "graph"):
            res[key].update(
                {
                    m: v
                    for m, v in twin[key].items()
                    if m != MMHA and not m.startswith(MMHA) and m not in fp8_peers
                }
            )
        peers = fp8_peers
    plan = ops.plan_for("cuda", cfg.batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.seq_len,
                        cfg.torch_dtype, kv_dtype=cfg.kv_torch_dtype)  # fmt: skip
    res["plan"] = plan_str(plan)
    for method in (MMHA, *peers):
        why = unavailable(method)
        if why:
            res["skipped"][method] = why
            continue
        time_method(cfg, method, plan, res)
    key = (cfg.kv_bytes, cfg.layers)
    if key not in floors:
        floors[key] = floor.read_floor_decode(cfg.kv_bytes, cfg.layers)
        floors[key]["cold_us"] = floor.read_floor_cold(cfg.kv_bytes) if secondary else math.nan
    res["floor"] = floors[key]
    res["floor_cold_us"] = floors[key]["cold_us"]
    if secondary:
        timed_peers = {m: v["us"] for m, v in res["decode"].items() if m in peers}
        for method in (MMHA, min(timed_peers, key=timed_peers.get, default=None)):
            if method is not None and method in res["decode"]:
                time_secondary(cfg, method, plan, res)
    return res


def gpu_header() -> dict:
    dev = torch.cuda.current_device()
    ceiling, how = floor.read_ceiling_gbs()
    return {
        "gpu": torch.cuda.get_device_name(dev),
        "sms": torch.cuda.get_device_properties(dev).multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "ceiling_gbs": ceiling,
        "ceiling_how": how,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_outputs(rows: list[dict], header: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    with open(out / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k not in ("errors", "skipped")],
                           extrasaction="ignore")  # fmt: skip
        w.writeheader()
        w.writerows(rows)
    (out / "bench.md").write_text(report.header_line(header) + "\n\n" + report.table(rows, full=True) + "\n")


def print_report(out_md: Path, header: dict, text: str, bad: list[str], notes: list[str] = ()) -> None:
    """A secondary benchmark's (--paged, --mods, --tree) closing: its table written to out_md and
    printed under the GPU line, then notes, then the target misses."""
    out_md.write_text(text + "\n")
    print(f"GPU: {header['gpu']} | torch {header['torch']} | CUDA {header['cuda']} | decode timing | "
          f"{time.strftime('%Y-%m-%d')}")  # fmt: skip
    print(text)
    for line in notes:
        print(line)
    print(f"targets: {len(bad)} misses" if bad else "targets: met on every row")
    for m in bad:
        print(f"  {m}")


def progress(items, desc: str):
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, file=sys.stderr)
    except ImportError:
        return items
