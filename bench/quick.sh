#!/usr/bin/env bash
# One device call: build, run a pytest selection, then time rows with bench/quick_rows.py (rows
# may force splits and warps: 16,8,2048@1x16). Output to stdout and $OUT/quick_rows.jsonl.
# Usage: [TESTS="tests/test_ops_gpu.py -k warps"] ROWS="..." [PEER_ROWS="..."] bash bench/quick.sh
source "$(dirname "$0")/device_env.sh"
build
if [ -n "${TESTS:-}" ]; then
  python -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tail -n 8
fi
ceiling=$(python -c "from mmha.bench import read_ceiling_gbs; print(read_ceiling_gbs()[0])")
echo "read ceiling ${ceiling} GB/s"
if [ -n "${PEER_ROWS:-}" ]; then
  python bench/quick_rows.py $PEER_ROWS --tag peer --ceiling "$ceiling" --out "$OUT" --peer
fi
python bench/quick_rows.py $ROWS --tag rows --ceiling "$ceiling" --out "$OUT" ${QUICK_ARGS:-}
