#!/usr/bin/env bash
# One device call that measures what a session needs, in an order that keeps the same-run comparison first
# (kind nvidia-h100-x1 or nvidia-h200; carry [".peer", ".whl"] with .peer/llama-bin.tar.xz, made by an earlier call
# with gpu_vs_llama.sh's LLAMA_PACK=1 — else llama.cpp is built in the call, 300-370 s of it):
#   1. lscpu and `moestream bench bw` (the host's read bandwidth, pinned PCIe, both at once) while nothing else runs
#   2. benchmarks/gpu_vs_llama.sh: llama.cpp at -ncmoe $NCMOE, then moestream over $GRID, on the Q4_K_M file
#   3. with the time left: step profiles ($DPROF), the compressed dense GEMV sweep ($QLIN_SHAPES), CUDA tests ($TESTS_K)
# $OUT gets at most 8 files (what the device tool returns): vs_llama.{log,json,md,png}, aux.log (lscpu, bench bw, the
# profiles' and the sweep's logs, the tests' summary), qlinear.json and up to two decode_profile_*.json. The vs_llama
# report of the second grid merges the first's (the work dir is resumed), its log is both runs' logs.
#   BUDGET_S  seconds for the whole call [560]; TAIL_S  seconds kept for step 3 [170]
#   QUANTS  the GGUF file(s) written and run [q4_k_m]; GRID, GRID2, NCMOE  as gpu_vs_llama.sh [see below]; DPROF  step_profile configurations BACKEND@GIB[@FLAGS] (at most two)
#   QLIN_SHAPES  qlinear_gpu.py --shapes ["" = skip]; TESTS_K  pytest -k over the CUDA-only test files ["" = skip]
#   SWEEP  thread counts of the host's CPU layer call sweep in step 1 (-> cpu_layer_sweep.json) ["" = skip];
#   (SWEEP_TUNINGS: ';'-separated MOESTREAM_CPU_LAYER_TUNING settings timed after it); DPROF_ENV  VAR=VALUE pairs
#   the step profiles run under; QLIN_PRE  qlinear_gpu.py arguments run in step 1 (QLIN_PRE_S [150]); TESTS_PRE  pytest
#   arguments run in step 1 (TESTS_PRE_S [120]); PRE_CMD  a command run in step 1 (PRE_S [120]); BW_FORMAT  bench bw's
#   --expert-format [q4_k]; BW=0 skips bench bw
# e.g. (the twenty-third session's call):  bash benchmarks/gpu_session.sh
set -uo pipefail
source benchmarks/device_env.sh
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-560}; TAIL_S=${TAIL_S:-170}
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
# GRID runs in one shared process (configurations that need a load of their own, fused and variants with their own
# environment, would run before it: they go in GRID2, run after GRID with what time is left before the tail)
GRID=${GRID:-"cpu@n36;cpu+noflow@n36;cpu+again@n36;cpu+noflow+again@n36;hybrid@n28;auto@n20,n28;offload@n20"}
GRID2=${GRID2-"cpu+x8@n36;hybrid+x8@n28"}
NCMOE=${NCMOE:-20,28,36,40}
QUANTS=${QUANTS:-q4_k_m}  # the file(s) both engines run: q4_k_m, q8_0 (vs_llama.py write)
DPROF=${DPROF-"cpu@4.16@t"}
DPROF_ENV=${DPROF_ENV-}  # e.g. MOESTREAM_BRIDGE_X8=1: the step profiles' environment
SWEEP=${SWEEP-"8,16"}  # thread counts of the CPU layer call sweep on the host (cpu_layer_tuning.py --sweep)
SWEEP_TUNINGS=${SWEEP_TUNINGS-"flow=0;kb=32;kb=256"}  # timed against the default in alternating rounds
QLIN_SHAPES=${QLIN_SHAPES-""}
TESTS_K=${TESTS_K-"overlapped_decode_equals_stepwise or hybrid or cuda_planar or cuda_gguf or planar_tokens or fp8 or tiles"}
AUX=$OUT/aux.log

{
  echo "== $(date -u +%T) gpu_session: budget ${BUDGET_S} s"
  lscpu | grep -E "Model name|Thread|Core|Socket|NUMA node0"
  python3 -c "from moestream.hardware import physical_cores as p; print('physical_cores', p())"
  if [ "${BW:-1}" != 0 ]; then  # BW=0: no bench bw (a short call)
    echo "== bench bw"
    timeout 60 python3 -m moestream.cli bench bw --expert-format "${BW_FORMAT:-q4_k}" -o /tmp/bw.json
  fi
  if [ -n "${QLIN_PRE:-}" ]; then  # e.g. "--q8 --shapes 'gdn in_proj_qkv,lm_head'": the dense GEMV sweep first
    echo "== $(date -u +%T) qlinear_gpu.py $QLIN_PRE"
    eval timeout ${QLIN_PRE_S:-150} python3 benchmarks/qlinear_gpu.py $QLIN_PRE --out "$OUT/qlinear.json"
  fi
  if [ -n "${PRE_CMD:-}" ]; then  # any command of this tree run in step 1 (e.g. benchmarks/miss_path.py), PRE_S [120]
    echo "== $(date -u +%T) $PRE_CMD"
    eval timeout ${PRE_S:-120} $PRE_CMD
  fi
  if [ -n "${TESTS_PRE:-}" ]; then  # pytest arguments run before the grid (e.g. a new kernel's CUDA tests)
    echo "== $(date -u +%T) CUDA tests $TESTS_PRE"
    eval timeout ${TESTS_PRE_S:-120} python3 -m pytest -q -p no:cacheprovider -rfs --tb=short $TESTS_PRE
  fi
  if [ -n "$SWEEP" ]; then
    echo "== $(date -u +%T) CPU layer call, threads $SWEEP (benchmarks/cpu_layer_tuning.py --sweep)"
    timeout 150 python3 benchmarks/cpu_layer_tuning.py --sweep "$SWEEP" --tunings "$SWEEP_TUNINGS" \
      --json "$OUT/cpu_layer_sweep.json"
  fi
} > "$AUX" 2>&1

KEEP_GGUF=1 QUANTS="$QUANTS" NCMOE="$NCMOE" GRID="$GRID" DEADLINE_S=$(( $(left) - TAIL_S )) CONFIG_S=${CONFIG_S:-90} \
  BUILD_GRID=none bash benchmarks/gpu_vs_llama.sh > /dev/null 2>&1  # (its own log: $OUT/vs_llama.log)
if [ -n "$GRID2" ] && [ "$(left)" -gt $(( TAIL_S + 60 )) ]; then  # the same files and work dir: measured runs resumed
  cp "$OUT/vs_llama.log" /tmp/vs_llama_1.log
  KEEP_GGUF=1 QUANTS="$QUANTS" NCMOE="$NCMOE" GRID="$GRID2" DEADLINE_S=$(( $(left) - TAIL_S )) CONFIG_S=${CONFIG_S:-90} \
    BUILD_GRID=none bash benchmarks/gpu_vs_llama.sh > /dev/null 2>&1
  cat /tmp/vs_llama_1.log "$OUT/vs_llama.log" > /tmp/vs_llama_2.log && mv /tmp/vs_llama_2.log "$OUT/vs_llama.log"
fi

{
  i=0
  for C in $(echo "$DPROF" | tr , ' '); do
    [ "$i" -lt 2 ] && [ "$(left)" -gt 60 ] || break
    echo "== $(date -u +%T) [$(left) s left] step profile $C"
    mkdir -p /tmp/dprof && env $DPROF_ENV OUT=/tmp/dprof PHASES=dprof DPROF="$C" STEPS=${STEPS:-32} DPROF_S=$(( $(left) > 90 ? 90 : $(left) - 10 )) \
      bash benchmarks/gpu_issue_runs.sh 2>&1 | grep -v "^WARNING: Target directory"
    cp /tmp/dprof/decode_profile_*.json "$OUT/" 2>/dev/null; rm -f /tmp/dprof/*
    i=$((i + 1))
  done
  if [ -n "$QLIN_SHAPES" ] && [ "$(left)" -gt 40 ]; then
    echo "== $(date -u +%T) [$(left) s left] qlinear_gpu.py --shapes '$QLIN_SHAPES'"
    timeout $(( $(left) > 100 ? 90 : $(left) - 10 )) python3 benchmarks/qlinear_gpu.py --shapes "$QLIN_SHAPES" \
      --out "$OUT/qlinear.json"
  fi
  if [ -n "$TESTS_K" ] && [ "$(left)" -gt 30 ]; then
    echo "== $(date -u +%T) [$(left) s left] CUDA tests -k '$TESTS_K'"
    timeout $(( $(left) - 5 )) python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/test_qpairs.py \
      tests/test_triton_layers.py tests/test_cuda_graphs.py tests/test_planar.py tests/test_host_embedding.py \
      tests/test_kv_fp8.py tests/test_lm_head_quant.py -k "$TESTS_K"
  fi
  echo "== done after $(( $(date +%s) - T0 )) s"
} >> "$AUX" 2>&1
tail -40 "$OUT/vs_llama.log"
tail -60 "$AUX"
