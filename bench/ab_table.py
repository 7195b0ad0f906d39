"""Per-row mmha times of several builds timed in one device call, side by side.

Each build's grid ran twice, alternated (``python -m mmha.bench ... --out DIR/NAME_1``, then
``_2``; build order repeated), so drift shows. Prints a markdown table (a caption line first, the
form ``bench/make_docs.py --ab`` takes): each build's two times and each build's mean over the
first build's, then the median and range of each ratio.

Usage: python bench/ab_table.py DIR "caption" NAME:LABEL [NAME:LABEL ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

KEY = ("dtype", "kv", "batch", "num_heads", "num_kv_heads", "head_dim", "seq_len")
HEAD = ("dtype", "kv", "B", "Hq", "Hkv", "D", "S")
# python -m mmha.bench --tree (bench_tree.json)
TREE_KEY = ("kv", "batch", "num_heads", "num_kv_heads", "head_dim", "context", "nodes", "shape")
TREE_HEAD = ("kv", "B", "Hq", "Hkv", "D", "context", "T", "tree")


def bench_file(root: Path, name: str) -> Path:
    """A run's results: bench.json, or the tree benchmark's bench_tree.json."""
    run = root / f"{name}_1"
    return Path("bench_tree.json") if (run / "bench_tree.json").exists() else Path("bench.json")


def times(root: Path, name: str, key: tuple[str, ...] = KEY) -> dict[tuple, list[float]]:
    """Row key -> mmha_decode_us of runs 1 and 2 of build ``name``. A tree row's one-token step on
    the same caches (mmha_single_token_us) is a row of its own, shape "one-token", once per run
    (the tree shapes of a row share it)."""
    got: dict[tuple, list[float]] = {}
    file = bench_file(root, name)
    for run in (1, 2):
        single: set[tuple] = set()
        for row in json.loads((root / f"{name}_{run}" / file).read_text())["rows"]:
            if "mmha_decode_us" in row:
                feat = f" +{row['features']}" if row.get("features") else ""  # mmha.bench.tree.Row.features
                row = {**row, "shape": f"{row['shape']}{feat}"} if feat else row
                got.setdefault(tuple(row.get(k, "") for k in key), []).append(row["mmha_decode_us"])
                if "mmha_single_token_us" in row:
                    one = tuple(
                        1 if k == "nodes" else f"one-token{feat}" if k == "shape" else row.get(k, "")
                        for k in key
                    )
                    if one not in single:
                        single.add(one)
                        got.setdefault(one, []).append(row["mmha_single_token_us"])
    return got


def table(root: Path, caption: str, builds: list[tuple[str, str]]) -> str:
    tree = bench_file(root, builds[0][0]).name == "bench_tree.json"
    runs = [times(root, name, TREE_KEY if tree else KEY) for name, _ in builds]
    labels = [label for _, label in builds]
    head = TREE_HEAD if tree else HEAD
    cols = [*head, *(f"{lb} us (2 runs)" for lb in labels), *(f"{lb} / {labels[0]}" for lb in labels[1:])]
    lines = [caption, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    ratios: list[list[float]] = [[] for _ in labels[1:]]
    for key in runs[0]:
        if not all(len(r.get(key, [])) == 2 for r in runs):
            continue
        means = [statistics.mean(r[key]) for r in runs]
        cells = [str(c) if c != "" else "-" for c in key]
        cells += [f"{r[key][0]:.1f}, {r[key][1]:.1f}" for r in runs]
        for i, m in enumerate(means[1:]):
            ratios[i].append(m / means[0])
            cells.append(f"{m / means[0]:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for label, r in zip(labels[1:], ratios, strict=True):
        spread = f"range {min(r):.3f}-{max(r):.3f}"
        lines.append(f"{label} / {labels[0]}: median {statistics.median(r):.3f}, {spread}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) < 4:
        raise SystemExit(__doc__)
    builds = [tuple(a.split(":", 1)) for a in argv[3:]]
    print(table(Path(argv[1]), argv[2], builds))


if __name__ == "__main__":
    main(sys.argv)
