#!/usr/bin/env bash
# One device call without llama.cpp (thirty-seventh session; carry [".peer", ".whl"]): A/B figures only, each against its
# own baseline in the same call. Phases in the order of PHASES ["grid gdn sweep"]:
#   grid   the full Q8_0 file (written to /dev/shm, kept): $GRID in one vs_llama run, [hybrid at 11.68 GiB (llama.cpp's
#          -ncmoe 29 VRAM on the thirty-sixth session's host) with the bridge's threading variants], GRID_S seconds [200]
#   gdn    the GDN prefill kernels' check (gpu_gdn_prep_check.sh without its 8-layer grid), at most 270 s
#   build  starts llama.cpp's build (gpu_vs_llama.sh __build, LLAMA_PACK=1) in its own session and goes on: it outlives
#          the call, so a gpu_vs_llama.sh call right after it on the same warm machine finds it built or still building
#          (last: the build's cores 2-15 would skew CPU figures taken beside it); its pack lands in /tmp/vs_work/pack
#   wake   benchmarks/omp_team_wake.py with one thread a core (the bridge team's wake-up, main thread's team alive / freed)
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
    build) mkdir -p /tmp/llama /tmp/vs_work/pack; touch /tmp/llama/BUILDING
           OUT=/tmp/vs_work/pack LLAMA_PACK=1 setsid nohup bash benchmarks/gpu_vs_llama.sh __build > /tmp/vs_work/build.log \
             2>&1 < /dev/null &
           echo "llama.cpp building in the background (log /tmp/vs_work/build.log)" ;;
    wake) timeout 40 python3 benchmarks/omp_team_wake.py --threads "$(nproc)" --calls 200 --out "$OUT/omp_wake.json" 2>&1 \
            | grep -v -i warn ;;
    sweep) timeout 75 python3 benchmarks/cpu_layer_tuning.py --sweep 16 --experts 640 --tunings "${SWEEP_TUNINGS:-tail=4}" \
             --rounds 3 --json "$OUT/cpu_sweep.json" 2>&1 | grep -v -i warn ;;
  esac
done
echo "== done after $(( $(date +%s) - T0 )) s"
