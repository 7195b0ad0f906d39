#!/usr/bin/env bash
# A/B timing of two builds in one device call: the working tree against BASE, a copy of an
# earlier tree (e.g. `git archive REV csrc mmha setup.py | tar -x -C .base`, carried along).
# Builds BASE once per machine in /tmp/mmha_base, the working tree in place, then times the same
# grid with each (python -m mmha.bench, same arguments), alternating twice (base, new, base, new)
# so that drift shows, and prints per-row mmha times of both and their ratio.
# HOST=1 also times an eager KVCache.step's host overhead with each build (bench/host_step_time.py),
# SOAK=1 runs each build's GPU soak (tests/test_soak.py; MMHA_SOAK_STEPS steps), before the grid.
# MMHA_KERNELS=fp16 (setup.py) builds only the kernel sets the grid runs, in a fraction of the time
# (the BASE copy is slimmed by bench/slim_tree.py, so a tree from before that option takes it too).
# The arguments are parsed first (check_bench_args, device_env.sh): a bad one stops the call
# before any build.
# Usage: BASE=.base bash bench/ab.sh --grid canonical --dtype fp16 --peers sdpa_cudnn --no-secondary
#        BASE=.base bash bench/ab.sh --mods --peers sdpa_mask   (the score modifiers' rows)
#        BASE=.base bash bench/ab.sh --paged --rows 1 3 13       (paged rows, by canonical index)
source "$(dirname "$0")/device_env.sh"
BASE=${BASE:?set BASE to the earlier tree}
check_bench_args "$@"
if [ ! -f /tmp/mmha_base/.built ]; then
  rm -rf /tmp/mmha_base && cp -r "$BASE" /tmp/mmha_base
  # MMHA_KERNELS: the base builds those kernel sets only too, whatever its age (bench/slim_tree.py).
  if [ -n "${MMHA_KERNELS:-}" ]; then
    # shellcheck disable=SC2086
    python bench/slim_tree.py /tmp/mmha_base --keep ${MMHA_KERNELS//,/ } || exit 1
  fi
  (cd /tmp/mmha_base && python setup.py build_ext --inplace >"$OUT/build_base.log" 2>&1) || {
    grep -E "error" "$OUT/build_base.log" | head -20
    exit 1
  }
  touch /tmp/mmha_base/.built
fi
build
if [ "${SOAK:-0}" = 1 ]; then
  for tree in /tmp/mmha_base "$PWD"; do
    name=$([ "$tree" = "$PWD" ] && echo new || echo base)
    (cd "$tree" && PYTHONPATH="$tree:$tree/tests" timeout 300 python -m pytest -q -p no:cacheprovider \
      tests/test_soak.py -k gpu >"$OUT/soak_$name.txt" 2>&1); echo "soak $name: $(tail -n 1 "$OUT/soak_$name.txt")"
  done
fi
if [ "${HOST:-0}" = 1 ]; then
  for round in 1 2; do
    PYTHONPATH=/tmp/mmha_base python bench/host_step_time.py --out "$OUT/host_base_$round.json" | sed "s/^/base: /"
    python bench/host_step_time.py --out "$OUT/host_new_$round.json" | sed "s/^/new:  /"
  done
fi
for round in 1 2; do
  (cd /tmp/mmha_base && PYTHONPATH=/tmp/mmha_base python -m mmha.bench "$@" --out "$OUT/ab_base_$round" \
    >"$OUT/ab_base_$round.txt" 2>&1) || tail -n 5 "$OUT/ab_base_$round.txt"
  python -m mmha.bench "$@" --out "$OUT/ab_new_$round" >"$OUT/ab_new_$round.txt" 2>&1 || tail -n 5 "$OUT/ab_new_$round.txt"
done
python - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
# The canonical grid (bench.json), the score modifiers' rows (--mods: bench_mods.json, with
# each build's own plain row) or paged rows (--paged: bench_paged.json, with each build's own
# contiguous row).
MODS = (out / "ab_base_1" / "bench_mods.json").exists()
PAGED = (out / "ab_base_1" / "bench_paged.json").exists()
NAME = "bench_mods.json" if MODS else "bench_paged.json" if PAGED else "bench.json"
KEY = ("modifier", "batch", "num_kv_heads", "seq_len") if MODS else (
    "batch", "num_kv_heads", "seq_len", "block_size") if PAGED else (
    "dtype", "kv", "batch", "num_heads", "num_kv_heads", "head_dim", "seq_len")  # kv: "", "fp8", "int8"


def times(name, field="mmha_decode_us"):
    t = {}
    for r in (1, 2):
        for row in json.loads((out / f"{name}_{r}" / NAME).read_text())["rows"]:
            if field in row:
                t.setdefault(tuple(row.get(k, "") for k in KEY), []).append(row[field])
    return t


base, new = times("ab_base"), times("ab_new")
SECOND = "plain_decode_us" if MODS else "contiguous_decode_us" if PAGED else None
plain_base, plain_new = (times(n, SECOND) for n in ("ab_base", "ab_new")) if SECOND else ({}, {})
head = [k if k not in ("batch", "num_kv_heads", "num_heads", "head_dim", "seq_len", "block_size") else
        {"batch": "B", "num_kv_heads": "Hkv", "num_heads": "Hq", "head_dim": "D", "seq_len": "S",
         "block_size": "block"}[k] for k in KEY]
extra = [f"{SECOND.split('_')[0]} us (base runs)", f"{SECOND.split('_')[0]} us (new runs)"] if SECOND else []
cols = [*head, "base us (2 runs)", "new us (2 runs)", *extra, "new / base"]
lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
ratios = []
for k, b in base.items():
    if k in new and len(b) == 2 and len(new[k]) == 2:
        ratio = statistics.mean(new[k]) / statistics.mean(b)
        ratios.append(ratio)
        cells = [*map(str, k), f"{b[0]:.1f}, {b[1]:.1f}", f"{new[k][0]:.1f}, {new[k][1]:.1f}"]
        if SECOND:
            cells += [", ".join(f"{x:.1f}" for x in plain_base.get(k, [])),
                      ", ".join(f"{x:.1f}" for x in plain_new.get(k, []))]
        lines.append("| " + " | ".join(cells) + f" | {ratio:.3f} |")
if ratios:
    lines += ["", f"new / base: median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}"]
print("\n".join(lines))
(out / "ab.md").write_text("\n".join(lines) + "\n")  # bench/make_docs.py --ab takes it (a caption line first)
PY
