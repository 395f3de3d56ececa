"""Dense layers kept compressed on a GPU (moe/qpairs.quant_linear): launch constants against cuBLAS on bf16.

CUDA only. From the repo root on the GPU machine:
    PYTHONPATH=$PWD python3 benchmarks/qlinear_gpu.py [--rows 1,4] [--out results.json]

At a capped configuration the dense layers of a GGUF stay compressed and a decode step runs ~200 of these GEMVs
(H100, 2026-12-06, offload at 11.3 GiB on the Qwen3.6 Q4_K_M file: ~1.6 ms of an 11.5 ms step, ~0.6 TB/s of
compressed bytes where cuBLAS reads bf16 at ~1.7 TB/s). For each shape of that model's dense layers (type as the
Q4_K_M file stores it) and each (BN rows, BV columns, warps) of CONFIGS, --calls launches with different weights (so
the bytes come from HBM, not L2) are recorded in one CUDA graph and replayed; reported: µs per GEMV, GB/s of stored
bytes, and the bf16 cuBLAS GEMV of the same shape. The fastest configuration per shape is what
MOESTREAM_QLINEAR_CFG=BN,BV,WARPS (moe/qpairs.linear_config) would then make the default. Rows > 1 time the multi-row
kernel (each weight tile decoded once for every row; MOESTREAM_QLINEAR_ROWS_CFG) beside "pairs", the pair kernel's one
program per row that it replaced, and "mma", the tensor-core experiment (a bf16 tile and tl.dot; GGUF only); one Q4_K
row also times "words", the word-load experiment (a 32-bit load per 8 codes), and Q4_K rows "repack", the layout
experiment (repack_q4k: codes as words in column order, scales unpacked; "gbs" counts the Q4_K bytes).
--q8: the layers as the Q8_0 file stores them; with --q8 or --planar the block kernel runs at its defaults only, and
--planar times Q8_0, Q4_K and Q6_K layers also through quant/planar.py (codes apart from their block scales: 16-byte loads) at the (BN, BV, warps, ELEM) of
PLANAR ("planar None": its defaults).
"""
from __future__ import annotations

import argparse
import json

import torch

from moestream.quant import planar
from moestream.moe import qpairs
from moestream.quant import gguf_format
from moestream.quant.synthetic import random_raw
from qpair_bench import time_graph  # (benchmarks/: the launches recorded in one CUDA graph, replayed)

# (name, GGUF type, N rows, K columns): the Qwen3.6-35B-A3B Q4_K_M file's dense layers (benchmarks/make_qwen36_q4km.py)
SHAPES = [("gdn in_proj_qkv", "Q4_K", 8192, 2048), ("gdn in_proj_z", "Q4_K", 4096, 2048),
          ("gdn out_proj", "Q6_K", 2048, 4096), ("attn q_proj", "Q4_K", 8192, 2048),
          ("shared gate", "Q4_K", 512, 2048), ("shared down", "Q6_K", 2048, 512), ("lm_head", "Q6_K", 151936, 2048)]
# --q8: the same layers as the Qwen3.6 Q8_0 file stores them (shared/tools/make_qwen36_gguf.py: every dense linear Q8_0)
Q8_SHAPES = [(n, "Q8_0", N, K) for n, _, N, K in SHAPES]
# quant/planar.py's (BN, BV, warps, ELEM) per row count (RT follows T): "planar" entries of the sweep
# (the 2026-12-06 H100 sweep: ELEM — products accumulated elementwise — won every Q8_0 shape, (8, 256, 4) at one row,
# (2, 256, 4) at four; the per-step reductions lost by 1.7x)
PLANAR = {1: [None, (4, 256, 4, True), (8, 256, 4, True), (16, 256, 4, True), (32, 256, 4, True), (8, 512, 4, True),
              (4, 512, 4, True), (16, 256, 8, True), (32, 256, 8, True), (8, 256, 4, False), (4, 1024, 4, False)],
          4: [None, (1, 256, 4, True), (2, 256, 4, True), (4, 256, 4, True), (8, 256, 4, True), (2, 512, 4, True),
              (4, 256, 8, True), (2, 512, 4, False)]}
CONFIGS = [None, (8, 512, 4), (16, 256, 4), (16, 512, 4), (16, 256, 8), (32, 256, 8), (8, 1024, 8), (32, 512, 8)]
# rows > 1: the multi-row kernel's (BN, BV, warps) (MOESTREAM_QLINEAR_ROWS_CFG), beside "pairs" (one pair-kernel program
# per row, MOESTREAM_QLINEAR_ROWS=0, at its default constants)
ROWS_CONFIGS = ["pairs", "mma", None, (4, 512, 4), (2, 1024, 4), (2, 1024, 8), (1, 2048, 4), (2, 2048, 8), (4, 1024, 4),
                (4, 1024, 8), (1, 1024, 4), (1, 1024, 2), (8, 512, 8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", help="results JSON, rewritten after every shape (a run stopped at its limit keeps them)")
    ap.add_argument("--shapes", help="comma list of layer names (default: all), e.g. 'gdn in_proj_qkv,lm_head'")
    ap.add_argument("--q8", action="store_true", help="the Q8_0 file's types (and the block kernel's default only)")
    ap.add_argument("--planar", action="store_true", help="Q8_0 / Q4_K / Q6_K layers also through quant/planar.py's sweep")
    args = ap.parse_args()
    pick = {n.strip() for n in args.shapes.split(",")} if args.shapes else None
    dev = torch.device("cuda")
    results = []
    for name, qtype, N, K in (Q8_SHAPES if args.q8 else SHAPES):
        if pick is not None and name not in pick:
            continue
        q = gguf_format(qtype)
        calls = args.calls if N * K < 1 << 26 else 2  # the head: 0.24 GB a copy
        raws = [random_raw(q, (N, K), dev, seed=i) for i in range(calls)]
        stored = raws[0].numel()
        dense = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(min(calls, 4))]
        for T in (int(t) for t in args.rows.split(",")):
            x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
            row = {"layer": name, "type": qtype, "N": N, "K": K, "rows": T, "stored_mb": stored / 1e6}
            us = time_graph(lambda i: x @ dense[i % len(dense)].t(), range(calls), args.iters)
            row["cublas_bf16_us"], row["cublas_gbs"] = us, N * K * 2 / us / 1e3
            row["configs"] = {}
            ones = CONFIGS + (["words"] if qtype == "Q4_K" else [])  # one row: + the word-load experiment
            for cfg in [None] if args.q8 or args.planar else (ones if T == 1 else ROWS_CONFIGS):  # the default only
                qpairs._QLINEAR_CFG["words_on"] = cfg == "words"  # (MOESTREAM_QLINEAR_WORDS=1)
                qpairs._QLINEAR_CFG["v"] = None if T > 1 or cfg == "words" else cfg
                qpairs._QLINEAR_CFG["rows_on"] = cfg != "pairs"
                qpairs._QLINEAR_CFG["mma_on"] = cfg == "mma"  # the tensor-core experiment (MOESTREAM_QLINEAR_MMA=1)
                qpairs._QLINEAR_CFG["rows_cfg"] = None if cfg in ("pairs", "mma") else cfg
                try:
                    us = time_graph(lambda i: qpairs.quant_linear(x, q, raws[i], (N, K)), range(calls), args.iters)
                except Exception as e:  # a configuration the compiler refuses (registers, shared memory)
                    row["configs"][str(cfg)] = f"{type(e).__name__}: {str(e)[:80]}"
                    continue
                row["configs"][str(cfg)] = {"us": round(us, 2), "gbs": round(stored / us / 1e3, 1)}
            if qtype == "Q4_K":  # the repacked-layout experiment: repack_q4k, then its kernel
                packed = [qpairs.repack_q4k(r, N, K) for r in raws]
                try:
                    us = time_graph(lambda i: qpairs.q4k_repacked_linear(x, packed[i], N, K), range(calls), args.iters)
                    row["configs"]["repack"] = {"us": round(us, 2), "gbs": round(stored / us / 1e3, 1)}
                except Exception as e:  # noqa: BLE001 - a compiler refusal is a result of the sweep
                    row["configs"]["repack"] = f"{type(e).__name__}: {str(e)[:80]}"
                del packed
            if args.planar and qtype in planar.TYPES:  # quant/planar.py; "gbs" counts the block format's bytes
                packed = [planar.repack(qtype, r, N, K) for r in raws]
                bs = planar.BLOCK[qtype]
                bvmax = next(v for v in (2048, 1024, 512, 256, 128, 64, 32) if K % v == 0 and v % bs == 0)
                for pc in PLANAR[1 if T == 1 else 4]:
                    if pc is not None and pc[1] < bs:
                        continue  # (K-quants step whole 256-value blocks)
                    cfg = None if pc is None else (pc[0], min(pc[1], bvmax), pc[2],
                                                   planar.config(qtype, N, K, T)[3], pc[3])
                    try:
                        us = time_graph(lambda i: planar.linear(qtype, x, packed[i], N, K, cfg=cfg), range(calls),
                                        args.iters)
                        row["configs"][f"planar {pc}"] = {"us": round(us, 2), "gbs": round(stored / us / 1e3, 1)}
                    except Exception as e:  # noqa: BLE001 - a compiler refusal is a result of the sweep
                        row["configs"][f"planar {pc}"] = f"{type(e).__name__}: {str(e)[:80]}"
                del packed
            ok = {k: v for k, v in row["configs"].items() if isinstance(v, dict)}
            best = min(ok, key=lambda k: ok[k]["us"])
            row["best"] = best
            named = "".join(f"; {k} {row['configs'][k]['us'] if k in ok else row['configs'][k]}"
                            for k in ("pairs", "mma", "words", "repack", "planar None") if k in row["configs"])
            print(f"{name:16s} {qtype} {N}x{K} rows {T}: cuBLAS bf16 {row['cublas_bf16_us']:.1f} us "
                  f"({row['cublas_gbs']:.0f} GB/s); default {ok.get('None', {}).get('us')} us{named}; best {best} "
                  f"{ok[best]['us']} us ({ok[best]['gbs']} GB/s of stored bytes)")
            results.append(row)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    qpairs._QLINEAR_CFG.clear()


if __name__ == "__main__":
    main()
