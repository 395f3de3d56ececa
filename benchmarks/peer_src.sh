#!/usr/bin/env bash
# Make the carried llama.cpp source for benchmarks/gpu_vs_llama.sh, here (the device machine has no network).
#   bash benchmarks/peer_src.sh            # -> .peer/llama.cpp-src.tar.gz (+ .peer/llama.cpp-src.txt: version)
# The llama-cpp-python 0.3.36 sdist (73 MiB, the git pack and vocab test files are most of it) is over the
# device tool's 64 MiB carry limit, so this keeps only its vendored llama.cpp without the parts a llama-bench
# build never reads (git objects, vocab GGUFs, docs, benches, media, the web UI).
set -euo pipefail
cd "$(dirname "$0")/.."
VER=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
mkdir -p .peer
SDIST=.peer/llama_cpp_python-$VER.tar.gz
[ -f "$SDIST" ] || pip download --no-deps --no-binary :all: "llama-cpp-python==$VER" -d .peer
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
tar xzf "$SDIST" -C "$TMP"
SRC=$TMP/llama_cpp_python-$VER/vendor/llama.cpp
COMMIT=$(cat "$TMP/llama_cpp_python-$VER/.git/modules/vendor/llama.cpp/HEAD" 2>/dev/null || echo unknown)
rm -rf "$SRC/.git" "$SRC/models" "$SRC/docs" "$SRC/benches" "$SRC/media" "$SRC/tools/ui" "$SRC/gguf-py"
tar czf .peer/llama.cpp-src.tar.gz -C "$TMP/llama_cpp_python-$VER/vendor" llama.cpp
echo "llama.cpp vendored in llama-cpp-python $VER (commit $COMMIT), trimmed by benchmarks/peer_src.sh" > .peer/llama.cpp-src.txt
rm -f "$SDIST"  # over the carry limit: only the trimmed tree travels
ls -la .peer
