"""Hugging Face checkpoint formats with small-float elements: FP8 (block / channel / tensor scales),
NVFP4 (ModelOpt) and MXFP4 (OCP MX; the gpt-oss checkpoint layout).

Parts use the checkpoint tensor names, so a loader can hand the safetensors tensors over as they are:

========== ===================================================================================
fp8_block  ``weight`` float8_e4m3fn (N, K); ``weight_scale_inv`` float32/bf16
           (ceil(N/bn), ceil(K/bk)), default bn = bk = 128 (HF ``quant_method: fp8`` with
           ``weight_block_size``, as in DeepSeek-V3 / Qwen3 FP8). w = fp8 * scale_inv.
fp8_channel``weight`` float8_e4m3fn (N, K); ``weight_scale`` (N,) or (N, 1) float32.
fp8_tensor ``weight`` float8_e4m3fn (N, K); ``weight_scale`` float32 scalar (ModelOpt FP8) or one
           per lead index (stacked experts). w = fp8 * weight_scale.
nvfp4      ModelOpt NVFP4: ``weight`` uint8 (N, K/2), two e2m1 per byte, element 2i in the low
           nibble, 2i+1 in the high one; ``weight_scale`` float8_e4m3fn (N, K/16), one per 16
           consecutive elements of a row (linear layout, as stored; kernels swizzle at load);
           ``weight_scale_2`` float32 scalar (or one per lead index).
           w = (e2m1 * float(weight_scale)) * weight_scale_2.
mxfp4      OCP MXFP4 as in gpt-oss: ``blocks`` uint8 (N, K/32, 16) (or (N, K/2)), two e2m1 per byte,
           low nibble first; ``scales`` uint8 (N, K/32) e8m0: 2^(s-127), 0xFF = NaN.
========== ===================================================================================

Every element is a small float times power-of-two or fp32 scales, so decoding in float32 rounds at
most once (the last fp32 multiply) and decoding in float64 is exact; tests/test_quant.py checks both
against an independent float64 bit decoder.  Leading dims (experts) are allowed: ``(*lead, N, K)``.
"""
from __future__ import annotations

from typing import Mapping

import torch

from .base import PartSpec, QuantFormat, cached_table, compute_dtype, get_format, register


def e2m1_table() -> torch.Tensor:
    """The 16 OCP e2m1 values (1 sign, 2 exponent bits with bias 1, 1 mantissa bit), from the bits."""
    vals = []
    for code in range(16):
        s, e, m = code >> 3, (code >> 1) & 3, code & 1
        mag = m * 0.5 if e == 0 else (1.0 + m * 0.5) * 2.0 ** (e - 1)
        vals.append(-mag if s else mag)
    return torch.tensor(vals, dtype=torch.float64)  # -0.0 for code 8


def e4m3fn_table() -> torch.Tensor:
    """All 256 float8_e4m3fn values (bias 7, no inf, S.1111.111 = NaN), from the bits."""
    vals = []
    for code in range(256):
        s, e, m = code >> 7, (code >> 3) & 0xF, code & 7
        if e == 15 and m == 7:
            v = float("nan")
        elif e == 0:
            v = m / 8.0 * 2.0 ** -6
        else:
            v = (1.0 + m / 8.0) * 2.0 ** (e - 7)
        vals.append(-v if s else v)
    return torch.tensor(vals, dtype=torch.float64)


def _e2m1(device, dtype) -> torch.Tensor:
    return cached_table("e2m1", e2m1_table, device, dtype)


def _e4m3(codes: torch.Tensor, dtype) -> torch.Tensor:
    """float8_e4m3fn codes (uint8) -> dtype; by table lookup so it works on every device/arch."""
    return cached_table("e4m3fn", e4m3fn_table, codes.device, dtype)[codes.long()]


def _e8m0(codes: torch.Tensor, dtype) -> torch.Tensor:
    """e8m0 scale codes (uint8) -> 2^(c-127) (c = 255 -> NaN), built from float32 bits (exact)."""
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, torch.full_like(c, 0x00400000), c << 23)  # c=0: 2^-127 is subnormal
    bits = torch.where(c == 255, torch.full_like(c, 0x7FC00000), bits)
    return bits.view(torch.float32).to(dtype)


def _fp4_pairs(packed: torch.Tensor, dtype) -> torch.Tensor:
    """(R, C) bytes -> (R, 2C) e2m1 values; element 2i = low nibble of byte i."""
    lut = _e2m1(packed.device, dtype)
    q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    return lut[q.long()]


class FP8Format(QuantFormat):
    def __init__(self, name: str, mode: str, block: tuple[int, int] = (128, 128)):
        self.name = name
        self.mode = mode
        f8 = torch.float8_e4m3fn
        if mode == "block":
            bn, bk = block
            self.block = (bn, bk)
            self.parts = (PartSpec("weight", 1, 1, 1, f8), PartSpec("weight_scale_inv", bn, bk, 1, torch.float32))
            self.block_shape = (bn, bk)
            self.col_align = bk
            self.description = f"FP8 e4m3 with {bn}x{bk} block scales (weight_scale_inv)"
        elif mode == "channel":
            self.parts = (PartSpec("weight", 1, 1, 1, f8), PartSpec("weight_scale", 1, None, 1, torch.float32))
            self.description = "FP8 e4m3 with one fp32 scale per output row"
        elif mode == "tensor":
            self.parts = (PartSpec("weight", 1, 1, 1, f8), PartSpec("weight_scale", None, None, 1, torch.float32))
            self.description = "FP8 e4m3 with a per-tensor fp32 scale (ModelOpt FP8)"
        else:
            raise ValueError(mode)

    def scale_layout(self, n_rows: int, n_cols: int) -> tuple[tuple[int, int], int]:
        """((rows, columns) a scale covers, scales per scale row) of an [n_rows, n_cols] weight: the scale of row i,
        column k is scale.flat[(i // rows) * stride + k // columns] (kernels/cpu_quant.fp8_matmul's layout)."""
        if self.mode == "block":
            return self.block, -(-n_cols // self.block[1])
        if self.mode == "channel":
            return (1, n_cols), 1
        return (n_rows, n_cols), 0

    def _decode(self, parts, n_rows, n_cols, out_dtype):
        cd = compute_dtype(out_dtype)
        w = parts["weight"]
        w = w.view(torch.float8_e4m3fn).to(cd) if w.dtype == torch.uint8 else w.to(cd)
        if self.mode == "block":
            bk = self.block[1]
            s = parts["weight_scale_inv"].to(cd)
            if n_cols % bk == 0:
                w = (w.reshape(n_rows, n_cols // bk, bk) * s.unsqueeze(-1)).reshape(n_rows, n_cols)
            else:
                w = w * s.repeat_interleave(bk, dim=1)[:, :n_cols]
        else:
            w = w * parts["weight_scale"].to(cd).reshape(-1, 1)
        return w if w.dtype == out_dtype else w.to(out_dtype)


class NVFP4Format(QuantFormat):
    name = "nvfp4"
    parts = (
        PartSpec("weight", 1, 2, 1, torch.uint8),
        PartSpec("weight_scale", 1, 16, 1, torch.float8_e4m3fn),
        PartSpec("weight_scale_2", None, None, 1, torch.float32),
    )
    block_shape = (1, 16)
    col_align = 16
    description = "ModelOpt NVFP4: e2m1 pairs, e4m3 scale per 16, fp32 global scale"

    def _decode(self, parts, n_rows, n_cols, out_dtype):
        cd = compute_dtype(out_dtype)
        q = _fp4_pairs(parts["weight"], cd)  # (R, K)
        s = _e4m3(parts["weight_scale"], cd)  # (R, K/16)
        g = parts["weight_scale_2"].to(cd).reshape(-1, 1)
        w = (q.reshape(n_rows, n_cols // 16, 16) * s.unsqueeze(-1)).reshape(n_rows, n_cols) * g
        return w if w.dtype == out_dtype else w.to(out_dtype)


class MXFP4Format(QuantFormat):
    name = "mxfp4"
    parts = (
        PartSpec("blocks", 1, 2, 1, torch.uint8),
        PartSpec("scales", 1, 32, 1, torch.uint8),
    )
    block_shape = (1, 32)
    col_align = 32
    description = "OCP MXFP4 (gpt-oss layout): e2m1 pairs low-nibble-first, e8m0 scale per 32"

    def _decode(self, parts, n_rows, n_cols, out_dtype):
        cd = compute_dtype(out_dtype)
        q = _fp4_pairs(parts["blocks"], cd)
        s = _e8m0(parts["scales"], cd)
        w = (q.reshape(n_rows, n_cols // 32, 32) * s.unsqueeze(-1)).reshape(n_rows, n_cols)
        return w if w.dtype == out_dtype else w.to(out_dtype)


FP8_BLOCK = register(FP8Format("fp8_block", "block", (128, 128)))
FP8_CHANNEL = register(FP8Format("fp8_channel", "channel"))
FP8_TENSOR = register(FP8Format("fp8_tensor", "tensor"))
NVFP4 = register(NVFP4Format())
MXFP4 = register(MXFP4Format())


def fp8_block_format(block_size=(128, 128)) -> FP8Format:
    """FP8 with ``weight_block_size`` other than 128x128 (unregistered instances are fine to use)."""
    bn, bk = (int(block_size[0]), int(block_size[1]))
    if (bn, bk) == (128, 128):
        return FP8_BLOCK
    return FP8Format(f"fp8_block_{bn}x{bk}", "block", (bn, bk))


def hf_quant_format(quantization: Mapping | None) -> QuantFormat | None:
    """The weight format of an HF checkpoint's quantization as `config.parse_quantization_config` reads it
    (ModelConfig.quantization: "format" fp8_block / fp8_tensor / nvfp4 / mxfp4, "block_size"); None for
    an unquantized checkpoint."""
    if quantization is None:
        return None
    if quantization["format"] == "fp8_block":
        return fp8_block_format(quantization["block_size"])
    return get_format(quantization["format"])
