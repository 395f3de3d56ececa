#!/usr/bin/env bash
# One device call for issue 13 (compressed experts on the GPU fast path), carry [".peer", ".whl"]:
# llama.cpp builds and the GGUF is written in the background while the CUDA tests (-m cuda) and the kernel
# micro-benchmarks run; then moestream vs llama.cpp on that file (benchmarks/gpu_vs_llama.sh: its env vars
# pass through: QUANTS (one here), NCMOE, GRID, DEADLINE_S, ...), then where a recorded decode step's time goes
# (benchmarks/step_profile.py). env: TESTS=0 / MICRO=0 / PROFILE=0 skip those parts.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
Q=${QUANTS:-q8_0}; F=/dev/shm/qwen36-$Q.gguf; LL=/tmp/llama
mkdir -p $LL
( tar xzf .peer/llama.cpp-slim.tar.gz -C $LL && cmake -S $LL/llama.cpp -B $LL/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > $LL/cfg.log 2>&1 \
  && taskset -c 4-15 cmake --build $LL/build --target llama-bench llama-batched-bench -j 12 > $LL/build.log 2>&1
  echo "llama.cpp build rc $?" ) &
BUILD=$!
( taskset -c 2-3 timeout 400 python3 benchmarks/vs_llama.py write "$Q" "$F" --vocab-from .peer/qwen3-tokenizer-gguf-fields.json \
    --work /tmp/vs_work > /tmp/write.log 2>&1 && touch "$F.done"; echo "write rc $?" ) &
WRITE=$!
{
  if [ "${TESTS:-1}" = 1 ]; then
    timeout ${TESTS_S:-150} taskset -c 0-1 python3 -m pytest -q -p no:cacheprovider -m cuda -rs tests/test_qpairs.py \
      tests/test_moe_pairs.py tests/test_grouped.py tests/test_cuda_graphs.py tests/test_device_cache_triton.py ${EXTRA_TESTS:-} 2>&1 | tail -30
  fi
  if [ "${MICRO:-1}" = 1 ]; then
    timeout 90 taskset -c 0-1 python3 benchmarks/qpair_bench.py 2>&1 | tail -40
    [ -f benchmarks/grouped_bench.py ] && timeout 90 taskset -c 0-1 python3 benchmarks/grouped_bench.py 2>&1 | tail -30
  fi
  wait $WRITE; tail -3 /tmp/write.log; wait $BUILD; tail -3 $LL/build.log
} 2>&1 | tee "$OUT/issue13_pre.log"
QUANTS=$Q BUILD=0 LLAMA_BIN=$LL/build/bin GGUF_DIR=/dev/shm KEEP_GGUF=1 bash benchmarks/gpu_vs_llama.sh
if [ "${PROFILE:-1}" = 1 ] && [ -f "$F" ]; then
  timeout ${PROFILE_S:-120} python3 benchmarks/step_profile.py --model "$F" --backend fused --out "$OUT/step_profile.json" \
    2>&1 | grep -v "INFO" | tail -40 | tee "$OUT/step_profile.log"
fi
