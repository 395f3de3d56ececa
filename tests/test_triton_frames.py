"""No Triton kernel of moestream spills past the driver's default stack frame (no GPU needed).

A kernel whose threads need more local memory than the context's stack limit (1 KiB by default) makes the CUDA
driver raise the limit and reserve limit x every thread the GPU can hold: memory outside torch's allocator that
no plan counts and the context never gives back (1.57 GiB on an H200 for the GDN chunk kernel's first launch,
benchmarks/RESULTS.md, eighth session). tests/data/triton_launches_qwen36_sm90.json holds every launch the
engine compiled on an H200 at the Qwen3.6 shape (Q8_0 and Q4_K_M experts; fused, offload, hybrid; decode and
prefill), as Triton specialised it; each is compiled here for sm_90 by the real compiler and its frame read from
the cubin. A kernel whose signature changed no longer compiles from its record: run benchmarks/gpu_mem_probe.sh on
a GPU and rewrite the file from its JSON (the GDN chunk kernel has its own test, tests/test_gdn_triton.py)."""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_harness import HAS_TRITON, compile_sm90, frame_bytes  # noqa: E402

from moestream.layers import triton_ops  # noqa: E402

DATA = json.loads((Path(__file__).resolve().parent / "data" / "triton_launches_qwen36_sm90.json").read_text())
LAUNCHES = DATA["launches"]


def _id(rec: dict) -> str:
    cs = ",".join(f"{k}={v}" for k, v in sorted(rec["constexprs"].items(), key=lambda kv: int(kv[0])))
    return f"{rec['kernel']}[{cs}]"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("rec", LAUNCHES, ids=[_id(r) for r in LAUNCHES])
def test_launch_stays_within_the_default_frame(rec):
    fn = getattr(importlib.import_module(rec["module"]), rec["kernel"])
    consts = {(int(i),): v for i, v in rec["constexprs"].items()}
    k = compile_sm90(fn, rec["signature"], consts, {"num_warps": rec["num_warps"], "num_stages": rec["num_stages"]})
    assert frame_bytes(k) <= triton_ops.DRIVER_STACK_LIMIT, (rec["kernel"], frame_bytes(k), rec["h200"])


def test_the_record_covers_the_decode_and_prefill_kernels():
    """The launches recorded include the kernels of every GPU path the benchmarks run (a file cut short by a
    failed probe would pass the test above vacuously)."""
    kernels = {r["kernel"] for r in LAUNCHES}
    for name in ("_gguf_gate_up_kernel", "_gguf_down_kernel", "_route_kernel", "_stage_kernel", "_post_kernel",
                 "_collect_kernel", "_gate_up_kernel", "_down_kernel", "_gdn_decode_kernel", "_rms_kernel"):
        assert name in kernels, name
    assert all(r["h200"]["local_bytes"] == 0 for r in LAUNCHES)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_gated_norm_with_head_map_compiles_within_the_frame():
    """The gated norm writing a Gated DeltaNet's value heads in out_proj's stored order (MAPPED, after
    GatedDeltaNet.absorb_out_perm; recorded after the launches above) compiles for sm_90 within the default frame."""
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "g_ptr": "*bf16", "y_ptr": "*bf16", "r_ptr": "*i32", "h_ptr": "*bf16",
           "N": "i32", "eps": "fp32", "G_INNER": "i32", "G_STRIDE": "i32"}
    consts = dict(ZERO_CENTERED=False, GATED=True, ADD=False, BLOCK=128, MAPPED=True, D_GROUP=32)
    k = compile_sm90(triton_ops._rms_kernel, {**sig, **{n: "constexpr" for n in consts}}, consts, {"num_warps": 4})
    assert frame_bytes(k) <= triton_ops.DRIVER_STACK_LIMIT
