#!/usr/bin/env bash
# One device call for the decode work: CUDA tests of the pair kernels and graphs, then decode sweeps.
#   bash benchmarks/gpu_issue6.sh [sweep args for the offload/hybrid/cpu sweep...]
# env: TESTS (extra test files), SWEEP_S (time limit per sweep), FUSED=0 to skip the fused ceiling run,
#      BENCHBW=1 to measure and save `moestream bench bw` first (the planner's hybrid fetch share reads it)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Socket|L3" || true
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_moe_pairs.py tests/test_cuda_graphs.py ${TESTS:-} 2>&1 | tail -25
  if [ "${BENCHBW:-0}" = 1 ]; then
    timeout 120 python3 -m moestream.cli bench bw
  fi
  if [ "${FUSED:-1}" = 1 ]; then  # the ceiling: every expert in VRAM, its own process (model built fused)
    timeout ${SWEEP_S:-400} python3 benchmarks/decode_sweep.py --backends fused --no-fused --batch 1,4,6 \
      --out "$OUT/sweep_fused.json" ${FUSED_ARGS:-}
  fi
  timeout ${SWEEP_S:-400} python3 benchmarks/decode_sweep.py --no-fused --out "$OUT/sweep.json" "$@"
} 2>&1 | tee "$OUT/gpu_issue6.log"
