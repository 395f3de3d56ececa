"""Where a one-row compressed dense GEMV's time goes, for Nsight Compute (CUDA only; issue 13).

At one row the Q4_K / Q6_K dense GEMVs of the Qwen3.6 Q4_K_M file read their stored bytes at ~0.6-0.9 TB/s where
cuBLAS reads bf16 at ~2.5 TB/s (benchmarks/RESULTS.md, 2026-12-06), and neither the launch-constant sweep nor two
layouts (word loads, a repacked layout) beat the default: the bound is not known. This script launches each kernel a
few times, eagerly, on weights larger than L2, so a profiler sees one steady launch of each (benchmarks/gemv_ncu.sh
runs Nsight Compute over it for each kernel). Without a profiler it prints each kernel's time per launch.
"""
from __future__ import annotations

import argparse
import time

import torch

from moestream.moe import qpairs
from moestream.quant import gguf_format
from moestream.quant.synthetic import random_raw

SHAPES = {"q4k": ("Q4_K", 8192, 2048), "q6k": ("Q6_K", 2048, 4096), "head": ("Q6_K", 151936, 2048)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--which", default="q4k", help="q4k | q6k | head | repack | cublas")
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args()
    dev = torch.device("cuda")
    qtype, N, K = SHAPES["q4k" if args.which in ("repack", "cublas") else args.which]
    q = gguf_format(qtype)
    copies = 2 if N * K > 1 << 26 else 8  # cycled: more bytes than L2 holds
    raws = [random_raw(q, (N, K), dev, seed=i) for i in range(copies)]
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    if args.which == "repack":
        packed = [qpairs.repack_q4k(r, N, K) for r in raws]
        fn = lambda i: qpairs.q4k_repacked_linear(x, packed[i % copies], N, K)  # noqa: E731
    elif args.which == "cublas":
        dense = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(3)]
        fn = lambda i: x @ dense[i % 3].t()  # noqa: E731
    else:
        fn = lambda i: qpairs.quant_linear(x, q, raws[i % copies], (N, K))  # noqa: E731
    for i in range(args.launches):
        fn(i)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(50):
        fn(i)
    torch.cuda.synchronize()
    print(f"{args.which} {qtype} {N}x{K}: {(time.perf_counter() - t) / 50 * 1e6:.1f} us a launch (eager, with launch "
          f"overhead), {raws[0].numel() / 1e6:.2f} MB stored")


if __name__ == "__main__":
    main()
