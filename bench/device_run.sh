#!/usr/bin/env bash
# One device call: build, optional initcheck, then the benchmark; everything lands in $OUT.
# Usage: bash bench/device_run.sh [mmha.bench args]   (default: --grid canonical)
source "$(dirname "$0")/device_env.sh"
build
if [ "${INITCHECK:-0}" = 1 ]; then
  # No kernel filter: torch's own fill kernels must be instrumented for their writes to count.
  PYTHONPATH="$PWD:$PWD/tests" compute-sanitizer --tool initcheck --error-exitcode 9 \
    python tests/sanitize_cases.py >"$OUT/initcheck.log" 2>&1
  echo "initcheck rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/initcheck.log" | tail -n 1)"
  echo "initcheck errors in mmha kernels: $(grep -c 'decode_attention_kernel' "$OUT/initcheck.log")"
fi
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--grid canonical)
python -m mmha.bench "${args[@]}" --out "$OUT" 2>"$OUT/bench_stderr.log"
