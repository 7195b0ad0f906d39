#!/usr/bin/env bash
# Benchmark a fixed set of fp16 rows (the canonical grid's hard ones) and print one table.
# Usage: bash bench/rows.sh OUTDIR [extra mmha.bench args]
set -uo pipefail
out=$1; shift
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
i=0
ROWS=${ROWS:-"16 8 2048 32768;64 8 1024 8192;16 32 512 8192;1 32 1024 65536;1 8 4096 65536;64 32 256 1024"}
IFS=";" read -ra specs <<<"$ROWS"
for spec in "${specs[@]}"; do
  set -- $spec "$@"
  b=$1 hkv=$2 s1=$3 s2=$4; shift 4
  python -m mmha.bench --batch "$b" --kv-heads "$hkv" --seq "$s1" "$s2" --dtype fp16 --out "$out/r$i" "$@" \
    2>>"$out/bench_stderr.log" | grep -E "^\| fp" | cut -d"|" -f3,5,7,9-13,16,19,20,22,23,25
  i=$((i + 1))
done
