#!/usr/bin/env bash
# One device call: build, then Nsight Compute's warp sampling on the attention kernel of each row
# (bench/profile_rows.py's rows and flags), joined with the kernel's line table by
# bench/source_stalls.py: where its warps spend their samples, by CUDA source line. Per row under
# $OUT: stalls_<row>.txt (by innermost line, then by the line two calls from the kernel body); the
# inputs to redo it anywhere (source_<row>.csv.gz, the source page; kernel_<row>.sass.gz, the
# kernel's listing with its line table) and ncu's logs in one archive, $OUT/stalls_inputs.tgz (a
# device call brings back few files).
# Cold by default (ncu flushes the caches before the launch); WARM=1 profiles the third of four
# launches without flushing. SKIP_BUILD=1 reuses the build in place.
# Usage: MMHA_KERNELS=fp16 bash bench/source_stalls.sh --tree 16,1024,64 1,1024,64
#        bash bench/source_stalls.sh 16,32,8,128,2048
source "$(dirname "$0")/device_env.sh"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  build
fi
flags=() rows=()
for a in "$@"; do  # rows are comma-separated numbers (with an @SPLITSxSTAGES plan); the rest flags
  if [[ "$a" =~ ^[0-9]+(,[0-9]+)+(@[0-9]+x[0-9]+)?$ ]]; then rows+=("$a"); else flags+=("$a"); fi
done
[ ${#rows[@]} -gt 0 ] || { echo "source_stalls.sh: give at least one row"; exit 2; }
so=$(ls mmha/_C*.so 2>/dev/null | head -n 1)
[ -n "$so" ] || { echo "source_stalls.sh: no built extension under mmha/"; exit 1; }
# The profiled kernel's mangled name: the first value under a "Kernel Name" header of ncu's CSV.
kernel_name='
import csv, sys
rows = list(csv.reader(sys.stdin))
head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
col = rows[head].index("Kernel Name") if head is not None else 0
print(next((r[col] for r in rows[head + 1:] if len(r) > col and r[col].startswith("_Z")), "") if head is not None else "")
'
cubins=$(mktemp -d)
(cd "$cubins" && cuobjdump -xelf all "$OLDPWD/$so" >/dev/null)
if [ "${WARM:-0}" = 1 ]; then
  when=(--cache-control none --launch-skip 2 --launch-count 1) iters=4 caches=warm
else
  when=(--launch-count 1) iters=1 caches=cold
fi
for row in "${rows[@]}"; do
  tag=${row//[^0-9A-Za-z]/_}
  rep=$OUT/stalls_$tag
  ncu --clock-control none --nvtx --nvtx-include mmha/ --kernel-name regex:decode_attention_kernel "${when[@]}" \
    --section SourceCounters --section WarpStateStats --warp-sampling-interval 0 -f -o "$rep" \
    python bench/profile_rows.py "${flags[@]}" "$row" --iters "$iters" >"$OUT/ncu_$tag.log" 2>&1 || {
    tail -n 20 "$OUT/ncu_$tag.log"
    continue
  }
  ncu --import "$rep.ncu-rep" --page source --csv --print-source sass >"$OUT/source_$tag.csv"
  name=$(ncu --import "$rep.ncu-rep" --page details --csv --print-kernel-base mangled | python -c "$kernel_name")
  cubin=$([ -n "$name" ] && grep -l -F "$name" "$cubins"/*.cubin | head -n 1)
  if [ -z "$cubin" ]; then
    echo "source_stalls.sh: $row: no cubin holds $name"
    continue
  fi
  # The kernel's own section of the cubin's listing (from its ".text.NAME:" label to the next one).
  nvdisasm --print-line-info-inline -c "$cubin" |
    awk -v n=".text.$name:" '$0 == n { on = 1; print; next } on && /^\.text\..*:$/ { exit } on' >"$OUT/kernel_$tag.sass"
  {
    echo "$row: $name ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), $(date +%F), $caches)"
    python bench/source_stalls.py "$OUT/source_$tag.csv" "$OUT/kernel_$tag.sass" --function "$name" --top 40
    echo
    python bench/source_stalls.py "$OUT/source_$tag.csv" "$OUT/kernel_$tag.sass" --function "$name" --top 25 --depth 2
  } >"$OUT/stalls_$tag.txt" 2>&1
  cat "$OUT/stalls_$tag.txt"
  gzip -f "$OUT/source_$tag.csv" "$OUT/kernel_$tag.sass"
  rm -f "$rep.ncu-rep"
done
rm -rf "$cubins"
inputs=$(cd "$OUT" && ls source_*.csv.gz kernel_*.sass.gz ncu_*.log 2>/dev/null)
if [ -n "$inputs" ]; then
  # shellcheck disable=SC2086
  (cd "$OUT" && tar czf stalls_inputs.tgz $inputs && rm -f $inputs)
fi
