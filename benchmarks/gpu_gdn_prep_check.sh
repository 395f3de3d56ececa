#!/usr/bin/env bash
# The GDN prefill kernels on a GPU, one short device call (carry [".peer", ".whl"]): the chunk terms
# (triton_ops.gdn_chunk_prep, MOESTREAM_GDN_PREP=1) and the conv / norms / gates front (triton_ops.gdn_prefill_front,
# MOESTREAM_GDN_FRONT=1), both opt-in: an all-resident Qwen3.6 prefill is host-bound (thirty-sixth session: 139 ms
# for 57 ms of kernels at 512 tokens, 3,806 launches), and they replace ~35 + ~28 torch launches a GDN layer.
#   1. its CUDA tests (and the GDN scan's), then the CUDA parity tests against HF with it on
#   2. benchmarks/gdn_chunk_bench.py: one layer's terms in torch vs the kernel, GPU and host time a call
#   3. an 8-layer file of the Qwen3.6 widths: step_profile --prefill 512 with both off and on, then fused pp512 / tg
#      with none, both, each alone, both again, none again (vs_llama.py, one shared process: read at each call)
# Everything goes to $OUT (gdn_prep_check.log, the profiles, the vs_llama report). LAYERS [8]; GDN_GRID=0 skips step 3's
# fused grid (when a full-file grid with the +gdnprep / +gdnfront variants follows in the same call).
set -uo pipefail
source benchmarks/device_env.sh
LOG=$OUT/gdn_prep_check.log
{
  nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
  echo "== $(date -u +%T) CUDA tests"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/test_gdn_triton.py -k cuda 2>&1 | tail -6
  MOESTREAM_GDN_PREP=1 MOESTREAM_GDN_FRONT=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short tests/test_cuda_parity.py \
    2>&1 | tail -6
  echo "== $(date -u +%T) gdn_chunk_bench"
  timeout 120 python3 benchmarks/gdn_chunk_bench.py --lengths 512,4096 2>&1 | grep -v -i warn
  echo "== $(date -u +%T) file: ${LAYERS:-8} layers"
  python3 benchmarks/vs_llama.py write q8_0 /dev/shm/gdn.gguf --layers "${LAYERS:-8}" \
    --vocab-from .peer/qwen3-tokenizer-gguf-fields.json 2>&1 | tail -1
  for P in 0 1; do
    echo "== $(date -u +%T) step_profile --prefill 512, MOESTREAM_GDN_PREP=MOESTREAM_GDN_FRONT=$P"
    MOESTREAM_GDN_PREP=$P MOESTREAM_GDN_FRONT=$P timeout 90 python3 benchmarks/step_profile.py --model /dev/shm/gdn.gguf --backend fused \
      --prefill 512 --out "$OUT/prefill_profile_gdnprep$P.json" 2>&1 | grep -v -i warn | head -14
  done
  if [ "${GDN_GRID:-1}" = 1 ]; then  # GDN_GRID=0: no fused grid on the 8-layer file (a full-file grid follows)
  echo "== $(date -u +%T) fused with and without, both orders"
  timeout 240 python3 benchmarks/vs_llama.py moe --model /dev/shm/gdn.gguf --quant q8_0 --work /tmp/gdn_work \
    --grid "fused@all;fused+gdnprep+gdnfront@all;fused+gdnprep@all;fused+gdnfront@all;fused+gdnprep+gdnfront+again@all;fused+again@all" \
    --config-s 60 --measure-s 8 2>&1 \
    | grep -E "tg bs1|error|Error"
  python3 benchmarks/vs_llama.py report --work /tmp/gdn_work --out "$OUT" >/dev/null 2>&1
  fi
  echo "== $(date -u +%T) done"
} > "$LOG" 2>&1
cat "$LOG"
