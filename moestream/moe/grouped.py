"""Grouped routed-expert GEMMs on the GPU: one layer call's experts in two Triton launches.

Why: the torch loop (compute.partial_outputs) costs a gather, a dequantization of the whole expert and
three GEMMs per expert, ~200 us each on an H200; a 512-token prefill chunk routes to ~all 256 experts of
a layer. Here the (token, k) pairs are sorted by expert once, on the device (no host loop, no sync:
`_block_table_kernel` cuts each expert's pairs into blocks of BM), and

1. `_gate_up_kernel`: each program takes BM pairs of one expert x BN columns of I, loops over H in BK
   steps, loads the expert's gate and up tiles from its row of the bank (compressed formats are decoded
   in registers by the decoders of quant/triton_dequant.py), `tl.dot`s in the activation dtype with fp32
   accumulation and writes h = silu(g) * u [P, I] (activation dtype; g, u, silu(g), h rounded to it
   where the torch loop rounds, so GPU backends keep the loop's and HF's bf16 rounding structure);
2. `_down_kernel`: the same over I for down [H, I], scaled by the pair's routing weight, writes [P, H].

Pair outputs are written by pair id (t*k + j) and summed over k in k order in fp32 (deterministic), by
`grouped_moe` or by `compute.accumulate` (compute.grouped_partials). Every pair row is computed by the
same tile code whichever other pairs share its call (BM depends on the call's T*k only), so a row's
value does not depend on how experts are split between calls (fused bank vs slot pool vs prefill buffer).

Shapes: x [T, H]; topk_ids, topk_w [T, k]; bank: name -> [N, ...] (dense: gate_up [N, 2I, H], down
[N, H, I]; GGUF: gate/up/down [N, >= bytes] uint8, a row may be longer than this layer's bytes; HF FP8 / NVFP4 /
MXFP4: "gate.weight", "gate.weight_scale_inv", ... [N, bytes] uint8, each part's stored bytes, as qpairs reads them);
rows: [E] bank row of each expert id (-1: not computed in this call).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.triton_dequant import Q8R, _GGUF_IDS, _GGUF_NS, _e2m1, _e4m3, _e8m0, _ld, gguf_decode, lut_table
from ..env import grouped_fp4_grouped_tiles
from .formats import PROJS, ExpertFormat, GGUFExpertFormat, HFExpertFormat

BK = 64  # preferred K step: a multiple of every GGUF sub-block (16 or 32 values), 128 bytes of bf16
BN = 64
# CUDA launch configuration (benchmarks/grouped_bench.py --sweep times others); bm None: block_m()
CONFIG = {"bn": BN, "bk": BK, "num_warps": 4, "num_stages": 3, "bm": None}
ACT_DTYPES = (torch.bfloat16, torch.float16)
FP4_GROUPS = tl.constexpr(grouped_fp4_grouped_tiles())  # NVFP4 / MXFP4 tiles decoded a scale group at a time


# ----------------------------------------------------------------------------- device: weight tiles
@triton.jit
def _dense_tile(w, n, nm, k0, K, BK: tl.constexpr):
    """[BN, BK] of a dense [N, K] matrix at w: rows n, columns k0..k0+BK."""
    k = k0 + tl.arange(0, BK)
    return tl.load(w + n.to(tl.int64)[:, None] * K + k[None, :], mask=nm[:, None], other=0.0)


@triton.jit
def _gguf_tile(w, n, nm, k0, K, lut, QT: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr,
               NS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """[BN, BK] float32 of a GGUF [N, K] matrix at w (row n = K // BS blocks of TS bytes), decoded as
    [BN, G, SS]: G sub-blocks (one scale each) of SS values; BK is a multiple of SS."""
    SS: tl.constexpr = BS // NS
    G: tl.constexpr = BK // SS
    g = k0 // SS + tl.arange(0, G)  # sub-block ids along the row
    row = n.to(tl.int64) * ((K // BS) * TS)
    if QT == Q8R:  # Q8_0R (Q8S 0): [BN, BK / 32, 32] code runs at byte K / 16 + k of each row, one scale a run
        r = (w + row)[:, None, None]
        q = tl.load((r + K // 16 + (g * 32)[None, :, None] + tl.arange(0, 32)[None, None, :]).to(
            tl.pointer_type(tl.int8)), mask=nm[:, None, None], other=0).to(tl.float32)
        d = tl.load((r + 2 * g[None, :, None]).to(tl.pointer_type(tl.float16)), mask=nm[:, None, None],
                    other=0.0).to(tl.float32)
        v = q * d
    else:
        p = w + row[:, None, None] + ((g // NS) * TS)[None, :, None]
        s = (g % NS)[None, :, None]
        e = s * SS + tl.arange(0, SS)[None, None, :]
        v = gguf_decode(p, e, s, nm[:, None, None], lut, QT)
    return tl.reshape(v, (BN, BK))


@triton.jit
def _hf_tile(w, sc, gsc, n, nm, k0, K, KIND: tl.constexpr, SMODE: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
             BK: tl.constexpr):
    """[BN, BK] float32 of an HF FP8 / NVFP4 / MXFP4 [N, K] matrix: codes at w (e4m3 one a byte; e2m1 two a byte,
    low nibble first), its scale part at sc (typed), NVFP4's fp32 global scale at gsc; the values of
    quant/fp_formats' decoders, scaled in their order (FP8: code x scale; NVFP4: (code x e4m3) x global)."""
    nn = n.to(tl.int64)[:, None]
    k = k0 + tl.arange(0, BK)[None, :]
    m = nm[:, None]
    if KIND == 0:
        v = _e4m3(_ld(w + nn * K, k, m))
        if SMODE == 0:  # [ceil(N / RB), ceil(K / CB)] block scales
            if CB % BK == 0:  # the tile inside one scale column: a scale per row
                s = tl.load(sc + (nn // RB) * ((K + CB - 1) // CB) + k0 // CB, mask=m, other=0.0)
            else:
                s = tl.load(sc + (nn // RB) * ((K + CB - 1) // CB) + k // CB, mask=m, other=0.0)
        elif SMODE == 1:  # one scale per output row
            s = tl.load(sc + nn, mask=m, other=0.0)
        else:  # one per expert
            s = tl.load(sc)
        return v * s.to(tl.float32)
    elif FP4_GROUPS and BK >= (16 if KIND == 1 else 32):
        # [BN, G, GS]: G scale groups of GS values; each code byte loaded once (its two nibbles interleaved back into
        # column order, low first), one scale per group broadcast over its values
        GS: tl.constexpr = 16 if KIND == 1 else 32
        G: tl.constexpr = BK // GS
        g = (k0 // GS + tl.arange(0, G))[None, :, None]
        m3 = nm[:, None, None]
        row = nn[:, :, None]
        b = _ld(w + row * (K // 2), g * (GS // 2) + tl.arange(0, GS // 2)[None, None, :], m3)
        q = _e2m1(tl.interleave(b & 0xF, b >> 4))
        sb = _ld(sc + row * (K // GS), g, m3)
        if KIND == 1:  # e4m3 scale per 16 columns, fp32 global
            v = q * _e4m3(sb) * tl.load(gsc).to(tl.float32)
        else:  # e8m0 scale per 32 columns
            v = q * _e8m0(sb)
        return tl.reshape(v, (nn.shape[0], BK))
    else:
        b = _ld(w + nn * (K // 2), k // 2, m)
        q = _e2m1(tl.where(k % 2 == 0, b & 0xF, b >> 4))
        if KIND == 1:  # e4m3 scale per 16 columns, fp32 global
            return q * _e4m3(_ld(sc + nn * (K // 16), k // 16, m)) * tl.load(gsc).to(tl.float32)
        else:  # e8m0 scale per 32 columns
            return q * _e8m0(_ld(sc + nn * (K // 32), k // 32, m))


@triton.jit
def _tile(w, sc, gsc, n, nm, k0, K, lut, DT: tl.constexpr, QT: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr,
          NS: tl.constexpr, KIND: tl.constexpr, SMODE: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    """Weight tile [BN, BK] in the activation dtype DT; QT -1: dense, -2: an HF format (KIND, SMODE, RB, CB; scales
    at sc, gsc), else a GGUF type."""
    if QT == -1:
        return _dense_tile(w, n, nm, k0, K, BK).to(DT)
    elif QT == -2:
        return _act(_hf_tile(w, sc, gsc, n, nm, k0, K, KIND, SMODE, RB, CB, BK), DT, F32)
    else:
        return _act(_gguf_tile(w, n, nm, k0, K, lut, QT, BS, TS, NS, BN, BK), DT, F32)


@triton.jit
def _act(v, DT: tl.constexpr, F32: tl.constexpr):
    """float32 -> activation dtype DT, rounded to nearest even. F32 (Triton's interpreter, whose float ->
    bfloat16 cast truncates): round the float32 bits first, so the cast is exact."""
    if F32 and DT == tl.bfloat16:
        b = v.to(tl.int32, bitcast=True)
        v = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return v.to(DT)


@triton.jit
def _mma(a, w, acc, F32: tl.constexpr):
    """acc + a [BM, BK] @ w[BN, BK]^T. F32 (Triton's interpreter, whose bf16 tl.dot is wrong): the same
    16-bit values multiplied as float32 (exact products, fp32 sums, as on tensor cores)."""
    if F32:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
    else:
        return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _q8r_mma(a, w, n, nm, k0, K: tl.constexpr, acc, F32: tl.constexpr):
    """acc + (a [BM, 32] @ codes[n, k0:k0 + 32]^T) * scale[n, k0 / 32] for Q8_0R rows at w: the block's int8 codes
    (exact in bf16 / fp16) multiplied on the tensor cores, its fp16 scale applied to the fp32 products after — one
    scale per row and block, where a dequantized tile multiplies (and rounds) every value by it."""
    row = w + n.to(tl.int64) * (K // 16 + K)
    q = tl.load((row[:, None] + K // 16 + k0 + tl.arange(0, 32)[None, :]).to(tl.pointer_type(tl.int8)),
                mask=nm[:, None], other=0)
    d = tl.load((row + 2 * (k0 // 32)).to(tl.pointer_type(tl.float16)), mask=nm, other=0.0).to(tl.float32)
    return acc + _mma(a, q.to(a.dtype), tl.zeros(acc.shape, dtype=tl.float32), F32) * d[None, :]


@triton.jit
def _block(blocks, BM: tl.constexpr):
    """(bank row, pair positions [BM], their mask) of this program's block; row < 0: nothing to do."""
    b = tl.program_id(0)
    row = tl.load(blocks + 3 * b)
    start = tl.load(blocks + 3 * b + 1)
    end = tl.load(blocks + 3 * b + 2)
    p = start + tl.arange(0, BM)
    return row, p, p < end


# ----------------------------------------------------------------------------- device: the two GEMMs
@triton.jit
def _gate_up_kernel(x, pairs, blocks, wg, g_stride, wu, u_stride, u_off, sg, sg_stride, gg, gg_stride,
                    su, su_stride, gu, gu_stride, lut, h, KTOP, H: tl.constexpr, I: tl.constexpr,
                    QT: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, NS: tl.constexpr, KIND: tl.constexpr,
                    SMODE: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, Q8S: tl.constexpr = 0):
    """h[p, n] = silu(x[tok] . gate[n]) * (x[tok] . up[n]) for the BM pairs p of one block. up's rows
    start u_off elements after wu's (dense: up is the second half of gate_up). sg / gg, su / gu: an HF
    format's scale and global-scale parts of gate and up (else unused); Q8S (last, with a default: recorded launches
    keep their positions): Q8_0R blocks scaled after their products (env.q8r_grouped). H, I are constexpr: the
    K loops get constant trip counts (and Triton's interpreter under numpy 2.4 cannot loop to a
    runtime bound)."""
    row, p, pm = _block(blocks, BM)
    if row < 0:
        return
    DT: tl.constexpr = h.dtype.element_ty
    tok = tl.load(pairs + p, mask=pm, other=0) // KTOP
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < I
    r64 = row.to(tl.int64)
    g_base = wg + r64 * g_stride
    u_base = wu + r64 * u_stride + u_off
    g_sc, g_gs = sg + r64 * sg_stride, gg + r64 * gg_stride
    u_sc, u_gs = su + r64 * su_stride, gu + r64 * gu_stride
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    if QT == Q8R and Q8S:  # Q8_0R: a block of 32 columns a step, its scale after the products
        for k0 in range(0, H, 32):
            a = tl.load(x + tok.to(tl.int64)[:, None] * H + (k0 + tl.arange(0, 32))[None, :], mask=pm[:, None],
                        other=0.0)
            acc_g = _q8r_mma(a, g_base, n, nm, k0, H, acc_g, F32)
            acc_u = _q8r_mma(a, u_base, n, nm, k0, H, acc_u, F32)
    else:
        for k0 in range(0, H, BK):
            a = tl.load(x + tok.to(tl.int64)[:, None] * H + (k0 + tl.arange(0, BK))[None, :], mask=pm[:, None],
                        other=0.0)
            acc_g = _mma(a, _tile(g_base, g_sc, g_gs, n, nm, k0, H, lut, DT, QT, BS, TS, NS, KIND, SMODE, RB, CB,
                                  BN, BK, F32), acc_g, F32)
            acc_u = _mma(a, _tile(u_base, u_sc, u_gs, n, nm, k0, H, lut, DT, QT, BS, TS, NS, KIND, SMODE, RB, CB,
                                  BN, BK, F32), acc_u, F32)
    # the rounding points of the torch loop (formats.expert_mlp): g, u, silu(g) and h in the activation dtype
    g = _act(acc_g, DT, F32).to(tl.float32)
    u = _act(acc_u, DT, F32).to(tl.float32)
    hv = _act(g / (1.0 + tl.exp(-g)), DT, F32).to(tl.float32) * u
    tl.store(h + p.to(tl.int64)[:, None] * I + n[None, :], _act(hv, DT, F32), mask=pm[:, None] & nm[None, :])


@triton.jit
def _down_kernel(h, pairs, blocks, topk_w, wd, w_stride, sd, sd_stride, gd, gd_stride, lut, out, H: tl.constexpr,
                 I: tl.constexpr, QT: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, NS: tl.constexpr,
                 KIND: tl.constexpr, SMODE: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr, SCATTER: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, Q8S: tl.constexpr = 0):
    """out[r, n] = w_pair * (h[p] . down[n]); r = the pair id (SCATTER) or its sorted position p."""
    row, p, pm = _block(blocks, BM)
    if row < 0:
        return
    DT: tl.constexpr = h.dtype.element_ty
    pair = tl.load(pairs + p, mask=pm, other=0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < H
    r64 = row.to(tl.int64)
    d_base = wd + r64 * w_stride
    d_sc, d_gs = sd + r64 * sd_stride, gd + r64 * gd_stride
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if QT == Q8R and Q8S:  # Q8_0R: a block of 32 columns a step, its scale after the products
        for k0 in range(0, I, 32):
            a = tl.load(h + p.to(tl.int64)[:, None] * I + (k0 + tl.arange(0, 32))[None, :], mask=pm[:, None],
                        other=0.0)
            acc = _q8r_mma(a, d_base, n, nm, k0, I, acc, F32)
    else:
        for k0 in range(0, I, BK):
            a = tl.load(h + p.to(tl.int64)[:, None] * I + (k0 + tl.arange(0, BK))[None, :], mask=pm[:, None],
                        other=0.0)
            acc = _mma(a, _tile(d_base, d_sc, d_gs, n, nm, k0, I, lut, DT, QT, BS, TS, NS, KIND, SMODE, RB, CB, BN,
                                BK, F32), acc, F32)
    # as the loop: the expert's output rounded to the activation dtype, then times the routing weight
    acc = _act(acc, DT, F32).to(tl.float32) * tl.load(topk_w + pair, mask=pm, other=0.0).to(tl.float32)[:, None]
    r = pair if SCATTER else p
    mask = pm[:, None] & nm[None, :]
    tl.store(out + r.to(tl.int64)[:, None] * H + n[None, :], acc.to(out.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- host side
_NO_HF = {"KIND": 0, "SMODE": 0, "RB": 1, "CB": 1}


def _gguf_consts(q) -> dict:
    """QT / BS / TS / NS of a GGUF type; Q8S: Q8_0R tiles scaled after their products (env.q8r_grouped "scale"), else
    dequantized in registers before them ("tile")."""
    from ..env import q8r_grouped

    return {"QT": _GGUF_IDS[q.type_name], "BS": q.block_size, "TS": q.type_size, "NS": _GGUF_NS.get(q.type_name, 1),
            **_NO_HF, "Q8S": int(q.type_name == "Q8_0R" and q8r_grouped() == "scale")}


_DENSE = {"QT": -1, "BS": 1, "TS": 1, "NS": 1, **_NO_HF}


def _hf_consts(fmt: HFExpertFormat) -> dict:
    """The tile constants of an HF format (qpairs' KIND / SMODE / scale block, QT -2)."""
    from .qpairs import _hf_consts as hf

    c = hf(fmt)
    return {"QT": -2, "BS": 1, "TS": 1, "NS": 1, "KIND": c["KIND"], "SMODE": c["SMODE"], "RB": c["RB"], "CB": c["CB"]}


def _hf_kind(fmt) -> bool:
    """An HF format the tiles decode: FP8 (block / channel / tensor scales), NVFP4, MXFP4."""
    from ..quant.fp_formats import FP8Format, MXFP4Format, NVFP4Format

    return isinstance(fmt, HFExpertFormat) and isinstance(fmt.qfmt, (FP8Format, NVFP4Format, MXFP4Format))


def _sub_block(fmt: ExpertFormat | None) -> int:
    """Values per scale of the format's types (a K step must hold whole sub-blocks); dense: 16 (tl.dot's minimum)."""
    if fmt is None or not fmt.quantized or isinstance(fmt, HFExpertFormat):  # HF: any K step (scales per element)
        return 16
    return max(q.block_size // _GGUF_NS.get(q.type_name, 1) for q in (fmt.quant(p) for p in PROJS))


def k_step(fmt: ExpertFormat | None, hidden: int, inter: int, largest: int = BK) -> int | None:
    """The largest K step <= `largest` that divides H and I and holds whole sub-blocks; None: none does."""
    ss = _sub_block(fmt)
    bk = largest
    while bk >= max(16, ss):
        if hidden % bk == 0 and inter % bk == 0:
            return bk
        bk //= 2
    return None


def supports(fmt: ExpertFormat | None, hidden: int, inter: int, dtype: torch.dtype) -> bool:
    """Whether the kernels compute experts of `fmt` (one layer's format; None: dense in `dtype`) for
    activations of `dtype`, H = hidden, I = inter."""
    if dtype not in ACT_DTYPES:
        return False
    if fmt is None or not fmt.quantized:
        if fmt is not None and fmt.dtype != dtype:  # dense weights are multiplied in the activation dtype
            return False
    elif _hf_kind(fmt):
        from ..quant.fp_formats import FP8Format

        if not isinstance(fmt.qfmt, FP8Format) and (hidden % fmt.qfmt.col_align or inter % fmt.qfmt.col_align):
            return False  # NVFP4 / MXFP4 rows of whole scale groups; FP8 blocks may be partial (H = 64, 128-blocks)
    elif type(fmt) is not GGUFExpertFormat:
        return False
    else:
        types = dict(fmt.types)  # gate and up share one decoder in _gate_up_kernel
        if types["gate"] != types["up"] or any(t not in _GGUF_IDS for t in types.values()):
            return False
        if hidden % fmt.quant("gate").block_size or inter % fmt.quant("down").block_size:
            return False  # rows of whole blocks (a GGUF file has nothing else)
    return k_step(fmt, hidden, inter) is not None


def bank_supported(bank: dict, fmt: ExpertFormat | None, x: torch.Tensor) -> bool:
    """`supports` for a bank (name -> [N, ...]) on x's device, its rows contiguous."""
    if fmt is None or not fmt.quantized:
        gu, down = bank.get("gate_up"), bank.get("down")
        if gu is None or down is None or gu.dtype != x.dtype or down.dtype != x.dtype:
            return False
        hidden, inter = down.shape[-2:]
        arrays = (gu, down)
    else:
        hidden, inter = fmt.hidden, fmt.inter
        names = [f"{p}.{part.name}" for p in PROJS for part in fmt.qfmt.parts] if _hf_kind(fmt) else PROJS
        arrays = tuple(bank.get(n) for n in names)
        if any(a is None for a in arrays):
            return False
    if any(a.device != x.device or not a[0].is_contiguous() for a in arrays):
        return False
    return supports(fmt, hidden, inter, x.dtype) and x.shape[-1] == hidden


def _tiles(fmt: ExpertFormat | None, hidden: int, inter: int, interp: bool) -> tuple[int, int]:
    """(BN, BK). Triton's interpreter pays per op, not per element: bigger tiles, fewer programs."""
    if interp:
        return 128, k_step(fmt, hidden, inter, 256)
    return CONFIG["bn"], k_step(fmt, hidden, inter, CONFIG["bk"])


def block_m(pairs: int) -> int:
    """Pairs per program: about the mean pairs per expert of a 256-expert model, 16..64. A function of
    the call's T*k only, so that every backend computes a row with the same tiles."""
    bm = 16
    while bm < 64 and bm * 128 < pairs:
        bm *= 2
    return bm


@triton.jit
def _block_table_kernel(counts, rows, blocks, n_exp, BM: tl.constexpr, EP: tl.constexpr, JMAX: tl.constexpr,
                        JB: tl.constexpr):
    """One program: expert i (counts[i] sorted pairs from sum(counts[:i]), bank row rows[i], none if < 0)
    writes its ceil(counts[i] / BM) blocks (row, first pair, end of the expert's pairs) after those of
    experts < i. EP >= n_exp, JMAX >= the most blocks of one expert (both powers of two)."""
    e = tl.arange(0, EP)
    me = e < n_exp
    c = tl.load(counts + e, mask=me, other=0).to(tl.int32)
    r = tl.load(rows + e, mask=me, other=-1).to(tl.int32)
    nb = tl.where(r >= 0, (c + BM - 1) // BM, 0)
    first = tl.cumsum(c, 0) - c
    b0 = tl.cumsum(nb, 0) - nb
    for j0 in range(0, JMAX, JB):
        j = j0 + tl.arange(0, JB)[None, :]
        m = me[:, None] & (j < nb[:, None])
        b = (b0[:, None] + j) * 3
        tl.store(blocks + b, r[:, None] + j * 0, mask=m)
        tl.store(blocks + b + 1, first[:, None] + j * BM, mask=m)
        tl.store(blocks + b + 2, (first + c)[:, None] + j * 0, mask=m)


def block_table(counts: torch.Tensor, rows: torch.Tensor, bm: int, max_blocks: int, max_count: int) -> torch.Tensor:
    """[max_blocks, 3] int32 (bank row, first pair, end of the expert's pairs) over the pairs sorted by
    expert: expert i (counts[i] <= max_count pairs, bank row rows[i], skipped where < 0) gets
    ceil(counts[i] / bm) blocks; spare blocks have row -1. Two launches, no host sync."""
    blocks = torch.full((max_blocks, 3), -1, dtype=torch.int32, device=counts.device)
    jmax = triton.next_power_of_2(max(1, triton.cdiv(max_count, bm)))
    _block_table_kernel[(1,)](counts, rows, blocks, counts.numel(), BM=bm,
                              EP=triton.next_power_of_2(max(counts.numel(), 2)), JMAX=jmax, JB=min(jmax, 16))
    return blocks


def _arrays(bank: dict, fmt: ExpertFormat | None):
    """(I, per projection (gate, up, down) its kernel arguments (codes, row stride, scales, row stride, global
    scale, row stride), offset of up's rows in its tensor (elements), kernel constants of the three). Dense: gate
    and up are the two halves of gate_up [N, 2I, H]; dense and GGUF have no scale parts (the codes passed, stride
    0, never read)."""
    if fmt is None or not fmt.quantized:
        gu, down = bank["gate_up"], bank["down"]
        inter = down.shape[-1]
        args = tuple((w, w.stride(0), w, 0, w, 0) for w in (gu, gu, down))
        return inter, args, inter * gu.shape[-1], (_DENSE, _DENSE, _DENSE)
    if _hf_kind(fmt):
        from .qpairs import _hf_parts

        c = _hf_consts(fmt)
        return fmt.inter, tuple(_hf_parts(bank, fmt, p, None) for p in PROJS), 0, (c, c, c)
    args = tuple((bank[p], bank[p].stride(0), bank[p], 0, bank[p], 0) for p in PROJS)
    return fmt.inter, args, 0, tuple(_gguf_consts(fmt.quant(p)) for p in PROJS)


def _launch_opts(interp: bool) -> dict:
    return {"F32": True} if interp else {"F32": False, "num_warps": CONFIG["num_warps"],
                                         "num_stages": CONFIG["num_stages"]}


def grouped_pairs(x: torch.Tensor, topk_w: torch.Tensor, pairs: torch.Tensor, counts: torch.Tensor,
                  rows: torch.Tensor, bank: dict, fmt: ExpertFormat | None, *, scatter: bool,
                  out: torch.Tensor | None = None, max_count: int | None = None) -> torch.Tensor:
    """Pair outputs w * mlp_e(x[t]) [P, H] of the pairs `pairs` (flat ids t*k + j, sorted by expert, with
    counts[i] pairs of the i-th expert, whose bank row is rows[i], -1 = leave its pairs unwritten): row p
    of `out` (scatter=False) or row pair id (scatter=True). topk_w [T, k]. max_count: the most pairs of
    one expert (default T: routing gives an expert at most one pair per token)."""
    T, H = x.shape
    k = topk_w.shape[1]
    P = pairs.numel()
    inter, (ag, au, ad), u_off, (cg, cu, cd) = _arrays(bank, fmt)
    if cg != cu:
        raise ValueError("grouped: gate and up must share one type")  # one kernel decodes both
    if out is None:  # the dtype of the torch loop's partials: y * topk_w
        dtype = torch.promote_types(x.dtype, topk_w.dtype)
        out = torch.empty((P if not scatter else T * k, H), dtype=dtype, device=x.device)
    if P == 0:
        return out
    x, topk_w, pairs = x.contiguous(), topk_w.contiguous(), pairs.contiguous()
    bm = CONFIG["bm"] or block_m(T * k)
    max_blocks = triton.cdiv(P, bm) + counts.numel()  # sum of ceil(c / bm) <= P / bm + experts
    blocks = block_table(counts, rows, bm, max_blocks, T if max_count is None else max_count)
    h = torch.empty((P, inter), dtype=x.dtype, device=x.device)
    lut = lut_table(x.device)
    interp = x.device.type != "cuda"
    bn, bk = _tiles(fmt, H, inter, interp)
    opts = _launch_opts(interp)
    _gate_up_kernel[(max_blocks, triton.cdiv(inter, bn))](
        x, pairs, blocks, ag[0], ag[1], au[0], au[1], u_off, *ag[2:], *au[2:], lut, h, k, H=H, I=inter, **cg,
        BM=bm, BN=bn, BK=bk, **opts)
    _down_kernel[(max_blocks, triton.cdiv(H, bn))](
        h, pairs, blocks, topk_w, *ad, lut, out, H=H, I=inter, **cd, SCATTER=scatter,
        BM=bm, BN=bn, BK=bk, **opts)
    return out


def grouped_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, bank: dict,
                rows: torch.Tensor, fmt: ExpertFormat | None = None,
                pair_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y [T, H] = sum_j topk_w[t, j] * mlp_{topk_ids[t, j]}(x[t]), every routed expert from `bank` row
    rows[expert] (rows [E] on the device); the k pair outputs of a token (held in pair_dtype: the runtime's
    grouped path holds them in promote_types(x, topk_w), compute.grouped_partials) are summed in k order in fp32.
    No host sync: the route is grouped on the device."""
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    pairs = torch.argsort(flat, stable=True)
    counts = torch.zeros(rows.numel(), dtype=torch.long, device=x.device)  # bincount would sync (its max)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.long))
    pair_out = torch.zeros((T * k, x.shape[1]), dtype=pair_dtype, device=x.device)
    grouped_pairs(x, topk_w, pairs, counts, rows.to(x.device), bank, fmt, scatter=True, out=pair_out)
    return pair_out.view(T, k, -1).sum(1, dtype=torch.float32).to(x.dtype)
