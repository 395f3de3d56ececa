"""Triton dequantization kernels: the CUDA fast path of moestream.quant (stored bytes -> dense rows).

Why: routed experts stay compressed in VRAM slots and are dequantized inside the expert computation,
so decoding must cost about one read of the compressed bytes and one write of the dense tile. The
torch decoders (gguf_formats, fp_formats) spend a dozen kernel launches and temporaries per tensor;
here each format is one kernel.

Exactness: every kernel decodes in float32 with the same operations in the same order as the torch
decoder of its format (exact values, such as fp16/e4m3/e2m1/e8m0 codes, are built from their bits
instead of tables), then rounds once to the output dtype, so it equals the torch path bit for bit:

* kernels are compiled with ``enable_fp_fusion=False``: ``d*q - m`` rounds twice, as in torch (an
  FMA would round once and differ in the last bit);
* no division (every divisor in the decoders is a power of two, written as an exact multiply);
* bfloat16 output is rounded to nearest even in integer arithmetic (``_bf16_bits``), so it is the
  same on a GPU and under Triton's CPU interpreter (whose own float->bf16 cast truncates).

Supported: GGUF Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL IQ4_XS IQ3_S IQ3_XXS IQ2_XXS IQ2_XS IQ2_S IQ1_S IQ1_M TQ1_0 TQ2_0 MXFP4 NVFP4,
fp8_block (any block size) / fp8_channel / fp8_tensor, nvfp4, mxfp4; outputs float32, bfloat16,
float16. Other formats and float64 stay on torch (``supports``).

Kernels read rows ``row0 .. row0+n`` or a list of row ids straight from the stored parts: gathering
rows copies no compressed bytes. Importing this module imports triton; moestream.quant.base imports
it only when a CUDA tensor is decoded, triton is installed and ``MOESTREAM_TRITON`` is not ``0``.
Tests run the same kernels on CPU under ``TRITON_INTERPRET=1`` (tests/test_triton_dequant.py).
"""
from __future__ import annotations

from contextlib import nullcontext
from math import prod

import torch
import triton
import triton.language as tl

from .base import QuantFormat, QuantFormatError, cached_table, norm_shape, resolve_rows
from .fp_formats import FP8Format, MXFP4Format, NVFP4Format
from .gguf_formats import _IQ4NL_LEVELS, GGUFFormat, iq_grid

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BIG = 1 << 30  # column unit of a part with one value per row: c // _BIG == 0 (K < 2^30)

# kernel ids of the GGUF types (constexpr QT) and their sub-blocks (one scale each) per block (NS)
Q8R = tl.constexpr(23)  # Q8_0R (gguf_formats.RowPlanarQ8): a row layout, not blocks; kernels address it by row
_GGUF_IDS = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q2_K": 5, "Q3_K": 6, "Q4_K": 7,
             "Q5_K": 8, "Q6_K": 9, "IQ4_NL": 10, "IQ4_XS": 11, "MXFP4": 12, "NVFP4": 13, "IQ3_S": 14,
             "IQ3_XXS": 15, "IQ2_XXS": 16, "IQ2_XS": 17, "IQ2_S": 18,
             "IQ1_S": 19, "IQ1_M": 20, "TQ1_0": 21, "TQ2_0": 22, "Q8_0R": 23}
_GGUF_NS = {"Q2_K": 16, "Q3_K": 16, "Q4_K": 8, "Q5_K": 8, "Q6_K": 16, "IQ4_XS": 8, "NVFP4": 4, "IQ3_S": 8, "IQ3_XXS": 8,
            "IQ2_XXS": 8, "IQ2_XS": 16, "IQ2_S": 16, "IQ1_S": 8, "IQ1_M": 16,
            "TQ1_0": 8, "TQ2_0": 8}  # (TQ*: one scale a block; 8 "sub-blocks" let a K step hold 32 values)
LUT_IQ3S = tl.constexpr(16)  # float offset of the IQ3_S grid (512 x 4 magnitudes) in `lut_table`, after the 16 IQ4 levels
LUT_IQ3XXS = tl.constexpr(16 + 2048)  # then the IQ3_XXS grid (256 x 4)
LUT_IQ2XXS = tl.constexpr(16 + 2048 + 1024)  # the IQ2_XXS grid (256 x 8)
LUT_IQ2XS = tl.constexpr(16 + 2048 + 1024 + 2048)  # the IQ2_XS grid (512 x 8)
LUT_IQ2S = tl.constexpr(16 + 2048 + 1024 + 2048 + 4096)  # the IQ2_S grid (1024 x 8)
LUT_IQ1S = tl.constexpr(16 + 2048 + 1024 + 2048 + 4096 + 8192)  # the IQ1_S grid (2048 x 8; IQ1_M's too)
LUT_GRIDS = ("IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S")  # in that order after the 16 IQ4 levels
_FP8, _NVFP4, _MXFP4 = 0, 1, 2
_ELEMS = 4096  # output values per program
# launch options of every kernel: no FMA contraction (``d*q - m`` must round twice, as in torch)
LAUNCH = {"num_warps": 4, "enable_fp_fusion": False}


# ----------------------------------------------------------------------------- device helpers
@triton.jit
def _ld(p, off, m):
    """Byte at ``p + off`` as int32 (0 where masked)."""
    return tl.load(p + off, mask=m, other=0).to(tl.int32)


@triton.jit
def _u16(p, off, m):
    """Little-endian uint16 at byte ``off`` as int32."""
    return _ld(p, off, m) | (_ld(p, off + 1, m) << 8)


@triton.jit
def _u32(p, off, m):
    """Little-endian uint32 at byte ``off`` as int32 bits (wraps above 2^31; read with shifts and masks)."""
    return _u16(p, off, m) | (_u16(p, off + 2, m) << 16)


@triton.jit
def _half(bits):
    """fp16 bits (int32, low 16) -> float32 (exact)."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16(p, off, m):
    """Little-endian fp16 at byte ``off`` -> float32 (exact)."""
    return _half(_u16(p, off, m))


@triton.jit
def _i8(b):
    """Byte (int32 0..255) read as a signed int8."""
    return b - ((b & 0x80) << 1)


@triton.jit
def _e4m3(b):
    """float8_e4m3fn code (int32) -> float32, from the bits (0x7F/0xFF are NaN)."""
    e = (b >> 3) & 0xF
    man = b & 7
    normal = (((e + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormal: man * 2^-9
    v = tl.where((b & 0x7F) == 0x7F, (b * 0 + 0x7FC00000).to(tl.float32, bitcast=True), v)
    return (v.to(tl.int32, bitcast=True) | ((b >> 7) << 31)).to(tl.float32, bitcast=True)  # sign bit (-0.0 too)


@triton.jit
def _e8m0(b):
    """e8m0 code -> 2^(b-127) from float32 bits (b = 0: the subnormal 2^-127; b = 255: NaN)."""
    bits = tl.where(b == 0, 0x00400000, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(q):
    """e2m1 code (0..15) -> float32 from the bits (code 8 is -0.0, as in fp_formats.e2m1_table)."""
    e = (q >> 1) & 3
    man = q & 1
    bits = tl.where(e == 0, man * 0x3F000000, ((e + 126) << 23) | (man << 22))
    return (bits | ((q >> 3) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1x2(q):
    """ggml's kvalues_mxfp4: twice the e2m1 value, as an integer (code 8 reads +0)."""
    e = (q >> 1) & 3
    man = q & 1
    v = tl.where(e == 0, man, (2 + man) << tl.maximum(e - 1, 0))
    return tl.where(q >= 8, -v, v).to(tl.float32)


@triton.jit
def _ue4m3_half(x):
    """ggml's NVFP4 sub-block scale: unsigned e4m3 (0x00/0x7F read as 0) times 0.5."""
    ex = (x >> 3) & 0xF
    man = (x & 7).to(tl.float32)
    pow2 = (tl.maximum(ex + 120, 1) << 23).to(tl.float32, bitcast=True)
    val = tl.where(ex == 0, man * 0.001953125, (1.0 + man * 0.125) * pow2)
    return tl.where((x == 0) | (x == 0x7F), 0.0, val * 0.5)


@triton.jit
def _bf16_bits(v):
    """float32 -> bfloat16 bits (int16), round to nearest even; NaN stays a quiet NaN."""
    b = v.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(v != v, (b >> 16) | 0x40, r)
    return r.to(tl.int16)


@triton.jit
def _store(out, offs, v, m, OUT_BF16: tl.constexpr):
    if OUT_BF16:
        tl.store(out + offs, _bf16_bits(v), mask=m)  # out is the int16 view of the bf16 output
    else:
        tl.store(out + offs, v.to(out.dtype.element_ty), mask=m)


# ----------------------------------------------------------------------------- GGUF blocks
# A program decodes G blocks as a [G, NS, SS] tile: NS sub-blocks (one scale each) of SS values.
# Each decoder gets p: [G, 1, 1] pointers to the blocks, e: [1, NS, SS] value ids within a block,
# s: [1, NS, 1] sub-block ids (so a scale is loaded once per sub-block, not once per value), m: the
# block mask, lut: the IQ4 levels; returns [G, NS, SS] float32 with the ops of gguf_formats._d_<type>.

@triton.jit
def _q4_0(p, e, m):
    q = (_ld(p, 2 + e % 16, m) >> ((e // 16) * 4)) & 0xF
    return _f16(p, 0, m) * (q - 8).to(tl.float32)


@triton.jit
def _q4_1(p, e, m):
    q = (_ld(p, 4 + e % 16, m) >> ((e // 16) * 4)) & 0xF
    return _f16(p, 0, m) * q.to(tl.float32) + _f16(p, 2, m)


@triton.jit
def _q5_0(p, e, m):
    q = ((_ld(p, 6 + e % 16, m) >> ((e // 16) * 4)) & 0xF) | (((_ld(p, 2 + e // 8, m) >> (e % 8)) & 1) << 4)
    return _f16(p, 0, m) * (q - 16).to(tl.float32)


@triton.jit
def _q5_1(p, e, m):
    q = ((_ld(p, 8 + e % 16, m) >> ((e // 16) * 4)) & 0xF) | (((_ld(p, 4 + e // 8, m) >> (e % 8)) & 1) << 4)
    return _f16(p, 0, m) * q.to(tl.float32) + _f16(p, 2, m)


@triton.jit
def _q8_0(p, e, m):
    return _i8(_ld(p, 2 + e, m)).to(tl.float32) * _f16(p, 0, m)


@triton.jit
def _q2_k(p, e, s, m):
    sc = _ld(p, s, m)
    dl = _f16(p, 80, m) * (sc & 0xF).to(tl.float32)
    ml = _f16(p, 82, m) * (sc >> 4).to(tl.float32)
    q = (_ld(p, 16 + (e // 128) * 32 + e % 32, m) >> (((e % 128) // 32) * 2)) & 3
    return dl * q.to(tl.float32) - ml


@triton.jit
def _q3_k(p, e, s, m):
    j = s
    lo = (_ld(p, 96 + j % 8, m) >> ((j // 8) * 4)) & 0xF
    hi = (_ld(p, 104 + j % 4, m) >> ((j // 4) * 2)) & 3
    dl = _f16(p, 108, m) * ((lo | (hi << 4)) - 32).to(tl.float32)
    ql = (_ld(p, 32 + (e // 128) * 32 + e % 32, m) >> (((e % 128) // 32) * 2)) & 3
    qh = (_ld(p, e % 32, m) >> (e // 32)) & 1
    return dl * (ql - ((qh ^ 1) << 2)).to(tl.float32)


@triton.jit
def _k_scale_min(p, j, m):
    """The six-bit scale and min of sub-block j (0..7) from the 12 bytes at offset 4 (Q4_K / Q5_K)."""
    a = _ld(p, 4 + j % 4, m)
    mm = _ld(p, 8 + j % 4, m)
    md = _ld(p, 12 + j % 4, m)
    sc = tl.where(j < 4, a & 0x3F, (md & 0xF) | ((a >> 2) & 0x30))
    mn = tl.where(j < 4, mm & 0x3F, (md >> 4) | ((mm >> 2) & 0x30))
    return sc, mn


@triton.jit
def _q4_k(p, e, s, m):
    sc, mn = _k_scale_min(p, s, m)
    dl = _f16(p, 0, m) * sc.to(tl.float32)
    ml = _f16(p, 2, m) * mn.to(tl.float32)
    q = (_ld(p, 16 + (e // 64) * 32 + e % 32, m) >> (((e // 32) % 2) * 4)) & 0xF
    return dl * q.to(tl.float32) - ml


@triton.jit
def _q5_k(p, e, s, m):
    sc, mn = _k_scale_min(p, s, m)
    dl = _f16(p, 0, m) * sc.to(tl.float32)
    ml = _f16(p, 2, m) * mn.to(tl.float32)
    ql = (_ld(p, 48 + (e // 64) * 32 + e % 32, m) >> (((e // 32) % 2) * 4)) & 0xF
    qh = (_ld(p, 16 + e % 32, m) >> (e // 32)) & 1
    return dl * (ql | (qh << 4)).to(tl.float32) - ml


@triton.jit
def _q6_k(p, e, s, m):
    dl = _f16(p, 208, m) * _i8(_ld(p, 192 + s, m)).to(tl.float32)
    h = e // 128
    ql = (_ld(p, h * 64 + e % 64, m) >> (((e % 128) // 64) * 4)) & 0xF
    qh = (_ld(p, 128 + h * 32 + e % 32, m) >> (((e % 128) // 32) * 2)) & 3
    return dl * ((ql | (qh << 4)) - 32).to(tl.float32)


@triton.jit
def _iq4_nl(p, e, m, lut):
    q = (_ld(p, 2 + e % 16, m) >> ((e // 16) * 4)) & 0xF
    return _f16(p, 0, m) * tl.load(lut + q)


@triton.jit
def _iq4_xs(p, e, s, m, lut):
    j = s
    lo = (_ld(p, 4 + j // 2, m) >> ((j % 2) * 4)) & 0xF
    hi = (_u16(p, 2, m) >> (2 * j)) & 3
    dl = _f16(p, 0, m) * ((lo | (hi << 4)) - 32).to(tl.float32)
    q = (_ld(p, 8 + j * 16 + e % 16, m) >> (((e % 32) // 16) * 4)) & 0xF
    return dl * tl.load(lut + q)


@triton.jit
def _iq3_s(p, e, s, m, lut):
    """Blocks of 110 bytes: d, 64 grid-index low bytes, 8 bytes of their 9th bits, 32 bytes of signs, 4 bytes of
    4-bit sub-block scales (32 values each: d * (1 + 2 scale)); a grid entry is 4 magnitudes (lut_table)."""
    j = s
    sc = (_ld(p, 106 + j // 2, m) >> ((j % 2) * 4)) & 0xF
    db = _f16(p, 0, m) * (1 + 2 * sc).to(tl.float32)
    g = e // 4
    idx = _ld(p, 2 + g, m) | (((_ld(p, 66 + g // 8, m) >> (g % 8)) & 1) << 8)
    v = db * tl.load(lut + LUT_IQ3S + idx * 4 + e % 4)
    return tl.where(((_ld(p, 74 + e // 8, m) >> (e % 8)) & 1) == 1, -v, v)


@triton.jit
def _ksign(sidx, b):
    """Sign bit b (0..7) of ksigns[sidx]: bits 0-6 are sidx's, bit 7 makes the count of set bits even."""
    par = sidx ^ (sidx >> 4)
    par = par ^ (par >> 2)
    par = (par ^ (par >> 1)) & 1
    return tl.where(b == 7, par, (sidx >> b) & 1)


@triton.jit
def _iq2_xxs(p, e, s, m, lut):
    """66-byte blocks: d, then per sub-block of 32 values 4 grid indices (256 x 8 grid) and a uint32 of four 7-bit
    sign indices with a 4-bit scale on top (d * (0.5 + scale) * 0.25)."""
    q = 2 + s * 8
    db = _f16(p, 0, m) * (0.5 + (_ld(p, q + 7, m) >> 4).to(tl.float32)) * 0.25
    aux = _u32(p, q + 4, m)
    grp = (e % 32) // 8
    v = db * tl.load(lut + LUT_IQ2XXS + _ld(p, q + grp, m) * 8 + e % 8)
    return tl.where(_ksign((aux >> (7 * grp)) & 0x7F, e % 8) == 1, -v, v)


@triton.jit
def _iq2_xs(p, e, s, m, lut):
    """74-byte blocks: d, 32 uint16 (a 9-bit index into a 512 x 8 grid, a 7-bit sign index) for 8 values each, 16
    4-bit scales for 16 values each."""
    sc = (_ld(p, 66 + s // 2, m) >> ((s % 2) * 4)) & 0xF
    db = _f16(p, 0, m) * (0.5 + sc.to(tl.float32)) * 0.25
    g = e // 8
    qs = _u16(p, 2 + 2 * g, m)
    v = db * tl.load(lut + LUT_IQ2XS + (qs & 511) * 8 + e % 8)
    return tl.where(_ksign(qs >> 9, e % 8) == 1, -v, v)


@triton.jit
def _iq2_s(p, e, s, m, lut):
    """82-byte blocks: d, 32 low bytes of 10-bit indices into a 1024 x 8 grid, 256 sign bits, 32 x 2 high index
    bits, 16 4-bit scales for 16 values each."""
    sc = (_ld(p, 74 + s // 2, m) >> ((s % 2) * 4)) & 0xF
    db = _f16(p, 0, m) * (0.5 + sc.to(tl.float32)) * 0.25
    g = e // 8
    idx = _ld(p, 2 + g, m) | (((_ld(p, 66 + g // 4, m) >> (2 * (g % 4))) & 3) << 8)
    v = db * tl.load(lut + LUT_IQ2S + idx * 8 + e % 8)
    return tl.where(((_ld(p, 34 + e // 8, m) >> (e % 8)) & 1) == 1, -v, v)


@triton.jit
def _iq1_s(p, e, s, m, lut):
    """50-byte blocks: d, 32 low bytes of 11-bit indices into a 2048 x 8 grid, per sub-block of 32 values a uint16:
    four 3-bit high index parts, a 3-bit scale (d * (2 scale + 1)) and the sign of a +-1/8 shift of the grid."""
    qh = _u16(p, 34 + 2 * s, m)
    dl = _f16(p, 0, m) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
    delta = tl.where((qh & 0x8000) == 0, 0.125, -0.125)
    grp = (e % 32) // 8
    idx = _ld(p, 2 + s * 4 + grp, m) | (((qh >> (3 * grp)) & 7) << 8)
    return dl * (tl.load(lut + LUT_IQ1S + idx * 8 + e % 8) + delta)


@triton.jit
def _iq1_m(p, e, s, m, lut):
    """56-byte blocks: 32 low index bytes (IQ1_S's grid), 16 bytes of 4-bit high parts (3 index bits and a shift
    sign) per group of 8, four uint16 of 3-bit sub-block scales (16 values each) whose top nibbles make d."""
    d = _half((_u16(p, 48, m) >> 12) | ((_u16(p, 50, m) >> 8) & 0xF0) | ((_u16(p, 52, m) >> 4) & 0xF00)
              | (_u16(p, 54, m) & 0xF000))
    sw = _u16(p, 48 + 2 * (s // 4), m)
    dl = d * (2 * ((sw >> (3 * (s % 4))) & 7) + 1).to(tl.float32)
    g = e // 8
    nib = (_ld(p, 32 + g // 2, m) >> (4 * (g % 2))) & 0xF
    idx = _ld(p, g, m) | ((nib & 7) << 8)
    delta = tl.where((nib & 8) == 0, 0.125, -0.125)
    return dl * (tl.load(lut + LUT_IQ1S + idx * 8 + e % 8) + delta)


@triton.jit
def _tq1_0(p, e, m):
    """54-byte blocks: 5 (then 4) base-3 digits per byte read by multiplying the byte by 3^i (uint8 wrap) and
    taking the top of 3x; d (f16) at byte 52; value d * (digit - 1)."""
    r1 = e - 160
    r2 = e - 240
    byte = tl.where(e < 160, e % 32, tl.where(e < 240, 32 + r1 % 16, 48 + r2 % 4))
    i = tl.where(e < 160, e // 32, tl.where(e < 240, r1 // 16, r2 // 4))
    pw = tl.where(i == 0, 1, tl.where(i == 1, 3, tl.where(i == 2, 9, tl.where(i == 3, 27, 81))))
    q = (_ld(p, byte, m) * pw) & 0xFF
    return _f16(p, 52, m) * (((q * 3) >> 8) - 1).to(tl.float32)


@triton.jit
def _tq2_0(p, e, m):
    """66-byte blocks: 2-bit codes (value d * (code - 1)), 4 per byte in 32-byte halves; d (f16) at byte 64."""
    r = e % 128
    q = (_ld(p, (e // 128) * 32 + r % 32, m) >> (2 * (r // 32))) & 3
    return _f16(p, 64, m) * (q - 1).to(tl.float32)


@triton.jit
def _iq3_xxs(p, e, s, m, lut):
    """Blocks of 98 bytes: d, 64 grid indices (256-entry grid of 4 magnitudes), then per sub-block of 32 values a
    uint32: four 7-bit sign indices (ksigns: the 8th sign makes the count of set bits even) and a 4-bit scale on
    top (d * (0.5 + scale) * 0.5)."""
    j = s
    w = j * 4
    db = _f16(p, 0, m) * (0.5 + (_ld(p, 69 + w, m) >> 4).to(tl.float32)) * 0.5
    sw = _u32(p, 66 + w, m)
    sidx = (sw >> (7 * ((e % 32) // 8))) & 0x7F
    v = db * tl.load(lut + LUT_IQ3XXS + _ld(p, 2 + e // 4, m) * 4 + e % 4)
    return tl.where(_ksign(sidx, e % 8) == 1, -v, v)


@triton.jit
def _mxfp4_g(p, e, m):
    x = _ld(p, 0, m)
    d = tl.where(x < 2, 0x00200000 << x, (x - 1) << 23).to(tl.float32, bitcast=True)
    q = (_ld(p, 1 + e % 16, m) >> ((e // 16) * 4)) & 0xF
    return d * _e2m1x2(q)


@triton.jit
def _nvfp4_g(p, e, s, m):
    sb = s
    w = e % 16
    d = _ue4m3_half(_ld(p, sb, m))
    q = (_ld(p, 4 + sb * 8 + w % 8, m) >> ((w // 8) * 4)) & 0xF
    return d * _e2m1x2(q)


@triton.jit
def gguf_decode(p, e, s, m, lut, QT: tl.constexpr):
    """Values ``e`` (sub-block ``s``) of the GGUF blocks at ``p`` as float32, for the type with kernel id QT.
    Shapes broadcast: e.g. p [G, 1, 1], e [1, NS, SS], s [1, NS, 1] (also imported by moe/grouped.py)."""
    if QT == 0:
        return _q4_0(p, e, m)
    elif QT == 1:
        return _q4_1(p, e, m)
    elif QT == 2:
        return _q5_0(p, e, m)
    elif QT == 3:
        return _q5_1(p, e, m)
    elif QT == 4:
        return _q8_0(p, e, m)
    elif QT == 5:
        return _q2_k(p, e, s, m)
    elif QT == 6:
        return _q3_k(p, e, s, m)
    elif QT == 7:
        return _q4_k(p, e, s, m)
    elif QT == 8:
        return _q5_k(p, e, s, m)
    elif QT == 9:
        return _q6_k(p, e, s, m)
    elif QT == 10:
        return _iq4_nl(p, e, m, lut)
    elif QT == 11:
        return _iq4_xs(p, e, s, m, lut)
    elif QT == 12:
        return _mxfp4_g(p, e, m)
    elif QT == 13:
        return _nvfp4_g(p, e, s, m)
    elif QT == 14:
        return _iq3_s(p, e, s, m, lut)
    elif QT == 15:
        return _iq3_xxs(p, e, s, m, lut)
    elif QT == 16:
        return _iq2_xxs(p, e, s, m, lut)
    elif QT == 17:
        return _iq2_xs(p, e, s, m, lut)
    elif QT == 18:
        return _iq2_s(p, e, s, m, lut)
    elif QT == 19:
        return _iq1_s(p, e, s, m, lut)
    elif QT == 20:
        return _iq1_m(p, e, s, m, lut)
    elif QT == 21:
        return _tq1_0(p, e, m)
    else:
        tl.static_assert(QT == 22, "gguf_decode reads block types only (Q8_0R is a row layout)")
        return _tq2_0(p, e, m)


@triton.jit
def _gguf_kernel(src, out, idx, lut, row0, n_rows, nblk, row_stride,
                 QT: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, NS: tl.constexpr, G: tl.constexpr,
                 HAS_IDX: tl.constexpr, OUT_BF16: tl.constexpr):
    g = tl.program_id(0).to(tl.int64) * G + tl.arange(0, G)  # block ids over the (n_rows, nblk) output
    mg = g < n_rows * nblk
    i = g // nblk
    if HAS_IDX:
        r = tl.load(idx + i, mask=mg, other=0)
    else:
        r = row0 + i
    m = mg[:, None, None]
    s = tl.arange(0, NS)[None, :, None]
    e = s * (BS // NS) + tl.arange(0, BS // NS)[None, None, :]
    if QT == Q8R:  # a row layout: block g % nblk's codes (from byte 2 nblk of its row) and scale (2 (g % nblk))
        row = (src + r * row_stride)[:, None, None]
        b = (g % nblk)[:, None, None]
        q = tl.load((row + 2 * nblk + b * BS + e).to(tl.pointer_type(tl.int8)), mask=m, other=0).to(tl.float32)
        v = q * tl.load((row + 2 * b).to(tl.pointer_type(tl.float16)), mask=m, other=0.0).to(tl.float32)
    else:
        p = (src + r * row_stride + (g % nblk) * TS)[:, None, None]
        v = gguf_decode(p, e, s, m, lut, QT)
    _store(out, g[:, None, None] * BS + e, v, m, OUT_BF16)


# ----------------------------------------------------------------------------- FP8 / NVFP4 / MXFP4
@triton.jit
def _fp_kernel(w, s, gs, out, idx, row0, n_rows, K, n_lead_rows,
               w_stride, s_stride, s_rows_per_lead, s_row_block, g_stride,
               S_COL_UNIT: tl.constexpr, KIND: tl.constexpr, HAS_IDX: tl.constexpr, HAS_G: tl.constexpr,
               BR: tl.constexpr, BC: tl.constexpr, GS: tl.constexpr, OUT_BF16: tl.constexpr):
    # tile [BR rows, BC // GS column groups, GS columns]: a group shares one scale (GS divides S_COL_UNIT)
    i = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cg = tl.program_id(1) * BC + tl.arange(0, BC // GS) * GS  # first column of each group (int32)
    c = cg[None, :, None] + tl.arange(0, GS)[None, None, :]
    mi = i < n_rows
    m = mi[:, None, None] & (c < K)
    if HAS_IDX:
        r = tl.load(idx + i, mask=mi, other=0)
    else:
        r = row0 + i
    lead = r // n_lead_rows
    wp = w + (r * w_stride)[:, None, None]
    if KIND == 0:
        v = _e4m3(_ld(wp, c, m))
    else:
        v = _e2m1((_ld(wp, c // 2, m) >> ((c % 2) * 4)) & 0xF)
    srow = lead * s_rows_per_lead + (r % n_lead_rows) // s_row_block
    sp = s + (srow * s_stride)[:, None, None] + (cg // S_COL_UNIT)[None, :, None]
    ms = mi[:, None, None] & (cg < K)[None, :, None]
    if KIND == 0:
        sv = tl.load(sp, mask=ms, other=0).to(tl.float32)
    elif KIND == 1:
        sv = _e4m3(_ld(sp, 0, ms))
    else:
        sv = _e8m0(_ld(sp, 0, ms))
    v = v * sv
    if HAS_G:
        v = v * tl.load(gs + lead * g_stride, mask=mi, other=0).to(tl.float32)[:, None, None]
    _store(out, i[:, None, None] * K + c, v, m, OUT_BF16)


# ----------------------------------------------------------------------------- host side
def supports(fmt: QuantFormat, out_dtype: torch.dtype = torch.float32) -> bool:
    """Whether a kernel decodes ``fmt`` to ``out_dtype``."""
    if out_dtype not in OUT_DTYPES:
        return False
    if isinstance(fmt, GGUFFormat):
        return fmt.type_name in _GGUF_IDS
    return isinstance(fmt, (FP8Format, NVFP4Format, MXFP4Format))


def lut_table(device) -> torch.Tensor:
    """The decoders' one float32 table on `device`: the 16 IQ4_NL / IQ4_XS levels, then at LUT_IQ3S the IQ3_S grid
    (512 entries of 4 magnitudes, gguf_formats.iq_grid), then the IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S and IQ1_S grids
    (LUT_GRIDS, at the LUT_* offsets; 33.8k floats), for every kernel that calls `gguf_decode`."""
    def build():
        return torch.cat([torch.tensor(_IQ4NL_LEVELS, dtype=torch.float32)]
                         + [iq_grid(name).to(torch.float32).reshape(-1) for name in LUT_GRIDS])
    return cached_table("gguf-lut", build, device)


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def decode_parts(fmt: QuantFormat, parts: dict[str, torch.Tensor], shape, rows=None,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """Rows ``rows`` of the canonical parts (``fmt._canon``) as a dense ``(n, K)`` tensor; None if unsupported."""
    if not supports(fmt, out_dtype):
        return None
    shape = norm_shape(shape)
    n, k = shape[-2], shape[-1]
    any_part = next(iter(parts.values()))
    dev = any_part.device
    row0, n_sel, idx = resolve_rows(rows, prod(shape[:-1]), dev)
    out = torch.empty((n_sel, k), dtype=out_dtype, device=dev)
    if n_sel == 0 or k == 0:
        return out
    has_idx = idx is not None
    idx_arg = idx if has_idx else out  # any tensor: unused unless HAS_IDX
    out_arg = out.view(torch.int16) if out_dtype == torch.bfloat16 else out
    bf16 = out_dtype == torch.bfloat16
    other_gpu = dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device()
    with torch.cuda.device(dev) if other_gpu else nullcontext():  # Triton launches on the current device
        if isinstance(fmt, GGUFFormat):
            src = _rows2d(parts["data"])
            _launch_gguf(fmt, src if src.dtype == torch.uint8 else src.view(torch.uint8), out, idx, row0, n_sel)
            return out
        kind, wname, sname = ((_FP8, "weight", fmt.parts[1].name) if isinstance(fmt, FP8Format) else
                              (_NVFP4, "weight", "weight_scale") if isinstance(fmt, NVFP4Format) else
                              (_MXFP4, "blocks", "scales"))
        w, s = _rows2d(parts[wname]), _rows2d(parts[sname])
        spec = next(p for p in fmt.parts if p.name == sname)
        if spec.row_block is None:  # one scale per tensor or per lead index
            s_rows_per_lead, s_row_block, s_col_unit = (0 if s.numel() == 1 else 1), n, _BIG
        else:
            s_rows_per_lead, s_row_block = -(-n // spec.row_block), spec.row_block
            s_col_unit = spec.col_unit if spec.col_unit is not None else _BIG
        has_g = kind == _NVFP4
        gs = parts["weight_scale_2"] if has_g else s
        br, bc = 16, 256
        grid = (triton.cdiv(n_sel, br), triton.cdiv(k, bc))
        _fp_kernel[grid](w, s, gs, out_arg, idx_arg, row0, n_sel, k, n,
                         w.stride(0), s.stride(0), s_rows_per_lead, s_row_block, 0 if gs.numel() == 1 else 1,
                         S_COL_UNIT=s_col_unit, KIND=kind, HAS_IDX=has_idx, HAS_G=has_g, BR=br, BC=bc,
                         GS=min(bc, s_col_unit & -s_col_unit), OUT_BF16=bf16, **LAUNCH)
    return out


def _check(fmt: QuantFormat, out_dtype: torch.dtype) -> None:
    if not supports(fmt, out_dtype):
        raise QuantFormatError(f"no Triton kernel for {fmt.name} -> {out_dtype}")


def dequantize(fmt: QuantFormat, raw, shape, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fmt.dequantize`` through the kernel (any device Triton runs on, incl. its CPU interpreter)."""
    _check(fmt, out_dtype)
    user_shape = tuple(int(x) for x in shape)
    return decode_parts(fmt, fmt._canon(raw, shape), shape, None, out_dtype).reshape(user_shape)


def gguf_rows_to(fmt: GGUFFormat, table: torch.Tensor, ids: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a GGUF matrix whose stored bytes `table` [V, row bytes] may live in page-locked host memory (the
    kernel reads them over PCIe, zero-copy): [n, K] of out_dtype on ids' device, one launch and no host
    synchronisation (recordable in a CUDA graph); under TRITON_INTERPRET=1 on CPU tensors in the tests."""
    _check(fmt, out_dtype)
    ids = ids.reshape(-1)
    out = torch.empty((ids.shape[0], table.shape[1] // fmt.type_size * fmt.block_size), dtype=out_dtype,
                      device=ids.device)
    if ids.shape[0]:
        _launch_gguf(fmt, table, out, ids, 0, ids.shape[0])
    return out


def _launch_gguf(fmt: GGUFFormat, src: torch.Tensor, out: torch.Tensor, idx: torch.Tensor | None, row0: int,
                 n: int) -> None:
    """out [n, K] = rows idx (or row0..row0 + n) of the GGUF blocks src [rows, row bytes] (uint8), decoded by
    _gguf_kernel on out's device (the IQ tables there too); src may be page-locked host memory."""
    bs = fmt.block_size
    nblk = out.shape[1] // bs
    g = max(1, _ELEMS // bs)
    bf16 = out.dtype == torch.bfloat16
    _gguf_kernel[(triton.cdiv(n * nblk, g),)](
        src, out.view(torch.int16) if bf16 else out, idx if idx is not None else out, lut_table(out.device), row0, n,
        nblk, src.stride(0), QT=_GGUF_IDS[fmt.type_name], BS=bs, TS=fmt.type_size, NS=_GGUF_NS.get(fmt.type_name, 1),
        G=g, HAS_IDX=idx is not None, OUT_BF16=bf16, **LAUNCH)


def dequantize_rows(fmt: QuantFormat, raw, shape, rows, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fmt.dequantize_rows`` through the kernel."""
    _check(fmt, out_dtype)
    return decode_parts(fmt, fmt._canon(raw, shape), shape, rows, out_dtype)
