"""moestream.quant: every GGUF type equals gguf.quants.dequantize bit for bit; FP8 / NVFP4 / MXFP4 equal
an independent float64 bit decoder exactly; row gathers, tiles and qlinear agree with the whole tensor."""
from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
import gguf.quants as gq  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from moestream.quant import (  # noqa: E402
    FORMATS, FP8_BLOCK, FP8_CHANNEL, FP8_TENSOR, MXFP4, NVFP4, GGUF_FORMATS, QuantFormatError,
    QuantizedTensor, fp8_block_format, get_format, gguf_format, hf_quant_format, ksigns_table, qlinear,
)
from moestream.config import parse_quantization_config  # noqa: E402
from moestream.core import ConfigError  # noqa: E402

REQUIRED_GGUF = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ3_S", "IQ4_XS"]
ALL_GGUF = sorted(GGUF_FORMATS)
# types the gguf package itself can quantize
GGUF_PY_QUANT = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "TQ1_0", "TQ2_0", "MXFP4"}

try:
    import libgguf  # test-only: llama.cpp's reference quantizers, for the types gguf cannot quantize
except ImportError:  # pragma: no cover
    libgguf = None


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _ours(name: str, raw: np.ndarray, shape) -> np.ndarray:
    return gguf_format(name).dequantize(torch.from_numpy(np.ascontiguousarray(raw)), shape).numpy()


# --------------------------------------------------------------------------- GGUF: quantized tensors
def _quantize(name: str, x: np.ndarray) -> np.ndarray:
    if name in GGUF_PY_QUANT:
        return gq.quantize(x, T[name])
    if libgguf is None:
        pytest.skip("libgguf (test extra) is needed to quantize " + name)
    return libgguf.quantize_rows(x, libgguf.GGMLQuantizationType[name])


# libgguf's IQ1_*/IQ2_* quantizers spend 2-30 s building search tables; those types are checked on
# random blocks (against gguf and against libgguf's native dequantizer) instead.
SLOW_TO_QUANTIZE = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S"}


@pytest.mark.parametrize("name", [n for n in ALL_GGUF if n not in SLOW_TO_QUANTIZE])
def test_gguf_quantized_tensor_bit_exact(name):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    bs = gguf_format(name).block_size
    shape = (6, max(bs, 1) * (2 if bs > 32 else 8))
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 3, size=(shape[0], 1))).astype(np.float32)
    x[0, :3] = 0.0
    raw = _quantize(name, x)
    ref = gq.dequantize(raw, T[name])
    ours = _ours(name, raw, shape)
    assert _bits_equal(ours, ref), name
    # and a 3-D (experts) shape over the same bytes
    assert _bits_equal(_ours(name, raw, (2, 3, shape[1])), ref.reshape(2, 3, -1)), name


# --------------------------------------------------------------------------- GGUF: random valid blocks
FP16_FIELDS = {  # byte offsets of the fp16 scales inside one block (ggml-common.h)
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0], "IQ1_S": [0],
    "IQ4_NL": [0], "IQ4_XS": [0], "TQ1_0": [52], "TQ2_0": [64], "MXFP4": [], "NVFP4": [],
}


def _random_blocks(name: str, n_rows: int, n_blocks: int, rng) -> np.ndarray:
    """Random bytes for every field, with finite fp16 scales: every code path, every grid index."""
    fmt = gguf_format(name)
    if name == "F32":
        return rng.standard_normal((n_rows, n_blocks)).astype(np.float32).view(np.uint8)
    if name == "F16":
        return rng.standard_normal((n_rows, n_blocks)).astype(np.float16).view(np.uint8)
    if name == "BF16":  # any non-NaN bf16 bit pattern
        v = rng.integers(0, 2**16, size=(n_rows, n_blocks), dtype=np.uint16)
        v = np.where((v & 0x7F80) == 0x7F80, v & 0xBFFF, v).astype(np.uint16)
        return v.view(np.uint8)
    b = rng.integers(0, 256, size=(n_rows * n_blocks, fmt.type_size), dtype=np.uint8)
    d = (rng.standard_normal((b.shape[0], 2)) * 0.05).astype(np.float16)
    if name == "IQ1_M":  # the fp16 scale is spread over the top nibbles of four uint16 scale words
        dbits = d[:, 0].view(np.uint16).astype(np.uint32)
        sc = b[:, 48:56].copy().view(np.uint16).astype(np.uint32)
        for i in range(4):
            sc[:, i] = (sc[:, i] & 0x0FFF) | (((dbits >> (4 * i)) & 0xF) << 12)
        b[:, 48:56] = sc.astype(np.uint16).view(np.uint8).reshape(-1, 8)
    for j, off in enumerate(FP16_FIELDS.get(name, [])):
        b[:, off:off + 2] = d[:, j:j + 1].view(np.uint8).reshape(-1, 2)
    return b.reshape(n_rows, n_blocks * fmt.type_size)


@pytest.mark.parametrize("name", ALL_GGUF)
def test_gguf_random_blocks_bit_exact(name):
    rng = np.random.default_rng(1234 + len(name) * 7 + ord(name[-1]))
    fmt = gguf_format(name)
    n_blocks = 4 if fmt.block_size > 1 else 256
    raw = _random_blocks(name, 96, n_blocks, rng)
    shape = (96, n_blocks * fmt.block_size)
    with np.errstate(over="ignore"):  # MXFP4 scale 0xFF times 12 overflows to inf (in both)
        ref = gq.dequantize(raw.view(np.float16) if name == "F16" else raw.view(np.float32) if name == "F32" else raw, T[name])
    assert np.isfinite(ref).all() or name in ("MXFP4",)
    assert _bits_equal(_ours(name, raw, shape), ref), name


IQ_TYPES = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"]


@pytest.mark.skipif(libgguf is None, reason="libgguf not installed")
@pytest.mark.parametrize("name", IQ_TYPES + ["Q4_K", "Q6_K", "IQ4_XS"])
def test_gguf_random_blocks_match_native_ggml(name):
    """An independent check of the codebooks: libgguf's native (C) dequantizer has its own tables."""
    rng = np.random.default_rng(99 + ord(name[2]))
    raw = _random_blocks(name, 64, 4, rng)
    ref = libgguf.dequantize_rows(raw, libgguf.GGMLQuantizationType[name], n_per_row=1024)
    assert _bits_equal(_ours(name, raw, (64, 1024)), ref)


def test_iq_tables():
    from moestream.quant.gguf_formats import iq_grid

    ks = ksigns_table().numpy().astype(int)
    assert ks[0] == 0 and ks[1] == 129 and ks[3] == 3 and ks[127] == 255
    assert all(bin(v).count("1") % 2 == 0 for v in ks)
    assert np.array_equal(ks, np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8))
    g = iq_grid("IQ3_S").numpy()
    assert g.shape == (512, 4) and len({tuple(r) for r in g.tolist()}) == 512
    assert set(np.unique(g).tolist()) <= {1, 3, 5, 7, 9, 11, 13, 15}
    g = iq_grid("IQ3_XXS").numpy()
    assert g.shape == (256, 4) and len({tuple(r) for r in g.tolist()}) == 256


def test_gguf_sizes_and_errors():
    for name in REQUIRED_GGUF:
        assert name in GGUF_FORMATS
        fmt = gguf_format(name)
        bs, ts = gguf.GGML_QUANT_SIZES[T[name]]
        assert (fmt.block_size, fmt.type_size) == (bs, ts)
        assert fmt.ggml_type == int(T[name])
        assert gguf_format(int(T[name])) is fmt and gguf_format(T[name]) is fmt and gguf_format(name.lower()) is fmt
        assert fmt.nbytes((3, 7, 512)) == 21 * 512 // bs * ts
        assert fmt.row_nbytes(512) == 512 // bs * ts
    assert gguf_format("Q4_K").bits_per_weight() == 4.5
    with pytest.raises(QuantFormatError, match="Q8_K"):
        gguf_format("Q8_K")
    with pytest.raises(QuantFormatError, match="4242"):
        gguf_format(4242)
    with pytest.raises(QuantFormatError, match="multiple"):
        gguf_format("Q4_K").dequantize(torch.zeros(144, dtype=torch.uint8), (1, 128))
    with pytest.raises(QuantFormatError, match="needs"):
        gguf_format("Q4_0").dequantize(torch.zeros(10, dtype=torch.uint8), (1, 32))


def test_gguf_stored_dtype_inputs():
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    h = torch.from_numpy(x.astype(np.float16))
    assert torch.equal(gguf_format("F16").dequantize(h, (4, 64)), h.float())
    assert torch.equal(gguf_format("F32").dequantize(torch.from_numpy(x), (4, 64)), torch.from_numpy(x))
    b = torch.from_numpy(x).bfloat16()
    assert torch.equal(gguf_format("BF16").dequantize(b, (4, 64), torch.bfloat16), b)


# --------------------------------------------------------------------------- float64 bit decoders
def ref_e4m3fn(codes: np.ndarray) -> np.ndarray:
    c = codes.astype(np.int64)
    s, e, m = c >> 7, (c >> 3) & 0xF, c & 7
    mag = np.where(e == 0, m * 2.0 ** -9, (1.0 + m / 8.0) * np.ldexp(1.0, e - 7))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(s == 1, -mag, mag)


def ref_e2m1(codes: np.ndarray) -> np.ndarray:
    c = codes.astype(np.int64)
    s, e, m = c >> 3, (c >> 1) & 3, c & 1
    mag = np.where(e == 0, m * 0.5, (1.0 + m * 0.5) * np.ldexp(1.0, e - 1))
    return np.where(s == 1, -mag, mag)


def ref_e8m0(codes: np.ndarray) -> np.ndarray:
    c = codes.astype(np.int64)
    return np.where(c == 255, np.nan, np.ldexp(1.0, c - 127))


def _unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """(..., C) bytes -> (..., 2C) codes, element 2i in the low nibble."""
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def _assert_exact(ours: torch.Tensor, ref64: np.ndarray):
    o = ours.numpy()
    if ours.dtype == torch.float64:
        assert np.array_equal(np.isnan(o), np.isnan(ref64))
        m = ~np.isnan(ref64)
        assert np.array_equal(o[m].view(np.uint64), ref64[m].view(np.uint64))  # incl. the sign of zero
    else:
        r32 = ref64.astype(np.float32)
        assert np.array_equal(np.isnan(o), np.isnan(r32))
        m = ~np.isnan(r32)
        assert np.array_equal(o[m].view(np.uint32), r32[m].view(np.uint32))


def _rand_fp8(rng, shape, allow_nan=True) -> np.ndarray:
    c = rng.integers(0, 256, size=shape, dtype=np.uint8)
    if not allow_nan:
        c = np.where((c & 0x7F) == 0x7F, c & 0xF0, c).astype(np.uint8)
    return c


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (3, 130, 256)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_fp8_block_exact(shape, scale_dtype):
    rng = np.random.default_rng(sum(shape))
    *lead, n, k = shape
    w = _rand_fp8(rng, shape)
    nb, kb = -(-n // 128), -(-k // 128)
    s = torch.from_numpy(rng.uniform(1e-4, 3e-2, size=(*lead, nb, kb)).astype(np.float32)).to(scale_dtype)
    raw = {"weight": torch.from_numpy(w).view(torch.float8_e4m3fn), "weight_scale_inv": s}
    s64 = s.double().numpy()
    s_full = np.repeat(np.repeat(s64, 128, axis=-2)[..., :n, :], 128, axis=-1)[..., :k]
    ref = ref_e4m3fn(w) * s_full
    for dt in (torch.float64, torch.float32):
        out = FP8_BLOCK.dequantize(raw, shape, dt)
        assert out.shape == shape and out.dtype == dt
        _assert_exact(out, ref)
    # bf16 output = the float32 result rounded once more
    assert torch.equal(FP8_BLOCK.dequantize(raw, shape, torch.bfloat16).float().nan_to_num(),
                       FP8_BLOCK.dequantize(raw, shape, torch.float32).bfloat16().float().nan_to_num())
    assert FP8_BLOCK.nbytes(shape) == int(np.prod(shape)) + 4 * s.numel()


def test_fp8_other_block_and_channel_and_tensor_exact():
    rng = np.random.default_rng(7)
    w = _rand_fp8(rng, (4, 64, 96))
    wt = torch.from_numpy(w).view(torch.float8_e4m3fn)
    fmt = fp8_block_format((32, 64))
    s = rng.uniform(0.001, 0.1, size=(4, 2, 2)).astype(np.float32)
    ref = ref_e4m3fn(w) * np.repeat(np.repeat(s.astype(np.float64), 32, 1), 64, 2)[..., :96]
    _assert_exact(fmt.dequantize({"weight": wt, "weight_scale_inv": torch.from_numpy(s)}, w.shape, torch.float64), ref)
    sc = rng.uniform(0.001, 0.1, size=(4, 64)).astype(np.float32)
    ref = ref_e4m3fn(w) * sc.astype(np.float64)[..., None]
    for dt in (torch.float64, torch.float32):
        _assert_exact(FP8_CHANNEL.dequantize({"weight": wt, "weight_scale": torch.from_numpy(sc)}, w.shape, dt), ref)
    g = np.float32(0.0123)
    ref = ref_e4m3fn(w) * np.float64(g)
    for dt in (torch.float64, torch.float32):
        _assert_exact(FP8_TENSOR.dequantize({"weight": wt, "weight_scale": torch.tensor(g)}, w.shape, dt), ref)
    per_expert = rng.uniform(0.001, 0.1, size=(4,)).astype(np.float32)
    ref = ref_e4m3fn(w) * per_expert.astype(np.float64)[:, None, None]
    _assert_exact(FP8_TENSOR.dequantize({"weight": wt, "weight_scale": torch.from_numpy(per_expert)}, w.shape, torch.float32), ref)


@pytest.mark.parametrize("shape", [(64, 256), (3, 40, 96)])
def test_nvfp4_exact(shape):
    rng = np.random.default_rng(shape[-1])
    *lead, n, k = shape
    packed = rng.integers(0, 256, size=(*lead, n, k // 2), dtype=np.uint8)
    sc = _rand_fp8(rng, (*lead, n, k // 16), allow_nan=False) & 0x7F  # ModelOpt scales are >= 0
    g = rng.uniform(1e-4, 1e-2, size=tuple(lead)).astype(np.float32)
    raw = {"weight": torch.from_numpy(packed), "weight_scale": torch.from_numpy(sc).view(torch.float8_e4m3fn),
           "weight_scale_2": torch.from_numpy(g)}
    ref = ref_e2m1(_unpack_fp4(packed)) * np.repeat(ref_e4m3fn(sc), 16, axis=-1)
    ref = ref * g.astype(np.float64).reshape(*lead, 1, 1)
    for dt in (torch.float64, torch.float32):
        _assert_exact(NVFP4.dequantize(raw, shape, dt), ref)
    assert NVFP4.nbytes(shape) == int(np.prod(shape)) // 2 + int(np.prod(shape)) // 16 + 4 * g.size
    assert NVFP4.bits_per_weight(4096) == 4.5


@pytest.mark.parametrize("shape", [(64, 256), (2, 24, 96)])
def test_mxfp4_exact(shape):
    rng = np.random.default_rng(shape[-1] + 1)
    *lead, n, k = shape
    blocks = rng.integers(0, 256, size=(*lead, n, k // 32, 16), dtype=np.uint8)  # gpt-oss layout
    scales = rng.integers(0, 256, size=(*lead, n, k // 32), dtype=np.uint8)
    scales.reshape(-1)[:4] = [0, 1, 254, 255]  # subnormal, smallest normal, largest, NaN
    raw = {"blocks": torch.from_numpy(blocks), "scales": torch.from_numpy(scales)}
    ref = ref_e2m1(_unpack_fp4(blocks.reshape(*lead, n, k // 2)))
    ref = ref * np.repeat(ref_e8m0(scales), 32, axis=-1)
    with np.errstate(over="ignore"):
        for dt in (torch.float64, torch.float32):
            _assert_exact(MXFP4.dequantize(raw, shape, dt), ref)
    flat = {"blocks": raw["blocks"].reshape(*lead, n, k // 2), "scales": raw["scales"]}
    assert torch.equal(MXFP4.dequantize(flat, shape).nan_to_num(), MXFP4.dequantize(raw, shape).nan_to_num())


# --------------------------------------------------------------------------- rows, tiles, qlinear
def _examples():
    """(format, raw, shape) for one format of each kind, 3-D (experts) shapes."""
    rng = np.random.default_rng(5)
    out = []
    for name in ("Q4_K", "IQ3_S", "Q8_0"):
        fmt = gguf_format(name)
        raw = _random_blocks(name, 2 * 48, 512 // fmt.block_size, rng)
        out.append((fmt, torch.from_numpy(raw).reshape(2, 48, -1), (2, 48, 512)))
    w = torch.from_numpy(_rand_fp8(rng, (2, 200, 384), allow_nan=False)).view(torch.float8_e4m3fn)
    out.append((FP8_BLOCK, {"weight": w, "weight_scale_inv": torch.rand(2, 2, 3) * 0.01}, (2, 200, 384)))
    out.append((NVFP4, {"weight": torch.from_numpy(rng.integers(0, 256, (2, 40, 64), dtype=np.uint8)),
                        "weight_scale": torch.from_numpy(rng.integers(0, 0x7F, (2, 40, 8), dtype=np.uint8)).view(torch.float8_e4m3fn),
                        "weight_scale_2": torch.tensor([0.01, 0.02])}, (2, 40, 128)))
    out.append((MXFP4, {"blocks": torch.from_numpy(rng.integers(0, 256, (2, 40, 4, 16), dtype=np.uint8)),
                        "scales": torch.from_numpy(rng.integers(110, 130, (2, 40, 4), dtype=np.uint8))}, (2, 40, 128)))
    return out


@pytest.fixture
def torch_tiles(monkeypatch):
    """qlinear's torch tile path (few-row CPU calls otherwise take the compiled kernel, whose activation
    rounding tests/test_cpu_kernels.py bounds): these tests check the tile decoders bit for bit."""
    monkeypatch.setenv("MOESTREAM_CPU_KERNELS", "0")


@pytest.mark.parametrize("example", _examples(), ids=lambda e: e[0].name)
def test_rows_tiles_and_qlinear(example, torch_tiles):
    fmt, raw, shape = example
    full = fmt.dequantize(raw, shape)
    flat = full.reshape(-1, shape[-1])
    rows = torch.tensor([0, 5, flat.shape[0] - 1, 17, 130 % flat.shape[0], 5])
    assert torch.equal(fmt.dequantize_rows(raw, shape, rows), flat[rows])
    assert torch.equal(fmt.dequantize_rows(raw, shape, slice(3, 20)), flat[3:20])
    c0, c1 = fmt.col_align, min(shape[-1], 3 * fmt.col_align)
    assert torch.equal(fmt.dequantize_tile(raw, shape, slice(10, 30), slice(c0, c1)), flat[10:30, c0:c1])
    assert torch.equal(fmt.dequantize_tile(raw, shape, rows, slice(c0, shape[-1])), flat[rows, c0:])
    tiles = list(fmt.iter_row_tiles(raw, shape, tile_rows=16))
    assert torch.equal(torch.cat([t for _, _, t in tiles]), flat)
    assert [(a, b) for a, b, _ in tiles][:2] == [(0, 16), (16, 32)]
    n = shape[-2]
    x = torch.randn(3, shape[-1])
    y = qlinear(x, fmt, raw, shape, rows=(n, 2 * n), tile_rows=16)  # expert 1
    torch.testing.assert_close(y, x @ full[1].t(), rtol=1e-5, atol=1e-5)
    qt = QuantizedTensor(fmt, shape, raw)
    assert torch.equal(qt.dequantize(torch.bfloat16), full.bfloat16())
    torch.testing.assert_close(qt.linear(x, rows=(0, n)), x @ full[0].t(), rtol=1e-5, atol=1e-5)
    assert qt.nbytes == fmt.nbytes(shape) > 0
    if c0 > 1:
        with pytest.raises(QuantFormatError, match="aligned"):
            fmt.dequantize_tile(raw, shape, slice(0, 2), slice(1, c1))


def test_registry_and_hf_configs():
    assert get_format("nvfp4") is NVFP4 and get_format("gguf:IQ3_S") is gguf_format("IQ3_S")
    assert {"fp8_block", "fp8_tensor", "fp8_channel", "nvfp4", "mxfp4"} <= set(FORMATS)
    with pytest.raises(QuantFormatError):
        get_format("nope")
    # an HF quantization_config as the model config reads it (config.parse_quantization_config), then its format
    def fmt(q):
        return hf_quant_format(parse_quantization_config(q))

    assert fmt(None) is None
    assert fmt({"quant_method": "fp8", "weight_block_size": [128, 128]}) is FP8_BLOCK
    assert fmt({"quant_method": "fp8", "weight_block_size": [64, 64]}).block == (64, 64)
    assert fmt({"quant_method": "fp8"}) is FP8_TENSOR
    assert fmt({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}) is NVFP4
    assert fmt({"quantization": {"quant_algo": "FP8"}}) is FP8_TENSOR
    assert fmt({"quant_method": "mxfp4"}) is MXFP4
    for rejected in ({"quant_method": "awq"}, {"quant_method": "modelopt_fp4", "quant_algo": "NVFP4"},
                     {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}, {}):
        with pytest.raises(ConfigError, match="not supported"):
            fmt(rejected)


# --------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("example", _examples(), ids=lambda e: e[0].name)
def test_cuda_matches_cpu(example):
    fmt, raw, shape = example
    cpu = fmt.dequantize(raw, shape)
    qt = QuantizedTensor(fmt, shape, raw).to("cuda")
    gpu = qt.dequantize()
    assert gpu.is_cuda
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.equal(qt.dequantize_rows(torch.tensor([1, 7], device="cuda")).cpu(), cpu.reshape(-1, shape[-1])[[1, 7]])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name", ALL_GGUF)
def test_cuda_gguf_bit_exact(name):
    rng = np.random.default_rng(3)
    fmt = gguf_format(name)
    n_blocks = 4 if fmt.block_size > 1 else 256
    raw = _random_blocks(name, 8, n_blocks, rng)
    shape = (8, n_blocks * fmt.block_size)
    gpu = fmt.dequantize(torch.from_numpy(raw).cuda(), shape).cpu().numpy()
    assert _bits_equal(gpu, _ours(name, raw, shape))


def test_qlinear_cpu_tiles_are_deterministic(torch_tiles):
    """CPU qlinear decodes L2-sized row tiles; the result does not depend on the tile size beyond the BLAS's
    summation order (each output column is one dot product over K, but a BLAS may sum it in another order for
    another number of columns: MKL's one-row product on AVX-512 does) and equals x @ W.T of the whole matrix.
    A tile put in the wrong columns, or a row decoded twice, is off by the values themselves."""
    from moestream.quant import default_tile_rows

    rng = np.random.default_rng(21)
    n, k = 300, 512
    fmt = gguf_format("Q4_K")
    raw = torch.from_numpy(_random_blocks("Q4_K", n, k // 256, rng))
    assert default_tile_rows(2048) == 128 and default_tile_rows(512) == 512  # 256 Ki values (1 MiB fp32)
    for dt in (torch.float32, torch.bfloat16):
        w = fmt.dequantize(raw, (n, k), dt)
        for m in (1, 5):
            x = torch.randn(m, k).to(dt)
            want = x @ w.t()
            # float32 sums of k products in any order: within k float32 ulps of the sum of |products|, then one
            # rounding to dt
            bound = (k * torch.finfo(torch.float32).eps * (x.abs().float() @ w.abs().float().t())
                     + torch.finfo(dt).eps * want.float().abs())
            for tile in (16, 48, None, n):
                y = qlinear(x, fmt, raw, (n, k), tile_rows=tile)
                assert ((y.float() - want.float()).abs() <= bound).all(), (dt, m, tile)
                if tile == n:  # one tile: the whole matrix's own product
                    assert torch.equal(y, want), (dt, m, tile)


def test_qlinear_never_decodes_more_than_a_tile(monkeypatch, torch_tiles):
    fmt = gguf_format("Q8_0")
    raw = torch.from_numpy(_random_blocks("Q8_0", 64, 4, np.random.default_rng(1)))
    seen = []
    real = type(fmt)._decode
    monkeypatch.setattr(type(fmt), "_decode", lambda self, p, nr, nc, dt: seen.append(nr) or real(self, p, nr, nc, dt))
    x = torch.randn(2, 128)
    torch.testing.assert_close(qlinear(x, fmt, raw, (64, 128), tile_rows=16), x @ fmt.dequantize(raw, (64, 128)).t())
    assert seen[:4] == [16, 16, 16, 16] and seen[-1] == 64  # the whole matrix only for the reference


# --------------------------------------------------------------------------- synthetic weights, bench bw
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_synthetic_weights_are_valid(name):
    from moestream.quant.synthetic import random_raw

    fmt = get_format(name)
    shape = (2, 16, 512)
    raw = random_raw(fmt, shape, seed=3)
    w = fmt.dequantize(raw, shape)
    assert w.shape == shape and torch.isfinite(w).all() and w.abs().max() > 0
    assert (w.abs() < 1e-30).float().mean() < 0.5  # mostly normal values (no subnormal scales)
    parts = {"data": raw} if isinstance(raw, torch.Tensor) else raw
    assert sum(t.numel() * t.element_size() for t in parts.values()) == fmt.nbytes(shape)


@pytest.mark.parametrize("expert_format", ["q4_k", "fp8", "nvfp4"])
def test_bench_bw_counts_compressed_bytes(expert_format, tmp_path, monkeypatch, capsys):
    from moestream.cli import main
    from moestream.moe import bench
    from moestream.moe.compute import RouteGroups, WeightRef, expert_mlp, partial_outputs

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the bench sets process-wide threads
    out = tmp_path / "bw.json"
    h, i = 256, 256
    assert main(["bench", "bw", "--device", "cpu", "-o", str(out), "--hidden", str(h), "--inter", str(i),
                 "--experts", "2", "--top-k", "2", "--host-mib", "4", "--iters", "1", "--cpu-threads", "1",
                 "--expert-format", expert_format]) == 0
    prof = json.loads(out.read_text())
    q = {"q4_k": gguf_format("Q4_K"), "fp8": FP8_BLOCK, "nvfp4": NVFP4}[expert_format]
    want = sum(q.nbytes(s) for s in ((i, h), (i, h), (h, i)))
    assert prof["expert_bytes"] == want < 3 * h * i * 2  # compressed, not dense bf16
    assert prof["expert_format"].endswith(q.name.removeprefix("gguf:")) and prof["cpu_expert_gbs"] > 0
    assert "stored as" in capsys.readouterr().out
    # the bench's bank computes what the dense weights compute
    fmt = bench.expert_format(expert_format, torch.float32, h, i)
    bank = bench.make_bank(fmt, 2, h, i)
    x = torch.randn(3, h)
    groups = RouteGroups.of(torch.ones(3, 1, dtype=torch.long))
    # with float activations (the kernels' int8 rounding of x and h, tested against its bound in
    # test_cpu_kernels.py, would hide a layout error of a few percent here)
    monkeypatch.setenv("MOESTREAM_CPU_KERNELS", "0")
    got = partial_outputs(x, torch.ones(3, 1), groups, {1: WeightRef(bank, 1, fmt)})[1]
    gate_up, down = fmt.dense({k: v[1] for k, v in bank.items()}, torch.float32)
    want = expert_mlp(x, gate_up, down)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_bench_bw_rejects_unknown_formats():
    from moestream.core import ConfigError
    from moestream.moe import bench

    with pytest.raises(ConfigError, match="unknown --expert-format 'q9'"):
        bench.expert_format("q9", torch.bfloat16, 256, 256)
    with pytest.raises(ConfigError, match="not a multiple"):
        bench.expert_format("q4_k", torch.bfloat16, 256, 100)


def test_gpu_tiles_bound_a_vocabulary_head():
    """A GPU qlinear decodes a weight in one tile up to GPU_TILE_BYTES dense, else in tiles of that size: a Q8_0
    head of 248,320 x 2,048 in bf16 goes through 16 tiles of 16,384 rows instead of 0.95 GiB at once; an 8192 x 2048
    projection stays one tile."""
    from moestream.quant.base import GPU_TILE_BYTES, gpu_tile_rows

    assert gpu_tile_rows(2048, 248320, 2) == GPU_TILE_BYTES // (2048 * 2) == 16384
    assert -(-248320 // gpu_tile_rows(2048, 248320, 2)) == 16
    assert gpu_tile_rows(2048, 8192, 2) == 8192 and gpu_tile_rows(2048, 0, 2) == 1
