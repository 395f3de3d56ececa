#!/usr/bin/env bash
# One device call without llama.cpp (thirty-seventh session; carry [".peer", ".whl"]): A/B figures only, each against its
# own baseline in the same call. 1. the CPU layer call on the host alone (cpu_layer_tuning.py --sweep 16: the team's
# wake-up after an idle gap, OpenMP / pool / pool spinning; tail=4 against the default); 2. the GDN prefill kernels'
# check (gpu_gdn_prep_check.sh without its 8-layer grid); 3. the full Q8_0 file: fused with and without both GDN
# kernels, hybrid at 11.68 GiB (llama.cpp's -ncmoe 29 VRAM on the thirty-sixth session's host) with the bridge's
# threading variants. Everything to $OUT.
set -uo pipefail
source benchmarks/device_env.sh
T0=$(date +%s)
lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core|NUMA node\(s\)"
echo "== $(date -u +%T) CPU layer call sweep"
timeout 75 python3 benchmarks/cpu_layer_tuning.py --sweep 16 --experts 640 --tunings "${SWEEP_TUNINGS:-tail=4}" --rounds 3 \
  --json "$OUT/cpu_sweep.json" 2>&1 | grep -v -i warn
echo "== $(date -u +%T) GDN check"
OUT=$OUT/gdn GDN_GRID=0 timeout 270 bash benchmarks/gpu_gdn_prep_check.sh 2>&1 | tail -60
echo "== $(date -u +%T) full file grid"
BUILD=0 LLAMA=0 KEEP_GGUF=1 QUANTS=q8_0 PLOT=0 DEADLINE_S=$(( ${END_S:-585} - ($(date +%s) - T0) - 20 )) \
  GRID="${GRID:-fused@all;fused+gdnprep+gdnfront@all;hybrid@11.68;hybrid+hold+t15@11.68;hybrid+pool@11.68;hybrid+again@11.68}" \
  bash benchmarks/gpu_vs_llama.sh 2>&1 | grep -E "^==|tg bs1|ERROR|rror" | tail -30
echo "== done after $(( $(date +%s) - T0 )) s"
