#!/usr/bin/env bash
# One device call: a diagnostic copy of the working tree built with MMHA_TIMELINE=1 in
# /tmp/mmha_timeline (once per machine; the working tree's own build is left as it is), then
# `python -m mmha.bench.timeline` there on the given rows: where each launch's time goes, block by
# block. Writes timeline.txt and timeline.json under $OUT.
# With MMHA_KERNELS (setup.py) only those kernel sets are built (a shorter build than the whole
# one); a build of other sets is not reused.
# Usage: [MMHA_KERNELS=fp16] bash bench/timeline.sh 16,32,8,128,2048 1,32,8,128,4096 [--replays 20]
#          [--epilogue] [--paged 16] [--tree 1,1024,64] [--kv int8]  (--kv: rows and tree rows alike)
source "$(dirname "$0")/device_env.sh"
TL=/tmp/mmha_timeline
sets="kernel sets: ${MMHA_KERNELS:-all}"
if [ ! -f "$TL/.built" ] || [ "$(cat "$TL/.built")" != "$sets" ] ||
  [ -n "$(find csrc -newer "$TL/.built" -print -quit)" ]; then
  rm -rf "$TL" && mkdir -p "$TL" && cp -r csrc mmha setup.py pyproject.toml "$TL"/
  (cd "$TL" && MMHA_TIMELINE=1 python setup.py build_ext --inplace >"$OUT/build_timeline.log" 2>&1) || {
    grep -E "error" "$OUT/build_timeline.log" | head -20
    exit 1
  }
  echo "$sets" >"$TL/.built"
fi
(cd "$TL" && PYTHONPATH="$TL" python -m mmha.bench.timeline "$@" --json "$OUT/timeline.json") 2>&1 | tee "$OUT/timeline.txt"
