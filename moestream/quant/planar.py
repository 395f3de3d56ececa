"""Compressed dense layers on a GPU in planar layouts: codes apart from their block scales, rows contiguous.

A Q8_0 block is 34 bytes (an fp16 scale, then 32 int8 codes), so block b of a row starts at byte 34 b and its codes
sit at 2-byte alignment only; the block-format kernels (moe/qpairs.py, quant/triton_dequant.py) read codes and scales
a byte per load, per value. On an H100 such a one-row GEMV is bound by its L1 traffic, not DRAM (Nsight Compute,
benchmarks/RESULTS.md 2026-12-06, twenty-fourth session: the Q4_K and Q6_K GEMVs at 79-94 % of L1/TEX throughput,
16-21 % of DRAM's). `repack` moves a matrix [N, K] into a layout whose codes are read with 16-byte loads:

- Q8_0: "q" int8 [N, K] (the codes), "d" fp16 [N, K / 32] (the block scales): 34 bytes per 32 values, as stored.
  y = sum over blocks of d * (sum of the block's 32 q * x).
- Q6_K: "ql" uint8 [N, K / 2] and "qh" uint8 [N, K / 4] (each block's low and high code bits as stored: value
  128 h + 32 m + l of a block is ql byte 64 h + 32 (m % 2) + l's nibble m // 2 and qh byte 32 h + l's bits 2 m),
  "sc" int8 [N, K / 16], "d" fp16 [N, K / 256]: 210 bytes per 256 values, as stored. A value is d sc (q - 32), so
  y = sum over 16-value sub-blocks of d sc ((sum of q x) - 32 (sum of x)).
- Q4_K: "qs" uint8 [N, K / 2] (each 256-value block's 128 code bytes in their stored order: byte l of group j holds
  value 64 j + l in its low nibble and 64 j + 32 + l in its high one), "sc" / "mn" uint8 [N, K / 32] (each 32-value
  sub-block's six-bit scale and min, unpacked), "d" / "dm" fp16 [N, K / 256]: 148 bytes per 256 values where Q4_K
  stores 144. A value is d sc q - dm mn, so y = sum over sub-blocks of d sc (sum of q x) - dm mn (sum of x).

All in fp32 (q * x is exact in fp32 for bf16 / fp16 x); the sums run in another order than the block kernels' and the
K-quants' scales, mins and offsets are applied per sub-block, so results agree with the dequantized product to fp32
rounding of those terms (tests/test_planar.py states the bound), not to the bit. `dense` writes the matrix as 16-bit
rows for a prefill's GEMM, each value as the block decoder computes it (to the bit). layers.QuantLinear moves its weight
here before the model goes to a GPU: by default Q8_0 and Q6_K matrices of WIDE_ROWS rows or more (vocabulary heads,
where the planar kernels measured faster), or the types MOESTREAM_PLANAR names at every shape ("0": none; `wanted`).

Measured (H100, benchmarks/RESULTS.md 2026-12-06, twenty-fourth session, one row, graph-timed): Q8_0 8192 x 2048 block
kernel 13.7 µs (1.30 TB/s of stored bytes), planar 13.8 at its best constants, 23.6 with each block's sum reduced across
threads in every step; the 151,936-row head 204.9 vs 196.5; four rows 36.8 vs 28.5 (the planar layout ahead). Q4_K and
Q6_K planar without the elementwise accumulation: 25.1 vs 13.1 µs and 430 vs 296 µs (not yet timed with it).
"""
from __future__ import annotations

import logging
import os

import torch

try:  # optional: absent on CPU-only installs
    import triton
    import triton.language as tl

    from .triton_dequant import _store  # bf16 rounded to nearest even, as torch's cast of the fp32 sums
except ImportError:  # pragma: no cover - depends on the install
    triton = None

MAX_ROWS = 8  # activation rows one program dots each loaded weight tile with (more rows: more programs)
_CFG: dict = {}


TYPES = ("Q8_0", "Q4_K", "Q6_K")
BLOCK = {"Q8_0": 32, "Q4_K": 256, "Q6_K": 256}


WIDE_ROWS = 32768  # the default's least rows (vocabulary heads): where the kernels measured faster planar
WIDE_TYPES = ("Q8_0", "Q6_K")  # ... for these types (Q4_K's head is untimed)


def wanted(type_name: str, rows: int | None = None) -> bool:
    """Whether a dense layer of this GGUF type and `rows` output rows on a GPU takes the planar layout
    (MOESTREAM_PLANAR, read once): unset or "wide" (default) — Q8_0 and Q6_K matrices of WIDE_ROWS rows or more;
    "0" — none; a list of types (e.g. "Q8_0,Q4_K,Q6_K") — those types at every shape. The default follows the kernels'
    timings (H100, benchmarks/RESULTS.md 2026-12-06/07): planar was as fast or slower on the model's narrow matrices
    (Q8_0 8192 x 2048 one row 13.8 vs 13.7 µs, Q6_K 2048 x 4096 32.3 vs 11.0) and faster on the 151,936-row heads
    (Q6_K 207.5 vs 294.9 µs at one row, 370.3 vs 535.7 at four; Q8_0 196.5 vs 204.9 and 444.8 vs 621.4)."""
    on = _CFG.get("types")
    if on is None:
        from ..env import triton_enabled

        env = os.environ.get("MOESTREAM_PLANAR", "wide").strip()
        wide = env in ("", "wide")
        asked = frozenset() if env == "0" or wide else frozenset(t.strip() for t in env.split(",") if t.strip())
        if asked - set(TYPES):
            logging.getLogger("moestream").warning("MOESTREAM_PLANAR: no planar layout for %s (only %s): ignored",
                                                   ", ".join(sorted(asked - set(TYPES))), ", ".join(TYPES))
        usable = triton is not None and triton_enabled()
        on = _CFG["types"] = frozenset() if not usable else asked & set(TYPES)
        _CFG["wide"] = usable and wide
    if type_name in on:
        return True
    return bool(_CFG.get("wide")) and type_name in WIDE_TYPES and rows is not None and rows >= WIDE_ROWS


def repack(type_name: str, raw: torch.Tensor, N: int, K: int) -> dict[str, torch.Tensor]:
    """A matrix [N, K] of `type_name` (raw: its stored blocks, any shape) in the planar layout (module docstring), on
    raw's device; the values are the stored ones exactly."""
    bs = BLOCK[type_name]
    if K % bs:
        raise ValueError(f"{type_name} rows hold whole {bs}-value blocks, not {K} columns")
    if type_name == "Q8_0":
        b = raw.reshape(N, K // 32, 34)
        return {"q": b[:, :, 2:].contiguous().view(torch.int8).reshape(N, K),
                "d": b[:, :, :2].contiguous().view(torch.float16).reshape(N, K // 32)}
    if type_name == "Q6_K":
        b = raw.reshape(N, K // 256, 210)
        return {"ql": b[:, :, :128].contiguous().reshape(N, K // 2),
                "qh": b[:, :, 128:192].contiguous().reshape(N, K // 4),
                "sc": b[:, :, 192:208].contiguous().view(torch.int8).reshape(N, K // 16),
                "d": b[:, :, 208:].contiguous().view(torch.float16).reshape(N, K // 256)}
    from . import gguf_formats as gf

    b = raw.reshape(N * (K // 256), 144)
    sc, mn = gf._k_scale_min(b[:, 4:16])
    return {"qs": b[:, 16:].contiguous().reshape(N, K // 2), "sc": sc.reshape(N, K // 32).contiguous(),
            "mn": mn.reshape(N, K // 32).contiguous(),
            "d": b[:, 0:2].contiguous().view(torch.float16).reshape(N, K // 256),
            "dm": b[:, 2:4].contiguous().view(torch.float16).reshape(N, K // 256)}


def config(type_name: str, N: int, K: int, T: int) -> tuple[int, int, int, int, bool]:
    """(BN rows, BV columns a step, warps, RT activation rows, ELEM) of the type's GEMV kernel: BV 256 (one K-quant
    block, eight Q8_0 ones), BN rows so that a load of codes spans ~2 KiB / activation rows, products accumulated
    elementwise — the fastest of benchmarks/qlinear_gpu.py's sweep for Q8_0 on an H100 (RESULTS, 2026-12-06,
    twenty-fourth session: 13.8 µs for 8192 x 2048 at one row, the block kernel 13.7; 28.5 against 36.8 at four).
    MOESTREAM_PLANAR_CFG="BN,BV,WARPS" sets the first three, MOESTREAM_PLANAR_ELEM=0 sums each block's products
    across threads in every step instead (1.7x slower there)."""
    rt = min(1 << max(0, T - 1).bit_length(), MAX_ROWS)
    cfg = _CFG.get("cfg", False)
    if cfg is False:
        from ..env import launch_triple

        cfg = _CFG["cfg"] = launch_triple("MOESTREAM_PLANAR_CFG")
        _CFG["elem"] = os.environ.get("MOESTREAM_PLANAR_ELEM", "1") != "0"
    bs = BLOCK[type_name]
    bv = next(v for v in (1024, 512, 256, 128, 64, 32) if K % v == 0 and v % bs == 0)
    if cfg is not None:
        return cfg[0], max(bs, min(cfg[1], bv)), cfg[2], rt, _CFG["elem"]
    bv = min(bv, 256)
    # a load of codes spans ~2 KiB (16 bytes a thread at 4 warps): Q4_K's codes are half a byte, a Q6_K load reads a
    # quarter of its low bits
    per = {"Q8_0": 2048, "Q4_K": 4096, "Q6_K": 8192}[type_name]
    bn = max(1, min(1 << max(0, N - 1).bit_length(), per // (bv * rt)))
    return bn, bv, 4, rt, _CFG["elem"]


def linear(type_name: str, x: torch.Tensor, packed: dict[str, torch.Tensor], N: int, K: int,
           perm: torch.Tensor | None = None, cfg: tuple | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T for W in `repack`'s layout: bf16 when x is bf16 (rounded in the kernel), else
    float32 cast to x's dtype. perm [K]: stored column c is x's column perm[c] (read in the kernel). Capturable in a
    CUDA graph; under TRITON_INTERPRET=1 on CPU tensors in the tests. cfg: `config`'s tuple (a benchmark's sweep)."""
    xs = x.reshape(-1, K).contiguous()
    T = xs.shape[0]
    bf16 = x.dtype == torch.bfloat16
    y = torch.empty((T, N), dtype=torch.bfloat16 if bf16 else torch.float32, device=x.device)
    bn, bv, warps, rt, elem = cfg or config(type_name, N, K, T)
    grid = (triton.cdiv(N, bn), triton.cdiv(T, rt))
    y_arg, perm_arg = y.view(torch.int16) if bf16 else y, xs if perm is None else perm
    if type_name == "Q8_0":
        _q8_linear_kernel[grid](xs, packed["q"], packed["d"], y_arg, perm_arg, T, N, K, BN=bn, BV=bv, RT=rt,
                                Y_BF16=bf16, PERM=perm is not None, ELEM=elem, num_warps=warps)
    elif type_name == "Q6_K":
        _q6k_linear_kernel[grid](xs, packed["ql"], packed["qh"], packed["sc"], packed["d"], y_arg, perm_arg, T, N, K,
                                 BN=bn, BV=bv, RT=rt, Y_BF16=bf16, PERM=perm is not None, ELEM=elem, num_warps=warps)
    else:
        _q4k_linear_kernel[grid](xs, packed["qs"], packed["sc"], packed["mn"], packed["d"], packed["dm"], y_arg,
                                 perm_arg, T, N, K, BN=bn, BV=bv, RT=rt, Y_BF16=bf16, PERM=perm is not None,
                                 ELEM=elem, num_warps=warps)
    return y.to(x.dtype).reshape(*x.shape[:-1], N)


def dense(type_name: str, packed: dict[str, torch.Tensor], N: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    """The matrix as [N, K] of `dtype` (one launch): each value as the block decoder computes it in fp32 (no FMA
    contraction, as quant/triton_dequant.py launches it), rounded once."""
    w = torch.empty((N, K), dtype=dtype, device=packed["d"].device)
    bs = BLOCK[type_name]
    bv = next(v for v in (1024, 512, 256, 128, 64, 32) if K % v == 0 and v % bs == 0)
    bf16 = dtype == torch.bfloat16
    w_arg = w.view(torch.int16) if bf16 else w
    if type_name == "Q8_0":
        _q8_dense_kernel[(triton.cdiv(N, 4), K // bv)](packed["q"], packed["d"], w_arg, N, K, BN=4, BV=bv,
                                                       OUT_BF16=bf16, num_warps=4,
                                                        enable_fp_fusion=False)
    elif type_name == "Q6_K":
        _q6k_dense_kernel[(triton.cdiv(N, 4), K // bv)](packed["ql"], packed["qh"], packed["sc"], packed["d"], w_arg, N,
                                                        K, BN=4, BV=bv, OUT_BF16=bf16, num_warps=4,
                                                        enable_fp_fusion=False)
    else:
        _q4k_dense_kernel[(triton.cdiv(N, 4), K // bv)](packed["qs"], packed["sc"], packed["mn"], packed["d"],
                                                        packed["dm"], w_arg, N, K, BN=4, BV=bv, OUT_BF16=bf16,
                                                        num_warps=4, enable_fp_fusion=False)
    return w


def dense_torch(type_name: str, packed: dict[str, torch.Tensor], N: int, K: int) -> torch.Tensor:
    """The matrix as float32 [N, K] with torch ops (any device; the module's fallback off a GPU)."""
    if type_name == "Q8_0":
        return (packed["q"].float().view(N, K // 32, 32) * packed["d"].float()[:, :, None]).view(N, K)
    if type_name == "Q6_K":  # value 128 h + 32 m + l: ql byte 64 h + 32 (m % 2) + l, nibble m // 2; qh bits 2 m
        ql = packed["ql"].view(N, K // 256, 2, 2, 32)
        qh = packed["qh"].view(N, K // 256, 2, 1, 32)
        lo = torch.cat([ql & 0xF, ql >> 4], dim=3)  # [N, blocks, 2 halves, 4 quarters m, 32]
        hi = torch.cat([(qh >> (2 * m)) & 3 for m in range(4)], dim=3)
        q = ((lo | (hi << 4)).to(torch.int8) - 32).float().view(N, K // 16, 16)
        dl = packed["d"].float().repeat_interleave(16, dim=1) * packed["sc"].float()
        return (dl[:, :, None] * q).view(N, K)
    qs = packed["qs"].view(N, K // 256, 4, 32)
    q = torch.stack([qs & 0xF, qs >> 4], dim=3).float().view(N, K // 32, 32)  # sub-blocks 2 j (low), 2 j + 1 (high)
    d = packed["d"].float().repeat_interleave(8, dim=1)[:, :, None]
    dm = packed["dm"].float().repeat_interleave(8, dim=1)[:, :, None]
    return (d * packed["sc"].float()[:, :, None] * q - dm * packed["mn"].float()[:, :, None]).view(N, K)


if triton is not None:

    @triton.jit
    def _program_rows(T, N: tl.constexpr, BN: tl.constexpr, RT: tl.constexpr):
        """Program (i, j) of a GEMV grid: its output columns n = i BN.. (mask, int64) and activation rows t = j RT..
        (mask, int64)."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        t = tl.program_id(1) * RT + tl.arange(0, RT)
        return n < N, n.to(tl.int64), t < T, t.to(tl.int64)

    @triton.jit
    def _q8_linear_kernel(x, q, d, y, perm, T, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr,
                       RT: tl.constexpr, Y_BF16: tl.constexpr, PERM: tl.constexpr, ELEM: tl.constexpr):
        """y rows t of program (i, j): BN output columns n = i BN.., RT activation rows t = j RT..; a step loads a
        [BN, BV // 32, 32] tile of codes (contiguous rows: 16-byte loads), x's [RT, BV // 32, 32] and the tile's
        [BN, BV // 32] scales. BV divides K."""
        nmask, nn, tmask, tt = _program_rows(T, N, BN, RT)
        g = tl.arange(0, BV // 32)
        c0 = g[:, None] * 32 + tl.arange(0, 32)[None, :]  # [G, 32] columns of a step
        if ELEM:
            acc = tl.zeros([RT, BN, BV // 32, 32], dtype=tl.float32)
        else:
            acc = tl.zeros([RT, BN, BV // 32], dtype=tl.float32)
        for k0 in range(0, K, BV):
            c = k0 + c0
            w = tl.load(q + nn[:, None, None] * K + c[None, :, :], mask=nmask[:, None, None], other=0)
            dv = tl.load(d + nn[:, None] * (K // 32) + (k0 // 32 + g)[None, :], mask=nmask[:, None], other=0.0)
            if PERM:
                cx = tl.load(perm + c)
            else:
                cx = c
            xv = tl.load(x + tt[:, None, None] * K + cx[None, :, :], mask=tmask[:, None, None], other=0.0)
            if ELEM:  # products summed elementwise, one reduction after the loop
                wd = w.to(tl.float32) * dv.to(tl.float32)[:, :, None]
                acc += wd[None, :, :, :] * xv.to(tl.float32)[:, None, :, :]
            else:  # each block's 32 products summed, then scaled
                part = tl.sum(w.to(tl.float32)[None, :, :, :] * xv.to(tl.float32)[:, None, :, :], axis=3)
                acc += part * dv.to(tl.float32)[None, :, :]
        if ELEM:
            out = tl.sum(tl.sum(acc, axis=3), axis=2)  # [RT, BN]
        else:
            out = tl.sum(acc, axis=2)
        _store(y, tt[:, None] * N + nn[None, :], out, tmask[:, None] & nmask[None, :], Y_BF16)

    @triton.jit
    def _q8_dense_kernel(q, d, w, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr,
                      OUT_BF16: tl.constexpr):
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        nn = n.to(tl.int64)
        c = tl.program_id(1) * BV + tl.arange(0, BV)
        v = tl.load(q + nn[:, None] * K + c[None, :], mask=nmask[:, None], other=0).to(tl.float32)
        dv = tl.load(d + nn[:, None] * (K // 32) + (c // 32)[None, :], mask=nmask[:, None], other=0.0)
        _store(w, nn[:, None] * K + c[None, :], v * dv.to(tl.float32), nmask[:, None], OUT_BF16)

    @triton.jit
    def _q4k_linear_kernel(x, qs, sc, mn, d, dm, y, perm, T, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                           BV: tl.constexpr, RT: tl.constexpr, Y_BF16: tl.constexpr, PERM: tl.constexpr,
                           ELEM: tl.constexpr):
        """Q4_K planar: a step reads [BN, BV // 64, 32] code bytes (16-byte loads; group j's byte l holds columns
        64 j + l and 64 j + 32 + l), the two sub-blocks' scales and mins of each group and x's columns of both
        nibbles; products summed per sub-block, then d sc (sum q x) - dm mn (sum x); ELEM: each value d sc q - dm mn
        (the block decoder's) times x summed elementwise, one reduction after the loop. BV: a multiple of 256
        dividing K."""
        nmask, nn, tmask, tt = _program_rows(T, N, BN, RT)
        G: tl.constexpr = BV // 64
        j = tl.arange(0, G)
        l = tl.arange(0, 32)
        if ELEM:
            acc = tl.zeros([RT, BN, G, 32], dtype=tl.float32)
        else:
            acc = tl.zeros([RT, BN, G], dtype=tl.float32)
        for k0 in range(0, K, BV):
            b = tl.load(qs + nn[:, None, None] * (K // 2) + (k0 // 2 + j * 32)[None, :, None] + l[None, None, :],
                        mask=nmask[:, None, None], other=0)  # [BN, G, 32] uint8
            lo = (b & 0xF).to(tl.float32)
            hi = (b >> 4).to(tl.float32)
            c = k0 + j[:, None] * 64 + l[None, :]  # [G, 32]: the low nibbles' columns; + 32 the high ones'
            if PERM:
                clo = tl.load(perm + c)
                chi = tl.load(perm + c + 32)
            else:
                clo = c
                chi = c + 32
            xr = x + tt[:, None, None] * K
            xlo = tl.load(xr + clo[None, :, :], mask=tmask[:, None, None], other=0.0).to(tl.float32)  # [RT, G, 32]
            xhi = tl.load(xr + chi[None, :, :], mask=tmask[:, None, None], other=0.0).to(tl.float32)
            sb = (k0 // 32 + 2 * j)[None, :]  # [1, G]: the low nibbles' sub-block; + 1 the high ones'
            row32 = nn[:, None] * (K // 32)
            m2 = nmask[:, None]
            sclo = tl.load(sc + row32 + sb, mask=m2, other=0).to(tl.float32)  # [BN, G]
            schi = tl.load(sc + row32 + sb + 1, mask=m2, other=0).to(tl.float32)
            mnlo = tl.load(mn + row32 + sb, mask=m2, other=0).to(tl.float32)
            mnhi = tl.load(mn + row32 + sb + 1, mask=m2, other=0).to(tl.float32)
            blk = nn[:, None] * (K // 256) + ((k0 + j * 64) // 256)[None, :]
            dv = tl.load(d + blk, mask=m2, other=0.0).to(tl.float32)
            dmv = tl.load(dm + blk, mask=m2, other=0.0).to(tl.float32)
            if ELEM:
                vlo = (dv * sclo)[:, :, None] * lo - (dmv * mnlo)[:, :, None]  # [BN, G, 32]
                vhi = (dv * schi)[:, :, None] * hi - (dmv * mnhi)[:, :, None]
                acc += vlo[None] * xlo[:, None] + vhi[None] * xhi[:, None]
            else:
                plo = tl.sum(lo[None, :, :, :] * xlo[:, None, :, :], axis=3)  # [RT, BN, G]
                phi = tl.sum(hi[None, :, :, :] * xhi[:, None, :, :], axis=3)
                slo = tl.sum(xlo, axis=2)[:, None, :]  # [RT, 1, G]
                shi = tl.sum(xhi, axis=2)[:, None, :]
                acc += (dv * sclo)[None] * plo + (dv * schi)[None] * phi - (dmv * mnlo)[None] * slo \
                    - (dmv * mnhi)[None] * shi
        if ELEM:
            out = tl.sum(tl.sum(acc, axis=3), axis=2)
        else:
            out = tl.sum(acc, axis=2)
        _store(y, tt[:, None] * N + nn[None, :], out, tmask[:, None] & nmask[None, :], Y_BF16)

    @triton.jit
    def _q4k_dense_kernel(qs, sc, mn, d, dm, w, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                          BV: tl.constexpr, OUT_BF16: tl.constexpr):
        """Q4_K planar as 16-bit rows: value = (d sc) q - (dm mn), as the block decoder computes it."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = (n < N)[:, None]
        nn = n.to(tl.int64)[:, None]
        c = tl.program_id(1) * BV + tl.arange(0, BV)[None, :]  # [1, BV]
        byte = (c // 64) * 32 + c % 32  # the code byte of column c, its high nibble where (c // 32) is odd
        b = tl.load(qs + nn * (K // 2) + byte, mask=nmask, other=0)
        q = ((b >> (((c // 32) % 2) * 4)) & 0xF).to(tl.float32)
        scv = tl.load(sc + nn * (K // 32) + c // 32, mask=nmask, other=0).to(tl.float32)
        mnv = tl.load(mn + nn * (K // 32) + c // 32, mask=nmask, other=0).to(tl.float32)
        dv = tl.load(d + nn * (K // 256) + c // 256, mask=nmask, other=0.0).to(tl.float32)
        dmv = tl.load(dm + nn * (K // 256) + c // 256, mask=nmask, other=0.0).to(tl.float32)
        _store(w, nn * K + c, dv * scv * q - dmv * mnv, nmask, OUT_BF16)

    @triton.jit
    def _q6k_part(ql, qh, xr, perm, nn, nmask, tmask, hh, e, f, k0, K: tl.constexpr, M: tl.constexpr,
                  PERM: tl.constexpr, dl, ELEM: tl.constexpr):
        """[RT, BN, H, 2] sums of quarter M's products q x (q unsigned, 0..63) and [RT, 1, H, 2] sums of its x, per
        16-value sub-block; tiles [BN, H, 2, 16] of code bytes (16-byte loads). ELEM: [RT, BN, H, 2, 16] products of
        the values dl (q - 32) (dl [BN, H, 2]: the sub-blocks' d sc) with x, and x."""
        b = tl.load(ql + nn[:, None, None, None] * (K // 2) + (k0 // 2 + hh * 64 + (M % 2) * 32)[None, :, None, None]
                    + (e * 16 + f)[None, None, :, :], mask=nmask[:, None, None, None], other=0)
        h = tl.load(qh + nn[:, None, None, None] * (K // 4) + (k0 // 4 + hh * 32)[None, :, None, None]
                    + (e * 16 + f)[None, None, :, :], mask=nmask[:, None, None, None], other=0)
        q = (((b >> ((M // 2) * 4)) & 0xF) | (((h >> (2 * M)) & 3) << 4)).to(tl.float32)
        c = k0 + hh[:, None, None] * 128 + M * 32 + (e * 16 + f)[None, :, :]  # [H, 2, 16]
        if PERM:
            c = tl.load(perm + c)
        xv = tl.load(xr + c[None, :, :, :], mask=tmask[:, None, None, None], other=0.0).to(tl.float32)
        if ELEM:
            prod = (dl[:, :, :, None] * (q - 32.0))[None] * xv[:, None]
            xsum = xv
        else:
            prod = tl.sum(q[None] * xv[:, None], axis=4)
            xsum = tl.sum(xv, axis=3)[:, None, :, :]
        return prod, xsum

    @triton.jit
    def _q6k_linear_kernel(x, ql, qh, sc, d, y, perm, T, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                           BV: tl.constexpr, RT: tl.constexpr, Y_BF16: tl.constexpr, PERM: tl.constexpr,
                           ELEM: tl.constexpr):
        """Q6_K planar: a step reads BV // 128 half-blocks of 128 values, each as four quarters of 32 (_q6k_part);
        per 16-value sub-block d sc (sum q x - 32 sum x); ELEM: each value d sc (q - 32) (the block decoder's) times x
        summed elementwise, one reduction after the loop. BV: a multiple of 256 dividing K."""
        nmask, nn, tmask, tt = _program_rows(T, N, BN, RT)
        H: tl.constexpr = BV // 128
        hh = tl.arange(0, H)
        e = tl.arange(0, 2)[:, None]
        f = tl.arange(0, 16)[None, :]
        xr = x + tt[:, None, None, None] * K
        sb = hh[:, None] * 8 + tl.arange(0, 2)[None, :]  # [H, 2]: quarter 0's sub-blocks within the step
        if ELEM:
            acc = tl.zeros([RT, BN, H, 2, 16], dtype=tl.float32)
        else:
            acc = tl.zeros([RT, BN, H, 2], dtype=tl.float32)
        for k0 in range(0, K, BV):
            srow = sc + nn[:, None, None] * (K // 16) + k0 // 16 + sb[None, :, :]
            m3 = nmask[:, None, None]
            dv = tl.load(d + nn[:, None] * (K // 256) + ((k0 + hh * 128) // 256)[None, :], mask=nmask[:, None],
                         other=0.0).to(tl.float32)[:, :, None]  # [BN, H, 1]
            for M in tl.static_range(4):  # quarter M's sub-blocks: 2 M, 2 M + 1 of its half-block
                dl = dv * tl.load(srow + 2 * M, mask=m3, other=0).to(tl.float32)  # [BN, H, 2]
                p, s = _q6k_part(ql, qh, xr, perm, nn, nmask, tmask, hh, e, f, k0, K, M, PERM, dl, ELEM)
                if ELEM:
                    acc += p
                else:
                    acc += dl[None] * (p - 32.0 * s)
        if ELEM:
            out = tl.sum(tl.sum(tl.sum(acc, axis=4), axis=3), axis=2)
        else:
            out = tl.sum(tl.sum(acc, axis=3), axis=2)
        _store(y, tt[:, None] * N + nn[None, :], out, tmask[:, None] & nmask[None, :], Y_BF16)

    @triton.jit
    def _q6k_dense_kernel(ql, qh, sc, d, w, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr,
                          OUT_BF16: tl.constexpr):
        """Q6_K planar as 16-bit rows: value = (d sc) (q - 32), as the block decoder computes it."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = (n < N)[:, None]
        nn = n.to(tl.int64)[:, None]
        c = tl.program_id(1) * BV + tl.arange(0, BV)[None, :]
        v = c % 128  # 32 m + l within the half-block
        m = v // 32
        b = tl.load(ql + nn * (K // 2) + (c // 128) * 64 + (m % 2) * 32 + v % 32, mask=nmask, other=0)
        h = tl.load(qh + nn * (K // 4) + (c // 128) * 32 + v % 32, mask=nmask, other=0)
        q = ((b >> ((m // 2) * 4)) & 0xF) | (((h >> (2 * m)) & 3) << 4)
        dl = tl.load(d + nn * (K // 256) + c // 256, mask=nmask, other=0.0).to(tl.float32) * \
            tl.load(sc + nn * (K // 16) + c // 16, mask=nmask, other=0).to(tl.float32)
        _store(w, nn * K + c, dl * (q - 32).to(tl.float32), nmask, OUT_BF16)
