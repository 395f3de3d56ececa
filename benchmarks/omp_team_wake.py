"""A worker thread's small CPU kernel call after an idle gap, with the main thread's OpenMP team alive and freed.

The cpu/hybrid bridge's worker is a thread of its own whose OpenMP team computes one layer call every few hundred
microseconds. libgomp lets an idle team spin (~3 ms) only while the process's OpenMP threads, all teams together, do
not outnumber the CPUs; the main thread's team (torch's CPU ops in parallel, e.g. while loading) makes them do, and the
worker's team then sleeps between calls. This times the worker's call (a Q8_0 matmul of ROWS x K, one token) after
--gap-us of the worker busy-waiting (as it polls for the GPU's next request), in rounds A B A B: A with the main
thread's team alive, B after kernels/cpu_quant.omp_release_team() freed it (MOESTREAM_OMP_RELEASE does that before
each bridge step).

    PYTHONPATH=$PWD python3 benchmarks/omp_team_wake.py [--threads N] [--gap-us 300] [--calls 400] [--rows 256]
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch

from moestream.kernels import cpu_quant


def tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def worker_calls(nt: int, gap_s: float, calls: int, rows: int, k: int) -> list[float]:
    out: list[float] = []

    def run():
        torch.set_num_threads(nt)
        x = torch.randn(1, k)
        w = torch.randint(0, 120, (rows, k // 32 * 34), dtype=torch.uint8)  # Q8_0 rows (scale bytes small: finite)
        for _ in range(calls):
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < gap_s:
                pass
            t1 = time.perf_counter()
            cpu_quant.qmatmul(x, w, "Q8_0")
            out.append(time.perf_counter() - t1)

    th = threading.Thread(target=run)
    th.start()
    th.join()
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--gap-us", type=float, default=300)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    if cpu_quant.module() is None:
        raise SystemExit("the CPU kernels could not be built here")
    torch.set_num_threads(a.threads)
    rows = []
    for r in range(a.rounds):
        for mode in ("main team alive", "main team freed"):
            big = torch.randn(1 << 22)
            (big + big).sum()  # a parallel region on the main thread: its team of a.threads
            before = tasks()
            if mode == "main team freed" and not cpu_quant.omp_release_team():
                raise SystemExit("omp_release_team failed: the OpenMP runtime has no omp_pause_resource_all")
            lat = worker_calls(a.threads, a.gap_us * 1e-6, a.calls, a.rows, a.k)
            n = len(lat)
            row = {"round": r, "mode": mode, "threads_before": before, "threads_after": tasks(),
                   "median_us": lat[n // 2] * 1e6, "p10_us": lat[n // 10] * 1e6, "p90_us": lat[n * 9 // 10] * 1e6}
            rows.append(row)
            print(f"round {r} {mode:16s} process threads {before:3d} -> {row['threads_after']:3d}: a call after "
                  f"{a.gap_us:.0f} us idle median {row['median_us']:7.1f} us (p10 {row['p10_us']:.1f}, p90 "
                  f"{row['p90_us']:.1f})", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "cpus": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
