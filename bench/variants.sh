#!/usr/bin/env bash
# One device call: time variants of the kernel, each built with its own experiment macros
# (-DMMHA_EXP_... switches that the experiment's commit adds to csrc/, defaulting to the current
# code), on a few rows (bench/quick_rows.py). Only the instantiation file OBJ is rebuilt per
# variant, and once more without flags at the end, so the tree is left with the default build.
# Lines go to stdout and $OUT/quick_rows.jsonl.
# Usage: VARIANTS="base:;nb3:-DMMHA_EXP_NB=3" ROWS="16,8,2048 1,32,1024" [PEER=--peer] \
#        [OBJ=decode_fp16_hd128] [NCU_ROW=B,Hq,Hkv,D,S] [QUICK_ARGS=--no-check] bash bench/variants.sh
# With NCU_ROW, each variant's kernel on that row also goes through Nsight Compute (DRAM, L2 and
# crossbar load, L2 hit rate), into $OUT/ncu_variants.txt.
source "$(dirname "$0")/device_env.sh"
build
ceiling=$(python -c "from mmha.bench import read_ceiling_gbs; print(read_ceiling_gbs()[0])")
echo "read ceiling ${ceiling} GB/s"
peer=${PEER:-}
IFS=";" read -ra variants <<<"$VARIANTS"
for v in "${variants[@]}"; do
  name=${v%%:*}
  flags=${v#*:}
  find build -name "${OBJ:-decode_fp16_hd128}.o" -delete
  if ! NVCC_APPEND_FLAGS="$flags" python setup.py build_ext --inplace >>"$OUT/build.log" 2>&1; then
    echo "$name: build failed"
    continue
  fi
  python bench/quick_rows.py $ROWS --tag "$name" --ceiling "$ceiling" --out "$OUT" $peer ${QUICK_ARGS:-}
  peer=""
  if [ -n "${NCU_ROW:-}" ]; then
    echo "== $name" >>"$OUT/ncu_variants.txt"
    ncu -k regex:decode_attention --launch-count 1 --metrics \
      gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,lts__lts2xbar_cycles_active_realtime.avg.pct_of_peak_sustained_elapsed,lts__ltcfabric2ltc_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__t_requests_srcunit_tex.sum,lts__t_sectors_srcunit_tex.sum \
      python bench/profile_rows.py "$NCU_ROW" --iters 0 --no-check 2>&1 | grep -E "^    [a-z]" | tee -a "$OUT/ncu_variants.txt"
  fi
done
# Leave the default build behind (ninja does not see NVCC_APPEND_FLAGS change).
find build -name "${OBJ:-decode_fp16_hd128}.o" -delete
build
