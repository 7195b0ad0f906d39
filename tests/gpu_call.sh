#!/usr/bin/env bash
# The whole GPU check in one device call of a bounded length: build once in a /tmp copy of the
# tree (skipped when that copy's build is there already), then compute-sanitizer on
# tests/sanitize_cases.py beside a parallel pytest (`-n WORKERS -v`, so a run cut off still names
# each test's result), each stopped at its own deadline; the logs and a summary land in
# $OUT/gpu_call.tgz whatever happens, and the summary is printed.
# Usage: [WORKERS=12] [TEST_BUDGET=400] [SAN_BUDGET=300] [CASES=int8] bash tests/gpu_call.sh [pytest args]
# (default pytest args: tests -k "not cpu": the CPU-only tests, which CI runs, are the slowest under
# 12 workers). TESTS=0 / SAN=0 skip a part.
set -uo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$src/out}
work=${WORK:-/tmp/mmha_call}
logs=/tmp/mmha_call_logs
mkdir -p "$OUT" "$logs"
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1
summary=$logs/summary.txt
: >"$summary"
pack() { tar czf "$OUT/gpu_call.tgz" -C "$logs" . 2>/dev/null; cat "$summary"; }
trap pack EXIT

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$summary" 2>&1
start=$(date +%s)
if [ ! -f "$work/.built" ]; then
  rm -rf "$work" && mkdir -p "$work" && cp -r "$src"/. "$work"/ && rm -rf "$work"/build "$work"/out
  if ! (cd "$work" && python setup.py build_ext --inplace >"$logs/build.log" 2>&1); then
    grep -E "error" "$logs/build.log" | head -20 | tee -a "$summary"
    echo "build: FAILED" >>"$summary"
    exit 1
  fi
  touch "$work/.built"
  echo "build: ok in $(($(date +%s) - start)) s" >>"$summary"
else
  echo "build: reused $work" >>"$summary"
fi
cd "$work" || exit 1

san_pid=
san_start=$(date +%s)
if [ "${SAN:-1}" != 0 ]; then
  # Under a new SID (setsid), so its deadline stops compute-sanitizer and the python under it.
  setsid bash -c "OUT=$logs/san SKIP_BUILD=1 SKIP_TESTS=1 CASES='${CASES:-}' bash tests/gpu_suite.sh \
    >$logs/sanitizers.txt 2>&1" &
  san_pid=$!
fi
rc=0
if [ "${TESTS:-1}" != 0 ]; then
  args=("$@")
  [ ${#args[@]} -gt 0 ] || args=(tests -k "not cpu")
  timeout -s INT "${TEST_BUDGET:-400}" python -m pytest "${args[@]}" -n "${WORKERS:-12}" -v -p no:cacheprovider \
    --timeout "${TEST_TIMEOUT:-300}" -rfE >"$logs/pytest.log" 2>&1
  rc=$?
  {
    echo "pytest: rc=$rc after $(($(date +%s) - start)) s (124/130: cut off at TEST_BUDGET)"
    echo "pytest: $(grep -c ' PASSED ' "$logs/pytest.log") passed, $(grep -c ' SKIPPED ' "$logs/pytest.log") skipped"
    grep -E '^(FAILED|ERROR) ' "$logs/pytest.log" | head -40
    tail -n 1 "$logs/pytest.log"
  } >>"$summary"
fi
if [ -n "$san_pid" ]; then
  deadline=$((san_start + ${SAN_BUDGET:-300}))
  while kill -0 "$san_pid" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 2; done
  if kill -0 "$san_pid" 2>/dev/null; then
    # Every process of that SID: `timeout` gives compute-sanitizer a process group of its own.
    pkill -KILL -s "$san_pid" 2>/dev/null || kill -- -"$san_pid" 2>/dev/null
    echo "sanitizers: cut off" >>"$summary"
  fi
  grep -E '^sanitizer|^suite' "$logs/san/summary.txt" >>"$summary" 2>/dev/null
fi
exit "$rc"
