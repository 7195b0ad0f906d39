#!/usr/bin/env bash
# One device call: build, then Nsight Compute on the kernel for the given rows (B,Hq,Hkv,D,S).
# Writes build.log and ncu.txt (one report per row: speed of light, memory, occupancy, warp
# stalls, shared-memory wavefronts) under $OUT.
# Usage: bash bench/profile.sh 16,32,8,128,32768 16,32,32,128,8192
source "$(dirname "$0")/device_env.sh"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  build
fi
python bench/profile_rows.py "$@" --iters 1
KERNELS=${KERNELS:-regex:decode_attention}
COUNT=${COUNT:-$#}
# One launch per row: each row's launches come in order, the first is the checked one.
ncu --kernel-name "$KERNELS" --launch-skip 0 --launch-count "$COUNT" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
  --section WarpStateStats --section SchedulerStats \
  --metrics "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed.sum,dram__bytes_read.sum,breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_requests_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  python bench/profile_rows.py "$@" --iters 0 >"$OUT/ncu${TAG:-}.txt" 2>&1
echo "ncu rc=$?"
grep -E "decode_attention_kernel|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|wavefronts_mem_shared|bank_conflicts|inst_executed.sum|Stall|Block Limit|stalled_(long|barrier|mio|lg|math|short|wait|no_inst|dispatch|tex|drain|membar|branch|imc|not_sel|selected)|dram__bytes" "$OUT/ncu${TAG:-}.txt" | head -120
