#!/usr/bin/env bash
# moestream vs llama.cpp on the same GGUF files, same GPU machine, same run (issue 13 item 4).
#
# ---- before the device call, here, from the repo root ---------------------------------------------
#   bash benchmarks/peer_src.sh         # pip-downloads the llama-cpp-python 0.3.36 sdist (73 MiB, over the
#                                       # 64 MiB carry limit) and keeps its vendored llama.cpp, trimmed, as
#                                       # .peer/llama.cpp-src.tar.gz (~9 MB) + .peer/llama.cpp-src.txt
#                                       # (any tar.gz of that llama.cpp/ tree works: LLAMA_SRC=.peer/FILE; without
#                                       # LLAMA_SRC, .peer/llama.cpp-src.tar.gz, else .peer/llama.cpp-slim.tar.gz)
#   cp ../shared/data/qwen3-tokenizer-gguf-fields.json .peer/        # the vocabulary (7.7 MB)
#   mkdir -p .whl && pip download --no-deps gguf==0.19.0 -d .whl     # GGUFWriter for the file writer (the
#                                                                    # GPU image has no gguf package)
#   X="$(git rev-parse --git-common-dir)/info/exclude"         # .peer/ and .whl/ must be ignored to be carried
#   grep -qx '/.peer/' "$X" || echo '/.peer/' >> "$X"          # (.whl/ is in .gitignore already)
# (a results JSON of an earlier call, for VRAM_FROM / MERGE below, also goes into .peer/)
#
# ---- the device call (kind nvidia-h200), carry [".peer", ".whl"] -----------------------------------
#   bash benchmarks/gpu_vs_llama.sh
# Everything goes to $OUT: vs_llama.log (this output), vs_llama.json (all figures, raw), vs_llama.md (the
# table), vs_llama.png (plot). Results are rewritten after every measurement, so a call stopped at its time
# limit still returns what it measured.
#
# Phases, chosen by environment variables (defaults in brackets):
#   QUANTS      files, in order, each written to GGUF_DIR, measured, then deleted ["q8_0 q4_k_m"]
#   BUILD       build llama-bench + llama-batched-bench (CUDA, sm_90) in the background from the start [1]
#   LLAMA       run llama.cpp at -ncmoe $NCMOE on each file (needs the build) [1]
#   MOE         run moestream on each file over $GRID [1]
#   GRID        vs_llama.py moe --grid [fused first, then offload/auto/hybrid/cpu at llama.cpp's VRAM]
#   NCMOE       ["0,15,29,33,40"]
#   VRAM_FROM   an earlier vs_llama.json whose llama.cpp VRAM sets the caps when LLAMA=0 (e.g. .peer/vs_llama.json)
#   MERGE       an earlier vs_llama.json merged into this call's report [VRAM_FROM]
#   DEADLINE_S  seconds from the start after which no new moestream configuration starts [540]
#   CONFIG_S    time limit per moestream configuration [150]; MEASURE_S seconds aimed at per decode figure [20]
#   GGUF_DIR    [/dev/shm, or /tmp when it has no room]; KEEP_GGUF=1 keeps the files
#   BENCHBW=1   `moestream bench bw` first (before the build starts), so `auto` can weigh hybrid [0]
#   BUILD_CORES cores the build may use while moestream runs [2-15]
#   LLAMA_PACK=1  the build's programs and libraries also into $OUT/llama-bin.tar.xz[.part-*] [0]
#   LLAMA_PREBUILT  such a pack, used instead of building [.peer/llama-bin.tar.xz when present]
#   PLOT=0      no vs_llama.png [1]
#   PP, TG, REPS  prompt / generated tokens / repetitions [512, 64, 2]
# For a dry run without a GPU (what was checked on the development machine): TINY=1 (tiny files, made-up
# vocabulary) DEVICE=cpu (moestream on the CPU, caps not applied) LLAMA_BIN=DIR (an existing llama.cpp build,
# e.g. a CPU one; no build) NCMOE=0,2,4 GRID="fused@all;offload,cpu,auto@n2".
#
#   AB_TREE     another moestream tree (e.g. an earlier commit: `git archive C | tar x -C .ab/old`, .ab/ ignored and
#               carried) run over AB_GRID on the same files after this tree's grid, into $WORK/ab; its report
#               goes to $OUT/ab/ [none]
#   AB_GRID     [cpu@all]
#   BUILD_GRID  the moestream grid run while llama.cpp builds [fused@all]; none: nothing
#   DURING_BUILD a shell command run after that grid if the build is still going (e.g. the CUDA tests)
#
# The build runs in its own session (setsid): it outlives the call, and a later call on the same warm
# machine (the device tool keeps a machine 30 s after a call) finds llama-bench built, the file in
# GGUF_DIR (KEEP_GGUF=1) and the results in WORK (--resume skips what is measured). The split used on
# 2026-12-03 (fourth session), two calls back to back:
#   A. KEEP_GGUF=1 QUANTS=q8_0 BUILD_GRID="fused@all;cpu@all" DURING_BUILD="bash benchmarks/gpu_tests.sh"
#   B. KEEP_GGUF=1 QUANTS=q8_0                         (llama.cpp at every -ncmoe, then the default grid)
set -uo pipefail
source benchmarks/device_env.sh  # $OUT, the carried wheels, this tree on PYTHONPATH
T0=$(date +%s)
QUANTS=${QUANTS:-"q8_0 q4_k_m"}; BUILD=${BUILD:-1}; LLAMA=${LLAMA:-1}; MOE=${MOE:-1}
NCMOE=${NCMOE:-0,15,29,33,40}; DEADLINE_S=${DEADLINE_S:-540}; CONFIG_S=${CONFIG_S:-150}; MEASURE_S=${MEASURE_S:-20}
VRAM_FROM=${VRAM_FROM:-}; MERGE=${MERGE:-$VRAM_FROM}; BUILD_CORES=${BUILD_CORES:-2-15}
DEVICE=${DEVICE:-cuda}; TINY=${TINY:-0}; LLAMA_BIN=${LLAMA_BIN:-}
SIZES="--pp ${PP:-512} --tg ${TG:-64} --reps ${REPS:-2}"  # llama-bench -p / -n / -r and moestream's pp / tg / reps
PLOT=$([ "${PLOT:-1}" = 1 ] && echo --plot)  # PLOT=0: no vs_llama.png (the device returns at most 8 files)
WORK=${WORK:-/tmp/vs_work}; LL=/tmp/llama; mkdir -p "$WORK" "$LL"
[ -n "$LLAMA_BIN" ] && BUILD=0
BIN=${LLAMA_BIN:-$LL/build/bin}
VOCAB=.peer/qwen3-tokenizer-gguf-fields.json
left() { echo $(( DEADLINE_S - ($(date +%s) - T0) )); }

build() {  # llama-bench and llama-batched-bench from the carried, trimmed llama.cpp source
  touch "$LL/BUILDING"
  trap 'rm -f "$LL/BUILDING"' EXIT
  local src=${LLAMA_SRC:-$(ls .peer/llama.cpp-src.tar.gz .peer/llama.cpp-slim.tar.gz 2>/dev/null | head -1)}
  echo "llama.cpp source: $src"
  tar xzf "$src" -C "$LL" \
  && cmake -S "$LL/llama.cpp" -B "$LL/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
       -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
       -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  && taskset -c "$BUILD_CORES" cmake --build "$LL/build" --target llama-bench llama-batched-bench -j "$(nproc)"
  local rc=$?
  if [ $rc = 0 ] && [ "${LLAMA_PACK:-0}" = 1 ]; then pack; fi
  rm -f "$LL/BUILDING"
  echo "build rc $rc after $(( $(date +%s) - T0 )) s"
  return $rc
}

# LLAMA_PACK=1: the two programs and their shared libraries, xz-compressed, into $OUT/llama-bin.tar.xz (split into
# 15 MiB parts .part-aa, -ab, ... when larger: the device tool returns files of at most 16 MiB). Joined here
# (`cat llama-bin.tar.xz.part-* > .peer/llama-bin.tar.xz`), a later call carries it and skips the 5-6 minute build
# (LLAMA_PREBUILT, below; note its origin in .peer/llama-bin.txt, which the report names, and leave the 9 MB source out
# of .peer/ then: the carried tree must stay under 64 MiB). A build output for timing only: never committed.
pack() {
  local t=$(date +%s)
  local stage="$WORK/llama-bin"; rm -rf "$stage"; mkdir -p "$stage"
  cp "$LL/build/bin/llama-bench" "$LL/build/bin/llama-batched-bench" "$stage/"
  find "$LL/build" -name "lib*.so*" ! -path "$stage/*" -exec cp -P {} "$stage/" \;
  (cd "$stage" && XZ_OPT="-T0 -6" tar -cJf "$WORK/llama-bin.tar.xz" .)
  local n=$(stat -c %s "$WORK/llama-bin.tar.xz")
  if [ "$n" -gt $((15 * 1024 * 1024)) ]; then split -b 15M "$WORK/llama-bin.tar.xz" "$OUT/llama-bin.tar.xz.part-"
  else cp "$WORK/llama-bin.tar.xz" "$OUT/"; fi
  echo "packed llama.cpp's build: $n bytes in $(( $(date +%s) - t )) s"
}

# LLAMA_PREBUILT (default .peer/llama-bin.tar.xz when present): a build of an earlier call (LLAMA_PACK=1), unpacked
# where the build would put it; used when every library it needs resolves, else the source is built as usual.
prebuilt() {
  local tarball=${LLAMA_PREBUILT:-.peer/llama-bin.tar.xz}
  [ -f "$tarball" ] || return 1
  mkdir -p "$LL/build/bin" && tar -xJf "$tarball" -C "$LL/build/bin" || return 1
  if LD_LIBRARY_PATH="$LL/build/bin" ldd "$LL/build/bin/llama-bench" | grep -q "not found"; then
    echo "prebuilt llama.cpp $tarball: libraries missing, building instead"; rm -f "$LL/build/bin/llama-bench"; return 1
  fi
  echo "llama.cpp from $tarball (prebuilt by an earlier call; $(cat .peer/llama-bin.txt 2>/dev/null || echo 'no note'))"
}
export LD_LIBRARY_PATH="$BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # a prebuilt's libraries (a build's have an RPATH)

building() { [ -f "$LL/BUILDING" ]; }
wait_build() {  # until the build ends or $1 seconds pass; 0 if llama-bench is there
  local until=$(( $(date +%s) + $1 ))
  while building && [ "$(date +%s)" -lt "$until" ]; do sleep 2; done
  [ -x "$BIN/llama-bench" ]
}
if [ "${1:-}" = __build ]; then build; exit $?; fi

report() {
  timeout 120 python3 benchmarks/vs_llama.py report --work "$WORK" --out "$OUT" ${MERGE:+--merge "$MERGE"} "$@" \
    > "$WORK/report.txt" 2>&1 || tail -5 "$WORK/report.txt"
}

{
  echo "== $(date -u) moestream vs llama.cpp; QUANTS='$QUANTS' BUILD=$BUILD LLAMA=$LLAMA MOE=$MOE"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  lscpu | grep -E "Model name|^CPU\(s\)" || true
  free -g | head -2; df -h /dev/shm /tmp | tail -2
  python3 benchmarks/vs_llama.py env --work "$WORK"
  python3 -c "import gguf" 2>/dev/null || echo "WARNING: no gguf package (carry .whl/gguf-*.whl): the file writer needs it"
  [ -f "$VOCAB" ] || echo "WARNING: $VOCAB missing (copy ../shared/data/qwen3-tokenizer-gguf-fields.json into .peer/)"
  # before the build starts: its compile jobs on cores 2-15 would take the host's memory bandwidth and cores from the
  # CPU figures (the thirtieth session's call read 33.6 GB/s of host memory and 7.5 GB/s of CPU experts that way)
  if [ "${BENCHBW:-0}" = 1 ]; then timeout 150 python3 -m moestream.cli bench bw; fi
  BUILD_PID=
  if [ "$BUILD" = 1 ] && [ ! -x "$BIN/llama-bench" ] && [ ! -f "$LL/BUILDING" ] && [ -z "${LLAMA_SRC:-}" ]; then prebuilt; fi
  if [ "$BUILD" = 1 ] && [ -x "$BIN/llama-bench" ]; then
    echo "llama.cpp already built in $BIN (an earlier call on this machine)"
  elif [ "$BUILD" = 1 ] && [ -f "$LL/BUILDING" ]; then
    echo "llama.cpp build of an earlier call still running"; BUILD_PID=marker
  elif [ "$BUILD" = 1 ]; then
    # its own session: it outlives this call, so the next call on the same (warm) machine finds it done
    touch "$LL/BUILDING"
    setsid nohup bash "$0" __build > "$WORK/build.log" 2>&1 < /dev/null &
    BUILD_PID=marker
  fi
  for Q in $QUANTS; do
    DIR=${GGUF_DIR:-/dev/shm}
    NEED=$([ "$Q" = q8_0 ] && echo 38 || echo 23)
    FREE=$(df -BG --output=avail "$DIR" | tail -1 | tr -dc 0-9)
    if [ ! -f "$DIR/qwen36-$Q.gguf.done" ] && [ "${FREE:-0}" -lt "$NEED" ]; then echo "$DIR has ${FREE} GB free, $Q needs $NEED: using /tmp"; DIR=/tmp; fi
    F=$DIR/qwen36-$Q.gguf
    echo "== $(date -u +%T) [$(left) s left] write $F"
    if [ "$TINY" = 1 ]; then WARGS=--tiny; else WARGS="--vocab-from $VOCAB"; fi
    if [ -f "$F.done" ]; then echo "$F written already"
    else
      timeout 300 python3 benchmarks/vs_llama.py write "$Q" "$F" $WARGS --work "$WORK" || { echo "write failed"; continue; }
    fi
    report
    if [ "$MOE" = 1 ] && [ -n "$BUILD_PID" ] && building && [ "${BUILD_GRID:-}" != none ]; then
      # while llama.cpp builds: only the configurations that need no llama.cpp VRAM figure (fused, fixed caps)
      echo "== $(date -u +%T) [$(left) s left] moestream during the build (fused)"
      timeout $(( $(left) > 30 ? $(left) : 30 )) python3 benchmarks/vs_llama.py moe --model "$F" --quant "$Q" \
        --work "$WORK" --resume $SIZES --grid "${BUILD_GRID:-fused@all}" --device "$DEVICE" --config-s "$CONFIG_S" --measure-s "$MEASURE_S" \
        --deadline-s "$(left)" ${VRAM_FROM:+--vram-from "$VRAM_FROM"}
      report
    fi
    if [ -n "${DURING_BUILD:-}" ] && building; then echo "== $(date -u +%T) [$(left) s left] $DURING_BUILD"; bash -c "$DURING_BUILD"; fi
    if [ "$LLAMA" = 1 ]; then
      if [ -n "$BUILD_PID" ]; then
        echo "== $(date -u +%T) [$(left) s left] waiting for the llama.cpp build"
        wait_build $(( $(left) > 60 ? $(left) - 60 : 1 )); BUILD_PID=; tail -3 "$WORK/build.log"
      fi
      if [ -x "$BIN/llama-bench" ]; then
        echo "== $(date -u +%T) [$(left) s left] llama.cpp on $Q"
        timeout $(( $(left) > 90 ? $(left) : 90 )) python3 benchmarks/vs_llama.py llama --model "$F" --quant "$Q" --work "$WORK" --resume $SIZES \
          --bin "$BIN" --ncmoe "$NCMOE" --threads "$(nproc)"
        grep -h "buffer size" "$WORK"/llama_"$Q"_ncmoe*.log 2>/dev/null | sort | uniq -c | head -30
        report
      else
        echo "no llama-bench: build failed"; tail -30 "$WORK/build.log"
      fi
    fi
    if [ "$MOE" = 1 ]; then
      echo "== $(date -u +%T) [$(left) s left] moestream on $Q"
      timeout $(( $(left) > 30 ? $(left) : 30 )) python3 benchmarks/vs_llama.py moe --model "$F" --quant "$Q" \
        --work "$WORK" --resume $SIZES ${GRID:+--grid "$GRID"} --device "$DEVICE" --config-s "$CONFIG_S" --measure-s "$MEASURE_S" \
        --deadline-s "$(left)" ${VRAM_FROM:+--vram-from "$VRAM_FROM"}
      report $PLOT
    fi
    if [ "$MOE" = 1 ] && [ -n "${AB_TREE:-}" ]; then
      echo "== $(date -u +%T) [$(left) s left] moestream from $AB_TREE on $Q"
      LLJ=$(ls "$WORK"/llama_"$Q".json 2>/dev/null | head -1)
      [ -z "$LLJ" ] && [ -n "$VRAM_FROM" ] && LLJ=$(realpath "$VRAM_FROM")  # LLAMA=0: the caps of an earlier run
      (cd "$AB_TREE" && PYTHONPATH="$PWD:$PYTHONPATH" timeout $(( $(left) > 30 ? $(left) : 30 )) python3 benchmarks/vs_llama.py moe \
        --model "$F" --quant "$Q" --work "$WORK/ab" --resume $SIZES --grid "${AB_GRID:-cpu@all}" --device "$DEVICE" \
        --config-s "$CONFIG_S" --measure-s "$MEASURE_S" --deadline-s "$(left)" ${LLJ:+--vram-from "$LLJ"})
      mkdir -p "$OUT/ab"
      timeout 120 python3 benchmarks/vs_llama.py report --work "$WORK/ab" --out "$OUT/ab" > "$WORK/ab/report.txt" 2>&1
      cat "$WORK/ab/report.txt" | tail -20
    fi
    [ "${KEEP_GGUF:-0}" = 1 ] || rm -f "$F" "$F.done"
  done
  [ -n "${BUILD_PID:-}" ] && { building && echo "llama.cpp build still running (it goes on after this call)"; tail -3 "$WORK/build.log"; }
  report $PLOT
  cat "$WORK/report.txt"
  echo "== done after $(( $(date +%s) - T0 )) s"
} 2>&1 | tee "$OUT/vs_llama.log"
