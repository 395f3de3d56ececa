"""Kernels per decode layer (tests/decode_ops.py): an upper bound so that a change adding launches to the
decode step shows up. Counts are of one batch-1 decode step of the tiny Qwen3.5-MoE (bf16, pairs; layers
gdn, gdn, gdn, attention), a layer counted from its token mixer up to the next layer's input norm.

On the CUDA path (Triton kernels, run under the interpreter on CPU tensors), measured on this branch:
GDN + MoE layer 11 (main before the fusions: 38); the attention + MoE layer, the last one (no next input
norm, but the logits-row pick), 28 (main: 61). Routed experts (moe/) not included."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from decode_ops import count_decode_step
from triton_harness import HAS_TRITON

BOUNDS_TRITON = {"gdn+moe": 11, "attn+moe": 28}


def test_cpu_step_runs_one_gemm_per_fused_group(tiny_checkpoint):
    """Torch path: in_proj, out_proj, router | shared gate | up | gate, shared down = 4 GEMMs per GDN + MoE
    layer; qkv, o_proj, router | shared in, shared down = 4 per attention + MoE layer."""
    ops = count_decode_step(tiny_checkpoint("qwen35_causal"))
    for where, names in ops.items():
        if ":" in where:
            assert names.count("mm") == 4, (where, names)


def test_unfused_step_issues_more_gemms(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("MOESTREAM_FUSE", "0")
    ops = count_decode_step(tiny_checkpoint("qwen35_causal"))
    gdn = next(names for where, names in ops.items() if where.endswith(":gdn+moe"))
    assert gdn.count("mm") == 10  # in_proj_qkv, _z, _b, _a, out_proj, router, gate, up, shared gate, down


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_cuda_path_kernels_per_layer_within_bounds(tmp_path):
    out = tmp_path / "ops.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("decode_ops.py")), "--triton", "--json",
                           str(out), "qwen35"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    per_kind = got["per_kind"]
    assert set(per_kind) == set(BOUNDS_TRITON), per_kind
    for kind, bound in BOUNDS_TRITON.items():
        layer = next(names for where, names in got["ops"].items() if where.endswith(":" + kind))
        assert per_kind[kind] <= bound, (kind, per_kind[kind], layer)
