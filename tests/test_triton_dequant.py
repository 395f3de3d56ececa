"""moestream.quant.triton_dequant: every Triton kernel equals the torch decoder bit for bit (which
tests/test_quant.py checks against the gguf package and float64 bit decoders).

* Interpreter: all cases run once, in a subprocess with TRITON_INTERPRET=1 (set before triton is
  imported), on CPU tensors; each case is then reported as its own test. Needs only `triton`.
* CUDA: the same cases through the real wiring (`fmt.dequantize` on CUDA tensors takes the kernel),
  plus an expert-sized tensor and qlinear; skipped without a GPU.

Run as a script (`python tests/test_triton_dequant.py --worker OUT.json`) it is the interpreter worker.
"""
from __future__ import annotations

import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_quant import _quantize, _random_blocks  # noqa: E402
from triton_harness import HAS_TRITON, assert_case, compile_sm90, interpreted_results, write_case_results  # noqa: E402

from moestream.quant import (  # noqa: E402
    FP8_BLOCK, FP8_CHANNEL, FP8_TENSOR, MXFP4, NVFP4, fp8_block_format, gguf_format, qlinear,
)

KERNEL_GGUF = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0",
               "TQ2_0", "MXFP4", "NVFP4"]
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------- cases
def _rng(case: str):
    return np.random.default_rng(zlib.crc32(case.encode()))


def _f8(rng, shape) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, 256, size=shape, dtype=np.uint8)).view(torch.float8_e4m3fn)


def _gguf_random(name):
    def build(rng):
        fmt = gguf_format(name)
        nblk = 2 if fmt.block_size >= 64 else 8
        raw = torch.from_numpy(_random_blocks(name, 12, nblk, rng)).reshape(2, 6, -1)
        return fmt, raw, (2, 6, nblk * fmt.block_size)
    return build


def _gguf_quantized(name):
    def build(rng):
        fmt = gguf_format(name)
        shape = (6, fmt.block_size * (2 if fmt.block_size >= 64 else 8))
        x = (rng.standard_normal(shape) * rng.uniform(0.01, 3, size=(shape[0], 1))).astype(np.float32)
        return fmt, torch.from_numpy(np.ascontiguousarray(_quantize(name, x))), shape
    return build


def _fp8(fmt, scale_shape, scale_dtype=torch.float32, scale_range=(1e-4, 3e-2), shape=(2, 20, 200)):
    def build(rng):
        s = torch.from_numpy(rng.uniform(*scale_range, size=scale_shape).astype(np.float32)).to(scale_dtype)
        name = "weight_scale_inv" if fmt.mode == "block" else "weight_scale"
        return fmt, {"weight": _f8(rng, shape), name: s}, shape
    return build


def _nvfp4(g_shape):
    def build(rng):
        shape = (2, 24, 96)
        raw = {"weight": torch.from_numpy(rng.integers(0, 256, (2, 24, 48), dtype=np.uint8)),
               "weight_scale": _f8(rng, (2, 24, 6)),
               "weight_scale_2": torch.from_numpy(rng.uniform(1e-4, 1e-2, size=g_shape).astype(np.float32))}
        return NVFP4, raw, shape
    return build


def _mxfp4(rng):
    shape = (2, 24, 96)
    scales = rng.integers(100, 140, size=(2, 24, 3), dtype=np.uint8)
    scales.reshape(-1)[:5] = [0, 1, 2, 254, 255]  # subnormal scales, the largest, NaN
    raw = {"blocks": torch.from_numpy(rng.integers(0, 256, (2, 24, 3, 16), dtype=np.uint8)),
           "scales": torch.from_numpy(scales)}
    return MXFP4, raw, shape


def _q8_0_row_planar(rng):
    """Q8_0R (each row's scales, then its codes): quantized Q8_0 rows of a [2, 6, 256] weight, rewritten."""
    from moestream.quant.gguf_formats import q8_0_row_planar

    _, raw, (n, k) = _gguf_quantized("Q8_0")(rng)
    return gguf_format("Q8_0R"), q8_0_row_planar(raw.clone(), k), (2, n // 2, k)  # the rows as 2 experts


CASES = {f"gguf-{n}-random": _gguf_random(n) for n in KERNEL_GGUF}
CASES["gguf-Q8_0R-quantized"] = _q8_0_row_planar
CASES.update({f"gguf-{n}-quantized": _gguf_quantized(n) for n in KERNEL_GGUF})
CASES.update({
    "fp8_block": _fp8(FP8_BLOCK, (2, 1, 2)),
    "fp8_block-bf16-scale": _fp8(FP8_BLOCK, (2, 1, 2), torch.bfloat16),
    "fp8_block-subnormal": _fp8(FP8_BLOCK, (2, 1, 2), scale_range=(1e-40, 1e-36)),
    "fp8_block-32x64": _fp8(fp8_block_format((32, 64)), (2, 2, 4), shape=(2, 40, 200)),
    "fp8_block-24x100": _fp8(fp8_block_format((24, 100)), (2, 2, 2), shape=(2, 40, 200)),
    "fp8_channel": _fp8(FP8_CHANNEL, (2, 20)),
    "fp8_tensor": _fp8(FP8_TENSOR, ()),
    "fp8_tensor-per-expert": _fp8(FP8_TENSOR, (2,)),
    "nvfp4": _nvfp4(()),
    "nvfp4-per-expert": _nvfp4((2,)),
    "mxfp4": _mxfp4,
})


def build_case(case: str):
    return CASES[case](_rng(case))


def _rows(shape) -> tuple[torch.Tensor, slice]:
    total = int(np.prod(shape[:-1]))
    return torch.tensor([total - 1, 0, 3, 3, total // 2]), slice(1, total - 2)


def mismatch(out: torch.Tensor, ref: torch.Tensor) -> str | None:
    """None if bit-identical (NaN positions equal, any NaN payload), else a description with ulps."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"shape/dtype {tuple(out.shape)} {out.dtype} != {tuple(ref.shape)} {ref.dtype}"
    o, r = out.detach().cpu().float(), ref.detach().cpu().float()
    on, rn = torch.isnan(o), torch.isnan(r)
    if not torch.equal(on, rn):
        return f"NaN at {int((on != rn).sum())} different positions"
    ob = o[~on].view(torch.int32).long()
    rb = r[~rn].view(torch.int32).long()
    bad = ob != rb
    if not bool(bad.any()):
        return None
    ulps = (ob - rb).abs()[bad]  # ulps of the float32 view (same sign); sign flips show as huge
    shift = {torch.float32: 0, torch.bfloat16: 16, torch.float16: 13}[out.dtype]
    return f"{int(bad.sum())} of {bad.numel()} values differ, max {int(ulps.max()) >> shift} ulp"


def check_case(case: str, decode, device: str = "cpu") -> list[str]:
    """Compare ``decode(fmt, raw, shape, rows, dtype)`` (rows None: whole tensor) with the torch path on CPU."""
    fmt, raw, shape = build_case(case)
    moved = raw.to(device) if isinstance(raw, torch.Tensor) else {k: v.to(device) for k, v in raw.items()}
    errors = []
    idx, sl = _rows(shape)
    for dt in OUT_DTYPES:
        for rows in (None, idx, sl):
            ref = fmt.dequantize(raw, shape, dt) if rows is None else fmt.dequantize_rows(raw, shape, rows, dt)
            out = decode(fmt, moved, shape, rows, dt)
            msg = mismatch(out, ref)
            if msg:
                errors.append(f"{dt} rows={'all' if rows is None else type(rows).__name__}: {msg}")
    return errors


def _kernel_decode(fmt, raw, shape, rows, dt):
    from moestream.quant import triton_dequant as td

    if rows is None:
        return td.dequantize(fmt, raw, shape, dt)
    return td.dequantize_rows(fmt, raw, shape, rows, dt)


# --------------------------------------------------------------------------- interpreter
def _worker(out_path: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")  # numpy overflow warnings of the interpreter (inf is expected)
    write_case_results(CASES, lambda case: check_case(case, _kernel_decode), out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory, timeout=900)


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_kernel_bit_exact(interpreted, case):
    assert_case(interpreted, case)


def test_kernels_cover_the_required_formats():
    from moestream.quant.base import FORMATS

    required = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}
    assert required <= set(KERNEL_GGUF)
    if HAS_TRITON:
        from moestream.quant import triton_dequant as td

        supported = {f.name for f in FORMATS.values() if td.supports(f)}
        assert supported == {f"gguf:{n}" for n in KERNEL_GGUF} | {"fp8_block", "fp8_channel", "fp8_tensor",
                                                                     "nvfp4", "mxfp4"}
        assert not td.supports(FP8_BLOCK, torch.float64)


# --------------------------------------------------------------------------- compiled for a GPU (no GPU needed)
_GGUF_SIG = {"src": "*u8", "out": "*fp32", "idx": "*i64", "lut": "*fp32", "row0": "i32", "n_rows": "i32",
             "nblk": "i32", "row_stride": "i32"}
_FP_SIG = {"w": "*u8", "s": "*fp32", "gs": "*fp32", "out": "*i16", "idx": "*i64", "row0": "i32", "n_rows": "i32",
           "K": "i32", "n_lead_rows": "i32", "w_stride": "i32", "s_stride": "i32", "s_rows_per_lead": "i32",
           "s_row_block": "i32", "g_stride": "i32"}
_FP_VARIANTS = {"fp8_block": (0, 128, "*fp32"), "fp8_block-bf16-scale": (0, 128, "*bf16"),
                "fp8_block-24x100": (0, 100, "*fp32"), "fp8_channel": (0, 1 << 30, "*fp32"),
                "nvfp4": (1, 16, "*u8"), "mxfp4": (2, 32, "*u8")}


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("variant", [f"gguf-{n}" for n in KERNEL_GGUF] + list(_FP_VARIANTS))
def test_kernel_compiles_for_sm90_without_fma(variant):
    """The real compiler (Triton -> PTX -> ptxas, for an H100/H200) accepts every kernel, and no multiply-add
    is contracted into an FMA (which would round once instead of twice and break bit-exactness)."""
    from moestream.quant import triton_dequant as td

    if variant.startswith("gguf-"):
        fmt = gguf_format(variant[5:])
        consts = {"QT": td._GGUF_IDS[fmt.type_name], "BS": fmt.block_size, "TS": fmt.type_size,
                  "NS": td._GGUF_NS.get(fmt.type_name, 1), "G": td._ELEMS // fmt.block_size, "HAS_IDX": True,
                  "OUT_BF16": False}
        fn, sig = td._gguf_kernel, dict(_GGUF_SIG)
    else:
        kind, unit, sdt = _FP_VARIANTS[variant]
        consts = {"S_COL_UNIT": unit, "KIND": kind, "HAS_IDX": False, "HAS_G": kind == 1, "BR": 16, "BC": 256,
                  "GS": min(256, unit & -unit), "OUT_BF16": True}
        fn, sig = td._fp_kernel, {**_FP_SIG, "s": sdt}
    sig.update({k: "constexpr" for k in consts})
    k = compile_sm90(fn, sig, consts, td.LAUNCH)  # the options every launch uses
    ptx = k.asm["ptx"]
    assert "mul.f32" in ptx or "mul.rn.f32" in ptx
    assert "fma." not in ptx


def test_cpu_tensors_stay_on_torch():
    from moestream.quant.base import _triton_path

    assert _triton_path(torch.zeros(1)) is None


# --------------------------------------------------------------------------- CUDA
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")


def _wired_decode(fmt, raw, shape, rows, dt):
    return fmt.dequantize(raw, shape, dt) if rows is None else fmt.dequantize_rows(raw, shape, rows, dt)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_kernel_bit_exact(case, monkeypatch):
    from moestream.quant import triton_dequant as td

    monkeypatch.delenv("MOESTREAM_TRITON", raising=False)
    calls = []
    real = td.decode_parts
    monkeypatch.setattr(td, "decode_parts", lambda *a, **k: calls.append(1) or real(*a, **k))
    errs = check_case(case, _wired_decode, "cuda")
    assert calls, "the CUDA path did not use the Triton kernel"
    assert not errs, f"{case}: " + "; ".join(errs)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "Q6_K", "fp8_block", "nvfp4"])
def test_cuda_expert_sized(name, monkeypatch):
    """One Qwen3.6-35B-A3B expert gate_up [1024, 2048] x 3 experts: grids, strides and int64 offsets."""
    from moestream.quant import triton_dequant as td

    rng = np.random.default_rng(11)
    shape = (3, 1024, 2048)
    if name.startswith("Q"):
        fmt = gguf_format(name)
        raw = torch.from_numpy(_random_blocks(name, 3 * 1024, 2048 // fmt.block_size, rng))
    elif name == "fp8_block":
        fmt, raw = FP8_BLOCK, {"weight": _f8(rng, shape), "weight_scale_inv": torch.rand(3, 8, 16) * 1e-2}
    else:
        fmt = NVFP4
        raw = {"weight": torch.from_numpy(rng.integers(0, 256, (3, 1024, 1024), dtype=np.uint8)),
               "weight_scale": torch.from_numpy(rng.integers(0, 0x7F, (3, 1024, 128), dtype=np.uint8)).view(torch.float8_e4m3fn),
               "weight_scale_2": torch.tensor([1e-3, 2e-3, 3e-3])}
    gpu = raw.cuda() if isinstance(raw, torch.Tensor) else {k: v.cuda() for k, v in raw.items()}
    for dt in OUT_DTYPES:
        assert mismatch(td.dequantize(fmt, gpu, shape, dt), fmt.dequantize(raw, shape, dt)) is None, dt
    rows = torch.arange(1024, 2048, device="cuda")  # expert 1
    x = torch.randn(5, 2048, device="cuda", dtype=torch.bfloat16)
    y = qlinear(x, fmt, gpu, shape, rows=(1024, 2048))
    assert mismatch(y, x @ fmt.dequantize_rows(gpu, shape, rows, torch.bfloat16).t()) is None
    monkeypatch.setenv("MOESTREAM_TRITON", "0")
    monkeypatch.setattr(td, "decode_parts", lambda *a, **k: pytest.fail("MOESTREAM_TRITON=0 still used Triton"))
    assert mismatch(fmt.dequantize(gpu, shape, torch.bfloat16), fmt.dequantize(raw, shape, torch.bfloat16)) is None


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        sys.exit("usage: python tests/test_triton_dequant.py --worker OUT.json (run the tests with pytest)")
