"""moestream.quant.planar: Q8_0, Q4_K and Q6_K dense layers in the planar layouts (codes apart from their block scales)
hold the stored values exactly; the GEMVs equal the float64 product of the dequantized weight within the fp32 bound
of tests/test_qpairs.py (`_bound`: two fp32 sums of the same products in any order), taken for Q4_K over the terms it
sums (d sc q x and dm mn x per sub-block: the scale and min are applied per sub-block, so their products are the terms),
for Q6_K over d sc q x and d sc 32 x;
the 16-bit dense forms are the block decoder's, to the bit.

* Interpreter: the cases run once in a subprocess with TRITON_INTERPRET=1 (tests/triton_harness.py), on CPU tensors.
* sm_90: the GEMV compiles for an H100 with 16-byte loads of the codes (the layout's reason to exist), no byte loads.
* CUDA (skipped without a GPU): the default launch constants at decode shapes, recorded in a CUDA graph; a tiny Q8_0
  GGUF served on the GPU holds its dense layers planar and gives the block layout's greedy tokens.

Run as a script (`python tests/test_planar.py --worker OUT.json`) it is the interpreter worker.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the worker runs as a script: find moestream
sys.path.insert(0, str(Path(__file__).resolve().parent))
from moestream.quant import planar  # noqa: E402
from moestream.quant import gguf_format  # noqa: E402
from moestream.quant.synthetic import random_raw  # noqa: E402
from triton_harness import HAS_TRITON, assert_case, compile_sm90, interpreted_results, write_case_results  # noqa: E402

Q8 = gguf_format("Q8_0")
Q4K = gguf_format("Q4_K")


def _bound(terms_abs_sum: torch.Tensor, K: int) -> torch.Tensor:
    return 2 * (K + 2) * 2.0 ** -24 * terms_abs_sum + 1e-30


def _terms(qtype: str, raw: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """|the weight's terms| [N, K] float64 whose products with |x| bound the GEMV's error: |W| for Q8_0 (d q), for Q4_K
    |d sc q| + |dm mn| (its kernel sums d sc q x and dm mn x apart, per sub-block), for Q6_K |d sc| (q + 32)."""
    fmt = gguf_format(qtype)
    if qtype == "Q8_0":
        return fmt.dequantize(raw.cpu(), (N, K), torch.float64).abs()
    if qtype == "Q6_K":  # d sc q x and d sc 32 x per sub-block (q unsigned)
        p = planar.repack("Q6_K", raw.cpu(), N, K)
        ql = p["ql"].view(N, K // 256, 2, 2, 32)
        qh = p["qh"].view(N, K // 256, 2, 1, 32)
        q = torch.cat([ql & 0xF, ql >> 4], dim=3) | (torch.cat([(qh >> (2 * m)) & 3 for m in range(4)], dim=3) << 4)
        dl = (p["d"].double().repeat_interleave(16, dim=1) * p["sc"].double()).abs()
        return (dl[:, :, None] * (q.double().view(N, K // 16, 16) + 32)).view(N, K)
    p = planar.repack("Q4_K", raw.cpu(), N, K)
    qs = p["qs"].view(N, K // 256, 4, 32)
    q = torch.stack([qs & 0xF, qs >> 4], dim=3).double().view(N, K // 32, 32)
    d = p["d"].double().repeat_interleave(8, dim=1)[:, :, None].abs()
    dm = p["dm"].double().repeat_interleave(8, dim=1)[:, :, None].abs()
    return (d * p["sc"].double()[:, :, None] * q + dm * p["mn"].double()[:, :, None]).view(N, K)


def _linear_errors(qtype: str, N: int, K: int, T: int, dtype, perm: bool, cfg, device="cpu") -> list[str]:
    fmt = gguf_format(qtype)
    raw = random_raw(fmt, (N, K), device, seed=N + K + T)
    packed = planar.repack(qtype, raw, N, K)
    W = fmt.dequantize(raw.cpu(), (N, K), torch.float64).to(device)
    x = (torch.randn(T, K, generator=torch.Generator().manual_seed(T)) * 0.5).to(dtype).to(device)
    p = torch.randperm(K, generator=torch.Generator().manual_seed(1)).to(device) if perm else None
    xs = x.double() if p is None else x.double()[:, p]
    got = planar.linear(qtype, x, packed, N, K, p, cfg).double()
    want = xs @ W.t()
    tol = _bound(xs.abs() @ _terms(qtype, raw, N, K).to(device).t(), K)
    if dtype == torch.bfloat16:  # the output rounded to bf16 once (to nearest: half an ulp)
        tol = tol + 2.0 ** -8 * want.abs()
    errs = []
    if got.shape != (T, N):
        errs.append(f"shape {tuple(got.shape)}")
    elif ((got - want).abs() > tol).any():
        errs.append(f"{qtype} N={N} K={K} T={T} {dtype} perm={perm} cfg={cfg}: max err "
                    f"{(got - want).abs().max().item():.3g}")
    return errs


def _dense_errors(qtype: str) -> list[str]:
    errs = []
    fmt = gguf_format(qtype)
    N, K = 24, 3 * planar.BLOCK[qtype]
    raw = random_raw(fmt, (N, K), "cpu", seed=7)
    packed = planar.repack(qtype, raw, N, K)
    held = sum(t.numel() * t.element_size() for t in packed.values())
    if held != raw.numel() * (148 if qtype == "Q4_K" else 144) // 144:  # Q4_K: scales and mins unpacked
        errs.append(f"the planar layout holds {held} bytes for {raw.numel()} stored")
    for dtype in (torch.float32, torch.bfloat16):
        if not torch.equal(planar.dense(qtype, packed, N, K, dtype), fmt.dequantize(raw, (N, K), dtype)):
            errs.append(f"dense {dtype} differs from the block decoder")
    if not torch.equal(planar.dense_torch(qtype, packed, N, K), fmt.dequantize(raw, (N, K), torch.float32)):
        errs.append("dense_torch differs from the block decoder")
    return errs


def _module_errors() -> list[str]:
    """QuantLinear.to_planar: Q8_0, Q4_K and Q6_K layers move (Q8_0 holding the same bytes: the plan's count), others
    not;
    the same products on the CPU fallback and for a prefill's rows; a second call changes nothing."""
    import os

    from moestream.engine.engine import dense_bytes_held
    from moestream.layers.quant_linear import QuantLinear, to_planar

    os.environ["MOESTREAM_PLANAR"] = "Q8_0,Q4_K,Q6_K"
    planar._CFG.clear()
    errs = []
    lins = {q: QuantLinear(q, random_raw(gguf_format(q), (40, 256), "cpu", seed=3), 40, 256)
            for q in ("Q8_0", "Q4_K", "Q6_K", "Q4_0")}
    raws = {q: m.raw.clone() for q, m in lins.items()}
    q8 = torch.nn.Sequential(lins["Q8_0"])
    before = dense_bytes_held(q8)
    x = torch.randn(3, 256)
    if to_planar(torch.nn.Sequential(*lins.values())) != 3 or lins["Q4_0"].planar is not None \
            or any(lins[q].raw.numel() for q in planar.TYPES) or lins["Q8_0"].to_planar():
        errs.append("to_planar moved other than the Q8_0, Q4_K and Q6_K layers, or moved one twice")
    if dense_bytes_held(q8) != before:
        errs.append(f"held bytes {dense_bytes_held(q8)} != {before}")
    for q in planar.TYPES:
        W = gguf_format(q).dequantize(raws[q], (40, 256), torch.float64)
        got = lins[q](x).double()
        if ((got - x.double() @ W.t()).abs() > _bound(x.double().abs() @ _terms(q, raws[q], 40, 256).t(), 256)).any():
            errs.append(f"the planar {q} module's product differs")
        if not torch.equal(lins[q].dense(torch.float32), W.float()):
            errs.append(f"{q} dense() differs")
    del os.environ["MOESTREAM_PLANAR"]
    planar._CFG.clear()
    return errs


# (type, N, K, T, dtype, perm, cfg): rows not a multiple of BN (masked), K of one to several steps, 1-9 activation
# rows (RT rows a program: the rest masked), x gathered through a permutation, both Q8_0 accumulations
LINEAR_CASES = {
    "q8:t1": ("Q8_0", 40, 256, 1, torch.float32, False, (8, 128, 4, 1, False)),
    "q8:t1elem": ("Q8_0", 40, 256, 1, torch.float32, False, (8, 128, 4, 1, True)),
    "q8:t3bf16": ("Q8_0", 40, 256, 3, torch.bfloat16, False, (4, 64, 4, 4, False)),
    "q8:t9perm": ("Q8_0", 24, 96, 9, torch.float32, True, (8, 32, 4, 8, True)),
    "q8:t2permbf16": ("Q8_0", 33, 128, 2, torch.bfloat16, True, (16, 128, 4, 2, False)),
    "q8:default": ("Q8_0", 40, 256, 3, torch.float32, False, None),
    "q4k:t1": ("Q4_K", 40, 768, 1, torch.float32, False, (8, 256, 4, 1, False)),
    "q4k:t3bf16": ("Q4_K", 33, 512, 3, torch.bfloat16, False, (4, 512, 4, 4, False)),
    "q4k:t9perm": ("Q4_K", 24, 512, 9, torch.float32, True, (8, 256, 4, 8, False)),
    "q4k:default": ("Q4_K", 40, 1024, 2, torch.float32, False, None),
    "q6k:t1": ("Q6_K", 40, 768, 1, torch.float32, False, (8, 256, 4, 1, False)),
    "q6k:t3bf16": ("Q6_K", 33, 512, 3, torch.bfloat16, False, (4, 512, 4, 4, False)),
    "q6k:t9perm": ("Q6_K", 24, 512, 9, torch.float32, True, (8, 256, 4, 8, False)),
    "q6k:default": ("Q6_K", 40, 1024, 2, torch.float32, False, None),
    "q4k:t1elem": ("Q4_K", 40, 768, 1, torch.float32, False, (8, 256, 4, 1, True)),
    "q4k:t3permelem": ("Q4_K", 33, 512, 3, torch.bfloat16, True, (4, 512, 4, 4, True)),
    "q6k:t1elem": ("Q6_K", 40, 768, 1, torch.float32, False, (8, 256, 4, 1, True)),
    "q6k:t9permelem": ("Q6_K", 24, 512, 9, torch.bfloat16, True, (8, 256, 4, 8, True)),
}
WORKER_CASES = [*LINEAR_CASES, "dense:Q8_0", "dense:Q4_K", "dense:Q6_K", "module"]


def _worker_case(case: str) -> list[str]:
    if case.startswith("dense:"):
        return _dense_errors(case[6:])
    if case == "module":
        return _module_errors()
    return _linear_errors(*LINEAR_CASES[case])


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory)


@pytest.mark.parametrize("case", WORKER_CASES)
def test_interpreted_planar(interpreted, case):
    assert_case(interpreted, case)


def test_repack_keeps_the_stored_values():
    """On the CPU, no Triton: Q8_0's codes and scales are the blocks' bytes in order; Q4_K's code bytes too, its
    scales and mins the unpacked six-bit fields; the torch dense form is the block decoder's."""
    N, K = 5, 256
    raw = random_raw(Q8, (N, K), "cpu", seed=2)
    p = planar.repack("Q8_0", raw, N, K)
    b = raw.reshape(N, K // 32, 34)
    assert torch.equal(p["q"].view(torch.uint8).reshape(N, K // 32, 32), b[:, :, 2:])
    assert torch.equal(p["d"].view(torch.uint8).reshape(N, K // 32, 2), b[:, :, :2])
    with pytest.raises(ValueError):
        planar.repack("Q8_0", raw, N, 48)  # rows of whole 32-value blocks only
    raw4 = random_raw(Q4K, (N, K), "cpu", seed=2)
    p4 = planar.repack("Q4_K", raw4, N, K)
    b4 = raw4.reshape(N, 144)
    assert torch.equal(p4["qs"], b4[:, 16:]) and torch.equal(p4["d"].view(torch.uint8), b4[:, 0:2])
    assert int(p4["sc"].max()) < 64 and int(p4["mn"].max()) < 64
    raw6 = random_raw(gguf_format("Q6_K"), (N, K), "cpu", seed=2)
    p6 = planar.repack("Q6_K", raw6, N, K)
    b6 = raw6.reshape(N, 210)
    assert torch.equal(torch.cat([p6["ql"], p6["qh"], p6["sc"].view(torch.uint8), p6["d"].view(torch.uint8)], 1), b6)
    for q, r, pk in (("Q8_0", raw, p), ("Q4_K", raw4, p4), ("Q6_K", raw6, p6)):
        assert torch.equal(planar.dense_torch(q, pk, N, K), gguf_format(q).dequantize(r, (N, K), torch.float32))


@pytest.mark.parametrize("qtype, T, env, want", [
    ("Q8_0", 1, "", (8, 256, 4, 1, True)), ("Q8_0", 4, "", (2, 256, 4, 4, True)),
    ("Q4_K", 1, "", (16, 256, 4, 1, True)),
    ("Q6_K", 1, "", (32, 256, 4, 1, True)), ("Q6_K", 3, "", (8, 256, 4, 4, True)),
    ("Q8_0", 1, "4,512,8", (4, 512, 8, 1, True)), ("Q4_K", 1, "4,128,4", (4, 256, 4, 1, True)),
    ("Q8_0", 1, "4,512", (8, 256, 4, 1, True))])
def test_launch_constants(qtype, T, env, want, monkeypatch):
    """The defaults (BV 256, a load of codes ~2 KiB, the elementwise form: the H100 sweep's best for Q8_0) and
    MOESTREAM_PLANAR_CFG's BN, BV, warps (BV at least a block; malformed: the defaults)."""
    monkeypatch.setenv("MOESTREAM_PLANAR_CFG", env)
    monkeypatch.setattr(planar, "_CFG", {})
    assert planar.config(qtype, 8192, 2048, T) == want


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("qtype,cfg", [("Q8_0", (2, 1024, 4, 1, False)), ("Q8_0", (8, 512, 4, 1, True)),
                                       ("Q8_0", (4, 512, 4, 4, False)), ("Q4_K", (4, 1024, 4, 1, False)),
                                       ("Q6_K", (8, 1024, 4, 1, False)), ("Q8_0", (8, 256, 4, 1, True)),
                                       ("Q4_K", (16, 256, 4, 1, True)), ("Q6_K", (32, 256, 4, 1, True))])
def test_sm90_codes_load_16_bytes(qtype, cfg):
    """Compiled for sm_90 at a Qwen3.6 shape (pointers 16-byte aligned, as torch allocates them): the codes and x are
    read with 128-bit loads and no load is a single byte."""
    import re
    import subprocess

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        pytest.skip("no cuobjdump in this triton build")
    bn, bv, warps, rt, elem = cfg
    consts = {"N": 8192, "K": 2048, "BN": bn, "BV": bv, "RT": rt, "Y_BF16": True, "PERM": False, "ELEM": elem}
    if qtype == "Q8_0":
        fn, sig = planar._q8_linear_kernel, {"x": "*bf16", "q": "*i8", "d": "*fp16", "y": "*i16", "perm": "*i64",
                                             "T": "i32"}
    elif qtype == "Q6_K":
        fn, sig = planar._q6k_linear_kernel, {"x": "*bf16", "ql": "*u8", "qh": "*u8", "sc": "*i8", "d": "*fp16",
                                              "y": "*i16", "perm": "*i64", "T": "i32"}
    else:
        fn, sig = planar._q4k_linear_kernel, {"x": "*bf16", "qs": "*u8", "sc": "*u8", "mn": "*u8", "d": "*fp16",
                                              "dm": "*fp16", "y": "*i16", "perm": "*i64", "T": "i32"}
    n_ptr = len(sig) - 1
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if __import__("os").environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: kernels are interpreted, not compiled")
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(n_ptr)}  # as the launcher specializes aligned tensors
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
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
    if qtype == "Q8_0":  # (Q4_K's six-bit scales and mins are bytes of their own, read as such)
        assert not any(ld.endswith((".U8", ".S8")) for ld in loads), loads


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
@pytest.mark.parametrize("T", [1, 4, 9])
@pytest.mark.parametrize("perm", [False, True])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_cuda_planar_linear(qtype, T, perm):
    """The default constants at a Qwen3.6 shape on the GPU: the float64 product's bound."""
    assert not _linear_errors(qtype, 4096, 2048, T, torch.bfloat16, perm, None, "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_cuda_planar_linear_graph_replay(qtype):
    """Recorded in a CUDA graph, replayed on new x: the eager result; the dense form is the block decoder's."""
    N, K = 2048, 4096
    raw = random_raw(gguf_format(qtype), (N, K), "cuda", seed=1)
    packed = planar.repack(qtype, raw, N, K)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    planar.linear(qtype, x, packed, N, K)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = planar.linear(qtype, x, packed, N, K)
    x.copy_(torch.randn(1, K, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, planar.linear(qtype, x, packed, N, K))
    assert torch.equal(planar.dense(qtype, packed, N, K, torch.bfloat16),
                       gguf_format(qtype).dequantize(raw.cpu(), (N, K), torch.bfloat16).cuda())


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
def test_cuda_q8_gguf_planar_tokens(tmp_path, monkeypatch, tiny_checkpoint):
    """A tiny Qwen3.6-shaped Q8_0 GGUF on the GPU with its dense layers kept compressed: every Q8_0 linear planar (raw
    released, the plan's dense bytes the bytes held), and the greedy tokens of the block layout
    (MOESTREAM_PLANAR=0)."""
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
        monkeypatch.setenv("MOESTREAM_PLANAR", "Q8_0" if on == "1" else "0")
        planar._CFG.clear()
        llm = LLM(path, device="cuda", dtype="float32", moe_backend="fused")
        lins = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear) and m.fmt.type_name == "Q8_0"]
        assert lins and all((m.planar == "Q8_0") == (on == "1") for m in lins)
        assert llm.engine.plan.bytes.dense == dense_bytes_held(llm.engine.model)
        tokens[on] = [o.token_ids for o in llm.generate(prompts, sp)]
        del llm, lins
        torch.cuda.empty_cache()
    planar._CFG.clear()
    assert tokens["1"] == tokens["0"]


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    write_case_results(WORKER_CASES, _worker_case, sys.argv[2])


def test_unknown_planar_type_names_are_reported(monkeypatch, caplog):
    """MOESTREAM_PLANAR names a type without a planar layout (or a typo): one warning naming it; the known ones
    still count where Triton runs."""
    monkeypatch.setenv("MOESTREAM_PLANAR", "Q8_0, Q5_K,q4k")
    monkeypatch.setattr(planar, "_CFG", {})
    with caplog.at_level("WARNING", logger="moestream"):
        planar.wanted("Q8_0")
    assert "no planar layout for Q5_K, q4k" in caplog.text
    assert not planar.wanted("Q5_K") and not planar.wanted("Q4_K")


@pytest.mark.parametrize("env", [None, "wide", "0", "Q4_K"])
def test_default_takes_wide_q8_0_and_q6_k_matrices_only(env, monkeypatch):
    """Unset (or "wide"): Q8_0 and Q6_K matrices of WIDE_ROWS rows or more (the heads, where the kernels measured
    faster), nothing narrower and no other type; "0": none; a list: those types at every shape and nothing else."""
    if env is None:
        monkeypatch.delenv("MOESTREAM_PLANAR", raising=False)
    else:
        monkeypatch.setenv("MOESTREAM_PLANAR", env)
    monkeypatch.setattr(planar, "_CFG", {})
    monkeypatch.setattr("moestream.env.triton_enabled", lambda: True)
    wide, narrow = planar.WIDE_ROWS, planar.WIDE_ROWS - 1
    got = {(q, n): planar.wanted(q, n) for q in planar.TYPES for n in (wide, 151936, narrow, 2048)}
    if env in (None, "wide"):
        want = {(q, n): q in ("Q8_0", "Q6_K") and n >= wide for q, n in got}
    elif env == "0":
        want = {key: False for key in got}
    else:
        want = {(q, n): q == "Q4_K" for q, n in got}
    assert got == want
    assert not planar.wanted("Q6_K")  # rows unknown: only a named type


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K"])
def test_cuda_wide_planar_module_tiles_many_rows(qtype, monkeypatch):
    """A planar head's many-row product (more rows than the GEMV takes) decoded a tile of rows at a time, as the block
    layout's qlinear does: equal to one whole-matrix GEMM's (up to a bf16 rounding)."""
    import moestream.quant.base as qbase
    from moestream.layers.quant_linear import GPU_GEMV_ROWS, QuantLinear

    monkeypatch.setenv("MOESTREAM_PLANAR", qtype)
    monkeypatch.setattr(planar, "_CFG", {})
    N, K = 4000, 256
    lin = QuantLinear(qtype, random_raw(gguf_format(qtype), (N, K), "cpu", seed=5), N, K)
    assert lin.to_planar()
    lin = lin.cuda()
    x = torch.randn(GPU_GEMV_ROWS + 3, K, device="cuda", dtype=torch.bfloat16)
    whole = lin(x)
    monkeypatch.setattr(qbase, "GPU_TILE_BYTES", 600 * K * 2)  # tiles of 600 rows: 7, the last partial
    tiled = lin(x)
    # the same bf16 operands; cuBLAS may pick another reduction order for a tile's GEMM than the whole one's: within
    # one bf16 rounding of the outputs
    torch.testing.assert_close(tiled.float(), whole.float(), rtol=2 ** -7, atol=2 ** -7 * float(whole.abs().max()))
