#!/usr/bin/env bash
# Everything a GPU machine checks, in one run: build, GPU + CPU tests, compute-sanitizer.
# Writes build.log, pytest.log, junit.xml, sanitizer logs and summary.txt under $OUT (default ./out).
# Exits non-zero when a test fails or a sanitizer reports anything (racecheck: any hazard, with
# --racecheck-report all, warnings included).
# Usage: bash tests/gpu_suite.sh [extra pytest args]
# TESTS: the test paths (default: tests), e.g. TESTS="tests/test_int8_gpu.py tests/test_fp8_gpu.py";
# CASES: one case set of tests/sanitize_cases.py for the sanitizers (e.g. int8, qk_norm; default:
# all of them, and the row norm's pass); SKIP_BUILD=1 uses the extension already built in place (so
# a sanitizer run and a parallel pytest, `-n 8`, can share one build); SKIP_TESTS / SKIP_SANITIZER.
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
if [ "${SKIP_BUILD:-0}" = 1 ]; then
  echo "build: skipped (SKIP_BUILD=1)" | tee -a "$summary"
elif ! python setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  grep -E "error|Error" "$OUT/build.log" | head -40
  echo "build: FAILED" | tee -a "$summary"
  exit 1
else
  echo "build: ok in $(($(date +%s) - start)) s" | tee -a "$summary"
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # A hung kernel must not eat the whole device call: every test gets TEST_TIMEOUT seconds.
  # shellcheck disable=SC2086
  python -m pytest ${TESTS:-tests} -q -rfEs -p no:cacheprovider --timeout "${TEST_TIMEOUT:-300}" \
    --junitxml="$OUT/junit.xml" "$@" 2>&1 | tee "$OUT/pytest.log" | tail -n 40
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
  echo "pytest: $(tail -n 1 "$OUT/pytest.log")" >>"$summary"
fi

# sanitize LABEL LOG TOOL ARGS...: compute-sanitizer --tool TOOL ARGS (then the python command)
# into $OUT/LOG; its summary line goes to $summary under LABEL, and any report fails the suite.
sanitize() {
  local label=$1 log=$2 tool=$3
  shift 3
  local report=()
  [ "$tool" = racecheck ] && report=(--racecheck-report all)
  PYTHONPATH="$PWD:$PWD/tests" timeout 600 compute-sanitizer --tool "$tool" --error-exitcode 9 "${report[@]}" \
    "$@" >"$OUT/$log" 2>&1
  local rc=$?
  local last
  last=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$log" | tail -n 1)
  echo "$label: rc=$rc $last" | tee -a "$summary"
  if [ "$rc" -ne 0 ] || ! echo "$last" | grep -qE 'SUMMARY: 0 (errors|hazards)'; then
    failed=1
    grep -m 20 -E '(Error|Warning|Race reported).*|^=+ +(Read|Write|at ).*' "$OUT/$log" | head -n 20
  fi
}

if [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  # memcheck without torch's caching allocator; initcheck unfiltered: torch's fill kernels must be
  # instrumented for their writes to count as initialisation (with a kernel filter it reports
  # false positives).
  read -r -a cases <<<"${CASES:-}"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 sanitize "sanitizer memcheck" sanitizer_memcheck.log memcheck \
    --kernel-name kns=decode_attention python tests/sanitize_cases.py ${cases[@]+"${cases[@]}"}
  sanitize "sanitizer racecheck" sanitizer_racecheck.log racecheck --kernel-name kns=decode_attention \
    python tests/sanitize_cases.py ${cases[@]+"${cases[@]}"}
  sanitize "sanitizer initcheck" sanitizer_initcheck.log initcheck python tests/sanitize_cases.py ${cases[@]+"${cases[@]}"}
  # The row norm's kernel, which the decode filter above leaves out (initcheck ran it unfiltered).
  if [ -z "${CASES:-}" ]; then
    for tool in memcheck racecheck; do
      sanitize "sanitizer $tool (row norm)" "sanitizer_${tool}_norms.log" "$tool" --kernel-name kns=row_norm \
        python tests/sanitize_cases.py norms
    done
  fi
fi
echo "suite: $([ "$failed" -eq 0 ] && echo passed || echo FAILED)" | tee -a "$summary"
cat "$summary"
exit "$failed"
