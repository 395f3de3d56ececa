"""GPU diagnostic (issue 13): where offload's values part from fused's on tiny HF-quantized checkpoints.

Run on the GPU machine: `python3 -m pytest -q -s -p no:cacheprovider benchmarks/hf_offload_probe.py`. For each
case it prints the bank arrays (dtype, shape) of fused's device banks, the host banks and offload's pools, then the
max |logit - fused's| over one prompt's positions (one prefill pass, tests/test_engine_parity.full_logits) and the
greedy tokens of fused / offload with and without prefetch, with the grouped kernels or the per-expert loop."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_engine_parity import full_logits  # noqa: E402
from conftest import tiny_checkpoint  # noqa: E402,F401  (fixtures)
from test_hf_quant import _tokens, quantized  # noqa: E402,F401

from moestream import LLM  # noqa: E402
from moestream.moe import compute  # noqa: E402

VARIANTS = {
    "fused": ("fused", {}),
    "offload c3 pf-off": ("offload", {"moe_cache_size": 3, "moe_prefetch": "off"}),
    "offload c3 pf-on": ("offload", {"moe_cache_size": 3, "moe_prefetch": "on"}),
    "offload c5 pf-off": ("offload", {"moe_cache_size": 5, "moe_prefetch": "off"}),
}


def _arrays(d: dict) -> str:
    return ", ".join(f"{n}:{str(t.dtype)[6:]}{tuple(t.shape)}" for n, t in d.items())


DEVICE = os.environ.get("PROBE_DEVICE", "cuda")  # cpu: a dry run of the script


@pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["nvfp4-qwen35", "fp8_block16x32-qwen35", "modelopt_fp8-qwen3-stacked"])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("dense", ["auto", "1"])
def test_probe(case, grouped, dense, quantized, monkeypatch):
    """dense: MOESTREAM_DENSE_QUANT (auto: fused dequantizes the dense layers to bf16 where every expert fits,
    offload keeps them compressed; 1: compressed in both)."""
    qdir, _, _ = quantized(case)
    monkeypatch.setenv("MOESTREAM_DENSE_QUANT", dense)
    if not grouped:
        if dense != "1":
            pytest.skip("the loop only with the dense layers alike")
        monkeypatch.setattr(compute, "grouped_bank_ready", lambda x, bank, fmt: False)
    print(f"\n== {case} grouped={grouped} MOESTREAM_DENSE_QUANT={dense}")
    ref = toks0 = None
    for name, (backend, kw) in VARIANTS.items():
        llm = LLM(qdir, moe_backend=backend, device=DEVICE, dtype="bfloat16", chunked_prefill_size=7,
                  max_running_requests=4, **kw)
        rt = llm.engine.runtime
        layer = rt.store.moe_layers[0] if hasattr(rt.store, "moe_layers") else 0
        try:
            if name in ("fused", "offload c3 pf-off"):
                print(f"  {name} store bank: {_arrays(rt.store.bank(layer))}")
                for attr in ("cache", "strategy", "prefill"):
                    obj = getattr(rt, attr, None)
                    pool = getattr(obj, "pool", None)
                    if pool is not None:
                        print(f"  {name} {attr}.pool: {_arrays(pool.arrays)}")
        except Exception as e:  # noqa: BLE001 - a diagnostic
            print(f"  (arrays: {e!r})")
        ids = list(range(4, 11))  # one chunk (chunked_prefill_size 7): one prefill pass
        lg = full_logits(llm, ids).float()
        toks = _tokens(llm)
        rt.close()
        if ref is None:
            ref, toks0 = lg, toks
        print(f"  {name:20s} max|logits - fused| {(lg - ref).abs().max().item():.4g}  "
              f"argmax agree {(lg.argmax(-1) == ref.argmax(-1)).float().mean().item():.2f}  "
              f"tokens {'== fused' if toks == toks0 else toks}")
