"""Q8_0 experts in a row-planar layout vs GGUF's block layout: is the pair kernels' ~1.1 TB/s on Q8_0 the layout?

GGUF's Q8_0 row is K/32 blocks of 34 bytes (an fp16 scale, then 32 int8 codes), so no code run is 16-byte
aligned and the pair kernels (moe/qpairs.py) read it a byte per value. The row-planar layout keeps the same
bytes per row but puts the row's K/32 scales first and its K codes after them: with K a multiple of 64 and rows
of 34 K / 32 bytes (2,176 for K = 2,048: 16-aligned) every code run starts 16-byte aligned. Same bytes over PCIe,
same bytes in VRAM.

This script times, for the Qwen3.6-35B-A3B expert shape (H = 2048, I = 512, top-8), one decode layer call of
the pair kernels (gate_up then down, as qpairs.quant_pair_outputs) on the block layout against the same call of
this file's planar kernels, both recorded 40 calls to a CUDA graph over 256 random slots (weights from HBM),
T = 1 and 4 tokens; it checks the planar outputs against the block kernels' first. A measurement, not a
path of the engine: if the planar kernels are much faster, the layout goes into the stores.

    PYTHONPATH=$PWD python3 benchmarks/q8_planar_bench.py [--T 1,4] [--sweep | --quick]
Under TRITON_INTERPRET=1 on a CPU, `--check` runs the correctness check only (small shapes).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from moestream.moe import qpairs
from moestream.moe.formats import PROJS, gguf_expert_format
from moestream.quant.synthetic import random_raw
from moestream.quant.triton_dequant import _store

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qpair_bench import time_graph  # noqa: E402  (40 calls recorded in one graph, replayed)


def to_planar(raw: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """[S, N * K / 32 * 34] GGUF Q8_0 bytes -> the same bytes row-planar: per row K / 16 scale bytes, then K codes."""
    b = raw.reshape(raw.shape[0], N, K // 32, 34)
    return torch.cat([b[..., :2].reshape(raw.shape[0], N, K // 16), b[..., 2:].reshape(raw.shape[0], N, K)],
                     dim=-1).reshape(raw.shape[0], -1).contiguous()


@triton.jit
def _q8p_dot(w, n, nmask, xrow, K: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr):
    """[BN] fp32: rows n of one row-planar Q8_0 matrix at w (uint8) dot xrow [K]."""
    RB: tl.constexpr = K // 16 + K  # bytes a row: K / 32 fp16 scales, K int8 codes
    rows = n.to(tl.int64) * RB
    codes = (w + K // 16).to(tl.pointer_type(tl.int8))
    scales = w.to(tl.pointer_type(tl.float16))
    acc = tl.zeros([BN, BV // 32], dtype=tl.float32)
    for k0 in range(0, K, BV):
        c = k0 + tl.arange(0, BV)
        q = tl.load(codes + rows[:, None] + c[None, :], mask=nmask[:, None], other=0).to(tl.float32)
        xv = tl.load(xrow + c).to(tl.float32)
        part = tl.sum(tl.reshape(q * xv[None, :], [BN, BV // 32, 32]), axis=2)
        j = k0 // 32 + tl.arange(0, BV // 32)
        sv = tl.load(scales + (rows // 2)[:, None] + j[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
        acc += part * sv
    return tl.sum(acc, axis=1)


@triton.jit
def _q8p_gate_up_kernel(x, src, gw, uw, stride, h, H: tl.constexpr, I: tl.constexpr, K_TOP, BN: tl.constexpr,
                        BV: tl.constexpr):
    p = tl.program_id(0)
    r = tl.load(src + p)
    if r >= 0:
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < I
        xrow = x + (p // K_TOP).to(tl.int64) * H
        g = _q8p_dot(gw + r * stride, n, nmask, xrow, H, BN, BV)
        u = _q8p_dot(uw + r * stride, n, nmask, xrow, H, BN, BV)
        _store(h, p.to(tl.int64) * I + n, g / (1.0 + tl.exp(-g)) * u, nmask, True)  # h: bf16 bits (int16)


@triton.jit
def _q8p_down_kernel(h, tw, src, dw, stride, y, H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr,
                     BV: tl.constexpr):
    p = tl.program_id(0)
    r = tl.load(src + p)
    if r >= 0:
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < H
        acc = _q8p_dot(dw + r * stride, n, nmask, h + p.to(tl.int64) * I, I, BN, BV)
        tl.store(y + p.to(tl.int64) * H + n, acc * tl.load(tw + p).to(tl.float32), mask=nmask)


def planar_pair_outputs(x, topk_w, src, pool, H, I, cfg=((4, 1024, 4), (4, 512, 4))):
    """y [P, H] float32, as qpairs.quant_pair_outputs, from row-planar pools {gate, up, down}."""
    T, k = topk_w.shape
    P = T * k
    h = torch.empty((P, I), dtype=x.dtype, device=x.device)
    (bn, bv, wa), (bn2, bv2, wa2) = cfg
    assert x.dtype == torch.bfloat16
    _q8p_gate_up_kernel[(P, triton.cdiv(I, bn))](x, src, pool["gate"], pool["up"], pool["gate"].stride(0),
                                                   h.view(torch.int16), H, I,
                                                   k, bn, min(bv, H), num_warps=wa)
    y = torch.empty((P, H), dtype=torch.float32, device=x.device)
    _q8p_down_kernel[(P, triton.cdiv(H, bn2))](h, topk_w.reshape(-1).contiguous(), src, pool["down"],
                                                pool["down"].stride(0), y, H, I, bn2, min(bv2, I), num_warps=wa2)
    return y


def make(slots, H, I, dev):
    fmt = gguf_expert_format({"gate": "Q8_0", "up": "Q8_0", "down": "Q8_0"}, H, I)
    block = {p: random_raw(fmt.quant(p), (slots, *fmt.logical(H, I)[p]), dev, seed=j).reshape(slots, -1)
             for j, p in enumerate(PROJS)}
    planar = {p: to_planar(block[p], *fmt.logical(H, I)[p]) for p in PROJS}
    return fmt, block, planar


def words_pair_outputs(x, topk_w, src, pool, fmt, cfg=None):
    """The engine's pair kernels with MOESTREAM_Q8_WORDS=1 (qpairs._q8_words_dot: the block layout read as 16-bit
    words), read at each call; cfg: {"gate_up": (BN, BV, warps), "down": ...} as qpairs takes it."""
    old = os.environ.get("MOESTREAM_Q8_WORDS")
    os.environ["MOESTREAM_Q8_WORDS"] = "1"
    try:
        return qpairs._quant_pair_outputs_triton(x, topk_w, src, pool, fmt, cfg)
    finally:
        if old is None:
            del os.environ["MOESTREAM_Q8_WORDS"]
        else:
            os.environ["MOESTREAM_Q8_WORDS"] = old


def check(args, dev) -> None:
    fmt, block, planar = make(args.slots, args.H, args.I, dev)
    cfg = ((4, min(1024, args.H), 4), (4, min(512, args.I), 4))
    for T in (1, 3):
        x = torch.randn(T, args.H, device=dev, dtype=torch.bfloat16)
        w = torch.rand(T, args.k, device=dev)
        src = torch.stack([torch.randperm(args.slots)[:args.k] for _ in range(T)]).reshape(-1).to(dev)
        src[1] = -1  # a pair another producer computes: left as it is by both
        ref = qpairs._quant_pair_outputs_triton(x, w, src, block, fmt)  # the block kernels (interpreted on a CPU)
        got = planar_pair_outputs(x, w, src, planar, args.H, args.I, cfg)
        words = words_pair_outputs(x, w, src, block, fmt, {"gate_up": cfg[0], "down": cfg[1]})
        keep = src >= 0
        for name, out in (("planar", got), ("16-bit words", words)):
            err = (out[keep] - ref[keep]).abs().max().item() / ref[keep].abs().max().item()
            print(f"check T={T}: max |{name} - block kernels| / max |block kernels| = {err:.2e}", flush=True)
            # same fp32 products summed in another order; h rounded to bf16 between the projections by both (a
            # value near a rounding tie may land one bf16 ulp apart: ~2e-4 of y's largest value, interpreted)
            assert err < 1e-3, (name, err)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", default="1,4")
    ap.add_argument("--H", type=int, default=2048)
    ap.add_argument("--I", type=int, default=512)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time the planar kernels' launch constants")
    ap.add_argument("--quick", action="store_true", help="... four other constant sets only")
    ap.add_argument("--check", action="store_true", help="the correctness check only (TRITON_INTERPRET=1 on a CPU)")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.check or dev.type == "cpu":
        if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("no GPU: run with TRITON_INTERPRET=1 --check")
        check(args, dev)
        return
    check(args, dev)
    fmt, block, planar = make(args.slots, args.H, args.I, dev)
    ebytes = sum(s[0] for s in fmt.shapes(args.H, args.I).values())
    print(f"{torch.cuda.get_device_name()} H={args.H} I={args.I} k={args.k} slots={args.slots}, one expert "
          f"{ebytes / 2**20:.2f} MiB; us a layer call (GB/s of expert bytes)")
    g = torch.Generator().manual_seed(1)
    for T in (int(t) for t in args.T.split(",")):
        srcs = [torch.stack([torch.randperm(args.slots, generator=g)[:args.k] for _ in range(T)]).reshape(-1).to(dev)
                for _ in range(args.calls)]
        x = torch.randn(T, args.H, device=dev, dtype=torch.bfloat16)
        w = torch.rand(T, args.k, device=dev)
        gb = T * args.k * ebytes / 1e3
        us_b = time_graph(lambda s: qpairs.quant_pair_outputs(x, w, s, block, fmt), srcs, args.iters)
        us_p = time_graph(lambda s: planar_pair_outputs(x, w, s, planar, args.H, args.I), srcs, args.iters)
        us_w = time_graph(lambda s: words_pair_outputs(x, w, s, block, fmt), srcs, args.iters)
        print(f"T={T}: block layout {us_b:.2f} us ({gb / us_b:.0f}), planar {us_p:.2f} us ({gb / us_p:.0f}): "
              f"{us_b / us_p:.2f}x; block layout in 16-bit words {us_w:.2f} us ({gb / us_w:.0f}): {us_b / us_w:.2f}x",
              flush=True)
        if args.sweep or args.quick:  # each stage's constants with the other stage at its default, both variants
            base = ((4, 1024, 4), (4, 512, 4))
            gu_grid = ((2, 8), (1024,), (4,)) if args.quick else ((2, 4, 8), (512, 1024, 2048), (4, 8))
            dn_grid = ((8, 16), (512,), (4,)) if args.quick else ((2, 4, 8, 16), (256, 512), (4, 8))
            gu = [((bn, bv, wa), base[1]) for bn, bv, wa in itertools.product(*gu_grid) if bn * bv <= 16384]
            dn = [(base[0], (bn, bv, wa)) for bn, bv, wa in itertools.product(*dn_grid) if bn * bv <= 8192]
            runs = {"planar": lambda s, c: planar_pair_outputs(x, w, s, planar, args.H, args.I, c),
                    "16-bit words": lambda s, c: words_pair_outputs(x, w, s, block, fmt, {"gate_up": c[0], "down": c[1]})}
            for name, run in runs.items():
                res = []
                for cfg in gu + dn:
                    try:
                        us = time_graph(lambda s: run(s, cfg), srcs, max(2, args.iters // 4))
                    except Exception as e:  # noqa: BLE001 - a constant set the compiler refuses
                        print(f"  {name} {cfg}: {type(e).__name__}")
                        continue
                    res.append((us, cfg))
                res.sort()
                print(f"  {name} sweep T={T}: " + "; ".join(f"{c} {us:.2f} us" for us, c in res[:5]), flush=True)


if __name__ == "__main__":
    main()
