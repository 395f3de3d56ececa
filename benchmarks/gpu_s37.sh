#!/usr/bin/env bash
# One device call without llama.cpp (thirty-seventh session; carry [".peer", ".whl"]): A/B figures only, each against its
# own baseline in the same call. Phases in the order of PHASES ["grid gdn sweep"]:
#   grid   the full Q8_0 file (written to /dev/shm, kept): $GRID in one vs_llama run, [hybrid at 11.68 GiB (llama.cpp's
#          -ncmoe 29 VRAM on the thirty-sixth session's host) with the bridge's threading variants], GRID_S seconds [200]
#   gdn    the GDN prefill kernels' check (gpu_gdn_prep_check.sh without its 8-layer grid), at most 270 s
#   sweep  the CPU layer call on the host alone (cpu_layer_tuning.py --sweep 16: the team's wake-up after an idle gap,
#          OpenMP / pool / pool spinning; $SWEEP_TUNINGS [tail=4] against the default), at most 75 s
# Everything to $OUT.
set -uo pipefail
source benchmarks/device_env.sh
T0=$(date +%s)
lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core|NUMA node\(s\)"
for P in ${PHASES:-grid gdn sweep}; do
  echo "== $(date -u +%T) [+$(( $(date +%s) - T0 )) s] $P"
  case $P in
    grid) BUILD=0 LLAMA=0 KEEP_GGUF=1 QUANTS=q8_0 PLOT=0 DEADLINE_S=${GRID_S:-200} \
            GRID="${GRID:-hybrid@11.68;hybrid+pool@11.68;hybrid+hold+t15@11.68;hybrid+again@11.68}" \
            bash benchmarks/gpu_vs_llama.sh 2>&1 | grep -E "^==|tg bs1|ERROR|rror" | tail -30 ;;
    gdn) OUT=$OUT/gdn GDN_GRID=0 timeout 270 bash benchmarks/gpu_gdn_prep_check.sh 2>&1 | tail -60 ;;
    sweep) timeout 75 python3 benchmarks/cpu_layer_tuning.py --sweep 16 --experts 640 --tunings "${SWEEP_TUNINGS:-tail=4}" \
             --rounds 3 --json "$OUT/cpu_sweep.json" 2>&1 | grep -v -i warn ;;
  esac
done
echo "== done after $(( $(date +%s) - T0 )) s"
