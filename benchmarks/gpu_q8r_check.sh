#!/usr/bin/env bash
# The Q8_0R questions left by the thirty-fifth session, in one short device call (carry [".peer", ".whl"]):
#   1. the CUDA tests of the Q8_0R layout (pair, fetch, grouped and dequant kernels; the engine moving between layouts)
#   2. fused pp512 / tg / bs4 on Q8_0R against the file layout, in both orders, on a file of the Qwen3.6 widths with
#      LAYERS layers (seconds to write; no llama.cpp: the question is Q8_0R against Q8_0 in one process order or the
#      other), and offload at a 4 GiB cap in both layouts (Q8_0R's fetch kernels since qpairs._fetch_cw)
#   3. the grouped prefill kernels alone (grouped_bench.py --stages), both Q8_0R forms against Q8_0
# Everything goes to $OUT (the device tool's folder): q8r_check.log and the vs_llama report of step 2.
#   LAYERS [8]  TESTS=0 skips step 1  BENCH=1 runs step 3 (the last session timed it)  PROF=0 skips the prefill profiles
#   (step_profile.py --prefill 512 of fused in each layout, after step 2's fused runs)
set -uo pipefail
source benchmarks/device_env.sh
LOG=$OUT/q8r_check.log
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader
  if [ "${TESTS:-1}" != 0 ]; then
    echo "== $(date -u +%T) CUDA tests"
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/test_q8_planar.py tests/test_qpairs.py \
      tests/test_grouped.py tests/test_triton_dequant.py -k "cuda and (Q8_0R or planar)" 2>&1 | tail -15
  fi
  echo "== $(date -u +%T) file: ${LAYERS:-8} layers"
  python3 benchmarks/vs_llama.py write q8_0 /dev/shm/q8r.gguf --layers "${LAYERS:-8}" \
    --vocab-from .peer/qwen3-tokenizer-gguf-fields.json 2>&1 | tail -1
  echo "== $(date -u +%T) fused, both layouts, both orders"
  timeout 260 python3 benchmarks/vs_llama.py moe --model /dev/shm/q8r.gguf --quant q8_0 --work /tmp/q8r_work \
    --grid "fused+q8blk@all;fused+q8r@all;fused+q8r+again@all;fused+q8blk+again@all" --config-s 60 --measure-s 8 2>&1 \
    | grep -E "tg bs1|error|Error"
  nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader
  if [ "${PROF:-1}" != 0 ]; then  # where a 512-token fused prefill's time goes in each layout (kernels, host ops)
    for P in 0 1; do
      echo "== $(date -u +%T) step_profile --prefill 512, MOESTREAM_Q8_PLANAR=$P"
      MOESTREAM_Q8_PLANAR=$P timeout 90 python3 benchmarks/step_profile.py --model /dev/shm/q8r.gguf --backend fused \
        --prefill 512 --out "$OUT/prefill_profile_q8planar$P.json" 2>&1 | grep -v -i warn | head -40
    done
  fi
  echo "== $(date -u +%T) offload at 4 GiB, both layouts"
  timeout 150 python3 benchmarks/vs_llama.py moe --model /dev/shm/q8r.gguf --quant q8_0 --work /tmp/q8r_work \
    --grid "offload+q8blk@4;offload+q8rall@4" --config-s 60 --measure-s 8 --resume 2>&1 | grep -E "tg bs1|error|Error"
  python3 benchmarks/vs_llama.py report --work /tmp/q8r_work --out "$OUT" >/dev/null 2>&1  # vs_llama.json / .md
  if [ "${BENCH:-0}" != 0 ]; then
    echo "== $(date -u +%T) grouped prefill kernels"
    timeout 120 python3 benchmarks/grouped_bench.py --formats Q8_0,Q8_0R,Q8_0R:scale --stages 3,1 --iters 10 2>&1 \
      | grep -v -i warn
  fi
  echo "== $(date -u +%T) done"
} > "$LOG" 2>&1
cat "$LOG"
