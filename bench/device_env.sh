# Sourced by the bench/*.sh device scripts: repository root, $OUT, build settings, build().
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Build the extension in place (log in $OUT/build.log); on failure show the errors and exit.
build() {
  python setup.py build_ext --inplace >>"$OUT/build.log" 2>&1 || {
    grep -E "error" "$OUT/build.log" | head -30
    exit 1
  }
}

# Parse `python -m mmha.bench "$@"`'s arguments alone (mmha/bench/args.py; no GPU, no build), so a
# bad one stops the script before its builds take device time.
check_bench_args() {
  MMHA_BENCH_CHECK_ARGS=1 python -m mmha.bench "$@" >/dev/null || {
    echo "python -m mmha.bench $*: the arguments do not parse (above); nothing built"
    exit 2
  }
}
