#!/usr/bin/env bash
# Device call (kind nvidia-h200, carry [".peer", ".whl"]): issue 17's memory-at-the-edge figures on the full
# Qwen3.6-35B-A3B-shaped Q4_K_M GGUF (21 GB, written here by make_qwen36_q4km.py): per --gpu-memory-gb cap, the
# longest prompt the plan allows (up to PROMPT), TTFT, decode bs1/bs4, peak device memory vs cap and plan
# (benchmarks/edge_memory.py). -> $OUT/edge_memory.{json,md,log}
#   CAPS ["4,8,12,24"]  PROMPT [32768]  DECODE [32]  QUANT [q4_k_m]  BACKEND [auto]
set -uo pipefail
source benchmarks/device_env.sh
Q=${QUANT:-q4_k_m}; F=${GGUF_DIR:-/dev/shm}/qwen36-$Q.gguf
[ -f "$F" ] || python3 benchmarks/make_qwen36_q4km.py "$F" --quant "$Q" --vocab-from .peer/qwen3-tokenizer-gguf-fields.json 2>&1 | tail -1
python3 benchmarks/edge_memory.py "$F" --caps "${CAPS:-4,8,12,24}" --prompt "${PROMPT:-32768}" --decode "${DECODE:-32}" \
  --backend "${BACKEND:-auto}" --json "$OUT/edge_memory.json" --md "$OUT/edge_memory.md" 2>&1 | tee "$OUT/edge_memory.log"
