"""CPU expert GEMM throughput of the hybrid/cpu decode worker (moe/bridge.PairMlp), per way of running it.

    PYTHONPATH=$PWD python3 benchmarks/cpu_experts.py [--layers 8 --experts 256 --hidden 2048 --inter 512]

Banks of random bf16 experts bigger than the last-level cache (so the bytes come from DRAM), a random
top-k of `experts` per layer call for a batch of 1 and 4 tokens; prints the expert bytes read per second for
the GEMMs one after another over torch's intra-op threads at several thread counts, plus a plain host read.
(Commit 2a461d9 also measured experts side by side on single-threaded Python threads: slower on the H200
host, see benchmarks/RESULTS.md, so that way was dropped.)"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moestream.moe.bridge import PairMlp  # noqa: E402
from moestream.hardware import physical_cores  # noqa: E402


def layer_calls(layers: int, experts: int, top_k: int, T: int, calls: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for c in range(calls):
        ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(T)]).reshape(-1)
        order = np.argsort(ids, kind="stable")
        ex, starts = np.unique(ids[order], return_index=True)
        yield c % layers, list(zip(ex.tolist(), starts.tolist(), np.append(starts[1:], len(order)).tolist()))


def measure(mlp: PairMlp, banks, hidden: int, top_k: int, T: int, calls: int) -> float:
    x = torch.randn(T * top_k, hidden).to(banks[0]["gate_up"].dtype)
    per = banks[0]["gate_up"][0].nbytes + banks[0]["down"][0].nbytes
    plan = list(layer_calls(len(banks), banks[0]["gate_up"].shape[0], top_k, T, calls))
    for layer, groups in plan[:4]:  # warm up (oneDNN primitives, scratch)
        mlp(x, groups, banks[layer]["gate_up"], banks[layer]["down"])
    t, nbytes = time.perf_counter(), 0
    for layer, groups in plan:
        mlp(x, groups, banks[layer]["gate_up"], banks[layer]["down"])
        nbytes += len(groups) * per
    return nbytes / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--calls", type=int, default=160)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cores = physical_cores()
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    banks = [{"gate_up": torch.randn(args.experts, 2 * args.inter, args.hidden, generator=g).to(torch.bfloat16),
              "down": torch.randn(args.experts, args.hidden, args.inter, generator=g).to(torch.bfloat16)}
             for _ in range(args.layers)]
    gib = sum(t.nbytes for b in banks for t in b.values()) / 2**30
    print(f"{args.layers} layers x {args.experts} experts ({gib:.1f} GiB bf16) made in {time.perf_counter() - t0:.0f} s; "
          f"{cores} physical cores, torch {torch.__version__}, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}", flush=True)
    host = torch.empty(1 << 29, dtype=torch.uint8).random_(0, 255)
    t = time.perf_counter()
    for _ in range(3):
        host.view(torch.float32).sum()
    res = {"cores": cores, "host_read_gbs": 3 * host.numel() / (time.perf_counter() - t) / 1e9, "runs": []}
    print(f"host read {res['host_read_gbs']:.1f} GB/s", flush=True)
    rows = 6 * args.top_k
    for T in (1, 4):
        for n in sorted({1, max(1, cores // 2), max(1, cores - 1), cores}):
            torch.set_num_threads(n)
            gbs = measure(PairMlp(rows), banks, args.hidden, args.top_k, T, args.calls)
            res["runs"].append({"threads": n, "tokens": T, "gbs": gbs})
            print(f"tokens {T}  threads {n:3d}  {gbs:6.1f} GB/s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
