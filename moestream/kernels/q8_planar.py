"""Q8_0 dense layers on a GPU in a planar layout: the same bytes, codes and scales apart.

A Q8_0 block is 34 bytes (an fp16 scale, then 32 int8 codes), so block b of a row starts at byte 34 b: its codes
sit at 2-byte alignment only, and the block-format kernels (moe/qpairs.py, quant/triton_dequant.py) read them a byte
per load. On an H100 such a one-row GEMV is bound by its L1 traffic, not DRAM (Nsight Compute, benchmarks/RESULTS.md
2026-12-06: the Q4_K and Q6_K GEMVs at 79-94 % of L1/TEX throughput, 16-21 % of DRAM's). `repack` splits a Q8_0
matrix [N, K] into "q" int8 [N, K] (the codes, rows contiguous) and "d" fp16 [N, K / 32] (the block scales):
2 + 32 bytes per 32 values as before, nothing rounded. `linear` reads them with 16-byte vector loads:

    y[t, n] = sum over blocks b of d[n, b] * (sum over j < 32 of q[n, 32 b + j] * x[t, 32 b + j])

in fp32 (q * x is exact in fp32 for bf16 / fp16 x; the order of the sums is not the block kernels', so the results
agree to fp32 rounding, not to the bit). `dense` writes the matrix as 16-bit rows for a prefill's GEMM (each value
d * q computed in fp32 and rounded once, as the block decoder gives it). layers.QuantLinear moves its Q8_0 weight
here at its first CUDA call (MOESTREAM_Q8_PLANAR=0 keeps the block layout).
"""
from __future__ import annotations

import os

import torch

try:  # optional: absent on CPU-only installs
    import triton
    import triton.language as tl

    from ..quant.triton_dequant import _store  # bf16 rounded to nearest even, as torch's cast of the fp32 sums
except ImportError:  # pragma: no cover - depends on the install
    triton = None

MAX_ROWS = 8  # activation rows one program dots each loaded weight tile with (more rows: more programs)
_CFG: dict = {}


def wanted() -> bool:
    """Whether Q8_0 dense layers on a GPU take the planar layout (MOESTREAM_Q8_PLANAR, read once; default on)."""
    on = _CFG.get("on")
    if on is None:
        from ..env import triton_enabled

        on = _CFG["on"] = triton is not None and triton_enabled() and os.environ.get("MOESTREAM_Q8_PLANAR", "1") != "0"
    return on


def repack(raw: torch.Tensor, N: int, K: int) -> dict[str, torch.Tensor]:
    """A Q8_0 matrix [N, K] (raw: N * K / 32 blocks of 34 bytes, any shape) as {"q": int8 [N, K], "d": fp16
    [N, K / 32]} on raw's device; the values are the stored ones exactly."""
    if K % 32:
        raise ValueError(f"Q8_0 rows hold whole 32-value blocks, not {K} columns")
    b = raw.reshape(N, K // 32, 34)
    return {"q": b[:, :, 2:].contiguous().view(torch.int8).reshape(N, K),
            "d": b[:, :, :2].contiguous().view(torch.float16).reshape(N, K // 32)}


def config(N: int, K: int, T: int) -> tuple[int, int, int, int, bool]:
    """(BN rows, BV columns a step, warps, RT activation rows, ELEM) of _linear_kernel. MOESTREAM_Q8_PLANAR_CFG=
    "BN,BV,WARPS" sets the first three (benchmarks/q8_gemv.py sweeps them), MOESTREAM_Q8_PLANAR_ELEM=1 the products'
    elementwise accumulation."""
    rt = min(1 << max(0, T - 1).bit_length(), MAX_ROWS)
    cfg = _CFG.get("cfg", False)
    if cfg is False:
        from ..moe.qpairs import _env_cfg

        cfg = _CFG["cfg"] = _env_cfg("MOESTREAM_Q8_PLANAR_CFG")
        _CFG["elem"] = os.environ.get("MOESTREAM_Q8_PLANAR_ELEM", "0") == "1"
    bv = next(v for v in (1024, 512, 256, 128, 64, 32) if K % v == 0)
    if cfg is not None:
        return cfg[0], max(32, min(cfg[1], bv)), cfg[2], rt, _CFG["elem"]
    bn = max(1, min(1 << max(0, N - 1).bit_length(), 4096 // (bv * rt)))
    return bn, bv, 4, rt, _CFG["elem"]


def linear(x: torch.Tensor, packed: dict[str, torch.Tensor], N: int, K: int,
           perm: torch.Tensor | None = None, cfg: tuple | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T for W in `repack`'s layout: bf16 when x is bf16 (rounded in the kernel), else
    float32 cast to x's dtype. perm [K]: stored column c is x's column perm[c] (read in the kernel). Capturable in a
    CUDA graph; under TRITON_INTERPRET=1 on CPU tensors in the tests. cfg: `config`'s tuple (a benchmark's sweep)."""
    xs = x.reshape(-1, K).contiguous()
    T = xs.shape[0]
    bf16 = x.dtype == torch.bfloat16
    y = torch.empty((T, N), dtype=torch.bfloat16 if bf16 else torch.float32, device=x.device)
    bn, bv, warps, rt, elem = cfg or config(N, K, T)
    _linear_kernel[(triton.cdiv(N, bn), triton.cdiv(T, rt))](
        xs, packed["q"], packed["d"], y.view(torch.int16) if bf16 else y, xs if perm is None else perm, T, N, K,
        BN=bn, BV=bv, RT=rt, Y_BF16=bf16, PERM=perm is not None, ELEM=elem, num_warps=warps)
    return y.to(x.dtype).reshape(*x.shape[:-1], N)


def dense(packed: dict[str, torch.Tensor], N: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    """The matrix as [N, K] of `dtype` (one launch): each value d * q in fp32, rounded once."""
    w = torch.empty((N, K), dtype=dtype, device=packed["q"].device)
    bv = next(v for v in (1024, 512, 256, 128, 64, 32) if K % v == 0)
    bf16 = dtype == torch.bfloat16
    _dense_kernel[(triton.cdiv(N, 4), K // bv)](packed["q"], packed["d"], w.view(torch.int16) if bf16 else w, N, K,
                                                 BN=4, BV=bv, OUT_BF16=bf16, num_warps=4)
    return w


if triton is not None:

    @triton.jit
    def _linear_kernel(x, q, d, y, perm, T, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr,
                       RT: tl.constexpr, Y_BF16: tl.constexpr, PERM: tl.constexpr, ELEM: tl.constexpr):
        """y rows t of program (i, j): BN output columns n = i BN.., RT activation rows t = j RT..; a step loads a
        [BN, BV // 32, 32] tile of codes (contiguous rows: 16-byte loads), x's [RT, BV // 32, 32] and the tile's
        [BN, BV // 32] scales. BV divides K."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        nn = n.to(tl.int64)
        t = tl.program_id(1) * RT + tl.arange(0, RT)
        tmask = t < T
        tt = t.to(tl.int64)
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
    def _dense_kernel(q, d, w, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr,
                      OUT_BF16: tl.constexpr):
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        nn = n.to(tl.int64)
        c = tl.program_id(1) * BV + tl.arange(0, BV)
        v = tl.load(q + nn[:, None] * K + c[None, :], mask=nmask[:, None], other=0).to(tl.float32)
        dv = tl.load(d + nn[:, None] * (K // 32) + (c // 32)[None, :], mask=nmask[:, None], other=0.0)
        _store(w, nn[:, None] * K + c[None, :], v * dv.to(tl.float32), nmask[:, None], OUT_BF16)
