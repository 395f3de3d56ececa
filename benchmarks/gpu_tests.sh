#!/usr/bin/env bash
# The CUDA tests on the GPU machine (its image lacks the server's packages: test files that import them
# are skipped at collection, the rest run): every test marked `cuda`, plus the files that skip without a
# GPU by their own condition, plus the CPU kernel tests (the GPU machine's host has AVX-512: the only place
# the AVX512-VNNI build runs). Verbose results go to ${TESTS_LOG:-/tmp/gpu_tests.log} line by line (a run
# stopped at its limit keeps what it reached); stdout gets the failures and the counts.
#   FIRST=tests/test_x.py  run that file first, with full tracebacks, into ${TESTS_LOG%.log}_first.log
#   SHARDS (default 1)     the `cuda` run split over that many concurrent pytest processes
#   TESTS_S (default 240)  limit of the `cuda` run; TESTS2_S (default TESTS_S) limit of each other run
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
LOG=${TESTS_LOG:-/tmp/gpu_tests.log}
: > "$LOG"
if [ -n "${FIRST:-}" ]; then
  timeout ${TESTS2_S:-${TESTS_S:-240}} python3 -m pytest -v -p no:cacheprovider -rfs --tb=long $FIRST \
    > "${LOG%.log}_first.log" 2>&1
  tail -5 "${LOG%.log}_first.log"
fi
# SHARDS=N (default 1): the `cuda` run as N pytest processes at once over N slices of the test files (one GPU, the
# host's cores compile the Triton kernels in parallel), their logs appended to $LOG in order when all are done.
N=${SHARDS:-1}
if [ "$N" -le 1 ]; then
  timeout ${TESTS_S:-240} python3 -m pytest -v -p no:cacheprovider -rfs -m cuda --continue-on-collection-errors tests \
    >> "$LOG" 2>&1
else
  FILES=($(grep -rl "mark.cuda" tests --include="test_*.py" | sort))
  for ((i = 0; i < N; i++)); do
    SLICE=(); for ((j = i; j < ${#FILES[@]}; j += N)); do SLICE+=("${FILES[j]}"); done
    timeout ${TESTS_S:-240} python3 -m pytest -v -p no:cacheprovider -rfs -m cuda --continue-on-collection-errors \
      "${SLICE[@]}" > "${LOG%.log}_shard$i.log" 2>&1 &
  done
  wait
  for ((i = 0; i < N; i++)); do cat "${LOG%.log}_shard$i.log" >> "$LOG"; rm -f "${LOG%.log}_shard$i.log"; done
fi
timeout ${TESTS2_S:-${TESTS_S:-240}} python3 -m pytest -v -p no:cacheprovider -rfs -k "not interpreted" tests/test_cuda_graphs.py \
  tests/test_triton_layers.py tests/test_triton_fused.py tests/test_decode_ops.py >> "$LOG" 2>&1
timeout ${TESTS2_S:-${TESTS_S:-240}} python3 -m pytest -v -p no:cacheprovider -rfs tests/test_cpu_kernels.py \
  tests/test_cpu_moe.py >> "$LOG" 2>&1
echo "CUDA tests: $(grep -c ' PASSED' "$LOG") passed, $(grep -c ' FAILED' "$LOG") failed, $(grep -c ' SKIPPED' "$LOG") skipped, $(grep -c '^ERROR' "$LOG") collection errors (missing server packages)"
grep -E " FAILED|^FAILED|Error:|assert " "$LOG" | grep -v "ModuleNotFoundError\|ImportError" | head -40
