#!/usr/bin/env bash
# What bounds the 4-bit matmul at one 27B shape: Nsight Compute's throughputs and warp stall
# reasons for one launch per row count (needs ncu on the GPU machine and counter access).
#   bash benchmarks/ncu_qmm.sh [N K] [extra qmm_one.py flags]
set -u
N=${1:-12288}
K=${2:-5120}
shift 2 2>/dev/null
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu here"; exit 0; }
METRICS="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed"
METRICS+=",lts__t_sectors.avg.pct_of_peak_sustained_elapsed,l1tex__t_sectors.avg.pct_of_peak_sustained_elapsed"
METRICS+=",sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
METRICS+=",smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active"
METRICS+=",smsp__inst_executed.sum,launch__registers_per_thread,launch__grid_size"
METRICS+=",regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio"
for M in ${MS:-1 16 31}; do
  echo "== M=$M $*"
  "$NCU" -k regex:_mma_kernel -s 2 -c 1 --cache-control all --metrics "$METRICS" \
    python benchmarks/qmm_one.py --n "$N" --k "$K" --m "$M" "$@" 2>&1 |
    grep -E "duration|throughput|pct|inst_executed|registers|grid_size|stalled" |
    awk '{v=$NF; n=$1; if ($0 ~ /stalled/ && v+0 < 0.05) next; print n, v}'
done
