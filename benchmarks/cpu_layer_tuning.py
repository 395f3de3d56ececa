"""The CPU MoE layer call (kernels/cpu/qmatmul.cpp ms_moe_layer) on Q4_K_M experts of the Qwen3.6 shape (gate/up Q4_K
[512, 2048], down Q6_K [2048, 512], random blocks with sane scales), plain and 8-row interleaved, under the layer
call's tunings (MOESTREAM_CPU_LAYER_TUNING: chunks a thread, chunk bytes, interleaved groups read ahead): GB/s of
expert bytes for 8 random experts of 48 (cold: beyond the caches) at 1 and 2 threads, hot (one expert again and
again), then the bridge's pattern (2 and 8 experts a call with a 100 us busy gap between calls).

    PYTHONPATH=$PWD python benchmarks/cpu_layer_tuning.py
"""
import os
import time

import numpy as np
import torch
from moestream.kernels import cpu_quant as cq
rng = np.random.default_rng(0)
H, I, E = 2048, 512, 48
def rand_q4k(rows, k):  # random bytes with sane fp16 scales
    nb = k // 256
    b = rng.integers(0, 256, size=(rows, nb, 144), dtype=np.uint8)
    d = (rng.random((rows, nb, 2)) * 0.01).astype(np.float16).view(np.uint8).reshape(rows, nb, 4)
    b[:, :, 0:4] = d
    return b.reshape(rows, nb * 144)
def rand_q6k(rows, k):
    nb = k // 256
    b = rng.integers(0, 256, size=(rows, nb, 210), dtype=np.uint8)
    b[:, :, 208:210] = (rng.random((rows, nb)) * 0.01).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return b.reshape(rows, nb * 210)
banks = {"gate": [rand_q4k(I, H) for _ in range(E)], "up": [rand_q4k(I, H) for _ in range(E)], "down": [rand_q6k(H, I) for _ in range(E)]}
x8 = {}
for p, t in (("gate", "Q4_K"), ("up", "Q4_K"), ("down", "Q6_K")):
    rows, k = (I, H) if p != "down" else (H, I)
    x8[p] = [cq.repack_x8(m.ctypes.data, rows, k, m.shape[1], t)[0] for m in banks[p]]
mod = cq.module()
x = torch.randn(1, H).to(torch.bfloat16); out = torch.zeros(8, H)
def run(bk, tids, G, nt, reps=150):
    ts = []
    for r in range(reps):
        ex = rng.choice(E, G, replace=False)
        wptr = np.array([[bk[p][e].ctypes.data for p in ("gate", "up", "down")] for e in ex], dtype=np.int64)
        starts = np.arange(G + 1, dtype=np.int64); rows = np.zeros(G, np.int64); w = np.ones(G, np.float32); dst = np.arange(G, dtype=np.int64)
        t = time.perf_counter()
        rc = mod.ms_moe_layer(x.data_ptr(), 1, 1, H, I, G, wptr.ctypes.data, tids.ctypes.data, starts.ctypes.data, rows.ctypes.data, w.ctypes.data, dst.ctypes.data, out.data_ptr(), 8, H, 1, 0, nt, 0)
        ts.append(time.perf_counter() - t); assert rc == 0, rc
    return np.median(ts[20:])
nbytes = sum(banks[p][0].nbytes for p in banks)
plain = np.array([cq.type_id("Q4_K"), cq.type_id("Q4_K"), cq.type_id("Q6_K")], dtype=np.int64)
inter = np.array([cq.X8_TYPES["Q4_K"][0], cq.X8_TYPES["Q4_K"][0], cq.X8_TYPES["Q6_K"][0]], dtype=np.int64)
print("expert bytes", nbytes, "isa", cq.isa())
for name, bk, tids in (("plain", banks, plain), ("x8", x8, inter)):
    for nt in (1, 2):
        t = run(bk, tids, 8, nt)
        print(f"{name} nt={nt}: 8 experts {t*1e6:.0f} us -> {8*nbytes/t/1e9:.1f} GB/s")
# hot (in cache): the same expert repeatedly
for name, bk, tids in (("plain", banks, plain), ("x8", x8, inter)):
    wptr = np.array([[bk[p][0].ctypes.data for p in ("gate", "up", "down")]], dtype=np.int64)
    st, rw, ww, dw = np.arange(2, dtype=np.int64), np.zeros(1, np.int64), np.ones(1, np.float32), np.zeros(1, np.int64)
    ts = []
    for r in range(200):
        t = time.perf_counter()
        mod.ms_moe_layer(x.data_ptr(), 1, 1, H, I, 1, wptr.ctypes.data, tids.ctypes.data, st.ctypes.data, rw.ctypes.data,
                         ww.ctypes.data, dw.ctypes.data, out.data_ptr(), 8, H, 1, 0, 1, 0)
        ts.append(time.perf_counter() - t)
    t = np.median(ts[20:])
    print(f"{name} hot 1 thread: {t*1e6:.0f} us -> {nbytes/t/1e9:.1f} GB/s")
print("--- tunings, x8, 2 threads, 8 experts cold")
for setting in ("", "chunks=2", "chunks=1,kb=256", "x8ahead=1", "x8ahead=2", "chunks=2,x8ahead=1", ""):
    os.environ["MOESTREAM_CPU_LAYER_TUNING"] = setting
    cq.threads()
    ts = [run(x8, inter, 8, 2) for _ in range(3)]
    print(f"{setting or 'default':22s} {min(ts)*1e6:.0f} us -> {8*nbytes/min(ts)/1e9:.1f} GB/s")
print("--- with a 100 us busy gap between calls (a GPU layer's share)")
def run_gap(bk, tids, G, nt, reps=150):
    ts = []
    for r in range(reps):
        ex = rng.choice(E, G, replace=False)
        wptr = np.array([[bk[p][e].ctypes.data for p in ("gate", "up", "down")] for e in ex], dtype=np.int64)
        starts = np.arange(G + 1, dtype=np.int64); rows = np.zeros(G, np.int64); w = np.ones(G, np.float32); dst = np.arange(G, dtype=np.int64)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 100e-6: pass
        t = time.perf_counter()
        rc = mod.ms_moe_layer(x.data_ptr(), 1, 1, H, I, G, wptr.ctypes.data, tids.ctypes.data, starts.ctypes.data, rows.ctypes.data, w.ctypes.data, dst.ctypes.data, out.data_ptr(), 8, H, 1, 0, nt, 0)
        ts.append(time.perf_counter() - t)
    return np.median(ts[20:])
for setting in ("", "x8ahead=1", "", "x8ahead=1"):
    os.environ["MOESTREAM_CPU_LAYER_TUNING"] = setting
    cq.threads()
    for G in (2, 8):
        t = min(run_gap(x8, inter, G, 2) for _ in range(2))
        print(f"{setting or 'default':12s} G={G} {t*1e6:.0f} us -> {G*nbytes/t/1e9:.1f} GB/s")
print("--- the file's layout (the bridge's on a GPU host: no interleaved copies there), rows read ahead, 2 threads")
for setting in ("", "rowsahead=4", "rowsahead=8", "rowsahead=16", "", "rowsahead=8"):
    os.environ["MOESTREAM_CPU_LAYER_TUNING"] = setting
    cq.threads()
    t = min(run(banks, plain, 8, 2) for _ in range(3))
    tg = min(run_gap(banks, plain, 2, 2) for _ in range(2))
    print(f"{setting or 'default (2)':14s} 8 experts {8*nbytes/t/1e9:.1f} GB/s; 2 experts with gaps {2*nbytes/tg/1e9:.1f} GB/s")

