#!/usr/bin/env bash
# The CUDA tests on the GPU machine (its image lacks the server's packages: test files that import them
# are skipped at collection, the rest run): every test marked `cuda`, plus the files that skip without a
# GPU by their own condition. Output to stdout; TESTS_S bounds each pytest run.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider -rs -m cuda --continue-on-collection-errors tests 2>&1 \
  | grep -v "^E  \|^  \|^Traceback\|^Hint\|^___\|^/usr\|^tests/.*: in <module>\|^ImportError" | tail -30
timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider -rs -k "not interpreted" tests/test_cuda_graphs.py \
  tests/test_triton_layers.py tests/test_triton_fused.py tests/test_decode_ops.py 2>&1 | tail -8
