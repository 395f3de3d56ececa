#!/usr/bin/env bash
# Run on the lent GPU machine (device tool) from the repo root:
#   bash benchmarks/gpu_run.sh [pytest args...]
# Installs moestream without dependencies over the machine's own torch, prints the environment,
# then runs the CUDA tests (and anything else passed in). Output also lands in $OUT/gpu_run.log.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  python3 -m pytest -q -p no:cacheprovider "${@:-tests/test_cuda_parity.py}"
} 2>&1 | tee "$OUT/gpu_run.log"
