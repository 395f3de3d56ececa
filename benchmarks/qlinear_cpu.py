"""CPU time of one compressed-weight GEMM (quant.base.qlinear) with bf16 activations, as it runs (float32
tiles for 16+ rows where the CPU has no native bf16 GEMM) and with bf16 tiles forced.

    PYTHONPATH=$PWD python3 benchmarks/qlinear_cpu.py [--type Q4_K --n 1024 --k 2048]"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moestream import hardware  # noqa: E402
from moestream.quant import base, gguf_format  # noqa: E402
from moestream.quant.synthetic import random_raw  # noqa: E402


def ms(fn, reps: int = 5) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--type", default="Q4_K")
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--k", type=int, default=2048)
    args = ap.parse_args()
    q = gguf_format(args.type)
    raw = random_raw(q, (args.n, args.k), seed=0)
    print(f"{args.type} {args.n}x{args.k}, {torch.get_num_threads()} threads, native bf16: "
          f"{hardware.cpu_has_native(torch.bfloat16)}")
    real = hardware.cpu_has_native
    for rows in (1, 16, 64, 256):
        x = torch.randn(rows, args.k).to(torch.bfloat16)
        as_is = ms(lambda: base.qlinear(x, q, raw, (args.n, args.k)))
        hardware.cpu_has_native = lambda dtype: True
        try:
            bf16 = ms(lambda: base.qlinear(x, q, raw, (args.n, args.k)))
        finally:
            hardware.cpu_has_native = real
        print(f"rows {rows:4d}: as is {as_is:7.2f} ms, bf16 tiles {bf16:7.2f} ms")


if __name__ == "__main__":
    main()
