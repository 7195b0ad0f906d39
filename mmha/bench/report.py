"""What a benchmark run reports: one summary per row, the bar it is held to, tables, plots."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from .methods import MMHA, PEERS

NAN = float("nan")

# The speed bar (docs/benchmarks.md), on the canonical rows (D = 128) of each dtype and GPU:
# % of the decode-timed read floor by cache size, the small caches against the best peer.
FLOOR_BAR = ((1e9, 97.0), (256e6, 94.0), (64e6, 85.0))  # (from this many KV bytes, min % of floor)
SMALL_CACHE_BYTES = 20e6
SMALL_CACHE_RATIO = 0.85
MEDIAN_RATIO = 0.97
GQA_POINTS = 3.0
# fp8 caches (issue bar): on caches of at least FP8_BIG_BYTES (fp8 bytes), at most FP8_RATIO of
# mmha's fp16 time on the same shape and at least FP8_PCT_FLOOR % of the fp8 bytes' read floor;
# on every fp8 row, faster than every 16-bit peer.
FP8_BIG_BYTES = 256e6
FP8_RATIO = 0.55
FP8_PCT_FLOOR = 95.0
# int8 caches (issue bar): on rows of at least INT8_BIG_BYTES in 16 bits, at most INT8_RATIO of
# mmha's 16-bit time on the same shape.
INT8_BIG_BYTES = 256e6
INT8_RATIO = 0.55
# int4 caches (issue bar): the same rows, at most INT4_RATIO of mmha's 16-bit time.
INT4_RATIO = 0.30


def summarize(res: dict, ceiling_gbs: float) -> dict:
    """One JSON row: the configuration, every method's decode time, the read floor and ratios."""
    cfg = res["config"]
    dec = res["decode"]
    t = dec.get(MMHA, {}).get("us", NAN)
    peers = {m: v["us"] for m, v in dec.items() if m in PEERS}
    best = min(peers, key=peers.get) if peers else None
    peer_t = peers[best] if best else NAN
    floor = res["floor"]
    floor_t = floor.get("us", NAN)
    row = {
        "group": cfg.group, "batch": cfg.batch, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "seq_len": cfg.seq_len, "dtype": cfg.dtype, "kv": cfg.kv,
        "kv_mb": cfg.kv_bytes / 1e6, "layers": cfg.layers, "plan": res["plan"],
        # Primary: decode timing (module mmha.bench.timing).
        "mmha_decode_us": t,
        "mmha_decode_p20_us": dec.get(MMHA, {}).get("p20", NAN),
        "mmha_decode_p80_us": dec.get(MMHA, {}).get("p80", NAN),
        **{f"{m}_decode_us": dec.get(m, {}).get("us", NAN) for m in PEERS},
        "best_peer_decode": best,
        "best_peer_decode_us": peer_t,
        "ratio": t / peer_t,  # mmha time / best peer time: < 1 is faster
        "read_floor_decode_us": floor_t,
        "read_floor_shape": floor.get("shape", ""),
        "pct_floor": 100 * floor_t / t,
        "peer_pct_floor": 100 * floor_t / peer_t,
        "gbs": cfg.step_bytes / (t * 1e-6) / 1e9,
        "pct_ceiling": 100 * cfg.step_bytes / (t * 1e-6) / 1e9 / ceiling_gbs,
        # Secondary: one cold-L2 call (do_bench), and 20 calls of one problem in a graph.
        "mmha_cold_us": res["cold"].get(MMHA, NAN),
        "best_peer_cold_us": res["cold"].get(best, NAN),
        "read_floor_cold_us": res.get("floor_cold_us", NAN),
        "mmha_graph_us": res["graph"].get(MMHA, NAN),
        "best_peer_graph_us": res["graph"].get(best, NAN),
        "errors": res["errors"],
        "skipped": res["skipped"],
    }  # fmt: skip
    return row


def fmt(x, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def row_label(r: dict) -> str:
    heads = f"Hq={r['num_heads']} Hkv={r['num_kv_heads']}"
    kv = f" kv={r['kv']}" if r.get("kv") else ""
    return f"{r['dtype']}{kv} B={r['batch']} {heads} D={r['head_dim']} S={r['seq_len']}"


def shape_key(r: dict) -> tuple:
    return (r["dtype"], r["batch"], r["num_heads"], r["num_kv_heads"], r["head_dim"], r["seq_len"])


def twin_rows(rows: list[dict], kv: str) -> list[dict]:
    """Each row with caches of ``kv`` ("fp8", "int8") beside its 16-bit twin: the twin's mmha time
    and cache size (``mmha_16bit_us``, ``kv_mb_16bit``; NaN where the run has no twin) and
    ``{kv}_speedup_ratio`` (the row's time / the twin's)."""
    twins = {shape_key(r): r for r in rows if not r.get("kv")}
    out = []
    for r in rows:
        if r.get("kv") != kv:
            continue
        t = twins.get(shape_key(r))
        t16, mb16 = (t["mmha_decode_us"], t["kv_mb"]) if t else (NAN, NAN)
        ratio = r["mmha_decode_us"] / t16
        out.append({**r, "mmha_16bit_us": t16, "kv_mb_16bit": mb16, f"{kv}_speedup_ratio": ratio})
    return out


def fp8_rows(rows: list[dict]) -> list[dict]:
    """Each fp8 row beside its 16-bit twin (``twin_rows``)."""
    return twin_rows(rows, "fp8")


def fp8_bar(rows: list[dict]) -> list[str]:
    """Where the fp8 rows miss their bar, one line each (empty: it holds)."""
    misses = []
    for r in fp8_rows(rows):
        label = row_label(r)
        if not r["ratio"] < 1:
            misses.append(f"{label}: {r['ratio']:.3f}x the best 16-bit peer ({r['best_peer_decode']})")
        if r["kv_mb"] * 1e6 >= FP8_BIG_BYTES:
            if not r["fp8_speedup_ratio"] <= FP8_RATIO:
                misses.append(f"{label}: {r['fp8_speedup_ratio']:.3f}x mmha's 16-bit time > {FP8_RATIO}")
            if not r["pct_floor"] >= FP8_PCT_FLOOR:
                misses.append(
                    f"{label}: {r['pct_floor']:.1f} % of the fp8 read floor < {FP8_PCT_FLOOR:.0f} %"
                )
    return misses


def int8_rows(rows: list[dict]) -> list[dict]:
    """Each int8 row beside its 16-bit twin (``twin_rows``)."""
    return twin_rows(rows, "int8")


def integer_bar(rows: list[dict], kv: str, ratio: float) -> list[str]:
    """Where the rows of ``kv`` ("int8", "int4") caches miss their bar (at most ``ratio`` of mmha's
    16-bit time on rows of at least INT8_BIG_BYTES in 16 bits), one line each (empty: it holds)."""
    misses = []
    for r in twin_rows(rows, kv):
        if r["kv_mb_16bit"] * 1e6 >= INT8_BIG_BYTES and not r[f"{kv}_speedup_ratio"] <= ratio:
            misses.append(f"{row_label(r)}: {r[f'{kv}_speedup_ratio']:.3f}x mmha's 16-bit time > {ratio}")
    return misses


def int8_bar(rows: list[dict]) -> list[str]:
    """The int8 rows' misses (``integer_bar`` at INT8_RATIO)."""
    return integer_bar(rows, "int8", INT8_RATIO)


def int4_rows(rows: list[dict]) -> list[dict]:
    """Each int4 row beside its 16-bit twin (``twin_rows``)."""
    return twin_rows(rows, "int4")


def int4_bar(rows: list[dict]) -> list[str]:
    """The int4 rows' misses (``integer_bar`` at INT4_RATIO)."""
    return integer_bar(rows, "int4", INT4_RATIO)


def header_line(h: dict) -> str:
    return (
        f"GPU: {h['gpu']} | torch {h['torch']} | CUDA {h['cuda']} | read ceiling {h['ceiling_gbs']:.0f} GB/s "
        f"({h['ceiling_how']}) | decode timing: per-call median of a graph of L calls on distinct caches"
    )


def table(rows: list[dict], full: bool = False) -> str:
    """The default table: what a user came for. ``full``: every peer and the secondary timings."""
    from tabulate import tabulate

    cols = ["row", "KV MB", "plan", "mmha us", "best peer", "peer us", "mmha/peer", "% floor", "floor us"]
    if full:
        cols += ["cudnn", "flash", "effic.", "default", "flashinfer", "eager", "L", "mmha cold", "peer cold",
                 "floor cold", "mmha graph", "peer graph", "GB/s", "% ceil"]  # fmt: skip
    body = []
    for r in rows:
        line = [row_label(r), fmt(r["kv_mb"]), r["plan"], fmt(r["mmha_decode_us"]),
                r["best_peer_decode"] or "-",
                fmt(r["best_peer_decode_us"]), fmt(r["ratio"], 2), fmt(r["pct_floor"]),
                fmt(r["read_floor_decode_us"])]  # fmt: skip
        if full:
            line += [fmt(r[f"{m}_decode_us"]) for m in ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient",
                                                        "sdpa_default", "flashinfer", "eager")]  # fmt: skip
            line += [r["layers"], fmt(r["mmha_cold_us"]), fmt(r["best_peer_cold_us"]),
                     fmt(r["read_floor_cold_us"]), fmt(r["mmha_graph_us"]), fmt(r["best_peer_graph_us"]),
                     fmt(r["gbs"], 0), fmt(r["pct_ceiling"])]  # fmt: skip
        body.append(line)
    return tabulate(body, headers=cols, tablefmt="github", disable_numparse=True)


def skipped_line(rows: list[dict]) -> str:
    """One line for what was not timed and why (the JSON has every reason per row)."""
    why: dict[tuple[str, str], int] = {}
    for r in rows:
        for m, reason in r["skipped"].items():
            key = (m, reason.split(":")[0] if "wrong result" not in reason else reason[:40])
            why[key] = why.get(key, 0) + 1
    if not why:
        return ""
    parts = [f"{m} ({reason}, {n} row{'s' if n > 1 else ''})" for (m, reason), n in sorted(why.items())]
    return "not timed: " + "; ".join(parts)


def is_canonical(r: dict) -> bool:
    return r["head_dim"] == 128 and r["num_heads"] == 32 and r["group"] != "custom" and not r.get("kv")


def bar(rows: list[dict]) -> list[str]:
    """Where the run misses the speed bar, one line each (empty: the bar holds)."""
    misses = []
    canon = [r for r in rows if is_canonical(r) and not math.isnan(r["ratio"])]
    for dt in sorted({r["dtype"] for r in canon}):
        sel = [r for r in canon if r["dtype"] == dt]
        med = statistics.median(r["ratio"] for r in sel)
        if med > MEDIAN_RATIO:
            misses.append(f"{dt}: median mmha/best peer {med:.3f} > {MEDIAN_RATIO}")
        mha = {round(r["kv_mb"]): r for r in sel if r["num_heads"] == r["num_kv_heads"]}
        for r in sel:
            label = row_label(r)
            if r["ratio"] > 1:
                misses.append(f"{label}: {r['ratio']:.3f}x {r['best_peer_decode']}")
            kv = r["kv_mb"] * 1e6
            if kv < SMALL_CACHE_BYTES and r["ratio"] > SMALL_CACHE_RATIO:
                misses.append(
                    f"{label}: {r['ratio']:.3f}x the best peer > {SMALL_CACHE_RATIO}x (small cache)"
                )
            for least, pct in FLOOR_BAR:
                if kv >= least:
                    if r["pct_floor"] < pct:
                        misses.append(f"{label}: {r['pct_floor']:.1f} % of the read floor < {pct:.0f} %")
                    break
            twin = mha.get(round(r["kv_mb"]))
            if (
                r["num_heads"] != r["num_kv_heads"]
                and twin
                and twin["pct_floor"] - r["pct_floor"] > GQA_POINTS
            ):
                misses.append(
                    f"{label}: {r['pct_floor']:.1f} % of floor, "
                    f"{twin['pct_floor'] - r['pct_floor']:.1f} points "
                    f"under the MHA row of {r['kv_mb']:.0f} MB"
                )
    for r in rows:
        if (r["head_dim"], r["num_kv_heads"], r["batch"], r["seq_len"], r["dtype"]) == (
            256,
            8,
            16,
            2048,
            "fp16",
        ):
            if r["ratio"] > 1:
                misses.append(f"{row_label(r)}: {r['ratio']:.3f}x {r['best_peer_decode']} (head_dim 256)")
    return misses


def plot(rows: list[dict], header: dict, out_dir: Path) -> list[Path]:
    """latency.png (decode us against S per group) and pct_floor.png; nothing without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    groups = sorted({(r["dtype"], r["group"], r["head_dim"]) for r in rows})
    ncols = min(3, len(groups))
    nrows = math.ceil(len(groups) / 3)
    fig, axes = plt.subplots(nrows, ncols, figsize=(15, 4 * nrows), squeeze=False)
    for ax, (dt, grp, d) in zip(axes.flat, groups, strict=False):
        sel = sorted((r for r in rows if (r["dtype"], r["group"], r["head_dim"]) == (dt, grp, d)),
                     key=lambda r: r["seq_len"])  # fmt: skip
        xs = [r["seq_len"] for r in sel]
        for m, key in (("mmha", "mmha_decode_us"), ("read floor", "read_floor_decode_us"),
                       *((p, f"{p}_decode_us") for p in PEERS)):  # fmt: skip
            ys = [r[key] for r in sel]
            if any(not math.isnan(y) for y in ys):
                style = {"linewidth": 2.5} if m == "mmha" else {"linestyle": ":"} if m == "read floor" else {}
                ax.plot(xs, ys, marker="o", label=m, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{grp} {dt} D={d}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("us per call (decode timing)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{header['gpu']}: decode attention, one layer of a decode step")
    fig.tight_layout()
    p = out_dir / "latency.png"
    fig.savefig(p, dpi=80)
    paths.append(p)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(12, 4))
    xs = range(len(rows))
    ax.bar(xs, [r["pct_floor"] for r in rows], label="mmha")
    ax.plot(xs, [r["peer_pct_floor"] for r in rows], "r.", label="best peer")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([row_label(r) for r in rows], rotation=90, fontsize=6)
    ax.set_ylabel("% of the read floor (decode timing)")
    ax.axhline(100, color="k", linewidth=0.5)
    ax.legend()
    fig.tight_layout()
    p = out_dir / "pct_floor.png"
    fig.savefig(p, dpi=80)
    paths.append(p)
    plt.close(fig)
    return paths
