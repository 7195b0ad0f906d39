#!/usr/bin/env bash
# One device call after a kernel or dispatcher change: the GPU suite (tests + compute-sanitizer),
# then the canonical benchmark, the split sweep, the whole-step benchmark and the agreement
# script, each into its own folder under $OUT (suite/, bench/, sweep/, step/, agreement.txt),
# packed into $OUT/validate.tgz at the end.
# docs/benchmarks.md is then regenerated here with bench/make_docs.py from those folders.
# Usage: bash bench/validate.sh   (SKIP_SUITE=1 to run only the measurements)
source "$(dirname "$0")/device_env.sh"
if [ "${SKIP_SUITE:-0}" != 1 ]; then
  OUT="$OUT/suite" bash tests/gpu_suite.sh 2>&1 | tail -n 15
else
  build
fi
python -m mmha.bench --grid canonical --out "$OUT/bench" 2>"$OUT/bench_stderr.log" | tail -n 3
python bench/split_sweep.py --extras --out "$OUT/sweep" >/dev/null 2>"$OUT/sweep_stderr.log"
echo "split sweep rc=$?"
python -m mmha.step_bench --out "$OUT/step" >"$OUT/step.txt" 2>&1
echo "step bench rc=$?"
python tests/agreement.py >"$OUT/agreement.txt" 2>&1
echo "agreement rc=$?"; tail -n 12 "$OUT/agreement.txt"
# Few files come back from the device: everything in one archive.
(cd "$OUT" && tar czf validate.tgz suite bench sweep step ./*.txt ./*.log && rm -rf suite bench sweep step)
