#!/usr/bin/env bash
# Run here, from the repo root, before a session's first device call: a fresh checkout has neither of the folders the
# device scripts carry, and the GPU image has no gguf package (moestream.quant's IQ codebooks and the GGUF writers
# need it: without it the HF/GGUF tests and the edge runs fail at import, as the twenty-ninth session's first call did).
#   bash benchmarks/device_prep.sh            # .whl/ (gguf + PyYAML for the image's Python 3.12) and .peer/ (the Qwen3
#                                             # vocabulary the GGUF writers use, from ../shared/data)
#   LLAMA=1 bash benchmarks/device_prep.sh    # also the trimmed llama.cpp source (benchmarks/peer_src.sh, ~9 MB) for
#                                             # gpu_vs_llama.sh / gpu_session.sh, which then build llama-bench in the call
# Then carry [".peer", ".whl"]; the run's reply lists what it could not carry under "not_carried".
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl .peer
ls .whl/gguf-*.whl >/dev/null 2>&1 || pip download -q --no-deps -d .whl "gguf==0.19.0"
ls .whl/pyyaml-*cp312*.whl >/dev/null 2>&1 || pip download -q --no-deps -d .whl --python-version 3.12 \
  --only-binary=:all: --platform manylinux_2_17_x86_64 pyyaml
VOCAB=../shared/data/qwen3-tokenizer-gguf-fields.json
[ -f .peer/qwen3-tokenizer-gguf-fields.json ] || { [ -f "$VOCAB" ] && cp "$VOCAB" .peer/; } \
  || echo "no $VOCAB: the GGUF writers' --vocab-from .peer/qwen3-tokenizer-gguf-fields.json will fail"
if [ "${LLAMA:-0}" = 1 ] && [ ! -f .peer/llama.cpp-src.tar.gz ] && [ ! -f .peer/llama-bin.tar.xz ]; then
  bash benchmarks/peer_src.sh
fi
du -sh .whl .peer
