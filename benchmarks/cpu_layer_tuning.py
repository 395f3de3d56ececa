"""The CPU MoE layer call (kernels/cpu/qmatmul.cpp ms_moe_layer) on Q4_K_M experts of the Qwen3.6 shape (gate/up Q4_K
[512, 2048], down Q6_K [2048, 512], quant.synthetic.random_raw's blocks), in the file's layout and 8-row interleaved, under
the layer call's tunings (MOESTREAM_CPU_LAYER_TUNING: chunks a thread, chunk bytes, interleaved groups / rows read
ahead): GB/s of expert bytes for random experts of 48 per call (cold: beyond the caches) at 1 and 2 threads, hot (one
expert again and again, 1 thread), and the bridge's pattern (2 and 8 experts a call with a 100 us busy gap between
calls, as a GPU's share of each layer leaves).

    PYTHONPATH=$PWD python benchmarks/cpu_layer_tuning.py [--threads 2]

--sweep 4,8,16 [--experts 640] (a GPU host, where 48 experts sit in the last-level cache): per thread count, both
layouts, cold experts drawn from --experts of them (640: ~1.2 GB, beyond any cache), 8 experts a call back to back,
8 with the 100 us gap, and 64 a call (the kernel's rate with a call's overhead spread): GB/s and the share of the
host's read bandwidth (moe/bench's figure, measured here first); calls of 3 and 8 after the caller yielded its core for
300 us (the team's wake-up: OpenMP, the kernels' pool, the pool spinning 2 ms); then where a call of 8 goes at the largest count
(kernels/cpu_quant.layer_profile: setup, first / last thread done with each phase), with and without flow;
--json FILE keeps them.
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
LAYOUTS: dict = {}
EXPERT_BYTES = 0


def build(experts: int) -> None:
    """E random experts of the shape in both layouts (LAYOUTS: name -> (per projection E arrays, type ids))."""
    global E, EXPERT_BYTES
    E = experts
    plain = {p: [m.numpy() for m in random_raw(gguf_format(t), (E, n, k), seed=j)]  # E [n, row bytes] arrays
             for j, (p, (t, n, k)) in enumerate(SHAPES.items())}
    x8 = {p: [cq.repack_x8(m.ctypes.data, n, k, m.shape[1], t)[0] for m in plain[p]] for p, (t, n, k) in SHAPES.items()}
    LAYOUTS["plain"] = (plain, np.array([cq.type_id(SHAPES[p][0]) for p in NAMES], dtype=np.int64))
    LAYOUTS["x8"] = (x8, np.array([cq.X8_TYPES[SHAPES[p][0]][0] for p in NAMES], dtype=np.int64))
    EXPERT_BYTES = sum(plain[p][0].nbytes for p in NAMES)


X = torch.randn(1, H).to(torch.bfloat16)
OUT = torch.zeros(64, H)


def time_calls(layout: str, G: int, nt: int, reps: int = 150, gap_s: float = 0.0, hot: bool = False,
               idle: bool = False) -> float:
    """Median seconds of a layer call of G experts (one token), nt threads; gap_s of busy waiting before each (idle:
    yielding the core meanwhile, as the bridge's worker waits for the GPU's next request)."""
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
            if idle:
                os.sched_yield()
        t = time.perf_counter()
        rc = mod.ms_moe_layer(X.data_ptr(), 1, 1, H, I, G, wptr.ctypes.data, tids.ctypes.data, starts.ctypes.data,
                              rows.ctypes.data, w.ctypes.data, dst.ctypes.data, OUT.data_ptr(), OUT.shape[0], H, 1, 0, nt, 0)
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
    ap.add_argument("--sweep", default="", help="thread counts, e.g. 4,8,16: the host sweep instead of the tunings")
    ap.add_argument("--experts", type=int, default=0, help="experts to draw from [48; 640 with --sweep]")
    ap.add_argument("--json", default="")
    ap.add_argument("--rounds", type=int, default=5, help="with --tunings: alternating rounds [5]")
    ap.add_argument("--tunings", default="", help="with --sweep: ';'-separated MOESTREAM_CPU_LAYER_TUNING settings "
                    "timed at the largest thread count, both layouts (e.g. 'rowsahead=8;rowsahead=32;kb=128')")
    args = ap.parse_args()
    if args.sweep:
        if args.experts and args.experts < 64:
            ap.error("--sweep draws 64 distinct experts a call: --experts must be at least 64")
        return sweep([int(n) for n in args.sweep.split(",")], args.experts or 640, args.json,
                     [t for t in args.tunings.split(";") if t], args.rounds)
    build(args.experts or 48)
    nt = args.threads
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


def sweep(counts: list[int], experts: int, out: str, tunings: list[str] = (), rounds: int = 5) -> None:
    """The host sweep (--sweep): per thread count and layout, GB/s of 8 cold experts a call back to back, with a
    100 us gap before each call, and of 64 a call; beside the host's read bandwidth. Then each of `tunings` at the
    largest thread count (8 and 64 a call), alternating with the default in `rounds` rounds."""
    import json

    from moestream.moe.bench import host_read_gbs

    torch.set_num_threads(max(counts))
    read = host_read_gbs(1024, 5)
    t0 = time.perf_counter()
    build(experts)
    print(f"expert bytes {EXPERT_BYTES}, {E} experts ({E * EXPERT_BYTES / 1e9:.2f} GB, made in "
          f"{time.perf_counter() - t0:.1f} s), isa {cq.isa()}; host read {read:.1f} GB/s")
    rows = []
    tuned("")
    for nt in counts:
        for layout in LAYOUTS:
            got = {"threads": nt, "layout": layout,
                   "g8": gbs(8, min(time_calls(layout, 8, nt) for _ in range(2))),
                   "g8_gap": gbs(8, min(time_calls(layout, 8, nt, gap_s=100e-6) for _ in range(2))),
                   "g64": gbs(64, time_calls(layout, 64, nt, reps=40))}
            rows.append(got)
            print(f"{nt:3d} threads {layout:5s}: 8 a call {got['g8']:6.1f} GB/s ({got['g8'] / read:4.0%}), with gaps "
                  f"{got['g8_gap']:6.1f}, 64 a call {got['g64']:6.1f} ({got['g64'] / read:4.0%})", flush=True)
    nt = max(counts)
    # the team's wake-up: calls of 3 and 8 experts after 300 us of the caller yielding its core (hybrid's worker
    # between two layers' requests), on OpenMP's team, the kernels' own pool (idle workers spin 300 us, then sleep) and
    # the pool spinning 2 ms; back to back for reference
    wake = {}
    for mode, env in (("omp", {"MOESTREAM_CPU_POOL": "omp"}), ("pool", {"MOESTREAM_CPU_POOL": "pool"}),
                      ("pool spin 2000", {"MOESTREAM_CPU_POOL": "pool", "MOESTREAM_CPU_SPIN_US": "2000"})):
        os.environ.update(env)
        cq.threads()
        for G in (3, 8):
            wake[f"{mode} G{G}"] = w = {"back_to_back": gbs(G, min(time_calls("plain", G, nt) for _ in range(2))),
                                        "idle_300us": gbs(G, min(time_calls("plain", G, nt, gap_s=300e-6, idle=True)
                                                                 for _ in range(2)))}
            print(f"{nt:3d} threads plain {mode:15s} {G} a call: back to back {w['back_to_back']:6.1f} GB/s, after "
                  f"300 us idle {w['idle_300us']:6.1f}", flush=True)
        for k in env:
            os.environ.pop(k)
    cq.threads()
    profiles = {}
    for setting in ("", "flow=0"):  # where a call of 8 cold experts goes at the largest thread count
        tuned(setting)
        cq.layer_profile(True)
        time_calls("plain", 8, nt)
        p = cq.layer_profile(False)
        n = max(1.0, p.pop("calls"))
        profiles[setting or "default"] = {k: v / n * 1e6 for k, v in p.items()}
        print(f"{nt:3d} threads plain {setting or 'default':8s} a call of 8, us: " +
              ", ".join(f"{k} {v:.1f}" for k, v in profiles[setting or "default"].items()) +
              f" (the bytes alone at host read: {8 * EXPERT_BYTES / read / 1e3:.1f})", flush=True)
    tuned("")
    # the tunings against the default in alternating rounds (one setting after another, `rounds` times; a host's rate
    # drifts by more than most tunings move it), each a median of the rounds
    tuned_rows, settings = [], [""] + list(tunings) if tunings else []
    got = {(st, layout): {"g8": [], "g64": []} for st in settings for layout in LAYOUTS}
    for _ in range(rounds if settings else 0):
        for setting in settings:
            tuned(setting)
            for layout in LAYOUTS:
                got[setting, layout]["g8"].append(gbs(8, time_calls(layout, 8, nt)))
                got[setting, layout]["g64"].append(gbs(64, time_calls(layout, 64, nt, reps=30)))
    for (setting, layout), v in got.items():
        row = {"threads": nt, "layout": layout, "tuning": setting or "default", "rounds": rounds,
               "g8": float(np.median(v["g8"])), "g64": float(np.median(v["g64"])), "g8_all": v["g8"]}
        tuned_rows.append(row)
        print(f"{nt:3d} threads {layout:5s} {row['tuning']:24s}: 8 a call {row['g8']:6.1f} GB/s "
              f"({row['g8'] / read:4.0%}; rounds {min(v['g8']):.1f}-{max(v['g8']):.1f}), 64 a call {row['g64']:6.1f}",
              flush=True)
    tuned("")
    if out:
        with open(out, "w") as f:
            json.dump({"host_read_gbs": read, "experts": E, "expert_bytes": EXPERT_BYTES, "isa": cq.isa(),
                       "rows": rows, "tunings": tuned_rows, "profile_us": profiles, "wake": wake}, f, indent=1)


if __name__ == "__main__":
    main()
