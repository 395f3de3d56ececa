"""moestream.layers.attn_prefill: the paged prefill attention kernel equals causal attention over the sequence's own
K/V rows (float64 reference).

* Interpreter: every case runs once in a subprocess with TRITON_INTERPRET=1 on CPU tensors (float32 caches, full-fp32
  dots: 1e-5), each reported as its own test. Needs only `triton`.
* Compiler: the kernel compiles for sm_90 and sm_80 (bf16, Qwen3.6's head dim 256 and 8 query heads per KV head)
  with tensor-core dots and no spilled registers (no GPU needed).
* CUDA: bf16 against the reference, and the engine's long-context prefill takes it; skipped without a GPU.

Run as a script (`python tests/test_attn_prefill.py --worker OUT.json`) it is the interpreter worker.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the worker runs as a script: find moestream
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_attention_slices import reference as causal_reference  # noqa: E402
from triton_harness import (HAS_TRITON, assert_case, compile_sm90, frame_bytes, interpreted_results,  # noqa: E402
                            write_case_results)

# name -> (chunk rows L, cached positions before it, query heads, KV heads, head dim, fp8 cache)
CASES = {
    "first-chunk-gqa8": (40, 0, 16, 2, 64, False),  # Qwen3.6's 8 query heads per KV head, plain causal
    "after-cache": (37, 300, 8, 2, 32, False),  # a late chunk: rows of the last tile past L, a partial key block
    "mha": (20, 50, 4, 4, 16, False),  # one query head per KV head
    "gqa3": (33, 100, 9, 3, 64, False),  # a group size that is not a power of two (SmolLM2): padded heads
    "one-row": (1, 90, 8, 2, 32, False),
    "fp8-cache": (24, 70, 8, 2, 32, True),  # e4m3fn keys and values decoded in registers
}


def reference(q, k, v, cached, scale):
    """q [L, H, D], k/v [cached + L, Hk, D] -> [L, H, D] float64: row i sees keys 0 .. cached + i."""
    return causal_reference(q, k, v, cached, scale, q.shape[1] // k.shape[1])


def make_case(case: str, device="cpu", dtype=torch.float32):
    L, cached, H, Hk, D, fp8 = CASES[case]
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    tokens = cached + L + 29
    k_cache = (torch.randn(tokens, Hk, D, generator=g) * 2).to(torch.float8_e4m3fn if fp8 else dtype)
    v_cache = torch.randn(tokens, Hk, D, generator=g).to(torch.float8_e4m3fn if fp8 else dtype)
    q = torch.randn(L, H, D, generator=g).to(dtype)
    index = torch.randperm(tokens, generator=g)[:cached + L]  # the sequence's rows scattered over the pool
    return [t.to(device) for t in (q, k_cache, v_cache, index)], cached, D ** -0.5


def check(case: str, device="cpu", dtype=torch.float32, tol=1e-5) -> list[str]:
    from moestream.layers import attn_prefill

    (q, k, v, index), cached, scale = make_case(case, device, dtype)
    assert attn_prefill.usable(q, k, force=True)
    got = attn_prefill.prefill_attention(q, k, v, index, cached, scale)
    if got is None:
        return [f"kernel failed: {attn_prefill._FAILED}"]
    rows = index.cpu()
    want = reference(q.cpu(), k.cpu()[rows].float(), v.cpu()[rows].float(), cached, scale)
    err = (got.double().cpu() - want).abs().max().item()
    return [] if err <= tol and got.dtype == q.dtype and got.shape == q.shape else [f"max error {err:.3g}"]


def _worker(out_path: str) -> None:
    write_case_results(CASES, check, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_matches_causal_attention(interpreted, case):
    assert_case(interpreted, case)


def test_cpu_tensors_keep_torch_and_a_failing_kernel_falls_back_once(monkeypatch, caplog):
    pytest.importorskip("triton")
    from moestream.layers import attn_prefill

    (q, k, v, index), cached, scale = make_case("mha")
    assert not attn_prefill.usable(q, k)  # CPU tensors: the torch path
    monkeypatch.setattr(attn_prefill, "_FAILED", [])

    def fails(err):
        def run(*args):
            raise err
        return run

    monkeypatch.setattr(attn_prefill, "_prefill_attention", fails(torch.cuda.OutOfMemoryError("x")))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        attn_prefill.prefill_attention(q, k, v, index, cached, scale)
    monkeypatch.setattr(attn_prefill, "_prefill_attention", fails(RuntimeError("no bf16 mma")))
    with caplog.at_level("WARNING", logger="moestream.layers"):
        assert attn_prefill.prefill_attention(q, k, v, index, cached, scale) is None
    assert "paged prefill attention disabled" in caplog.text and "no bf16 mma" in caplog.text
    assert not attn_prefill.usable(q, k, force=True)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("D,G,fp8", [(256, 8, False), (256, 8, True), (128, 4, False)])
def test_kernel_compiles_without_spills(arch, D, G, fp8):
    from moestream.layers import attn_prefill as ap

    elt = "*u8" if fp8 else "*bf16"
    ptrs = {"q_ptr": "*bf16", "k_ptr": elt, "v_ptr": elt, "idx_ptr": "*i64", "o_ptr": "*bf16"}
    ints = {n: "i32" for n in ("Q_ST", "Q_SH", "K_ST", "K_SH", "V_ST", "V_SH", "O_ST", "O_SH", "L", "cached")}
    GP = 1 << (G - 1).bit_length()
    consts = {"G": G, "GP": GP, "ROWS": ap.TILE_ROWS // GP, "D": D, "BLOCK": ap.BLOCK_N, "IEEE": False,
              "WHILE": False, "FP8": fp8}
    sig = {**ptrs, **ints, "scale": "fp32", **{n: "constexpr" for n in consts}}
    k = compile_sm90(ap._prefill_kernel, sig, consts, {"num_warps": 4 if D <= 128 else 8, "num_stages": 2},
                     arch=arch)
    assert "mma" in k.asm["ptx"]  # the scores and P.V on tensor cores
    assert frame_bytes(k) == 0  # nothing spilled to local memory


# --------------------------------------------------------------------------- CUDA
cuda = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")


@cuda
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_bf16_matches_reference(case):
    errs = check(case, "cuda", torch.bfloat16, tol=3e-2)
    assert not errs, errs


@cuda
def test_cuda_long_context_prefill_takes_the_kernel(monkeypatch):
    """Attention.forward of a chunk past the gather bound on a GPU runs the kernel, not the torch blocks, and equals
    the gathered path."""
    from moestream.layers import attention as am
    from moestream.layers import attn_prefill
    from moestream.layers.attention import Attention, kv_rows

    H, Hk, D, cached, L = 16, 2, 256, 3000, 200
    a = Attention(H * D, H, Hk, D, 1e-6, False, False, True).cuda()
    torch.manual_seed(0)
    kp = torch.randn(cached + L + 10, Hk, D, device="cuda", dtype=torch.bfloat16)
    vp = torch.randn_like(kp)
    index = torch.randperm(cached + L + 10, device="cuda")[:cached + L]
    q = torch.randn(L, H, D, device="cuda", dtype=torch.bfloat16)
    calls = []
    orig = attn_prefill.prefill_attention
    monkeypatch.setattr(attn_prefill, "prefill_attention", lambda *a_: calls.append(1) or orig(*a_))
    monkeypatch.setattr(am, "GATHER_BYTES", 1024)
    got = a._attend_long(q, kp, vp, index, cached)
    want = a._attend(q, kv_rows(kp, index, q.dtype), kv_rows(vp, index, q.dtype), cached)
    assert calls and (got.float() - want.float()).abs().max().item() < 3e-2


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _worker(sys.argv[2])
