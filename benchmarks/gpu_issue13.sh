#!/usr/bin/env bash
# One device call for issue 13 (compressed experts on the GPU fast path), carry [".peer", ".whl"]:
#   CUDA tests of the quantized pair / grouped / route kernels, the kernel micro-benchmarks, then
#   moestream vs llama.cpp on the same GGUF (benchmarks/gpu_vs_llama.sh, its env vars pass through),
#   then where a recorded decode step's time goes (benchmarks/step_profile.py) on the file it kept.
# env: TESTS=0 skips the tests, MICRO=0 the micro-benchmarks, PROFILE=0 the step profile.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  if [ "${TESTS:-1}" = 1 ]; then
    timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider -x -rs tests/test_qpairs.py tests/test_moe_pairs.py \
      tests/test_cuda_graphs.py tests/test_device_cache_triton.py tests/test_bridge.py ${EXTRA_TESTS:-} 2>&1 | tail -30
  fi
  if [ "${MICRO:-1}" = 1 ]; then
    timeout 90 python3 benchmarks/qpair_bench.py 2>&1 | tail -40
    [ -f benchmarks/grouped_bench.py ] && timeout 90 python3 benchmarks/grouped_bench.py 2>&1 | tail -30
  fi
} 2>&1 | tee "$OUT/issue13_pre.log"
KEEP_GGUF=1 bash benchmarks/gpu_vs_llama.sh
if [ "${PROFILE:-1}" = 1 ]; then
  F=$(ls /dev/shm/qwen36-*.gguf /tmp/qwen36-*.gguf 2>/dev/null | head -1)
  [ -n "$F" ] && timeout ${PROFILE_S:-120} python3 benchmarks/step_profile.py --model "$F" --backend fused \
    --out "$OUT/step_profile.json" 2>&1 | grep -v "^INFO" | tail -40 | tee "$OUT/step_profile.log"
fi
