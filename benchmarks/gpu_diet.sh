#!/usr/bin/env bash
# One device call for the decode-step fusions (branch diet): the CUDA tests of the fused kernels, then a
# recorded batch-1 decode step of the Qwen3.6 shape (random bf16, benchmarks/step_profile.py): replay ms
# and kernels per step, for BASE (a checkout without the fusions, e.g. main copied to .base), this tree
# with MOESTREAM_FUSE=0 (Triton fusions only) and this tree as is.
#   bash benchmarks/gpu_diet.sh            (carry [".base"] where BASE=.base is wanted)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BASE=${BASE:-.base}
timeout ${TESTS_S:-300} env PYTHONPATH=$PWD python3 -m pytest -q -p no:cacheprovider -rs -k "not interpreted" \
  tests/test_triton_layers.py tests/test_triton_fused.py tests/test_cuda_graphs.py tests/test_cuda_parity.py 2>&1 | tail -15
run() {  # name, PYTHONPATH root, env...
  local name=$1 root=$2; shift 2
  timeout ${PROFILE_S:-150} env "$@" PYTHONPATH=$root:$PWD/benchmarks python3 benchmarks/step_profile.py --random \
    --backend fused --reps 30 --out "$OUT/prof_$name.json" 2>&1 | grep -v INFO | head -25 | sed "s/^/[$name] /"
}
[ -d "$BASE/moestream" ] && run base "$PWD/$BASE"
run unfused "$PWD" MOESTREAM_FUSE=0
run diet "$PWD"
