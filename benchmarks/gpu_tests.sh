#!/usr/bin/env bash
# The CUDA tests on the GPU machine (its image lacks the server's packages: test files that import them
# are skipped at collection, the rest run): every test marked `cuda`, plus the files that skip without a
# GPU by their own condition, plus the CPU kernel tests (the GPU machine's host has AVX-512: the only place
# the AVX512-VNNI build runs). Verbose results go to ${TESTS_LOG:-/tmp/gpu_tests.log} line by line (a run
# stopped at its limit keeps what it reached); stdout gets the failures and the counts.
#   FIRST=tests/test_x.py  run that file first, with full tracebacks, into ${TESTS_LOG%.log}_first.log
#   TESTS_S (default 240)  limit of the `cuda` run; TESTS2_S (default TESTS_S) limit of each other run
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
LOG=${TESTS_LOG:-/tmp/gpu_tests.log}
: > "$LOG"
if [ -n "${FIRST:-}" ]; then
  timeout ${TESTS2_S:-${TESTS_S:-240}} python3 -m pytest -v -p no:cacheprovider -rfs --tb=long $FIRST \
    > "${LOG%.log}_first.log" 2>&1
  tail -5 "${LOG%.log}_first.log"
fi
timeout ${TESTS_S:-240} python3 -m pytest -v -p no:cacheprovider -rfs -m cuda --continue-on-collection-errors tests \
  >> "$LOG" 2>&1
timeout ${TESTS2_S:-${TESTS_S:-240}} python3 -m pytest -v -p no:cacheprovider -rfs -k "not interpreted" tests/test_cuda_graphs.py \
  tests/test_triton_layers.py tests/test_triton_fused.py tests/test_decode_ops.py >> "$LOG" 2>&1
timeout ${TESTS2_S:-${TESTS_S:-240}} python3 -m pytest -v -p no:cacheprovider -rfs tests/test_cpu_kernels.py \
  tests/test_cpu_moe.py >> "$LOG" 2>&1
echo "CUDA tests: $(grep -c ' PASSED' "$LOG") passed, $(grep -c ' FAILED' "$LOG") failed, $(grep -c ' SKIPPED' "$LOG") skipped, $(grep -c '^ERROR' "$LOG") collection errors (missing server packages)"
grep -E " FAILED|^FAILED|Error:|assert " "$LOG" | grep -v "ModuleNotFoundError\|ImportError" | head -40
