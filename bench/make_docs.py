"""Writes docs/benchmarks.md from benchmark runs' own output (never edit that page by hand).

Usage:
    python bench/make_docs.py --bench RUN.json [--bench RUN2.json ...] [--before OLD.json]
                              [--step STEP.md] [--sweep SWEEP.json]
                              [--fp8 FP8RUN.json ...] [--fp8-accuracy ACC.json]

--bench: a ``python -m mmha.bench --grid canonical`` bench.json, one per GPU model (copied to
docs/data/bench_<gpu>.json with its plots). --before: the previous kernel's decode times on the
same GPU and run (rows with ``old_decode_us``). --step: the table ``python -m mmha.bench.step``
printed. --sweep: a ``python -m mmha.bench.sweep`` sweep.json (the dispatcher's check).
--fp8: a ``python -m mmha.bench --grid canonical --fp8`` bench.json (copied to
docs/data/bench_fp8_<gpu>.json). --fp8-accuracy: ``python -m mmha.bench.fp8_accuracy``'s JSON.
--int8: a ``python -m mmha.bench --grid canonical --int8`` bench.json (docs/data/bench_int8_<gpu>.json).
--int4: likewise with ``--int4`` (docs/data/bench_int4_<gpu>.json).
--hf: a ``python -m mmha.bench.hf`` bench_hf.json, one per GPU model (copied to
docs/data/bench_hf_<gpu>.json). --mods: a ``python -m mmha.bench --mods`` bench_mods.json, one per
GPU model (copied to docs/data/bench_mods_<gpu>.json). --tree: a ``python -m mmha.bench --tree``
bench_tree.json, one per GPU model (docs/data/bench_tree_<gpu>.json). --paged / --epilogue: likewise
for ``--paged`` and ``--epilogue`` (bench_paged_<gpu>.json, bench_epilogue_<gpu>.json). --ab: what
``bench/ab.sh`` wrote (ab.md) for a kernel change, after a first line saying what the two builds were;
repeatable.
--kv-accuracy: a ``python -m mmha.bench.kv_accuracy`` kv_accuracy.json (kept under its own name).
--models: a ``python -m mmha.bench.models`` models_<gpu>.json, one per GPU model (kept under that name).
--distributed: a ``torchrun ... -m mmha.bench.distributed --out`` JSON, one per machine (world size
and GPU: docs/data/bench_distributed_w<N>_<gpu>.json). --distributed-demo: the output of
``torchrun ... -m mmha.distributed.demo`` (kept under its own name, quoted as it is).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mmha.bench import report  # noqa: E402
from mmha.bench.sweep import render as sweep_table  # noqa: E402

DOCS = ROOT / "docs"

METHOD = """\
## How it is measured
- **Decode timing (primary)**: one layer of a decode step. L calls, each on its own cache, qkv and
  output (mmha's calls share one lengths tensor, as the layers of a step share
  `KVCache.lengths`), are captured back to back in one CUDA graph, L = max(2, min(32,
  ceil(1 GiB / cache bytes))); per-call time = median replay time / L over 25 replays, after
  at least 100 ms of warm-up replays. No call finds its cache in L2, none pays a flush's
  write-back, none waits on the CPU, nothing overlaps across calls (`mmha/bench/timing.py`).
- **Read floor**: L streaming reads of distinct buffers of the cache's size under the same timing,
  the fastest of four program shapes (`mmha/bench/floor.py`): what any kernel that reads the
  K/V bytes once pays. "% floor" = floor time / method time.
- Every method is checked against an fp32 reference before it is timed. Peers: SDPA with the
  cuDNN, flash and efficient backends and torch's default choice (`enable_gqa` for GQA), eager
  matmul-softmax-matmul; FlashInfer where importable (it is not on these machines).
- Secondary (in the JSON/CSV, and the cold columns below): one cold-L2 call (`do_bench`, whose
  flush adds its own write-back) and 20 calls of one problem in a graph.
- `plan` is `splits x stages` (`mmha.dispatch.choose_variant`)."""

BAR = """\
## The bar (fp16 and bf16, D = 128 canonical rows, each GPU model)
Every row no slower than the best peer and the median at most 0.97x; >= 97 % of the read floor
for caches >= 1 GB, >= 94 % for 256 MB - 1 GB, >= 85 % for 64-256 MB; the 17 MB rows at most
0.85x the best peer; GQA rows within 3 points (% of floor) of the MHA row with the same cache;
head_dim 256 GQA (fp16, B=16, Hkv=8, S=2048) at least level with the best peer. The list under
each GPU is `mmha.bench.report.bar()` on that run's JSON."""


# What each kept sweep run was (the sweep's JSON has no header).
SWEEP_RUNS = {
    "sweep_h200.json": "NVIDIA H200, 2026-11-23, every canonical row and `--extras`: the plan was timed first"
    " in each row, before the timing's 100 ms warm-up existed, and the first timing of the two 64K rows"
    " came out ~12 % slow whatever the plan (B=1 Hkv=32 S=65536: 282.5 us here, 243.2 in that day's"
    " benchmark run with the same plan); the sweep now times the plan again last",
    "sweep_h100.json": "NVIDIA H100 80GB HBM3, 2026-11-26, every canonical row and `--extras`, after the"
    " ring-depth rules (2 stages for 16-bit grids of more items than SMs)",
    "sweep_tree_h100.json": "NVIDIA H100 80GB HBM3, 2026-11-26, `--tree`: the tree benchmark's rows at the"
    " plan's splits and each stage count up to the plan's, four rounds of alternating order",
}


def keep(src: Path, name: str) -> Path:
    dst = DOCS / "data" / name
    if src.resolve() != dst.resolve():
        shutil.copy(src, dst)
    return dst


def gpu_sections(paths: list[Path], name: str, module, extra=None, misses=None) -> list[str]:
    """One section per GPU of a secondary benchmark (``module``: mods, tree or paged, with its
    ``table`` and ``misses``): its JSON kept as bench_<name>_<gpu>.json, the table, ``extra(data)``
    lines, the target misses (``misses(data)`` in place of ``module.misses(rows)``)."""
    lines = []
    for path in paths:
        data = json.loads(path.read_text())
        h = data["header"]
        keep(path, f"bench_{name}_{slug(h['gpu'])}.json")
        bad = misses(data) if misses else module.misses(data["rows"])
        lines += [
            f"### {h['gpu']}, {h['date']}: torch {h['torch']}, CUDA {h['cuda']}", "",
            module.table(data["rows"]), "", *(extra(data) if extra else []),
            "Targets: " + ("met on every row." if not bad else f"{len(bad)} misses:"), "",
            *[f"- {m}" for m in bad], "",
        ]  # fmt: skip
    return lines


def slug(gpu: str) -> str:
    return "h100" if "H100" in gpu else "h200" if "H200" in gpu else gpu.lower().replace(" ", "_")


def cold_table(rows: list[dict]) -> str:
    from tabulate import tabulate

    body = [[report.row_label(r), report.fmt(r["mmha_cold_us"]), report.fmt(r["best_peer_cold_us"]),
             report.fmt(r["read_floor_cold_us"]), report.fmt(r["mmha_graph_us"]),
             report.fmt(r["best_peer_graph_us"])] for r in rows]  # fmt: skip
    cols = ["row", "mmha cold us", "peer cold us", "floor cold us", "mmha graph us", "peer graph us"]
    return tabulate(body, headers=cols, tablefmt="github", disable_numparse=True)


def gpu_section(data: dict, name: str) -> list[str]:
    header, rows = data["header"], data["rows"]
    canon = [r for r in rows if report.is_canonical(r)]
    extra = [r for r in rows if not report.is_canonical(r)]
    out = [f"## {header['gpu']}", "", report.header_line(header) + f" | {header['date']}", ""]
    for dt in sorted({r["dtype"] for r in canon}):
        sel = [r for r in canon if r["dtype"] == dt]
        ahead = sum(r["ratio"] <= 1 for r in sel)
        med = sorted(r["ratio"] for r in sel)[len(sel) // 2]
        out += [
            f"### Canonical rows, {dt} (mmha ahead of or level with the best peer on {ahead} of {len(sel)};"
            f" median mmha / best peer {med:.3f})",
            "",
            report.table(sel),
            "",
        ]
    if extra:
        out += ["### Other head dims and the small-head rows (fp16)", "", report.table(extra), ""]
    misses = report.bar(rows)
    out += ["### Against the bar", ""]
    out += [f"- {m}" for m in misses] if misses else ["The bar holds on every canonical row."]
    line = report.skipped_line(rows)
    out += ["", f"Not timed: {line[len('not timed: ') :]}." if line else "", ""]
    out += ["### Secondary timings", "", cold_table(canon), ""]
    plots = [p for p in (f"latency_{name}.png", f"pct_floor_{name}.png") if (DOCS / "data" / p).exists()]
    out += [f"![{p}](data/{p})" for p in plots] + [""]
    return out


def before_section(before: dict, after: dict) -> list[str]:
    from tabulate import tabulate

    new = {(r["batch"], r["num_kv_heads"], r["seq_len"]): r for r in after["rows"]
           if report.is_canonical(r) and r["dtype"] == "fp16"}  # fmt: skip
    body = []
    for r in before["rows"]:
        n = new.get((r["batch"], r["num_kv_heads"], r["seq_len"]))
        if n is None:
            continue
        body.append([f"fp16 B={r['batch']} Hkv={r['num_kv_heads']} S={r['seq_len']}", r["plan"],
                     report.fmt(r["old_decode_us"]), n["plan"], report.fmt(n["mmha_decode_us"]),
                     report.fmt(n["mmha_decode_us"] / r["old_decode_us"], 3)])  # fmt: skip
    faster = sum(float(b[-1]) < 1 for b in body)
    cols = ["row", "per-warp rings: plan", "us", "tile loop: plan", "us", "new / old"]
    return [
        f"## Before and after: the per-warp-ring loop against the tile loop ({before['gpu']})",
        "",
        "The previous kernel (per-warp cp.async rings of 16-key steps, blocks of 4-16 warps; commit"
        " 480a266) built beside this one and timed by the same decode timing on the same machine,"
        f" right after the run above (its own dispatcher's plans: variant/splits x warps). The tile"
        f" loop is faster on {faster} of {len(body)} rows.",
        "",
        tabulate(body, headers=cols, tablefmt="github", disable_numparse=True),
        "",
    ]


def fp8_section(data: dict, name: str) -> list[str]:
    from tabulate import tabulate

    h = data["header"]
    rows = report.fp8_rows(data["rows"])
    body = [[report.row_label(r), report.fmt(r["kv_mb"]), r["plan"], report.fmt(r["mmha_decode_us"]),
             report.fmt(r["mmha_16bit_us"]), report.fmt(r["fp8_speedup_ratio"], 3),
             f"{report.fmt(r['best_peer_decode_us'])} ({r['best_peer_decode']})", report.fmt(r["ratio"], 3),
             report.fmt(r["pct_floor"]), report.fmt(r["read_floor_decode_us"])] for r in rows]  # fmt: skip
    misses = report.fp8_bar(data["rows"])
    return [
        f"### {h['gpu']} ({name}), {h['date']}: torch {h['torch']}, CUDA {h['cuda']}", "",
        tabulate(body, headers=["row", "fp8 KV MB", "plan", "mmha fp8 us", "mmha 16-bit us", "fp8 / 16-bit",
                                "best 16-bit peer us", "fp8 / peer", "% fp8 floor", "fp8 floor us"],
                 tablefmt="github", disable_numparse=True), "",
        "fp8 bar (`mmha.bench.report.fp8_bar`): "
        + ("holds on every row." if not misses else f"{len(misses)} misses:"), "",
        *[f"- {m}" for m in misses], "",
    ]  # fmt: skip


def kv_sections(paths: list[Path], kv: str, section) -> list[str]:
    """Each GPU's run with ``kv`` caches: kept as docs/data/bench_<kv>_<gpu>.json, its section."""
    lines = []
    for path in paths:
        data = json.loads(path.read_text())
        name = slug(data["header"]["gpu"])
        keep(path, f"bench_{kv}_{name}.json")
        lines += section(data, name)
    return lines


def integer_section(data: dict, name: str, kv: str) -> list[str]:
    """An int8 or int4 run's rows beside their 16-bit twins, and where they miss the bar."""
    from tabulate import tabulate

    h = data["header"]
    rows = report.twin_rows(data["rows"], kv)
    body = [[report.row_label(r), report.fmt(r["kv_mb_16bit"]), report.fmt(r["kv_mb"]), r["plan"],
             report.fmt(r["mmha_decode_us"]), report.fmt(r["mmha_16bit_us"]),
             report.fmt(r[f"{kv}_speedup_ratio"], 3), report.fmt(r["pct_floor"])] for r in rows]  # fmt: skip
    misses = report.int8_bar(data["rows"]) if kv == "int8" else report.int4_bar(data["rows"])
    return [
        f"### {h['gpu']} ({name}), {h['date']}: torch {h['torch']}, CUDA {h['cuda']}", "",
        tabulate(body, headers=["row", "16-bit KV MB", f"{kv} KV MB", "plan", f"mmha {kv} us",
                                "mmha 16-bit us", f"{kv} / 16-bit", f"% {kv} floor"],
                 tablefmt="github", disable_numparse=True), "",
        f"{kv} bar (`mmha.bench.report.{kv}_bar`): "
        + ("holds on every row." if not misses else f"{len(misses)} misses:"), "",
        *[f"- {m}" for m in misses], "",
    ]  # fmt: skip


def int8_section(data: dict, name: str) -> list[str]:
    return integer_section(data, name, "int8")


def int4_section(data: dict, name: str) -> list[str]:
    return integer_section(data, name, "int4")


def fp8_accuracy_section(acc: dict) -> list[str]:
    from tabulate import tabulate

    body = [[r["head_dim"], f"{r['fp8_max_abs_err']:.2e}", f"{r['fp8_mean_abs_err']:.2e}",
             f"{r['fp16_max_abs_err']:.2e}", f"{r['fp16_mean_abs_err']:.2e}",
             f"{r['e4m3_bound_min_over_heads']:.2g}", r["within_bound"]]
            for r in acc["attention"]]  # fmt: skip
    lines = [
        "### Accuracy", "",
        "`python -m mmha.bench.fp8_accuracy` (H200): N(0, 1) q, K, V, 1025 keys, Hq 8, Hkv 2, per-kv-head"
        " scales from the absolute maxima; mmha's output with an fp8 cache and with an fp16 cache against"
        " fp64 attention over the unquantised fp16 cache. The bound is the worst case from e4m3's 3-bit"
        " mantissa (`tests/fp8_cases.py`, asserted per head by `tests/test_fp8_gpu.py`): loose by"
        " construction, it allows every value its largest rounding in the same direction.", "",
        tabulate(body, headers=["head dim", "fp8 max err", "fp8 mean err", "fp16 max err", "fp16 mean err",
                                "e4m3 bound (min over heads)", "within bound"], tablefmt="github"), "",
    ]  # fmt: skip
    for r in acc.get("hf", []):
        lines.append(
            f"- HF adapter (random-weight Llama config, 2 layers, Hq 8, Hkv 2, D 32), {r['dtype']} model: fp8"
            f" against {r['dtype']} cache, {r['rows']} rows x {r['steps']} steps teacher-forced: max |logit"
            f" difference| {r['max_logit_diff']:.3g} (mean of the per-step maxima"
            f" {r['mean_step_max_logit_diff']:.3g}; logits up to {r['logit_scale']:.3g}), top-1 flips"
            f" {r['top1_flips']} of {r['rows'] * r['steps']}, decisive mismatches {r['decisive_mismatches']}"
            " (a step where the 16-bit top-1 wins by more than twice the logit difference)."
        )
    return lines + [""]


HF_METHODS = ("hf_dynamic", "hf_static_compile", "mmha_native", "mmha_graphs")
# Targets of the HF routes against transformers' static cache + torch.compile (issue of the routes).
HF_TARGET = {1024: 1.1, 8192: 1.3, 32768: 1.3}


def routes_against_static(methods: dict, need: float | None, row: str, misses: list[str]) -> list[str]:
    """Both mmha routes' speed-ups over transformers' static cache + compile in one row of
    ``methods`` (by method name), formatted; a miss of ``need`` is added to ``misses``."""
    base = methods.get("hf_static_compile", {}).get("step_ms")
    ratios = []
    for method in ("mmha_native", "mmha_graphs"):
        step = methods.get(method, {}).get("step_ms")
        ratio = base / step if base and step else None
        ratios.append(f"{ratio:.2f}" if ratio else "")
        if ratio is not None and need is not None and ratio < need:
            misses.append(f"{row}: {method} {ratio:.2f}x < {need}x")
    return ratios


def hf_section(data: dict) -> list[str]:
    from tabulate import tabulate

    h = data["header"]
    by = {}
    for r in data["rows"]:
        by.setdefault((r["batch"], r["context"]), {})[r["method"]] = r
    body, misses = [], []

    def tok(r: dict) -> str:
        return f"{r['decode_tok_s']:.0f}" if "decode_tok_s" in r else r.get("skipped", "")

    for (batch, context), m in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ratios = routes_against_static(m, HF_TARGET.get(context), f"B={batch} context {context}", misses)
        share = m.get("mmha_graphs", {}).get("attention_share")
        body.append([batch, context, *[tok(m.get(x, {})) for x in HF_METHODS], *ratios,
                     f"{100 * share:.0f} %" if share is not None else ""])  # fmt: skip
    cols = ["batch", "context", *[f"{x} tok/s" for x in HF_METHODS], "native / static+compile",
            "graphs / static+compile", "attention share (graphs)"]  # fmt: skip
    return [
        f"### {h['gpu']}, {h['date']}: torch {h['torch']}, CUDA {h['cuda']}, "
        f"transformers {h['transformers']}",
        "",
        tabulate(body, headers=cols, tablefmt="github", disable_numparse=True),
        "",
        "Targets (at least 1.1x transformers' static cache + compile at context 1K, 1.3x at 8K and 32K, "
        "both routes): " + ("met on every row where both ran." if not misses else "missed on:"),
        "",
        *[f"- {x}" for x in misses],
        "",
    ]


# Targets of the model-families issue: mmha's routes against transformers' static cache + compile.
MODELS_TARGET = {1024: 2.0, 8192: 4.0}


def models_section(data: dict) -> list[str]:
    """A ``models_<gpu>.json``: the families' tokens on each route, then the 8B shapes' speed."""
    from tabulate import tabulate

    METHODS = ("hf_static_compile", "mmha_native", "mmha_graphs")  # noqa: N806
    h = data["header"]
    routes: dict = {}
    for r in data["rows"]:
        cell = "refused: " + r["refused"] if r["refused"] else "equal" if r["tokens_equal"] else "differ"
        routes.setdefault((r["family"], r["model_type"]), {})[r["route"]] = cell
    families = [[f, t, m.get("graphs", ""), m.get("native", "")] for (f, t), m in routes.items()]
    by: dict = {}
    for r in data["speed"]:
        by.setdefault((r["model"], r["batch"], r["context"]), {})[r["method"]] = r
    body, misses = [], []
    for (model, batch, context), m in by.items():
        row = f"{model} B={batch} context {context}"
        ratios = routes_against_static(m, MODELS_TARGET.get(context), row, misses)
        tok = [f"{m[x]['decode_tok_s']:.0f}" if "decode_tok_s" in m.get(x, {}) else "" for x in METHODS]
        share = m.get("mmha_graphs", {}).get("attention_share")
        share = f"{100 * share:.0f} %" if share is not None else ""
        body.append([model, batch, context, *tok, *ratios, share, m.get("mmha_graphs", {}).get("date", "")])
    equal = sum(r["tokens_equal"] for r in data["rows"])
    tokens = (
        [
            f"fp32 greedy tokens against transformers' own `generate` ({equal} of {len(data['rows'])} family"
            " x route rows equal):",
            "",
            tabulate(
                families,
                ["family", "model type", "HFDecoder (graphs)", "MmhaCache (native)"],
                tablefmt="github",
            ),
            "",
        ]
        if data["rows"]
        else ["The families' tokens were not run on this GPU (`--no-families`).", ""]
    )
    return [
        f"### {h['device']}, {h['date']}: torch {h['torch']}, transformers {h['transformers']}", "",
        *tokens,
        "Decode tokens/s (fp16, 32 new tokens after the prompt):", "",
        tabulate(body, ["model", "batch", "context", *[f"{x} tok/s" for x in METHODS],
                        "native / static+compile", "graphs / static+compile", "attention share (graphs)",
                        "measured"], tablefmt="github", disable_numparse=True), "",
        "Targets (at least 2x transformers' static cache + compile at context 1K, 4x at 8K, both shapes): "
        + ("met on every row." if not misses else "missed on:"), "",
        *[f"- {x}" for x in misses], "",
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", type=Path, action="append", required=True)
    ap.add_argument("--before", type=Path)
    ap.add_argument("--step", type=Path)
    ap.add_argument("--sweep", type=Path, action="append", help="sweep.json, one per run (SWEEP_RUNS)")
    ap.add_argument("--fp8", type=Path, action="append", default=[])
    ap.add_argument("--fp8-accuracy", type=Path)
    ap.add_argument("--int8", type=Path, action="append", default=[])
    ap.add_argument("--int4", type=Path, action="append", default=[])
    ap.add_argument("--hf", type=Path, action="append", default=[])
    ap.add_argument("--ab", type=Path, action="append", default=[])
    ap.add_argument("--mods", type=Path, action="append", default=[])
    ap.add_argument("--tree", type=Path, action="append", default=[])
    ap.add_argument("--paged", type=Path, action="append", default=[])
    ap.add_argument("--epilogue", type=Path, action="append", default=[])
    ap.add_argument("--models", type=Path, action="append", default=[])
    ap.add_argument("--kv-accuracy", type=Path, action="append", default=[])
    ap.add_argument("--distributed", type=Path, action="append", default=[])
    ap.add_argument("--distributed-demo", type=Path, action="append", default=[])
    args = ap.parse_args()
    runs = []
    for path in args.bench:
        data = json.loads(path.read_text())
        name = slug(data["header"]["gpu"])
        keep(path, f"bench_{name}.json")
        for p in report.plot(data["rows"], data["header"], DOCS / "data"):
            p.rename(DOCS / "data" / f"{p.stem}_{name}.png")
        runs.append((name, data))
    lines = [
        "# Benchmarks", "",
        "Generated by `bench/make_docs.py` from the runs' JSON in `docs/data/` (the benchmark's own"
        " output: `python -m mmha.bench --grid canonical`). Absolute times compare only on one GPU"
        " model.", "", METHOD, "", BAR, "",
    ]  # fmt: skip
    for name, data in runs:
        lines += gpu_section(data, name)
    if args.before:
        before = json.loads(keep(args.before, args.before.name).read_text())
        match = [d for n, d in runs if slug(before["gpu"]) == n]
        if match:
            lines += before_section(before, match[0])
    for ab in args.ab:
        caption, _, table = keep(ab, ab.name).read_text().strip().partition("\n")
        lines += [
            f"## Before and after ({ab.name})", "",
            f"`bench/ab.sh` (both builds on one machine, the grid timed base, new, base, new): {caption}",
            "", table, "",
        ]  # fmt: skip
    if args.step:
        text = keep(args.step, args.step.name).read_text().strip()
        lines += [
            "## The whole decode step", "",
            "`python -m mmha.bench.step` (its module docstring says how): every layer and the lm_head"
            " of the demo model, mmha against the SDPA path (static caches, a length mask), eager and"
            " in one CUDA graph per step (the run's data beside the table, in `step_bench_<gpu>.json`).",
            "", text, "",
        ]  # fmt: skip
    if args.sweep:
        lines += [
            "## Dispatcher sweep", "",
            "`python -m mmha.bench.sweep`: each row at every split count (the plan's stages) and every"
            " stage count (the plan's splits, and one pass), decode timing, against the dispatcher's"
            " plan (`SxT`: S splits, T stages).", "",
        ]  # fmt: skip
        for path in args.sweep:
            sweep = json.loads(keep(path, path.name).read_text())
            lines += [f"### {SWEEP_RUNS.get(path.name, path.name)}", "", sweep_table(sweep), ""]
    if args.fp8 or args.fp8_accuracy:
        lines += [
            "## fp8 (e4m3) caches", "",
            "`python -m mmha.bench --grid canonical --dtype fp16 bf16 --no-extras --fp8 --no-secondary`:"
            " each canonical row again with an fp8 cache (one scale per kv head), beside mmha's 16-bit time"
            " from the same run;"
            " the peers have no fp8 cache and run the 16-bit row. The read floor is that of the fp8 bytes."
            " The bar: faster than every 16-bit peer on every row; on caches of >= 256 MB of fp8 bytes at"
            " most 0.55x mmha's 16-bit time and >= 95 % of the fp8 read floor.", "",
        ]  # fmt: skip
        lines += kv_sections(args.fp8, "fp8", fp8_section)
        if args.fp8_accuracy:
            lines += fp8_accuracy_section(
                json.loads(keep(args.fp8_accuracy, args.fp8_accuracy.name).read_text())
            )
    if args.int8:
        lines += [
            "## int8 caches", "",
            "`python -m mmha.bench --grid canonical --dtype fp16 --no-extras --int8 --peers"
            " --no-secondary` (no peers: the bar is against mmha's own 16-bit time): each canonical row"
            " again with an int8 cache (codes with a scale per token and kv head; the int8 bytes count"
            " both), beside mmha's 16-bit time from the same run. The bar: on rows of >= 256 MB in 16"
            " bits at most 0.55x mmha's 16-bit time.", "",
        ]  # fmt: skip
        lines += kv_sections(args.int8, "int8", int8_section)
    if args.int4:
        lines += [
            "## int4 caches", "",
            "`python -m mmha.bench --grid canonical --dtype fp16 --no-extras --int4 --peers --no-secondary`:"
            " each canonical row again with an int4 cache (`mmha.int4`: codes two a byte, K's fp16 scales"
            " and zero points per 64 tokens, V's per token; the int4 bytes count them all), beside mmha's"
            " 16-bit time from the same run. The rows' lengths are S - 2, so a step reads S - 1 keys and"
            " does not complete a K group (one step in 64 does, and quantises it). The bar: on rows of"
            " >= 256 MB in 16 bits at most 0.30x mmha's 16-bit time.", "",
        ]  # fmt: skip
        lines += kv_sections(args.int4, "int4", int4_section)
    if args.mods:
        from mmha.bench import mods

        lines += [
            "## Score modifiers", "",
            "`python -m mmha.bench --mods` (its module docstring says how): mmha with each modifier against"
            " its own plain step (the window rows: the plain row of the window's length) and the peers that"
            " can express the modifier; decode timing, fp16, Hq 32, D 128. Targets: a window at most 1.05x"
            " the plain row of its length, the others at most 1.03x the plain row, faster than every peer.",
            "",
        ]  # fmt: skip
        lines += gpu_sections(args.mods, "mods", mods)
    if args.tree:
        from mmha.bench import tree

        lines += [
            "## Tree steps", "",
            "`python -m mmha.bench --tree` (its module docstring says how): a tree-masked step of T nodes"
            " (check + append, then attention) against mmha's one-token step on the same caches, T one-token"
            " calls, SDPA with the tree as a boolean mask and flex_attention with a block mask; decode"
            " timing, fp16. GB/s: K/V bytes of cache + nodes over the time; TFLOP/s: Q.K and P.V of every"
            " node over every key. Targets: T = 64 at contexts >= 4K at most 1.3x the one-token step or at"
            " least 0.6x the GPU's dense fp16 matrix product measured in the same run, every row faster"
            " than every peer; the last column is the TFLOP/s a row's step would run at 1.3x its"
            " one-token step.",
            "",
        ]  # fmt: skip
        lines += gpu_sections(
            args.tree,
            "tree",
            tree,
            extra=tree.ceiling_lines,
            misses=lambda data: tree.misses(data["rows"], data["header"]),
        )
    if args.paged:
        from mmha.bench import paged

        lines += [
            "## Paged caches", "",
            "`python -m mmha.bench --paged` (its module docstring says how): each canonical row's caches as"
            " pages scattered at random through a pool with spare blocks, against mmha on the contiguous"
            " caches and SDPA's cuDNN kernel in the same run; decode timing, fp16. Target: paged at most"
            " 1.03x contiguous on every row.",
            "",
        ]  # fmt: skip

        def memory(data: dict) -> list[str]:
            return ["Memory:", "", *[
                f"- blocks of {m['block_size']}: {m['batch']} rows of mixed length ({m['tokens']} tokens)"
                f" hold {m['paged_bytes'] / 2**20:.0f} MiB of pages against"
                f" {m['contiguous_bytes'] / 2**20:.0f} MiB"
                f" for a contiguous cache of capacity {m['capacity']} ({m['paged_over_contiguous']:.3f}x;"
                " Hkv 8, D 128, fp16, one layer)"
                for m in data.get("memory", [])
            ], ""]  # fmt: skip

        lines += gpu_sections(args.paged, "paged", paged, memory)
    if args.epilogue:
        from mmha.bench import epilogue

        lines += [
            "## Output epilogue", "",
            "`python -m mmha.bench --epilogue` (its module docstring says how): the canonical batch-16 and"
            " batch-64 rows with an int8 epilogue (shift and smooth per channel, one scale) fused into the"
            " step, against the plain step and the plain step followed by the same epilogue as a compiled"
            " torch op, in the same run; decode timing, fp16. Target: at most 1.02x the plain call and"
            " faster than plain + separate epilogue on every row.",
            "",
        ]  # fmt: skip
        lines += gpu_sections(args.epilogue, "epilogue", epilogue)
    if args.distributed:
        from mmha.bench import distributed

        lines += [
            "## Decode across GPUs", "",
            "`torchrun --nproc-per-node N -m mmha.bench.distributed` (its module docstring says how): a"
            " `ShardedKVCache` step (each rank's kernel on its shard, the collective, the merge kernel)"
            " against `KVCache.step` on one GPU holding the whole cache; decode timing with the"
            " collectives inside the graph, fp16, Hq 32, Hkv 8, D 128. \"kernel\" is the ranks' local"
            " step alone, \"merge\" the rest's share. Targets (two GPUs, sequence mode): 1.8x one GPU"
            " from 4 GB per layer, 1.6x at 1 GB. A run on one GPU (N = 1) measures what the sharded"
            " step adds to the kernel; it has no target (a share below zero is the spread between two timings"
            " of nearly the same work).", "",
        ]  # fmt: skip
        for path in args.distributed:
            data = json.loads(path.read_text())
            h = data["header"]
            keep(path, f"bench_distributed_w{h['world_size']}_{slug(h['gpu'])}.json")
            bad = distributed.misses(data["rows"])
            lines += [
                f"### {h['world_size']} x {h['gpu']}, {h['date']}: torch {h['torch']}, CUDA {h['cuda']}", "",
                distributed.table(data["rows"]), "",
                "Targets: " + ("no row with a target." if not any(
                    r["mode"] == "sequence" and r["world_size"] > 1 for r in data["rows"]
                ) else "met on every row." if not bad else f"{len(bad)} misses:"), "",
                *[f"- {m}" for m in bad], "",
            ]  # fmt: skip
        for path in args.distributed_demo:
            kept = keep(path, path.name)
            lines += [
                f"### `mmha.distributed.demo` (`docs/data/{kept.name}`)", "",
                "A Llama-8B-shaped stack with random weights decoding one row after a long context, one"
                " CUDA graph per step (the demo's own output; `#` lines name the command and machine):", "",
                "```", *kept.read_text().strip().splitlines(), "```", "",
            ]  # fmt: skip
    if args.hf:
        model = json.loads(args.hf[0].read_text())["header"]["model"]
        lines += [
            "## Hugging Face generation", "",
            "`python -m mmha.bench.hf` (its module docstring says how): a random-init Llama-shaped model"
            f" (hidden {model['hidden_size']}, {model['num_hidden_layers']} layers, Hq"
            f" {model['num_attention_heads']}, Hkv {model['num_key_value_heads']}, D {model['head_dim']},"
            f" intermediate {model['intermediate_size']}, vocab {model['vocab_size']}, fp16), greedy, decode"
            " tokens/s after the prefill: transformers' `generate()` with its dynamic cache, with its static"
            " cache (which it compiles: `torch.compile`, CUDA graphs), mmha inside that same `generate`"
            " (`attn_implementation=\"mmha\"`, `MmhaCache`; compiled the same way), and mmha's own loop"
            " (`HFDecoder`, one CUDA graph per step). The attention share is the decode timing of the"
            " model's attention calls on `HFDecoder`'s cache over its step time.", "",
        ]  # fmt: skip
        for path in args.hf:
            data = json.loads(path.read_text())
            keep(path, f"bench_hf_{slug(data['header']['gpu'])}.json")
            lines += hf_section(data)
    if args.kv_accuracy:
        from mmha.bench.kv_accuracy import model_table, table

        lines += [
            "## K/V cache formats in accuracy", "",
            "`python -m mmha.bench.kv_accuracy` (its module docstring says how): each format's attention"
            " error against the 16-bit cache, one tensor stored in it and the other 16-bit (mean and max"
            " relative error of the output over heads and seeds), on random and on outlier-channel K/V;"
            " with `--model`, the formats on an HF model, teacher-forced against the 16-bit cache. These"
            " chose the integer layouts (int8 per token; int4 V per token, K per channel in groups of"
            " 64); the kernels store the codes and scales as the reference does, bit for bit, and their"
            " own arithmetic adds what a 16-bit cache's does (`python bench/one_chain_error.py`; one"
            " 128K-key item on an H200: `docs/data/one_chain_error_h200.md`).", "",
        ]  # fmt: skip
        for path in args.kv_accuracy:
            data = json.loads(keep(path, path.name).read_text())
            h = data["header"]
            lines += [f"### {h['device']}, {h['date']}: torch {h['torch']} (`docs/data/{path.name}`)", "",
                      table(data["rows"]), ""]  # fmt: skip
            if data.get("model_rows"):
                lines += [f"On `{h['model']}` (fp16, random weights at trained scale):", "",
                          model_table(data["model_rows"]), ""]  # fmt: skip
    if args.models:
        lines += [
            "## Model families", "",
            "`python -m mmha.bench.models` (its module docstring says how): every family of"
            " `mmha.bench.families` (small random-weight models from each family's config class) on both"
            " routes, then a Llama-3-8B-shaped and a Qwen-3-8B-shaped model (random weights, fp16) at batch"
            " 16 against transformers' static cache, which its `generate` compiles (`torch.compile`, CUDA"
            " graphs); the native route runs inside that same compiled `generate`.", "",
        ]  # fmt: skip
        for path in args.models:
            data = json.loads(path.read_text())
            keep(path, f"models_{slug(data['header']['device'])}.json")
            lines += models_section(data)
    (DOCS / "benchmarks.md").write_text("\n".join(x for x in lines if x is not None).rstrip() + "\n")
    print(f"wrote {DOCS / 'benchmarks.md'}")


if __name__ == "__main__":
    main()
