#!/usr/bin/env bash
# One device call: build, then Nsight Compute on the kernel for the given rows
# (B,Hq,Hkv,D,S[@SPLITSxSTAGES], see bench/profile_rows.py). Writes build.log and ncu.txt (one
# report per row: speed of light, memory, occupancy, warp stalls, shared memory) under $OUT.
# PEER=sdpa_cudnn profiles that peer on the same rows instead.
# Usage: bash bench/profile.sh 16,32,8,128,2048 16,32,32,128,8192@2x3
#        bash bench/profile.sh 16,32,8,128,2048 --mod alibi   (a score modifier, as --mods runs it)
#        bash bench/profile.sh --tree 1,1024,4                (a tree step of the tree benchmark's rows)
#        bash bench/profile.sh --kv int8 --tree 16,4096,4    (the same row over its int8 twin)
source "$(dirname "$0")/device_env.sh"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  build
fi
range=mmha
peer=()
if [ -n "${PEER:-}" ]; then
  range=peer
  peer=(--peer "$PEER")
fi
# One launch per row (--iters 1), caught by the NVTX range: set-up kernels are not profiled.
ncu --clock-control none --nvtx --nvtx-include "$range/" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
  --section WarpStateStats --section SchedulerStats \
  --metrics "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  python bench/profile_rows.py "$@" "${peer[@]}" --iters 1 >"$OUT/ncu${TAG:-}.txt" 2>&1
echo "ncu rc=$?"
grep -E "decode_attention_kernel|  [a-z_0-9]+<|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|bank_conflicts|inst_executed.sum|Block Limit|stalled_(long|barrier|mio|lg|math|short|wait|no_inst|dispatch|tex|drain|membar|branch|imc|not_sel|selected|sleeping)|dram__bytes" "$OUT/ncu${TAG:-}.txt" | head -150
