#!/usr/bin/env bash
# One short device call that checks the CUDA side before a long benchmark: every CUDA test (marked `cuda`,
# plus the files that skip without a GPU), a recorded batch-1 decode step of the Qwen3.6 shape with and
# without the decode fusions (benchmarks/step_profile.py --random), and the CPU quant kernels' rates on the
# GPU machine's host at 1 / 8 / 16 threads (benchmarks/cpu_vs_llama.py --kernels).
#   bash benchmarks/gpu_verify.sh        (device kind nvidia-h200; writes $OUT/verify.log, $OUT/prof_*.json)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core"; grep -o -w -E "avx512f|avx512_vnni|avx512_bf16|amx_tile|avx_vnni" /proc/cpuinfo | sort | uniq -c
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "== CUDA tests"
  timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider -rs -m cuda tests 2>&1 | tail -25
  timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider -rs -k "not interpreted" \
    tests/test_cuda_graphs.py tests/test_triton_layers.py tests/test_triton_fused.py tests/test_decode_ops.py 2>&1 | tail -15
  for v in unfused:MOESTREAM_FUSE=0 fused:MOESTREAM_FUSE=1; do
    echo "== step profile ${v%%:*}"
    timeout ${PROFILE_S:-120} env "${v#*:}" PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/step_profile.py --random \
      --backend fused --reps 30 --out "$OUT/prof_${v%%:*}.json" 2>&1 | grep -v INFO | head -30
  done
  for t in 1 8 16; do
    echo "== CPU kernels, $t threads"
    timeout 90 python3 benchmarks/cpu_vs_llama.py --kernels --threads $t --out "$OUT/cpu_kernels_$t.json" 2>&1 | tail -8
  done
  date -u
} 2>&1 | tee "$OUT/verify.log"
