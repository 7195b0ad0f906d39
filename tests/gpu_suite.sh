#!/usr/bin/env bash
# Everything a GPU machine checks, in one run: build, GPU + CPU tests, compute-sanitizer.
# Writes build.log, pytest.log, junit.xml, sanitizer logs and summary.txt under $OUT (default ./out).
# Exits non-zero when a test fails or a sanitizer reports anything (racecheck: any hazard, with
# --racecheck-report all, warnings included).
# Usage: bash tests/gpu_suite.sh [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1
summary="$OUT/summary.txt"
: >"$summary"
failed=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$summary"
python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$summary"

start=$(date +%s)
if ! python setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  grep -E "error|Error" "$OUT/build.log" | head -40
  echo "build: FAILED" | tee -a "$summary"
  exit 1
fi
echo "build: ok in $(($(date +%s) - start)) s" | tee -a "$summary"

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # A hung kernel must not eat the whole device call: every test gets TEST_TIMEOUT seconds.
  python -m pytest tests -q -rfEs -p no:cacheprovider --timeout "${TEST_TIMEOUT:-300}" \
    --junitxml="$OUT/junit.xml" "$@" 2>&1 | tee "$OUT/pytest.log" | tail -n 40
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
  echo "pytest: $(tail -n 1 "$OUT/pytest.log")" >>"$summary"
fi

if [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  for tool in memcheck racecheck initcheck; do
    env=()
    [ "$tool" = memcheck ] && env=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
    # initcheck runs unfiltered: torch's fill kernels must be instrumented for their writes to
    # count as initialisation (with a kernel filter it reports false positives).
    filter=(--kernel-name kns=decode_attention)
    [ "$tool" = initcheck ] && filter=()
    report=()
    [ "$tool" = racecheck ] && report=(--racecheck-report all)
    env "${env[@]}" PYTHONPATH="$PWD:$PWD/tests" timeout 600 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      "${filter[@]}" "${report[@]}" python tests/sanitize_cases.py >"$OUT/sanitizer_$tool.log" 2>&1
    rc=$?
    last=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -n 1)
    echo "sanitizer $tool: rc=$rc $last" | tee -a "$summary"
    if [ "$rc" -ne 0 ] || ! echo "$last" | grep -qE 'SUMMARY: 0 (errors|hazards)'; then
      failed=1
      grep -m 20 -E '(Error|Warning|Race reported).*|^=+ +(Read|Write|at ).*' "$OUT/sanitizer_$tool.log" | head -n 20
    fi
  done
  # The row norm's kernel, which the decode filter above leaves out (initcheck ran it unfiltered).
  for tool in memcheck racecheck; do
    report=()
    [ "$tool" = racecheck ] && report=(--racecheck-report all)
    PYTHONPATH="$PWD:$PWD/tests" timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      --kernel-name kns=row_norm "${report[@]}" python tests/sanitize_cases.py norms \
      >"$OUT/sanitizer_${tool}_norms.log" 2>&1
    rc=$?
    last=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_${tool}_norms.log" | tail -n 1)
    echo "sanitizer $tool (row norm): rc=$rc $last" | tee -a "$summary"
    if [ "$rc" -ne 0 ] || ! echo "$last" | grep -qE 'SUMMARY: 0 (errors|hazards)'; then
      failed=1
      grep -m 20 -E '(Error|Warning|Race reported).*' "$OUT/sanitizer_${tool}_norms.log" | head -n 20
    fi
  done
fi
echo "suite: $([ "$failed" -eq 0 ] && echo passed || echo FAILED)" | tee -a "$summary"
cat "$summary"
exit "$failed"
