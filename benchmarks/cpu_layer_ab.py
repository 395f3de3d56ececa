"""Two builds of the CPU kernel library side by side on one MoE layer call (kernels/cpu/qmatmul.cpp's
ms_moe_layer), in one process, alternating: the A/B behind a kernel change, results compared bit for bit.

    PYTHONPATH=$PWD python3 benchmarks/cpu_layer_ab.py --old REV [--new WORKTREE] [--threads 2] [--rounds 6]

--old REV: a git revision whose qmatmul.cpp / decode.cpp are built as "old"; --new: the working tree (default).
Both are built with this CPU's best flags (kernels/cpu_quant._isa_flags). Shapes:
- decode: the Qwen3.6-35B-A3B expert shape (H 2048, I 512), Q8_0, 8 experts x 1 bf16 token, 6 layers of 64
  experts walked (GB/s of expert bytes);
- prefill: a tiny Qwen3-MoE's (H 1024, I 512), Q4_K, 128 float32 tokens x top-4 of 32 experts (layer calls/s).
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from moestream.kernels import cpu_quant  # noqa: E402

SRCS = ("moestream/kernels/cpu/qmatmul.cpp", "moestream/kernels/cpu/decode.cpp")


def build(srcs: list[Path], out: Path) -> ctypes.CDLL:
    _, flags = cpu_quant._isa_flags()
    subprocess.run(["g++", "-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", *flags, *map(str, srcs), "-o", str(out)],
                   check=True)
    lib = ctypes.CDLL(str(out))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ms_moe_layer.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64,
                                 ctypes.c_int, ctypes.c_int]
    return lib


def blocks(rng, rows: int, k: int, qtype: str) -> np.ndarray:
    """Random codes with small f16 scales (no inf/NaN): Q8_0 (34 bytes per 32) or Q4_K (144 per 256)."""
    per, size = (32, 34) if qtype == "Q8_0" else (256, 144)
    b = rng.integers(0, 256, (rows, k // per, size), dtype=np.uint8)
    half = np.frombuffer(np.full(b.shape[0] * b.shape[1], 0.01, np.float16).tobytes(), np.uint8)
    b[:, :, 0:2] = half.reshape(b.shape[0], b.shape[1], 2)
    if qtype == "Q4_K":
        b[:, :, 2:4] = half.reshape(b.shape[0], b.shape[1], 2)
    return b.reshape(rows, -1)


def layer_call(lib, x, banks, H, I, ids, tid, threads):
    """One ms_moe_layer call: x [T, H], ids [T, k] -> y [T * k, H] (pair p's row)."""
    k = ids.shape[1]
    order = np.argsort(ids.reshape(-1), kind="stable")
    flat = ids.reshape(-1)[order]
    ex, starts = np.unique(flat, return_index=True)
    starts = np.append(starts, len(flat)).astype(np.int64)
    rows, dst = (order // k).astype(np.int64), order.astype(np.int64)
    w = np.ones(len(flat), np.float32)
    wp = np.array([[b.ctypes.data + e * (I if j < 2 else H) * b.shape[1] for j, b in enumerate(banks)] for e in ex],
                  np.int64)  # expert e's gate / up ([I, H]) and down ([H, I]) rows in each bank
    out = torch.zeros(len(flat), H)
    tids = np.full(3, tid, np.int64)
    xdtype = 1 if x.dtype == torch.bfloat16 else 0
    rc = lib.ms_moe_layer(x.data_ptr(), xdtype, x.shape[0], H, I, len(ex), wp.ctypes.data, tids.ctypes.data,
                          starts.ctypes.data, rows.ctypes.data, w.ctypes.data, dst.ctypes.data, out.data_ptr(),
                          len(flat), H, xdtype, 0, threads, 0)
    if rc:
        raise RuntimeError(f"ms_moe_layer returned {rc}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", default=str(ROOT))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    for s in SRCS:
        (tmp / Path(s).name).write_bytes(subprocess.run(["git", "-C", str(ROOT), "show", f"{args.old}:{s}"],
                                                        check=True, capture_output=True).stdout)
    libs = {"old": build([tmp / Path(s).name for s in SRCS], tmp / "old.so"),
            "new": build([Path(args.new) / s for s in SRCS], tmp / "new.so")}
    rng = np.random.default_rng(0)
    shapes = {"decode": (2048, 512, 64, 8, 1, "Q8_0", 8, torch.bfloat16, 6),
              "prefill": (1024, 512, 32, 4, 128, "Q4_K", 12, torch.float32, 4)}
    for name, (H, I, E, k, T, qtype, tid, dtype, L) in shapes.items():
        banks = [[blocks(rng, E * I, H, qtype), blocks(rng, E * I, H, qtype), blocks(rng, E * H, I, qtype)]
                 for _ in range(L)]
        x = torch.randn(T, H).to(dtype)
        ids = [np.stack([rng.choice(E, k, replace=False) for _ in range(T)]) for _ in range(L)]
        same = all(torch.equal(layer_call(libs["old"], x, banks[i], H, I, ids[i], tid, args.threads),
                               layer_call(libs["new"], x, banks[i], H, I, ids[i], tid, args.threads)) for i in range(L))
        rates = {"old": [], "new": []}
        per_call = k * sum(b.nbytes for b in banks[0]) / E if T == 1 else 1.0  # bytes (decode) or calls
        for _ in range(args.rounds):
            for lib in ("old", "new"):
                t = time.perf_counter()
                for i in range(L):
                    layer_call(libs[lib], x, banks[i], H, I, ids[i], tid, args.threads)
                rates[lib].append(L * per_call / (time.perf_counter() - t))
        unit = "GB/s of expert bytes" if T == 1 else "layer calls/s"
        print(f"{name}: {qtype}, H {H}, I {I}, {T} token(s) x top-{k} of {E}, {args.threads} threads, bit-equal {same}; "
              f"{unit}, median of {args.rounds}: old {np.median(rates['old']) / (1e9 if T == 1 else 1):.1f}, "
              f"new {np.median(rates['new']) / (1e9 if T == 1 else 1):.1f}")


if __name__ == "__main__":
    main()
