#!/usr/bin/env bash
# Nsight Compute on the one-row compressed dense GEMVs (benchmarks/gemv_probe.py), each kernel's steady launch:
# speed of light, occupancy, warp stalls, memory workload -> $OUT/gemv_ncu.log (or stdout). Device call, any CUDA kind.
set -uo pipefail
source benchmarks/device_env.sh
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
LOG=${OUT:-/tmp}/gemv_ncu.log
{
  echo "== ncu: ${NCU:-none}"; [ -n "$NCU" ] && "$NCU" --version | tail -1
  for W in ${WHICH:-q4k repack cublas q6k head}; do
    timeout 60 python3 benchmarks/gemv_probe.py --which "$W"
    [ -n "$NCU" ] || continue
    echo "== ncu $W"
    timeout ${NCU_S:-90} "$NCU" --launch-skip 3 --launch-count 1 -k "regex:_gguf|_q4kr|gemv|nvjet|gemm" \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis python3 benchmarks/gemv_probe.py --which "$W" 2>&1 \
      | grep -vE "^==PROF==|^\s*$|----" | grep -E "Duration|Throughput|Busy|Occupancy|Registers|Block Size|Grid Size|Waves|Stall|stall|Warp Cycles|Issued|Eligible|Active Warps|L1|L2|DRAM|Mem|Bank|Shared|Local|spill|Theoretical|Achieved|Limit|Function|_kernel|gemv|OPT|WRN" | head -80
  done
} > "$LOG" 2>&1
cat "$LOG"
