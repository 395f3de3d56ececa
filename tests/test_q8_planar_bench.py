"""benchmarks/q8_planar_bench.py's kernels under the Triton interpreter: the row-planar Q8_0 pair kernels and the
engine's 16-bit word reads (MOESTREAM_Q8_WORDS) give the block kernels' outputs (its --check, in a process of its own:
TRITON_INTERPRET must be set before Triton is imported)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_harness import HAS_TRITON  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_planar_and_word_kernels_equal_the_block_kernels():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    env.pop("MOESTREAM_Q8_WORDS", None)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "q8_planar_bench.py"), "--check", "--H", "128",
                          "--I", "64", "--slots", "16", "--k", "4"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("check T=")]
    assert len(lines) == 4, out.stdout  # T = 1 and 3, planar and words
