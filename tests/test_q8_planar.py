"""moestream.kernels.q8_planar: a Q8_0 dense layer in the planar layout (codes and block scales apart) holds the stored
values exactly, and its GEMV equals the float64 product of the dequantized weight within the fp32 bound of
tests/test_qpairs.py (`_bound`: two fp32 sums of the same products in any order); its 16-bit dense form is the block
decoder's, to the bit.

* Interpreter: the cases run once in a subprocess with TRITON_INTERPRET=1 (tests/triton_harness.py), on CPU tensors.
* sm_90: the GEMV compiles for an H100 with 16-byte loads of the codes (the layout's reason to exist), no byte loads.
* CUDA (skipped without a GPU): the default launch constants at decode shapes, recorded in a CUDA graph; a tiny Q8_0
  GGUF served on the GPU holds its dense layers planar and gives the block layout's greedy tokens.

Run as a script (`python tests/test_q8_planar.py --worker OUT.json`) it is the interpreter worker.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the worker runs as a script: find moestream
sys.path.insert(0, str(Path(__file__).resolve().parent))
from moestream.kernels import q8_planar  # noqa: E402
from moestream.quant import gguf_format  # noqa: E402
from moestream.quant.synthetic import random_raw  # noqa: E402
from triton_harness import HAS_TRITON, assert_case, compile_sm90, interpreted_results, write_case_results  # noqa: E402

Q8 = gguf_format("Q8_0")


def _bound(terms_abs_sum: torch.Tensor, K: int) -> torch.Tensor:
    return 2 * (K + 2) * 2.0 ** -24 * terms_abs_sum + 1e-30


def _linear_errors(N: int, K: int, T: int, dtype, perm: bool, cfg, device="cpu") -> list[str]:
    raw = random_raw(Q8, (N, K), device, seed=N + K + T)
    packed = q8_planar.repack(raw, N, K)
    W = Q8.dequantize(raw.cpu(), (N, K), torch.float64).to(device)
    x = (torch.randn(T, K, generator=torch.Generator().manual_seed(T)) * 0.5).to(dtype).to(device)
    p = torch.randperm(K, generator=torch.Generator().manual_seed(1)).to(device) if perm else None
    xs = x.double() if p is None else x.double()[:, p]
    got = q8_planar.linear(x, packed, N, K, p, cfg).double()
    want = xs @ W.t()
    tol = _bound(xs.abs() @ W.abs().t(), K)
    if dtype == torch.bfloat16:  # the output rounded to bf16 once (to nearest: half an ulp)
        tol = tol + 2.0 ** -8 * want.abs()
    errs = []
    if got.shape != (T, N):
        errs.append(f"shape {tuple(got.shape)}")
    elif ((got - want).abs() > tol).any():
        errs.append(f"N={N} K={K} T={T} {dtype} perm={perm} cfg={cfg}: max err {(got - want).abs().max().item():.3g}")
    return errs


def _dense_errors() -> list[str]:
    errs = []
    N, K = 24, 96
    raw = random_raw(Q8, (N, K), "cpu", seed=7)
    packed = q8_planar.repack(raw, N, K)
    if packed["q"].numel() + 2 * packed["d"].numel() != raw.numel():
        errs.append("the planar layout holds other bytes than the blocks")
    for dtype in (torch.float32, torch.bfloat16):
        if not torch.equal(q8_planar.dense(packed, N, K, dtype), Q8.dequantize(raw, (N, K), dtype)):
            errs.append(f"dense {dtype} differs from the block decoder")
    return errs


def _module_errors() -> list[str]:
    """QuantLinear.to_planar: the same bytes held (the plan's count), the same products on the CPU fallback and for a
    prefill's rows; a second call and other types change nothing."""
    from moestream.engine.engine import dense_bytes_held
    from moestream.layers.quant_linear import QuantLinear, planar_q8

    errs = []
    N, K = 40, 64
    raw = random_raw(Q8, (N, K), "cpu", seed=3)
    lin = QuantLinear("Q8_0", raw.clone(), N, K)
    other = QuantLinear("Q4_0", random_raw(gguf_format("Q4_0"), (8, 64), "cpu", seed=4), 8, 64)
    model = torch.nn.Sequential(lin, other)
    before = dense_bytes_held(model)
    x = torch.randn(3, K)
    want = x.double() @ Q8.dequantize(raw, (N, K), torch.float64).t()
    if planar_q8(model) != 1 or lin.raw.numel() or other.q8_codes is not None or lin.to_planar():
        errs.append("planar_q8 moved other than the one Q8_0 layer, or moved it twice")
    if dense_bytes_held(model) != before:
        errs.append(f"held bytes {dense_bytes_held(model)} != {before}")
    got = lin(x).double()
    if ((got - want).abs() > _bound(x.double().abs() @ Q8.dequantize(raw, (N, K), torch.float64).abs().t(), K)).any():
        errs.append("the planar module's product differs")
    if not torch.equal(lin.dense(torch.float32), Q8.dequantize(raw, (N, K), torch.float32)):
        errs.append("dense() differs")
    return errs


# (N, K, T, dtype, perm, cfg): rows not a multiple of BN (masked), K of one to several steps, 1-9 activation rows
# (RT rows a program: the rest masked), x gathered through a permutation, both accumulations
LINEAR_CASES = {
    "t1": (40, 256, 1, torch.float32, False, (8, 128, 4, 1, False)),
    "t1elem": (40, 256, 1, torch.float32, False, (8, 128, 4, 1, True)),
    "t3bf16": (40, 256, 3, torch.bfloat16, False, (4, 64, 4, 4, False)),
    "t9perm": (24, 96, 9, torch.float32, True, (8, 32, 4, 8, True)),
    "t2permbf16": (33, 128, 2, torch.bfloat16, True, (16, 128, 4, 2, False)),
    "default": (40, 256, 3, torch.float32, False, None),
}
WORKER_CASES = [*LINEAR_CASES, "dense", "module"]


def _worker_case(case: str) -> list[str]:
    if case == "dense":
        return _dense_errors()
    if case == "module":
        return _module_errors()
    return _linear_errors(*LINEAR_CASES[case])


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory)


@pytest.mark.parametrize("case", WORKER_CASES)
def test_interpreted_planar_q8(interpreted, case):
    assert_case(interpreted, case)


def test_repack_keeps_the_stored_values():
    """On the CPU, no Triton: codes and scales are the blocks' bytes, in order."""
    N, K = 5, 64
    raw = random_raw(Q8, (N, K), "cpu", seed=2)
    p = q8_planar.repack(raw, N, K)
    b = raw.reshape(N, K // 32, 34)
    assert torch.equal(p["q"].view(torch.uint8).reshape(N, K // 32, 32), b[:, :, 2:])
    assert torch.equal(p["d"].view(torch.uint8).reshape(N, K // 32, 2), b[:, :, :2])
    with pytest.raises(ValueError):
        q8_planar.repack(raw, N, 48)  # rows of whole 32-value blocks only
    vals = (p["q"].float().view(N, K // 32, 32) * p["d"].float()[:, :, None]).view(N, K)
    assert torch.equal(vals, Q8.dequantize(raw, (N, K), torch.float32))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("cfg", [(2, 1024, 4, 1, False), (8, 512, 4, 1, True), (4, 512, 4, 4, False)])
def test_sm90_codes_load_16_bytes(cfg):
    """Compiled for sm_90 at a Qwen3.6 shape (pointers 16-byte aligned, as torch allocates them): the codes and x are
    read with 128-bit loads and no load is a single byte."""
    import re
    import subprocess

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        pytest.skip("no cuobjdump in this triton build")
    bn, bv, warps, rt, elem = cfg
    sig = {"x": "*bf16", "q": "*i8", "d": "*fp16", "y": "*i16", "perm": "*i64", "T": "i32"}
    consts = {"N": 8192, "K": 2048, "BN": bn, "BV": bv, "RT": rt, "Y_BF16": True, "PERM": False, "ELEM": elem}
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if __import__("os").environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: kernels are interpreted, not compiled")
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}  # what the launcher specializes for aligned tensors
    try:
        k = triton.compile(ASTSource(fn=q8_planar._linear_kernel, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    except (RuntimeError, FileNotFoundError) as e:
        if "ptxas" in str(e).lower():
            pytest.skip(f"no ptxas: {e}")
        raise
    cubin = Path(__import__("tempfile").mkdtemp()) / "k.cubin"
    cubin.write_bytes(k.asm["cubin"])
    sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True).stdout
    loads = re.findall(r"\bLDG\.E(?:\.[A-Z0-9]+)*", sass)
    assert any(ld.endswith(".128") for ld in loads), loads
    assert not any(ld.endswith((".U8", ".S8")) for ld in loads), loads


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
@pytest.mark.parametrize("T", [1, 4, 9])
@pytest.mark.parametrize("perm", [False, True])
def test_cuda_planar_linear(T, perm):
    """The default constants at a Qwen3.6 shape on the GPU: the float64 product's bound."""
    assert not _linear_errors(4096, 2048, T, torch.bfloat16, perm, None, "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
def test_cuda_planar_linear_graph_replay():
    """Recorded in a CUDA graph, replayed on new x: the eager result."""
    N, K = 2048, 4096
    packed = q8_planar.repack(random_raw(Q8, (N, K), "cuda", seed=1), N, K)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    q8_planar.linear(x, packed, N, K)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = q8_planar.linear(x, packed, N, K)
    x.copy_(torch.randn(1, K, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, q8_planar.linear(x, packed, N, K))


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
def test_cuda_q8_gguf_planar_tokens(tmp_path, monkeypatch, tiny_checkpoint):
    """A tiny Qwen3.6-shaped Q8_0 GGUF on the GPU with its dense layers kept compressed: every Q8_0 linear planar (raw
    released, the plan's dense bytes the bytes held), and the greedy tokens of the block layout
    (MOESTREAM_Q8_PLANAR=0)."""
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    from moestream import LLM, SamplingParams
    from moestream.engine.engine import dense_bytes_held
    from moestream.layers.quant_linear import QuantLinear

    monkeypatch.setenv("MOESTREAM_DENSE_QUANT", "1")
    path, _ = gguf_writer.write_gguf(tiny_checkpoint("qwen35_causal"), tmp_path / "m.gguf", Q.Q8_0)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 14, 3], list(range(20, 60))]
    tokens = {}
    for on in ("0", "1"):
        monkeypatch.setenv("MOESTREAM_Q8_PLANAR", on)
        q8_planar._CFG.clear()
        llm = LLM(path, device="cuda", dtype="float32", moe_backend="fused")
        lins = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear) and m.fmt.type_name == "Q8_0"]
        assert lins and all((m.q8_codes is not None) == (on == "1") for m in lins)
        assert llm.engine.plan.bytes.dense == dense_bytes_held(llm.engine.model)
        tokens[on] = [o.token_ids for o in llm.generate(prompts, sp)]
        del llm, lins
        torch.cuda.empty_cache()
    q8_planar._CFG.clear()
    assert tokens["1"] == tokens["0"]


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    write_case_results(WORKER_CASES, _worker_case, sys.argv[2])
