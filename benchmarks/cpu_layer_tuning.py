"""The CPU MoE layer call (kernels/cpu/qmatmul.cpp ms_moe_layer) on Q4_K_M experts of the Qwen3.6 shape (gate/up Q4_K
[512, 2048], down Q6_K [2048, 512], quant.synthetic.random_raw's blocks), in the file's layout and 8-row interleaved, under
the layer call's tunings (MOESTREAM_CPU_LAYER_TUNING: chunks a thread, chunk bytes, interleaved groups / rows read
ahead): GB/s of expert bytes for random experts of 48 per call (cold: beyond the caches) at 1 and 2 threads, hot (one
expert again and again, 1 thread), and the bridge's pattern (2 and 8 experts a call with a 100 us busy gap between
calls, as a GPU's share of each layer leaves).

    PYTHONPATH=$PWD python benchmarks/cpu_layer_tuning.py [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from moestream.kernels import cpu_quant as cq
from moestream.quant import gguf_format
from moestream.quant.synthetic import random_raw

H, I, E = 2048, 512, 48
NAMES = ("gate", "up", "down")
rng = np.random.default_rng(0)


SHAPES = {"gate": ("Q4_K", I, H), "up": ("Q4_K", I, H), "down": ("Q6_K", H, I)}
PLAIN = {p: [m.numpy() for m in random_raw(gguf_format(t), (E, n, k), seed=j)]  # E [n, row bytes] arrays
         for j, (p, (t, n, k)) in enumerate(SHAPES.items())}
X8 = {p: [cq.repack_x8(m.ctypes.data, n, k, m.shape[1], t)[0] for m in PLAIN[p]] for p, (t, n, k) in SHAPES.items()}
LAYOUTS = {"plain": (PLAIN, np.array([cq.type_id(SHAPES[p][0]) for p in NAMES], dtype=np.int64)),
           "x8": (X8, np.array([cq.X8_TYPES[SHAPES[p][0]][0] for p in NAMES], dtype=np.int64))}
EXPERT_BYTES = sum(PLAIN[p][0].nbytes for p in NAMES)
X = torch.randn(1, H).to(torch.bfloat16)
OUT = torch.zeros(8, H)


def time_calls(layout: str, G: int, nt: int, reps: int = 150, gap_s: float = 0.0, hot: bool = False) -> float:
    """Median seconds of a layer call of G experts (one token), nt threads; gap_s of busy waiting before each."""
    banks, tids = LAYOUTS[layout]
    starts, rows = np.arange(G + 1, dtype=np.int64), np.zeros(G, np.int64)
    w, dst = np.ones(G, np.float32), np.arange(G, dtype=np.int64)
    mod = cq.module()
    ts = []
    for _ in range(reps):
        ex = np.arange(G) if hot else rng.choice(E, G, replace=False)
        wptr = np.array([[banks[p][e].ctypes.data for p in NAMES] for e in ex], dtype=np.int64)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < gap_s:
            pass
        t = time.perf_counter()
        rc = mod.ms_moe_layer(X.data_ptr(), 1, 1, H, I, G, wptr.ctypes.data, tids.ctypes.data, starts.ctypes.data,
                              rows.ctypes.data, w.ctypes.data, dst.ctypes.data, OUT.data_ptr(), 8, H, 1, 0, nt, 0)
        ts.append(time.perf_counter() - t)
        assert rc == 0, rc
    return float(np.median(ts[20:]))


def gbs(G: int, seconds: float) -> float:
    return G * EXPERT_BYTES / seconds / 1e9


def tuned(setting: str) -> None:
    os.environ["MOESTREAM_CPU_LAYER_TUNING"] = setting
    cq.threads()  # passes the setting on to the library


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    nt = ap.parse_args().threads
    print(f"expert bytes {EXPERT_BYTES}, isa {cq.isa()}, {nt} threads")
    tuned("")
    for layout in LAYOUTS:
        for n in (1, nt):
            print(f"{layout:5s} {n} thread(s): 8 experts {gbs(8, time_calls(layout, 8, n)):.1f} GB/s")
        print(f"{layout:5s} hot, 1 thread: {gbs(1, time_calls(layout, 1, 1, reps=200, hot=True)):.1f} GB/s")
    print(f"--- tunings, interleaved, {nt} threads, 8 experts back to back")
    for setting in ("", "chunks=2", "chunks=1,kb=256", "x8ahead=1", "x8ahead=2", "chunks=2,x8ahead=1", ""):
        tuned(setting)
        print(f"{setting or 'default':22s} {gbs(8, min(time_calls('x8', 8, nt) for _ in range(3))):.1f} GB/s")
    print("--- interleaved, with a 100 us busy gap between calls (a GPU layer's share)")
    for setting in ("", "x8ahead=1", "", "x8ahead=1"):
        tuned(setting)
        for G in (2, 8):
            t = min(time_calls("x8", G, nt, gap_s=100e-6) for _ in range(2))
            print(f"{setting or 'default':12s} G={G} {gbs(G, t):.1f} GB/s")
    print(f"--- the file's layout (the bridge's on a GPU host: no interleaved copies there), rows read ahead, {nt} threads")
    for setting in ("", "rowsahead=4", "rowsahead=8", "rowsahead=16", "", "rowsahead=8"):
        tuned(setting)
        t = min(time_calls("plain", 8, nt) for _ in range(3))
        tg = min(time_calls("plain", 2, nt, gap_s=100e-6) for _ in range(2))
        print(f"{setting or 'default (2)':14s} 8 experts {gbs(8, t):.1f} GB/s; 2 experts with gaps {gbs(2, tg):.1f} GB/s")


if __name__ == "__main__":
    main()
