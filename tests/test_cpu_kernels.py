"""The compiled CPU matmuls on GGUF bytes (moestream/kernels/cpu_quant.py) against float64 references.

Block formats multiply activations rounded to int8 per block of 32 (K-quants: per 256; scale d = amax/127,
as llama.cpp does), so two references:
- exact model: the same rounding done here in float32, then float64 products: the kernel must agree to
  float32 accumulation error (rtol 1e-5 of sum |w x|) — this catches any unpacking or scale bug;
- true float64 x @ W.T: the error is bounded by the activation rounding, |x - xq| <= d/2 per value, so
  |y - y_ref| <= sum_blocks d_b / 2 * sum_{k in b} |W[i, k]| (plus the float32 slack above).
Both the AVX2 kernels (when this CPU has them) and the portable scalar ones are checked.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from moestream.kernels import cpu_quant
from moestream.quant import gguf_format, qlinear
from moestream.quant import base as qbase

IQ_TYPES = ["IQ4_NL", "MXFP4", "IQ4_XS", "IQ3_S"]  # codebook formats (4-bit levels, e2m1, the IQ3_S grid)
BLOCK_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"] + IQ_TYPES
FLOAT_TYPES = ["F16", "BF16"]
# byte offsets of fp16 scale fields in one block (ggml block structs); MXFP4's e8m0 byte is set apart
SCALES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
          "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ3_S": (0,), "MXFP4": ()}

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="CPU quant kernels could not be built here")


def _weights(name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, row_bytes] GGUF bytes: random in every field, random signed fp16 scales (d and dmin differ)."""
    rng = np.random.default_rng(seed)
    if name in FLOAT_TYPES:
        dt = torch.float16 if name == "F16" else torch.bfloat16
        return torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)).to(dt).view(torch.uint8)
    fmt = gguf_format(name)
    b = rng.integers(0, 256, size=(n * k // fmt.block_size, fmt.type_size), dtype=np.uint8)
    for off in SCALES[name]:
        d = (rng.standard_normal(b.shape[0]) * 0.05).astype(np.float16)
        b[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    if name == "MXFP4":  # e8m0 scales 2^(e-127) around 2^-8 (the codes reach 6)
        b[:, 0] = rng.integers(116, 124, size=b.shape[0])
    return torch.from_numpy(b.reshape(n, -1))


K_TYPES = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_S")


def act_block(name: str) -> int:
    """Values per activation scale: 256 for K-quant and IQ super-block weights (one scale per super-block,
    integer sums across its sub-blocks, as llama.cpp's Q8_K), else 32."""
    return 256 if name in K_TYPES else 32


def _quantized_x(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x rounded like the kernel (float32 math, round half to even) and the per-block scales d."""
    xb = x.float().reshape(x.shape[0], -1, block)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv)
    return (q.double() * d.double()).reshape(x.shape), d.squeeze(-1).double()


def _check(name: str, n_x: int, force_scalar: bool, n: int = 40, k: int = 512, seed: int = 0):
    raw = _weights(name, n, k, seed)
    w = gguf_format(name).dequantize(raw, (n, k), torch.float64)
    x = torch.randn(n_x, k, generator=torch.Generator().manual_seed(seed))
    y = cpu_quant.qmatmul(x, raw, name, force_scalar=force_scalar).double()
    scale = x.double().abs() @ w.abs().T  # sum |w x| per output: the float32 rounding scale
    if name in FLOAT_TYPES:
        torch.testing.assert_close(y, x.double() @ w.T, rtol=0, atol=1e-5 * scale.max().item())
        return
    block = act_block(name)
    xq, d = _quantized_x(x, block)
    assert (y - xq @ w.T).abs().le(1e-5 * scale + 1e-6).all(), "kernel differs from its exact model"
    bound = (d / 2) @ w.abs().reshape(n, -1, block).sum(-1).T  # [n_x, n]
    err = (y - x.double() @ w.T).abs()
    assert err.le(bound + 1e-5 * scale + 1e-6).all(), f"activation rounding error above its bound: {(err / bound).max()}"
    assert err.max() > 0  # the rounding is real: this reference is not the exact model above


@pytest.mark.parametrize("name", BLOCK_TYPES + FLOAT_TYPES)
@pytest.mark.parametrize("n_x", [1, 3, 6])
def test_kernels_against_float64(name, n_x):
    _check(name, n_x, force_scalar=False)


@pytest.mark.parametrize("name", FLOAT_TYPES)
@pytest.mark.parametrize("k", [8, 24, 200, 203, 1000])
@pytest.mark.parametrize("n_x", [1, 2, 3, 4])
def test_float_kernels_every_row_length(name, k, n_x):
    """F16 / BF16 rows: the 16-lane steps (AVX-512), the unrolled and single 8-lane steps and the scalar tail each
    take a part of a row whose length is no multiple of their step; the sum is the float64 product's."""
    _check(name, n_x, force_scalar=False, n=24, k=k, seed=k)


@pytest.mark.parametrize("name", BLOCK_TYPES + FLOAT_TYPES)
def test_scalar_kernels_against_float64(name):
    _check(name, 5, force_scalar=True, seed=1)


@pytest.mark.parametrize("name", IQ_TYPES)
def test_codebook_types_against_the_gguf_package(name):
    """The codebook formats against the gguf package's own dequantizer (an oracle independent of
    moestream.quant): the same values as moestream's decoder, and the kernels (AVX2 and scalar) within the
    activation rounding bound of x @ W.T in float64."""
    gq = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    n, k = 24, 768
    raw = _weights(name, n, k, seed=3)
    w = torch.from_numpy(gq.dequantize(raw.numpy(), GGMLQuantizationType[name]).astype(np.float64)).reshape(n, k)
    assert torch.equal(w, gguf_format(name).dequantize(raw, (n, k), torch.float64))
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(3))
    _, d = _quantized_x(x, act_block(name))
    bound = (d / 2) @ w.abs().reshape(n, -1, act_block(name)).sum(-1).T
    scale = x.double().abs() @ w.abs().T
    for force_scalar in (False, True):
        y = cpu_quant.qmatmul(x, raw, name, force_scalar=force_scalar).double()
        err = (y - x.double() @ w.T).abs()
        assert err.le(bound + 1e-5 * scale + 1e-6).all(), (force_scalar, (err / bound).max())


ROW_TYPES = [t for t in BLOCK_TYPES if t not in ("IQ4_XS", "IQ3_S")] + FLOAT_TYPES  # ms_dequant_rows reads these


@pytest.mark.parametrize("name", ROW_TYPES)
def test_dequant_rows_against_the_gguf_package(name):
    """The compiled row lookup (QuantEmbedding's): the gguf package's own dequantizer (an oracle independent of
    moestream) to float32 rounding, and bit for bit the torch decoder's rows (prefill and decode embed alike);
    repeated and unordered ids; an id out of range is an IndexError, not a read past the weight."""
    gq = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    n, k = 24, 512
    raw = _weights(name, n, k, seed=5)
    ids = torch.tensor([23, 0, 7, 7, 11])
    out = cpu_quant.dequant_rows(raw, cpu_quant.TYPES[name], ids, k)
    assert out is not None and out.dtype == torch.float32 and out.shape == (5, k)
    ref = torch.from_numpy(gq.dequantize(raw.numpy(), GGMLQuantizationType[name]).astype(np.float32)).reshape(n, k)
    torch.testing.assert_close(out, ref[ids], rtol=1e-6, atol=1e-7)
    ours = gguf_format(name).dequantize_rows(raw.view(torch.uint8), (n, k), ids, torch.float32)
    assert torch.equal(out, ours)
    with pytest.raises(IndexError):
        cpu_quant.dequant_rows(raw, cpu_quant.TYPES[name], torch.tensor([n]), k)


def test_quant_embedding_takes_the_row_kernel(monkeypatch):
    """QuantEmbedding on CPU looks rows up with ms_dequant_rows (same rows as the torch decoder, in the
    module's dtype), and with MOESTREAM_CPU_KERNELS=0 goes back to the decoder."""
    from moestream.layers.quant_linear import QuantEmbedding

    raw = _weights("Q6_K", 40, 256, seed=6)
    emb = QuantEmbedding("Q6_K", raw, 40, 256, torch.bfloat16)
    ids = torch.tensor([[3, 39], [0, 3]])
    calls = []
    real = cpu_quant.dequant_rows
    monkeypatch.setattr(cpu_quant, "dequant_rows", lambda *a: calls.append(1) or real(*a))
    y = emb(ids)
    assert calls and y.shape == (2, 2, 256) and y.dtype == torch.bfloat16
    monkeypatch.setenv("MOESTREAM_CPU_KERNELS", "0")
    calls.clear()
    assert torch.equal(emb(ids), y) and not calls


@pytest.mark.parametrize("mode", ["block", "channel", "tensor"])
def test_hf_fp8_kernel_against_float64(mode, monkeypatch):
    """HF FP8 weights (e4m3 bytes, float32 scales per 128x128 block / row / expert) through qlinear's CPU
    kernel path (cpu_quant.fp8_matmul: float32 activations, no rounding), AVX2 and scalar: within float32
    accumulation error of x @ W.T in float64, experts of a stacked weight with partial scale blocks (N = 200,
    K = 600 are not multiples of 128)."""
    from moestream.quant import FP8_BLOCK, FP8_CHANNEL, FP8_TENSOR, qlinear
    from moestream.quant import base as qb
    from moestream.quant.synthetic import random_raw

    fmt = {"block": FP8_BLOCK, "channel": FP8_CHANNEL, "tensor": FP8_TENSOR}[mode]
    E, n, k = 2, 200, 600
    raw = random_raw(fmt, (E, n, k), seed=4)
    w = fmt.dequantize(raw, (E, n, k), torch.float64).reshape(E * n, k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    calls = []
    real = cpu_quant.fp8_matmul
    monkeypatch.setattr(cpu_quant, "fp8_matmul", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for e in range(E):
        rows = (e * n, (e + 1) * n)
        ref, scale = x.double() @ w[rows[0]:rows[1]].T, x.double().abs() @ w[rows[0]:rows[1]].abs().T
        args = qb._fp8_rows(fmt, raw, (E, n, k), *rows)
        for y in (qlinear(x, fmt, raw, (E, n, k), rows=rows), real(x, *args, force_scalar=True)):
            assert (y.double() - ref).abs().le(1e-5 * scale + 1e-6).all(), (e, ((y - ref).abs() / scale).max())
    assert len(calls) == E  # qlinear took the kernel
    assert qb._fp8_rows(fmt, raw, (E, n, k), n - 8, n + 8) is None  # rows across two experts: the torch path


def test_iq3s_is_supported_once_its_codebook_is_set(monkeypatch):
    """IQ3_S's grid comes from the gguf package at load; without it the type stays on the torch path."""
    assert cpu_quant.supports("IQ3_S")
    monkeypatch.delitem(cpu_quant._STATE, "iq3s_grid")
    assert not cpu_quant.supports("IQ3_S") and cpu_quant.supports("IQ4_XS")


def test_avx2_build_on_avx2_cpus():
    from moestream.hardware import cpu_flags

    assert cpu_quant.has_avx2() == ({"avx2", "fma", "f16c"} <= cpu_flags())
    assert cpu_quant.isa() == cpu_quant._isa_flags()[0]


AVX2_FLAGS = {"avx", "avx2", "fma", "f16c", "sse4_2"}
VNNI_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512dq"}


def test_isa_selection_by_cpu_flags(monkeypatch):
    """The build picks the best instruction set the CPU reports: AVX512-VNNI where all its flags are there,
    else AVX2 (this development machine), else portable C++; each candidate falls back to the next."""
    def pick(flags):
        monkeypatch.setattr(cpu_quant, "cpu_flags", lambda: frozenset(flags))
        return [name for name, _ in cpu_quant._isa_candidates()]

    assert pick(VNNI_FLAGS) == ["avx512vnni", "avx2", "generic"]
    assert pick(VNNI_FLAGS - {"avx512_vnni"}) == ["avx2", "generic"]  # AVX-512 without VNNI: the AVX2 build
    assert pick(AVX2_FLAGS) == ["avx2", "generic"]
    assert pick({"sse2"}) == ["generic"]
    monkeypatch.setattr(cpu_quant, "cpu_flags", lambda: frozenset(VNNI_FLAGS))
    assert "-mavx512vnni" in cpu_quant._isa_flags()[1] and "-mavx2" in cpu_quant._isa_flags()[1]


def test_refused_isa_falls_back_to_the_next(monkeypatch):
    monkeypatch.setattr(cpu_quant, "cpu_flags", lambda: frozenset(VNNI_FLAGS))
    tried = []

    def build(cxx, isa, flags):
        tried.append(isa)
        if isa == "avx512vnni":
            raise RuntimeError("c++: unrecognized command-line option '-mavx512vnni'")
        return isa

    monkeypatch.setattr(cpu_quant, "_build_isa", build)
    assert cpu_quant._build() == "avx2" and tried == ["avx512vnni", "avx2"]


def test_avx512_vnni_build_compiles(tmp_path):
    """The AVX512-VNNI variant cannot run on an AVX2-only machine, but it must compile, and use vpdpbusd."""
    import shutil
    import subprocess

    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    flags = dict((n, f) for n, _, f in cpu_quant._ISAS)["avx512vnni"]
    out = tmp_path / "vnni.so"
    cpu_quant.build_library(cxx, flags, str(out))
    assert out.stat().st_size > 0
    if shutil.which("objdump"):
        dis = subprocess.run(["objdump", "-d", str(out)], capture_output=True, text=True).stdout
        assert "vpdpbusd" in dis


def test_threads_split_rows_without_changing_results():
    raw = _weights("Q4_K", 300, 1024)
    x = torch.randn(2, 1024)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = cpu_quant.qmatmul(x, raw, "Q4_K")
        torch.set_num_threads(2)
        y2 = cpu_quant.qmatmul(x, raw, "Q4_K")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y1, y2)


@pytest.mark.parametrize("force_scalar", [0, 1])
def test_segments_in_one_call_equal_one_call_each(force_scalar):
    """ms_qmatmul_segs (a layer's separate q, k, v of mixed types in one parallel region, x quantized once per
    activation form): every segment's columns are the floats its own ms_qmatmul call gives; a type the kernels
    lack is refused."""
    K, mod = 512, cpu_quant.module()
    specs = [("Q4_K", 64), ("Q6_K", 16), ("Q8_0", 24), ("BF16", 8), ("Q4_0", 8)]
    raws = [_weights(t, n, K, seed=i) for i, (t, n) in enumerate(specs)]
    x = torch.randn(5, K)
    total = sum(n for _, n in specs)
    segs = np.array([[r.data_ptr(), cpu_quant.TYPES[t], r.stride(0), n] for (t, n), r in zip(specs, raws)],
                    dtype=np.int64)
    out = torch.full((5, total + 3), float("nan"))
    assert mod.ms_qmatmul_segs(x.data_ptr(), 5, K, len(specs), segs.ctypes.data, out.data_ptr(), total + 3, 2,
                               force_scalar) == 0
    col = 0
    for (t, n), r in zip(specs, raws):
        own = torch.empty(5, n)
        assert mod.ms_qmatmul(x.data_ptr(), 5, K, r.data_ptr(), n, r.stride(0), cpu_quant.TYPES[t], own.data_ptr(), n,
                              2, force_scalar) == 0
        assert torch.equal(out[:, col:col + n], own), t
        col += n
    assert out[:, total:].isnan().all()  # nothing written past the segments' columns
    segs[1, 1] = 99  # no such type
    assert mod.ms_qmatmul_segs(x.data_ptr(), 5, K, len(specs), segs.ctypes.data, out.data_ptr(), total + 3, 2,
                               force_scalar) == -1


@pytest.mark.parametrize("name,n,k", [("Q4_0", 64, 576), ("Q4_1", 40, 1536), ("Q4_K", 24, 512), ("Q6_K", 32, 768),
                                      ("Q8_0", 48, 640)])
def test_rows_interleaved_by_8_give_the_gguf_rows_products(name, n, k):
    """repack_x8 (8 rows interleaved, one row per lane of the integer products): the GGUF layout's products up to float
    summation order, near the float64 product as closely; the SIMD and scalar paths, 1 and 2 threads, and a row alone
    or among others give the same floats; shapes the layout cannot take are refused."""
    raw = _weights(name, n, k)
    arr, tid, row_bytes = cpu_quant.repack_x8(raw.data_ptr(), n, k, raw.stride(0), name)
    assert arr.nbytes == n * row_bytes == (raw.numel() * 148 // 144 if name == "Q4_K" else raw.numel())
    mod, x = cpu_quant.module(), torch.randn(5, k)
    ref = x.double() @ gguf_format(name).dequantize(raw, (n, k), torch.float64).t()
    gguf = cpu_quant.qmatmul(x, raw, name)
    runs = {}
    for scalar in (0, 1):
        for nt in (1, 2):
            y = torch.empty(5, n)
            assert mod.ms_qmatmul(x.data_ptr(), 5, k, arr.ctypes.data, n, row_bytes, tid, y.data_ptr(), n, nt,
                                  scalar) == 0
            runs[scalar, nt] = y
    y = runs[0, 1]
    assert all(torch.equal(y, other) for other in runs.values())
    one = torch.empty(1, n)
    mod.ms_qmatmul(x[2:3].contiguous().data_ptr(), 1, k, arr.ctypes.data, n, row_bytes, tid, one.data_ptr(), n, 2, 0)
    assert torch.equal(one[0], y[2])
    scale = ref.abs().max().item()
    assert (y.double() - gguf.double()).abs().max().item() < 1e-5 * scale  # float order only
    assert (y.double() - ref).abs().max().item() < 1.05 * (gguf.double() - ref).abs().max().item() + 1e-5 * scale
    with pytest.raises(ValueError):
        cpu_quant.repack_x8(raw.data_ptr(), n - 1, k, raw.stride(0), name)  # not whole groups of 8
    with pytest.raises(ValueError):
        cpu_quant.repack_x8(raw.data_ptr(), n, k, raw.stride(0), "Q5_0")  # no interleaved layout
    bad = torch.empty(1, 7)
    assert mod.ms_qmatmul(x.data_ptr(), 1, k, arr.ctypes.data, 7, row_bytes, tid, bad.data_ptr(), 7, 1, 0) == -1
    segs = np.array([[arr.ctypes.data, tid, row_bytes, 7]], dtype=np.int64)  # in one call with others: the same rule
    assert mod.ms_qmatmul_segs(x.data_ptr(), 1, k, 1, segs.ctypes.data, bad.data_ptr(), 7, 1, 0) == -1


@pytest.mark.parametrize("name,k", [("Q4_K", 512), ("Q4_0", 256), ("Q4_1", 384), ("Q6_K", 512), ("Q8_0", 320)])
def test_interleaved_rows_against_many_activation_rows_give_each_rows_own_floats(name, k):
    """A prefill's many activation rows against an interleaved group (several rows a pass over its codes, then 2 and
    1 for what is left): every row's outputs are the floats the row gets alone (the one-row kernel of a decode step)
    and the scalar twin's, for 1..19 rows (passes of 8, 4, 2, 1 and their remainders), in ms_qmatmul and in an
    ms_moe_layer call whose experts have 1..13 rows each."""
    n, mod = 32, cpu_quant.module()
    raw = _weights(name, n, k, seed=3)
    arr, tid, rb = cpu_quant.repack_x8(raw.data_ptr(), n, k, raw.stride(0), name)
    x = torch.randn(19, k) * torch.linspace(0.1, 3.0, 19)[:, None]
    alone = torch.empty(19, n)
    for r in range(19):
        assert mod.ms_qmatmul(x[r:r + 1].contiguous().data_ptr(), 1, k, arr.ctypes.data, n, rb, tid,
                              alone[r:r + 1].data_ptr(), n, 1, 0) == 0
    for rows in range(1, 20):
        for scalar in (0, 1):
            y = torch.full((rows, n), float("nan"))
            assert mod.ms_qmatmul(x.data_ptr(), rows, k, arr.ctypes.data, n, rb, tid, y.data_ptr(), n, 2, scalar) == 0
            assert torch.equal(y, alone[:rows]), (rows, scalar)
    gguf = cpu_quant.qmatmul(x, raw, name)
    assert (alone - gguf).abs().max().item() < 1e-5 * gguf.abs().max().item()  # the GGUF rows' products
    # a layer call: gate / up [n, k] interleaved, down [k, n] in the file's layout (n = I = 32, H = k)
    E, I, H = 3, n, k
    ups = [_weights(name, I, H, seed=20 + e) for e in range(E)]
    downs = [_weights("Q8_0", H, I, seed=30 + e) for e in range(E)]
    x8 = [cpu_quant.repack_x8(u.data_ptr(), I, H, u.stride(0), name)[0] for u in ups]
    counts = [13, 1, 6]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rows_ = np.concatenate([np.arange(c) for c in counts]).astype(np.int64)
    P = int(starts[-1])
    w, dst = np.linspace(0.2, 0.9, P).astype(np.float32), np.arange(P, dtype=np.int64)
    tids = np.array([tid, tid, cpu_quant.TYPES["Q8_0"]], dtype=np.int64)
    ptrs = np.array([[a.ctypes.data, a.ctypes.data, d.data_ptr()] for a, d in zip(x8, downs)], dtype=np.int64)
    xs = x[:13].contiguous()
    y = torch.empty(P, H)
    assert mod.ms_moe_layer(xs.data_ptr(), 0, 13, H, I, E, ptrs.ctypes.data, tids.ctypes.data, starts.ctypes.data,
                            rows_.ctypes.data, w.ctypes.data, dst.ctypes.data, y.data_ptr(), P, H, 0, 0, 2, 0) == 0
    for p in range(P):  # each pair as a call of its own: one row, one expert
        g = int(np.searchsorted(starts, p, side="right") - 1)
        one = torch.empty(1, H)
        st, r1, w1, d1 = np.array([0, 1]), np.array([rows_[p]]), w[p:p + 1].copy(), np.array([0])
        assert mod.ms_moe_layer(xs.data_ptr(), 0, 13, H, I, 1, ptrs[g:g + 1].copy().ctypes.data, tids.ctypes.data,
                                st.ctypes.data, r1.ctypes.data, w1.ctypes.data, d1.ctypes.data, one.data_ptr(), 1, H,
                                0, 0, 1, 0) == 0
        assert torch.equal(one[0], y[p]), p


@pytest.mark.parametrize("force_scalar", [0, 1])
def test_interleaved_rows_beside_other_segments_and_in_layer_calls(force_scalar):
    """Interleaved matrices are read a group of 8 rows at a time: in one ms_qmatmul_segs call beside a segment whose
    rows are not whole groups (every row handed out alone) each segment's columns are its own call's floats; in
    ms_moe_layer interleaved gate / up / down experts give the GGUF experts' outputs up to float order (several
    rows per expert, 1 and 2 threads alike)."""
    K, mod = 512, cpu_quant.module()
    specs = [("Q4_K", 16), ("Q6_K", 12), ("Q4_0", 24), ("Q4_1", 8)]
    mats = []
    for i, (t, n) in enumerate(specs):
        raw = _weights(t, n, K, seed=i)
        if t in cpu_quant.X8_TYPES and n % 8 == 0:  # Q6_K's 12 rows stay as stored
            arr, tid, rb = cpu_quant.repack_x8(raw.data_ptr(), n, K, raw.stride(0), t)
            mats.append((arr, arr.ctypes.data, tid, rb, n))
        else:
            mats.append((raw, raw.data_ptr(), cpu_quant.TYPES[t], raw.stride(0), n))
    x = torch.randn(3, K)
    total = sum(n for _, n in specs)
    segs = np.array([[addr, tid, rb, n] for _, addr, tid, rb, n in mats], dtype=np.int64)
    for nt in (1, 2):
        out = torch.full((3, total), float("nan"))
        assert mod.ms_qmatmul_segs(x.data_ptr(), 3, K, len(mats), segs.ctypes.data, out.data_ptr(), total, nt,
                                   force_scalar) == 0
        col = 0
        for _, addr, tid, rb, n in mats:
            own = torch.empty(3, n)
            assert mod.ms_qmatmul(x.data_ptr(), 3, K, addr, n, rb, tid, own.data_ptr(), n, nt, force_scalar) == 0
            assert torch.equal(out[:, col:col + n], own), tid
            col += n
    H, I, E = 512, 256, 3
    banks = [[_weights("Q4_K", n, k, seed=10 + 3 * e + j) for j, (n, k) in enumerate(((I, H), (I, H), (H, I)))]
             for e in range(E)]
    x8 = [[cpu_quant.repack_x8(w.data_ptr(), w.shape[0], k, w.stride(0), "Q4_K")[0]
           for w, k in zip(ws, (H, H, I))] for ws in banks]
    xs = torch.randn(4, H)
    starts, rows = np.array([0, 3, 4, 6]), np.array([0, 1, 3, 2, 0, 2])
    w, dst = np.linspace(0.2, 0.7, 6).astype(np.float32), np.arange(6)
    gguf_ptrs = np.array([[m.data_ptr() for m in ws] for ws in banks], dtype=np.int64)
    x8_ptrs = np.array([[m.ctypes.data for m in ws] for ws in x8], dtype=np.int64)
    tids = np.full(3, cpu_quant.X8_TYPES["Q4_K"][0], dtype=np.int64)
    ref = cpu_quant.moe_layer(xs, gguf_ptrs, ("Q4_K",) * 3, starts, rows, w, dst, torch.empty(6, H), I)
    runs = []
    for nt in (1, 2):
        y = torch.empty(6, H)
        assert mod.ms_moe_layer(xs.data_ptr(), 0, 4, H, I, 3, x8_ptrs.ctypes.data, tids.ctypes.data, starts.ctypes.data,
                                rows.ctypes.data, w.ctypes.data, dst.ctypes.data, y.data_ptr(), 6, H, 0, 0, nt,
                                force_scalar) == 0
        runs.append(y)
    assert torch.equal(runs[0], runs[1])
    assert (runs[0] - ref).abs().max().item() < 1e-4 * ref.abs().max().item()


def test_bad_row_bytes_are_refused():
    raw = _weights("Q8_0", 4, 64)
    with pytest.raises(ValueError):
        cpu_quant.qmatmul(torch.randn(1, 96), raw, "Q8_0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qlinear_uses_the_kernel_for_few_rows(dtype, monkeypatch):
    fmt, n, k = gguf_format("Q5_K"), 48, 512
    raw = _weights("Q5_K", 2 * n, k).reshape(2, n, -1)
    x = torch.randn(3, k).to(dtype)
    y = qlinear(x, fmt, raw, (2, n, k), rows=(n, 2 * n))  # expert 1
    assert y.dtype == dtype and y.shape == (3, n)
    assert torch.equal(y, cpu_quant.qmatmul(x, raw.reshape(2 * n, -1)[n:], "Q5_K").to(dtype))
    monkeypatch.setenv("MOESTREAM_CPU_KERNELS", "0")  # the torch tile path: differs by the x rounding
    y_torch = qlinear(x, fmt, raw, (2, n, k), rows=(n, 2 * n))
    assert not torch.equal(y, y_torch)
    torch.testing.assert_close(y.float(), y_torch.float(), rtol=0.05, atol=0.05 * y_torch.float().abs().max().item())


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K"])
def test_qlinear_takes_the_kernel_for_every_row_count_row_by_row(name):
    """A prefill's many rows take the int8-activation kernel too, and each row's result is the one it gets
    alone (the rounding is per row): a prompt gives the same numbers however it is chunked."""
    fmt, n, k = gguf_format(name), 32, 512
    raw = _weights(name, n, k)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(7))
    y = qlinear(x, fmt, raw, (n, k))
    alone = torch.cat([qlinear(x[i:i + 1], fmt, raw, (n, k)) for i in range(x.shape[0])])
    assert torch.equal(y, alone)
    assert torch.equal(y, cpu_quant.qmatmul(x, raw, name))


@pytest.mark.parametrize("name", FLOAT_TYPES)
def test_qlinear_many_rows_of_16_bit_weights_take_the_float_gemm(name):
    """F16 / BF16 rows (float activations) go to the kernel for a few rows only: beyond, one float32 tile GEMM
    computes the same product faster."""
    fmt, n, k = gguf_format(name), 32, 256
    raw = _weights(name, n, k)
    x = torch.randn(qbase.CPU_FLOAT_KERNEL_MAX_ROWS + 1, k)
    y = qlinear(x, fmt, raw, (n, k))
    torch.testing.assert_close(y, x @ fmt.dequantize(raw, (n, k)).T, rtol=1e-5, atol=1e-4)
    assert not qbase.cpu_kernel_rows_ok(fmt, x.shape[0]) and qbase.cpu_kernel_rows_ok(fmt, x.shape[0] - 1)


def test_build_failure_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(cpu_quant, "_STATE", {})

    def fail():
        raise OSError("no compiler")

    monkeypatch.setattr(cpu_quant, "_build", fail)
    fmt, n, k = gguf_format("Q8_0"), 16, 64
    raw = _weights("Q8_0", n, k)
    x = torch.randn(1, k)
    with caplog.at_level(logging.WARNING, logger="moestream"):
        y1 = qlinear(x, fmt, raw, (n, k))
        y2 = qlinear(x, fmt, raw, (n, k))
    assert not cpu_quant.available()
    assert len([r for r in caplog.records if "CPU quant kernels unavailable" in r.message]) == 1
    ref = x @ fmt.dequantize(raw, (n, k)).T
    assert torch.equal(y1, y2)
    torch.testing.assert_close(y1, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant, qtype", [("qwen3", "Q8_0"), ("llama", "Q8_0"), ("qwen3", "IQ4_NL")])
def test_tiny_gguf_with_kernels(variant, qtype, tiny_checkpoint, tmp_path, monkeypatch):
    """CPU-only GGUF runs keep dense linears and the embedding compressed (bytes equal to what the
    dequantize-at-load path decodes, llama's q/k rows un-permuted too) and compute them and the routed
    experts with the kernels: logits within the int8 activation rounding of the exact path's."""
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    from moestream import LLM
    from moestream.layers.quant_linear import QuantEmbedding, QuantLinear
    from test_engine_parity import full_logits

    hf_dir = tiny_checkpoint("qwen3") if variant == "qwen3" else gguf_writer.make_llama(tmp_path / "hf")
    path, _ = gguf_writer.write_gguf(hf_dir, tmp_path / "m.gguf", Q[qtype])
    kw = dict(device="cpu", dtype="float32")
    fast = LLM(path, **kw)
    monkeypatch.setenv("MOESTREAM_CPU_KERNELS", "0")
    monkeypatch.setenv("MOESTREAM_FUSE", "0")  # the exact model keeps its projections by their loaded names
    exact = LLM(path, **kw)
    params = dict(exact.engine.model.named_parameters())
    mods = [(n, m) for n, m in fast.engine.model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    assert any(n.endswith("qkv_proj") for n, _ in mods) and any(isinstance(m, QuantEmbedding) for _, m in mods)
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}  # fused by byte rows (models/fuse.py)
    for name, m in mods:
        head, _, leaf = name.rpartition(".")
        if leaf in parts:
            w = torch.cat([params[f"{head}.{p}.weight"] for p in parts[leaf]])
        else:
            w = params[name + ".weight"]
        got = m.fmt.dequantize(m.raw, tuple(w.shape))
        if name == "lm_head" and qtype != "Q8_0":  # F16 (float activations for the logits): fp16 rounding
            assert m.fmt.type_name == "F16"
            torch.testing.assert_close(got, w, rtol=1e-3, atol=1e-6)
            continue
        if name == "lm_head":  # the tied Q8_0 embedding, as stored, with float activations for the logits
            assert m.fmt.type_name == "Q8_0" and m.float_activations
        assert torch.equal(got, w), name
    ids = list(range(4, 10))  # 6 rows: every matmul takes the kernel
    monkeypatch.setenv("MOESTREAM_CPU_KERNELS", "1")
    ours = full_logits(fast, ids)
    theirs = full_logits(exact, ids)
    rel = ((ours - theirs).norm() / theirs.norm()).item()
    # ~1% per rounded matmul, compounded over the layers of a random-weight model
    assert 1e-6 < rel < 6e-2, rel
    # greedy picks agree wherever the exact path's top-2 margin exceeds twice the largest logit change
    top2 = theirs.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (ours - theirs).abs().max()
    assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])


# ---- HF safetensors FP4: ModelOpt NVFP4, gpt-oss MXFP4 (cpu_quant.fp4_matmul, qlinear's CPU path) ------------
FP4_NAMES = ("nvfp4", "mxfp4")


def _fp4_format(name: str):
    from moestream.quant import MXFP4, NVFP4

    return NVFP4 if name == "nvfp4" else MXFP4


def _fp4_raw(name: str, n: int, k: int, seed: int = 0, lead: tuple = (), signed: bool = True) -> dict:
    """Stored parts of a (*lead, n, k) HF FP4 weight: every e2m1 code; NVFP4 e4m3 scales over their whole finite
    range (subnormals, both signs unless `signed` is False; no NaN code) and a global scale per lead index;
    MXFP4 e8m0 scales 2^-20..2^12 with a few of the subnormal-half codes 0 and 1."""
    rng = np.random.default_rng(seed)
    codes = torch.from_numpy(rng.integers(0, 256, size=(*lead, n, k // 2), dtype=np.uint8))
    if name == "nvfp4":
        s = rng.integers(0, 0x7F, size=(*lead, n, k // 16), dtype=np.uint8)  # 0x00..0x7E: no NaN
        if signed:
            s |= (rng.random(s.shape) < 0.3).astype(np.uint8) << 7
        g = torch.from_numpy((rng.random(lead or (1,)) * 0.02 + 0.001).astype(np.float32)).reshape(lead)
        return {"weight": codes, "weight_scale": torch.from_numpy(s).view(torch.float8_e4m3fn), "weight_scale_2": g}
    e = rng.integers(107, 139, size=(*lead, n, k // 32), dtype=np.uint8)
    e.reshape(-1)[:3] = (0, 1, 0)
    return {"blocks": codes.reshape(*lead, n, k // 32, 16), "scales": torch.from_numpy(e)}


def _fp4_args(name: str, raw: dict, n: int, k: int):
    """(codes [n, K/2], scale bytes, global scale) of a 2-D weight for cpu_quant.fp4_matmul."""
    if name == "nvfp4":
        return raw["weight"], raw["weight_scale"].view(torch.uint8), raw["weight_scale_2"].reshape(-1)[0]
    return raw["blocks"].reshape(n, k // 2), raw["scales"], None


def _check_fp4(name: str, n_x: int, n: int, k: int, force_scalar: bool, seed: int = 0):
    """fp4_matmul against the exact model (x rounded to int8 per 16 here, float64 products: float32 accumulation
    error) and the true x @ W.T (within the activation rounding bound), W decoded by quant/fp_formats.py."""
    fmt = _fp4_format(name)
    raw = _fp4_raw(name, n, k, seed)
    w = fmt.dequantize(raw, (n, k), torch.float64)
    x = torch.randn(n_x, k, generator=torch.Generator().manual_seed(seed))
    codes, scales, g = _fp4_args(name, raw, n, k)
    y = cpu_quant.fp4_matmul(x, codes, scales, name, g, force_scalar=force_scalar).double()
    scale = x.double().abs() @ w.abs().T
    xq, d = _quantized_x(x, 16)  # one activation scale per 16 values (qmatmul.cpp's HF FP4 section)
    err_model = (y - xq @ w.T).abs()
    assert err_model.le(1e-5 * scale + 1e-30).all(), f"kernel differs from its exact model: {(err_model / scale).max()}"
    bound = (d / 2) @ w.abs().reshape(n, -1, 16).sum(-1).T
    err = (y - x.double() @ w.T).abs()
    assert err.le(bound + 1e-5 * scale + 1e-30).all(), f"rounding error above its bound: {(err / bound).max()}"
    assert err.max() > 0


@pytest.mark.parametrize("name", FP4_NAMES)
@pytest.mark.parametrize("n_x, n, k", [(1, 37, 544), (3, 40, 96), (5, 33, 2048), (8, 7, 32)])
@pytest.mark.parametrize("force_scalar", [False, True])
def test_hf_fp4_kernels_against_float64(name, n_x, n, k, force_scalar):
    """Several scale blocks a row (K = 544: 17 blocks of 32, so NVFP4's 4-block scale groups end in a partial
    one; K = 96: only that partial group), odd row counts, 1-8 activation rows (chunks of 4 and a rest)."""
    _check_fp4(name, n_x, n, k, force_scalar, seed=n + k)


@pytest.fixture(params=[name for name, _ in cpu_quant._isa_candidates()])
def isa_build(request, monkeypatch):
    """The library built for each instruction set this CPU can run, swapped in for the test (the default build
    is the first; an AVX512-VNNI machine also runs the AVX2-only build's maddubs path and the portable one)."""
    import shutil

    name, flags = request.param, dict(cpu_quant._isa_candidates())[request.param]
    if name != cpu_quant.isa():
        cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
        if cxx is None:
            pytest.skip("no C++ compiler")
        monkeypatch.setitem(cpu_quant._STATE, "mod", cpu_quant._build_isa(cxx, name, flags))
    assert cpu_quant.isa() == name
    return name


@pytest.mark.parametrize("name", FP4_NAMES)
def test_hf_fp4_kernels_of_every_isa_build(name, isa_build):
    for force_scalar in (False, True):
        _check_fp4(name, 5, 21, 544, force_scalar, seed=11)
        _check_fp4(name, 2, 9, 96, force_scalar, seed=12)


def test_hf_mxfp4_decoder_against_transformers():
    """Our MXFP4 decoder (quant/fp_formats.py, which the kernels' tests take as W) against transformers' own
    gpt-oss dequantizer, an oracle independent of moestream: the same float64 values, subnormal-half scale codes
    included; and the kernels within the activation rounding bound of x @ W.T with that oracle's W."""
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    E, n, k = 2, 24, 768
    raw = _fp4_raw("mxfp4", n, k, seed=13, lead=(E,))
    ref = mx.convert_moe_packed_tensors(raw["blocks"], raw["scales"], dtype=torch.float64).transpose(1, 2)  # [E, n, K]
    assert torch.equal(ref, _fp4_format("mxfp4").dequantize(raw, (E, n, k), torch.float64))
    _bound_against(ref[1], "mxfp4", {"blocks": raw["blocks"][1], "scales": raw["scales"][1]}, n, k)


def _gguf_nvfp4_bytes(raw: dict, n: int, k: int) -> np.ndarray:
    """An HF NVFP4 weight's codes and (non-negative) e4m3 scales repacked as GGUF NVFP4 blocks (type 40): per 64
    values 4 scale bytes, then per 16 values 8 bytes holding values j (low nibble) and j + 8 (high nibble)."""
    b = raw["weight"].numpy()
    codes = np.stack([b & 15, b >> 4], -1).reshape(n, k // 16, 16)  # element 2i low nibble, 2i + 1 high
    qs = (codes[..., :8] | (codes[..., 8:] << 4)).astype(np.uint8).reshape(n, k // 64, 32)
    d = raw["weight_scale"].view(torch.uint8).numpy().reshape(n, k // 64, 4)
    return np.concatenate([d, qs], -1).reshape(n, -1)


def test_hf_nvfp4_decoder_against_the_gguf_package():
    """Our NVFP4 decoder against the gguf package's NVFP4 dequantizer (llama.cpp's format: the same e2m1 codes
    and e4m3 scales per 16, packed differently; unsigned scales, so these are >= 0 here) times the global scale:
    the same float64 values; and the kernels within the activation rounding bound with that oracle's W."""
    gq = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    if not hasattr(GGMLQuantizationType, "NVFP4"):
        pytest.skip("this gguf package has no NVFP4")
    n, k = 24, 576
    raw = _fp4_raw("nvfp4", n, k, seed=14, signed=False)
    g = float(raw["weight_scale_2"])
    ref = torch.from_numpy(gq.dequantize(_gguf_nvfp4_bytes(raw, n, k), GGMLQuantizationType.NVFP4).astype(np.float64))
    ref = ref.reshape(n, k) * g
    assert torch.equal(ref, _fp4_format("nvfp4").dequantize(raw, (n, k), torch.float64))
    _bound_against(ref, "nvfp4", raw, n, k)


def _bound_against(w: torch.Tensor, name: str, raw: dict, n: int, k: int) -> None:
    """The kernels (AVX and scalar) within the activation rounding bound of x @ w.T."""
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(15))
    _, d = _quantized_x(x, 16)
    bound = (d / 2) @ w.abs().reshape(n, -1, 16).sum(-1).T + 1e-5 * (x.double().abs() @ w.abs().T)
    for force_scalar in (False, True):
        y = cpu_quant.fp4_matmul(x, *_fp4_args(name, raw, n, k)[:2], name, _fp4_args(name, raw, n, k)[2],
                                 force_scalar=force_scalar).double()
        err = (y - x.double() @ w.T).abs()
        assert err.le(bound).all(), (force_scalar, (err / bound).max())


@pytest.mark.parametrize("name", FP4_NAMES)
def test_hf_fp4_rows_strided_and_threads(name):
    """Rows `ws` / `ss` bytes apart (views into wider buffers) give the contiguous rows' result, and splitting the
    weight rows over 1 or 2 threads does not change a bit."""
    n, k = 300, 2048  # ~1.1 KB a row: the rows split over both threads
    raw = _fp4_raw(name, n, k, seed=16)
    codes, scales, g = _fp4_args(name, raw, n, k)
    wide_c = torch.zeros(n, k // 2 + 40, dtype=torch.uint8)
    wide_s = torch.zeros(n, scales.shape[1] + 24, dtype=torch.uint8)
    wide_c[:, 8:8 + k // 2], wide_s[:, 4:4 + scales.shape[1]] = codes, scales
    x = torch.randn(3, k)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = cpu_quant.fp4_matmul(x, codes, scales, name, g)
        torch.set_num_threads(2)
        y2 = cpu_quant.fp4_matmul(x, codes, scales, name, g)
        y3 = cpu_quant.fp4_matmul(x, wide_c[:, 8:8 + k // 2], wide_s[:, 4:4 + scales.shape[1]], name, g)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y1, y2) and torch.equal(y1, y3)
    with pytest.raises(ValueError):  # K not a multiple of 32
        cpu_quant.fp4_matmul(torch.randn(1, k - 16), codes[:, :-8], scales, name, g)
    with pytest.raises(ValueError):  # scales of another format's block
        cpu_quant.fp4_matmul(x, codes, torch.zeros(n, k // (32 if name == "nvfp4" else 16), dtype=torch.uint8), name, g)


@pytest.mark.parametrize("name", FP4_NAMES)
def test_qlinear_takes_the_fp4_kernel(name, monkeypatch):
    """qlinear on an expert of stacked HF FP4 weights (per-expert NVFP4 global scales): the kernel for few rows
    (bf16 x in, bf16 out), the same as fp4_matmul on that expert's rows; NVFP4 rows across two experts, many
    rows, or the kernels off take the torch tile path (which differs by the x rounding)."""
    fmt, E, n, k = _fp4_format(name), 2, 48, 512
    raw = _fp4_raw(name, n, k, seed=17, lead=(E,))
    calls = []
    real = cpu_quant.fp4_matmul
    monkeypatch.setattr(cpu_quant, "fp4_matmul", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = torch.randn(3, k).to(torch.bfloat16)
    y = qlinear(x, fmt, raw, (E, n, k), rows=(n, 2 * n))  # expert 1
    assert len(calls) == 1 and y.dtype == torch.bfloat16 and y.shape == (3, n)
    codes, scales, g = qbase._fp4_rows(fmt, raw, (E, n, k), n, 2 * n)
    assert torch.equal(y, real(x, codes, scales, name, g).to(torch.bfloat16))
    if name == "nvfp4":
        assert float(g) == float(raw["weight_scale_2"][1])
        assert qbase._fp4_rows(fmt, raw, (E, n, k), n - 8, n + 8) is None  # two global scales: the torch path
    w = fmt.dequantize(raw, (E, n, k), torch.float64).reshape(E * n, k)[n:]
    xq, _ = _quantized_x(x.float(), 16)
    scale = x.double().abs() @ w.abs().T
    assert ((y.double() - xq @ w.T).abs() <= 1e-2 * scale + 1e-6).all()  # bf16 output rounding
    calls.clear()
    xs = torch.randn(37, k)  # a prefill's rows take the kernel too, each row as it would alone
    many = qlinear(xs, fmt, raw, (E, n, k), rows=(0, n))
    assert len(calls) == 1 and many.shape == (37, n)
    assert torch.equal(many, torch.cat([qlinear(xs[i:i + 1], fmt, raw, (E, n, k), rows=(0, n)) for i in range(37)]))
    calls.clear()
    monkeypatch.setenv("MOESTREAM_CPU_KERNELS", "0")
    y_torch = qlinear(x, fmt, raw, (E, n, k), rows=(n, 2 * n))
    assert not calls and not torch.equal(y, y_torch)
    torch.testing.assert_close(y.float(), y_torch.float(), rtol=0.05, atol=0.05 * y_torch.float().abs().max().item())


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("k", [256, 1024])
def test_one_row_of_x_gives_the_floats_it_gives_among_others(name, k):
    """One activation row (decode) gives bit for bit the outputs it gives computed beside other rows (another
    pass width of the kernel), whatever the number of weight rows."""
    raw = _weights(name, 42, k, seed=3)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3))
    both = cpu_quant.qmatmul(x, raw, name)
    for r in range(3):
        assert torch.equal(cpu_quant.qmatmul(x[r:r + 1], raw, name)[0], both[r]), r
    for rows in (1, 2, 3, 5, 9):  # chunks that end before a group of four does
        assert torch.equal(cpu_quant.qmatmul(x[:1], raw[:rows], name)[0], both[0, :rows])


def test_other_builds_give_the_same_interleaved_and_float_products(tmp_path):
    """The AVX2 build (the one AVX2-only machines run: no vpdpbusd, so Q8_0X8 takes |q| against x signed by q, and
    8-lane float steps only) checked on this machine where it builds the AVX-512 one by default: interleaved Q8_0 /
    Q4_0 against the GGUF rows and many activation rows, and the float kernels at every row length. A subprocess
    with the CPU's AVX-512 flags hidden (the library is built and cached per flags)."""
    import subprocess
    import sys
    from pathlib import Path

    if cpu_quant.isa() != "avx512vnni":
        pytest.skip("this machine runs the AVX2 (or generic) build already: the tests above check it")
    code = """
import sys
sys.path.insert(0, {tests!r})
from moestream.kernels import cpu_quant
real = cpu_quant.cpu_flags
cpu_quant.cpu_flags = lambda: frozenset(f for f in real() if not f.startswith("avx512"))
assert cpu_quant.isa() == "avx2", cpu_quant.isa()
import test_cpu_kernels as T
T.test_rows_interleaved_by_8_give_the_gguf_rows_products("Q8_0", 48, 640)
T.test_rows_interleaved_by_8_give_the_gguf_rows_products("Q4_0", 64, 576)
T.test_interleaved_rows_against_many_activation_rows_give_each_rows_own_floats("Q8_0", 320)
for name in ("BF16", "F16"):
    for k in (8, 200, 203):
        for n_x in (1, 2, 4):
            T.test_float_kernels_every_row_length(name, k, n_x)
print("ok")
""".format(tests=str(Path(__file__).parent))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-2000:]
