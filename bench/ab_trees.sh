#!/usr/bin/env bash
# A/B of several source trees in one device call (bench/ab.sh does two): each tree of TREES
# ("label:path", the first the baseline; "." is the working tree, others e.g. `git archive REV csrc
# mmha setup.py tests bench pyproject.toml | tar -x -C .tREV`, carried along) is copied to
# /tmp/ab_<label> and built once per machine, all side by side (MAX_JOBS split between them); with
# MMHA_KERNELS only those kernel sets (older trees slimmed by bench/slim_tree.py), with
# MMHA_HEAD_DIMS (e.g. 128) only those head dims' files (--grid quick and the tree benchmark's
# Llama-shaped rows are head dim 128, its seed rows 64: four fp16 trees at 128 build 3 files each,
# not 17; a step of another head dim fails "not supported"). Then the same
# `python -m mmha.bench` arguments run with each build in turn, twice (a, b, c, a, b, c), and
# bench/ab_table.py prints each build's rows beside the first's ($OUT/ab.md, a caption line first;
# the runs themselves in $OUT/ab_runs.tgz).
# The arguments are parsed first (check_bench_args, device_env.sh): a bad one stops the call
# before any build.
# Tree rows: give `--peers` with no names (mmha's tree step and one-token step only); with the
# peers and the sequential baseline a run of 16 tree rows took about 90 s a build (H200).
# AB_BUILD_ONLY=1 stops after the builds (a later call on the same machine runs the benchmark on
# them; other scripts may use /tmp/ab_<label> meanwhile).
# Usage: TREES="main:.t915 branch:." MMHA_KERNELS=fp16 bash bench/ab_trees.sh --grid canonical \
#          --dtype fp16 --peers --no-secondary
source "$(dirname "$0")/device_env.sh"
TREES=${TREES:?set TREES to "label:path ..." (the first is the baseline)}
read -r -a trees <<<"$TREES"
check_bench_args "$@"
jobs=$(( ${MAX_JOBS:-16} / ${#trees[@]} )); [ "$jobs" -ge 1 ] || jobs=1
for t in "${trees[@]}"; do
  label=${t%%:*} src=${t#*:} dst=/tmp/ab_${t%%:*}
  [ -f "$dst/.built" ] && continue
  (
    rm -rf "$dst" && mkdir -p "$dst" && cp -r "$src"/. "$dst"/ && rm -rf "$dst"/.t* "$dst"/build
    if [ -n "${MMHA_KERNELS:-}${MMHA_HEAD_DIMS:-}" ]; then
      slim=()  # the lists split at their commas
      # shellcheck disable=SC2206
      [ -z "${MMHA_KERNELS:-}" ] || slim+=(--keep ${MMHA_KERNELS//,/ })
      # shellcheck disable=SC2206
      [ -z "${MMHA_HEAD_DIMS:-}" ] || slim+=(--head-dims ${MMHA_HEAD_DIMS//,/ })
      python bench/slim_tree.py "$dst" "${slim[@]}" >/dev/null || exit 1
    fi
    (cd "$dst" && MAX_JOBS=$jobs python setup.py build_ext --inplace >"$OUT/build_$label.log" 2>&1) || {
      grep -E "error" "$OUT/build_$label.log" | head -20
      exit 1
    }
    touch "$dst/.built"
  ) &
done
wait
labels=()
for t in "${trees[@]}"; do
  label=${t%%:*}
  [ -f "/tmp/ab_$label/.built" ] || { echo "build of $label failed"; exit 1; }
  labels+=("$label:$label")
done
[ -z "${AB_BUILD_ONLY:-}" ] || { echo "built: ${labels[*]}"; exit 0; }
for round in 1 2; do
  for t in "${trees[@]}"; do
    label=${t%%:*}
    (cd "/tmp/ab_$label" && PYTHONPATH="/tmp/ab_$label" python -m mmha.bench "$@" --out "$OUT/${label}_$round" \
      >"$OUT/${label}_$round.txt" 2>&1) || tail -n 5 "$OUT/${label}_$round.txt"
  done
done
caption="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), $(date +%F): ${TREES}; python -m mmha.bench $*"
python bench/ab_table.py "$OUT" "$caption" "${labels[@]}" | tee "$OUT/ab.md"
# The runs' own files in one archive (few files come back from a device call).
(cd "$OUT" && tar czf ab_runs.tgz ./*_[12] ./*_[12].txt && rm -rf ./*_[12] ./*_[12].txt)
