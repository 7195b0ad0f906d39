#!/usr/bin/env bash
# One device call: per-block timelines of the decode kernel (bench/trace_blocks.py) on a few rows.
# Rebuilds the instantiation file OBJ with -DMMHA_EXP_TRACE, traces, then rebuilds it without,
# so the tree is left with the default build. Output to stdout and $OUT/trace_blocks.jsonl.
# Usage: ROWS="1,8,4096@16 16,8,2048" [OBJ=decode_fp16_hd128] [RUNS=15] [TRACE_ARGS=--dump] bash bench/trace.sh
source "$(dirname "$0")/device_env.sh"
build
obj=${OBJ:-decode_fp16_hd128}
find build -name "$obj.o" -delete
NVCC_APPEND_FLAGS="-DMMHA_EXP_TRACE" python setup.py build_ext --inplace >>"$OUT/build.log" 2>&1 || {
  grep -E "error" "$OUT/build.log" | head -30
  exit 1
}
python bench/trace_blocks.py $ROWS --runs "${RUNS:-15}" --out "$OUT" ${TRACE_ARGS:-}
find build -name "$obj.o" -delete
build
