#!/usr/bin/env bash
# Device call (kind nvidia-h200, carry [".peer", ".whl"]): where device memory outside torch's allocator
# comes from (benchmarks/mem_probe.py), on 4-layer Qwen3.6-shaped GGUFs (full widths and vocabulary, so every
# kernel is specialised as on the 40-layer file; 4 GB instead of 36.5 GB, written in seconds).
#   bash benchmarks/gpu_mem_probe.sh            # -> $OUT/mem_probe_*.json, $OUT/mem_probe.log, $OUT/ptx/
# QUANTS ["q8_0 q4_k_m"], CONFIGS_q8_0 / CONFIGS_q4_k_m (mem_probe.py --configs), HOOKS [1]
set -uo pipefail
source benchmarks/device_env.sh
D=${GGUF_DIR:-/dev/shm}; HOOKS=${HOOKS-1}
CONFIGS_q8_0=${CONFIGS_q8_0:-"fused@0,fused@0:eager,offload@3,hybrid@3"}
CONFIGS_q4_k_m=${CONFIGS_q4_k_m:-"fused@0,offload@2"}
for q in ${QUANTS:-q8_0 q4_k_m}; do
  f=$D/qwen36_4l_$q.gguf
  python3 benchmarks/make_qwen36_q4km.py "$f" --quant "$q" --layers 4 --vocab-from .peer/qwen3-tokenizer-gguf-fields.json \
    2>&1 | tail -2
  var=CONFIGS_$q
  python3 benchmarks/mem_probe.py "$f" --configs "${!var}" ${HOOKS:+--hooks} --json "$OUT/mem_probe_$q.json" \
    --dump-dir "$OUT/ptx/$q" 2>&1 | tee -a "$OUT/mem_probe.log"
  rm -f "$f"
done
