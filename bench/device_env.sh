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
