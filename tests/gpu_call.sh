#!/usr/bin/env bash
# The whole GPU check in one device call of a bounded length: the tree copied to /tmp and built
# there (the build skipped when csrc/ and setup.py are those of the last build on this machine:
# a later call re-runs tests, changed or not, without rebuilding), then compute-sanitizer on
# tests/sanitize_cases.py beside a parallel pytest (`-n WORKERS -v`, so a run cut off still names
# each test's result), both stopped CALL_BUDGET seconds after the script began (the build's time
# included); the logs and a summary land in $OUT/gpu_call.tgz whatever happens, and the summary
# is printed.
# Usage: [WORKERS=12] [CALL_BUDGET=560] [CASES=int8] [MMHA_KERNELS=fp16,fp16_s8] \
#          bash tests/gpu_call.sh [pytest args]
#        bash tests/gpu_call.sh --stamp   (prints the build's stamp of these sources)
# MMHA_KERNELS (setup.py): a build of those kernel sets only (about 80 s for three on an H200,
# against 100-130 s for all); tests and sanitizer cases that need other sets fail with "operation
# not supported", so pick them to match (pytest -k, CASES).
# (default pytest args: tests -k "not cpu": the CPU-only tests, which CI runs, are the slowest under
# 12 workers; with TIER=kernels the end-to-end files of tests/end_to_end.txt are left out too: the
# kernel tests for a change inside csrc/kernels, about half the suite's device time, the HF and
# distributed files the other half). TESTS=0 / SAN=0 skip a part. Tests a call's deadline cut off
# are listed in the logs (unrun.txt, by tests/unreached.py); REST=1 runs exactly those on the same
# machine (the build and the logs stay while it is held).
set -uo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
# The sources a build depends on and the kernel sets it holds (MMHA_KERNELS), as one digest.
stamp=$(cd "$src" && { find csrc setup.py -type f -not -path '*/__pycache__/*' | sort | xargs cat
  echo "MMHA_KERNELS=${MMHA_KERNELS:-}"; } | md5sum | cut -c1-32)
if [ "${1:-}" = --stamp ]; then
  echo "$stamp"
  exit 0
fi
case "${TIER:-all}" in all | kernels) ;; *) echo "TIER must be all or kernels, got ${TIER}" >&2; exit 2 ;; esac
OUT=${OUT:-$src/out}
work=${WORK:-/tmp/mmha_call}
logs=${work}_logs  # beside the work tree: a stand-in run (tests/test_gpu_call.py) keeps its own
mkdir -p "$OUT" "$logs"
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1
summary=$logs/summary.txt
: >"$summary"
pack() { tar czf "$OUT/gpu_call.tgz" -C "$logs" . 2>/dev/null; cat "$summary"; }
trap pack EXIT

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$summary" 2>&1
start=$(date +%s)
mkdir -p "$work" && cp -r "$src"/. "$work"/ && rm -rf "$work"/out  # sources anew; the build stays
if [ "$(cat "$work/.built" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$work"/build
  if ! (cd "$work" && python setup.py build_ext --inplace >"$logs/build.log" 2>&1); then
    grep -E "error" "$logs/build.log" | head -20 | tee -a "$summary"
    echo "build: FAILED" >>"$summary"
    exit 1
  fi
  echo "$stamp" >"$work/.built"
  echo "build: ok in $(($(date +%s) - start)) s (kernel sets: ${MMHA_KERNELS:-all})" >>"$summary"
else
  echo "build: reused $work (csrc/, setup.py and the kernel sets unchanged: ${MMHA_KERNELS:-all})" >>"$summary"
fi
cd "$work" || exit 1

san_pid=
deadline=$((start + ${CALL_BUDGET:-560}))
if [ "${SAN:-1}" != 0 ]; then
  # Under a new SID (setsid), so its deadline stops compute-sanitizer and the python under it.
  setsid bash -c "OUT=$logs/san SKIP_BUILD=1 SKIP_TESTS=1 CASES='${CASES:-}' bash tests/gpu_suite.sh \
    >$logs/sanitizers.txt 2>&1" &
  san_pid=$!
fi
rc=0
left=$((deadline - 15 - $(date +%s)))
if [ "${TESTS:-1}" != 0 ] && [ "$left" -lt 30 ]; then
  echo "pytest: not run (${left} s left of CALL_BUDGET after the build)" >>"$summary"
  rc=1
elif [ "${TESTS:-1}" != 0 ]; then
  args=("$@")
  [ ${#args[@]} -gt 0 ] || args=(tests -k "not cpu")
  if [ "${TIER:-all}" = kernels ]; then
    while read -r f; do [ -z "$f" ] || args+=("--ignore=$f"); done < <(grep -v '^#' tests/end_to_end.txt)
  fi
  if [ "${REST:-0}" != 0 ]; then  # the tests the last call's deadline cut off
    mapfile -t args <"$logs/unrun.txt" 2>/dev/null || args=()
    echo "pytest: REST=1, ${#args[@]} tests left by the last call" >>"$summary"
  fi
  if [ ${#args[@]} -eq 0 ]; then
    echo "pytest: nothing to run" >>"$summary"
  else
    # The run's tests, listed beside it: those without an outcome when it ends go to unrun.txt.
    timeout "$left" python -m pytest "${args[@]}" --collect-only -q -p no:cacheprovider >"$logs/collected.txt" 2>&1 &
    collect_pid=$!
    # pytest-xdist's workers and pytest-timeout's per-test limit where those plugins are installed
    # (the GPU machines have both; without them the run is serial and unlimited per test).
    workers=(-n "${WORKERS:-12}")
    { [ "${WORKERS:-12}" != 0 ] && python -c "import xdist" 2>/dev/null; } || workers=()
    limit=(--timeout "${TEST_TIMEOUT:-300}")
    python -c "import pytest_timeout" 2>/dev/null || limit=()
    timeout -s INT "$left" python -m pytest "${args[@]}" "${workers[@]}" -v -p no:cacheprovider \
      "${limit[@]}" -rfE --durations=40 >"$logs/pytest.log" 2>&1
    rc=$?
    wait "$collect_pid"
    python tests/unreached.py "$logs/collected.txt" "$logs/pytest.log" >"$logs/unrun.txt" 2>"$logs/unrun_count.txt"
    {
      echo "pytest: rc=$rc after $(($(date +%s) - start)) s (124: cut off at CALL_BUDGET)"
      echo "pytest: $(grep -c ' PASSED ' "$logs/pytest.log") passed, $(grep -c ' SKIPPED ' "$logs/pytest.log") skipped"
      echo "pytest: $(cat "$logs/unrun_count.txt") (REST=1 runs them)"
      grep -E '^(FAILED|ERROR) ' "$logs/pytest.log" | head -40
      # The slowest tests (pytest --durations; printed when the run ends, not when it is cut off).
      sed -n '/slowest 40 durations/,/^$/p' "$logs/pytest.log" | sed -n 2,11p
      tail -n 1 "$logs/pytest.log"
    } >>"$summary"
  fi
fi
if [ -n "$san_pid" ]; then
  while kill -0 "$san_pid" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 2; done
  if kill -0 "$san_pid" 2>/dev/null; then
    # Every process of that SID: `timeout` gives compute-sanitizer a process group of its own.
    pkill -KILL -s "$san_pid" 2>/dev/null || kill -- -"$san_pid" 2>/dev/null
    echo "sanitizers: cut off" >>"$summary"
  fi
  grep -E '^sanitizer|^suite' "$logs/san/summary.txt" >>"$summary" 2>/dev/null
fi
exit "$rc"
