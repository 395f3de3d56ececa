"""Random but valid stored weights of any format, made directly on a device (benchmarks, `bench bw`).

Throughput does not depend on the values, but NaN/inf or subnormal scales would make CPU math slow
and results meaningless, so every scale is a small finite number: GGUF blocks are random bytes with
their fp16 scale fields overwritten, FP8/FP4 codes avoid NaN, scales are positive floats.
"""
from __future__ import annotations

from math import prod

import torch

from .base import QuantFormat, QuantFormatError, Raw, norm_shape
from .fp_formats import FP8Format, MXFP4Format, NVFP4Format
from .gguf_formats import GGUFFormat, q8_0_row_planar

# byte offsets of the fp16 scale fields inside one block (ggml-common.h block structs)
_FP16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q8_0R": (0,), "Q2_K": (80, 82),
    "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ2_XXS": (0,), "IQ2_XS": (0,),
    "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,),
    "TQ1_0": (52,), "TQ2_0": (64,),
}


def _fp16_bytes(value: float, device) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float16).view(torch.uint8).to(device)


def random_raw(fmt: QuantFormat, shape, device="cpu", seed: int = 0) -> Raw:
    """Stored parts of a ``shape`` weight in ``fmt`` (one uint8 tensor for GGUF, else a part mapping)."""
    shape = norm_shape(shape)
    device = torch.device(device)
    g = torch.Generator(device=device)
    g.manual_seed(seed)

    def u8(*s, hi=256):
        return torch.randint(0, hi, s, dtype=torch.uint8, device=device, generator=g)

    lead, n, k = shape[:-2], shape[-2], shape[-1]
    if isinstance(fmt, GGUFFormat):
        if fmt.type_name in ("F32", "F16", "BF16"):
            dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[fmt.type_name]
            return torch.randn(shape, device=device, generator=g).to(dt)
        blocks = u8(prod(shape) // fmt.block_size, fmt.type_size)
        if fmt.type_name == "MXFP4":
            blocks[:, 0] = 120 + blocks[:, 0] % 8  # e8m0 scales around 2^-5
        elif fmt.type_name == "NVFP4":
            blocks[:, :4] = 0x20 + blocks[:, :4] % 0x20  # ue4m3 scales in [2^-3, 2)
        elif fmt.type_name == "IQ1_M":  # fp16 scale 0x2400 in the top nibbles of its 4 uint16 scale words
            for i, nib in enumerate((0x0, 0x0, 0x4, 0x2)):
                blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (nib << 4)
        for off in _FP16_FIELDS.get(fmt.type_name, ()):
            blocks[:, off:off + 2] = _fp16_bytes(0.01, device)
        if fmt.type_name == "Q8_0R":  # Q8_0 blocks, each row rewritten row-planar
            return q8_0_row_planar(blocks.reshape(*lead, n, -1), k)
        return blocks.reshape(*lead, n, -1)
    if isinstance(fmt, FP8Format):
        w = (u8(*shape) & 0x77).view(torch.float8_e4m3fn)  # |w| < 240: no NaN
        spec = fmt.part_specs(shape)[fmt.parts[1].name][0]
        s = torch.rand(spec, device=device, generator=g) * 1e-2 + 1e-3
        return {"weight": w, fmt.parts[1].name: s}
    if isinstance(fmt, NVFP4Format):
        return {"weight": u8(*lead, n, k // 2),
                "weight_scale": (0x20 + u8(*lead, n, k // 16, hi=0x20)).view(torch.float8_e4m3fn),
                "weight_scale_2": torch.full(tuple(lead), 1e-2, device=device)}
    if isinstance(fmt, MXFP4Format):
        return {"blocks": u8(*lead, n, k // 32, 16), "scales": 120 + u8(*lead, n, k // 32, hi=8)}
    raise QuantFormatError(f"no random weights for {fmt.name}")
