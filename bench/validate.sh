#!/usr/bin/env bash
# One device call after a kernel or dispatcher change: each step into its own folder under $OUT,
# packed into $OUT/validate.tgz at the end (few files come back from a device call).
#   SUITE=1 (default)  build, every test, compute-sanitizer: tests/gpu_suite.sh -> suite/
#   BENCH=canonical    python -m mmha.bench --grid canonical (or quick, or none) -> bench/
#   BENCH_ARGS=...     extra arguments for it (e.g. "--peers sdpa_cudnn --no-secondary")
#   SWEEP=1            python -m mmha.bench.sweep --extras -> sweep/
#   STEP=1             python -m mmha.bench.step -> step/
# docs/benchmarks.md is then regenerated here: python bench/make_docs.py (see its docstring).
# Usage: bash bench/validate.sh
source "$(dirname "$0")/device_env.sh"
if [ "${SUITE:-1}" = 1 ]; then
  OUT="$OUT/suite" bash tests/gpu_suite.sh 2>&1 | tail -n 25
else
  build
fi
if [ "${BENCH:-canonical}" != none ]; then
  # shellcheck disable=SC2086
  timeout 1200 python -m mmha.bench --grid "${BENCH:-canonical}" ${BENCH_ARGS:-} --out "$OUT/bench" \
    2>"$OUT/bench_stderr.log" | tee "$OUT/bench.txt" | tail -n 60
fi
if [ "${SWEEP:-0}" = 1 ]; then
  timeout 1200 python -m mmha.bench.sweep --extras --out "$OUT/sweep" 2>"$OUT/sweep_stderr.log" | tail -n 30
fi
if [ "${STEP:-0}" = 1 ]; then
  timeout 900 python -m mmha.bench.step --out "$OUT/step" >"$OUT/step.txt" 2>&1
  echo "step bench rc=$?"; tail -n 12 "$OUT/step.txt"
fi
(cd "$OUT" && tar czf validate.tgz --exclude=validate.tgz . 2>/dev/null)
