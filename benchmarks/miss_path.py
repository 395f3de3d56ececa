"""What a batch-1 decode layer call's missed experts cost on this machine, by the ways they can reach the GPU.

CUDA only. From the repo root on the GPU machine:
    PYTHONPATH=$PWD python3 benchmarks/miss_path.py [--format q8_0] [--misses 0,1,2,4,8] [--json out.json]

Shape: Qwen3.6-35B-A3B experts (H=2048, I=512, k=8) in a compressed format; a pinned host bank of --experts
experts and a device pool of --slots rows. One "layer call" = the pair kernels over k pairs of one token, m of
which read experts that are not yet in the pool. --calls such calls (different random experts and rows) are
recorded back to back in one CUDA graph, as a decode step records its layers, and replayed. Per m, µs per call:

    fetch    the pair kernels copy their own rows of the missed experts from the host bank (the default at batch 1)
    stage    the staging kernel copies the misses first (SM loads from pinned memory), then the plain pair kernels
    ce       the copy engine copies the misses (cudaMemcpyAsync of each array, addresses known to the host: the
             floor of any design that moves misses with DMA, before the cost of telling the host which they are)
    ce_only / stage_only   the copies alone

The marginal miss rate of a way is m x one expert's bytes / (its µs at m - fetch's µs at m = 0): what the decode
path's PCIe bytes actually move at, against the copy engine's bulk rate that `bench bw` reports.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from moestream.moe import qpairs
from moestream.moe.pairs import stage_experts
from moestream.moe.store import page_locked_zeros

import qpair_bench


def layer_calls(args, dev, m: int, slots: int):
    """`calls` (src, experts, rows, count) of k distinct pool rows each, the first m of them misses staged from
    distinct random host experts."""
    g = torch.Generator().manual_seed(7 + m)
    out = []
    for _ in range(args.calls):
        rows = torch.randperm(slots, generator=g)[:args.k]
        experts = torch.randperm(args.experts, generator=g)[:args.k]
        out.append((rows.to(dev), experts[:m].tolist(), rows[:m].tolist(),
                    (experts.to(dev), rows.to(dev), torch.tensor(m, device=dev))))
    return out


def time_graph(fns, iters: int) -> float:
    """µs per call of fns (one callable per call), recorded in one CUDA graph and replayed."""
    for f in fns[:2]:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / (iters * len(fns)))
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--format", default="q8_0")
    ap.add_argument("--misses", default="0,1,2,4,8")
    ap.add_argument("--H", type=int, default=2048)
    ap.add_argument("--I", type=int, default=512)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    fmt, pool, ebytes = qpair_bench.make_pool(args.format, args.slots, args.H, args.I, dev)
    if fmt is None:
        raise SystemExit("miss_path.py times compressed formats (the fetch kernels' path)")
    _, hpool, _ = qpair_bench.make_pool(args.format, args.experts, args.H, args.I, dev)
    host = {n: page_locked_zeros(v.shape, v.dtype).copy_(v) for n, v in hpool.items()}
    del hpool
    x = torch.randn(1, args.H, device=dev, dtype=torch.bfloat16)
    w = torch.rand(1, args.k, device=dev)
    y = torch.empty(args.k, args.H, device=dev)
    res = {"format": args.format, "expert_bytes": ebytes, "device": torch.cuda.get_device_name(dev),
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "calls": args.calls, "rows": []}
    from moestream.moe.bench import h2d_gbs
    n = min(args.experts, 32)
    res["ce_bulk_gbs"] = h2d_gbs({name: v[:n] for name, v in host.items()}, n, dev, True, 5)
    print(f"{args.format}: one expert {ebytes / 2**20:.2f} MiB; copy engine, expert rows back to back: "
          f"{res['ce_bulk_gbs']:.1f} GB/s ({res['device']})")
    base = None
    print(f"{'misses':>6} {'fetch':>8} {'stage':>8} {'ce':>8} {'stage_only':>10} {'ce_only':>8}   us a call; "
          "marginal GB/s fetch / stage / ce")
    for m in (int(v) for v in args.misses.split(",")):
        calls = layer_calls(args, dev, m, args.slots)

        def compute(src, staged=None):
            return lambda: qpairs._quant_pair_outputs_triton(x, w, src, pool, fmt, y=y, staged=staged)

        def ce(experts, rows):
            def run():
                for e, r in zip(experts, rows):
                    for n, dst in pool.items():
                        dst[r].copy_(host[n][e], non_blocking=True)
            return run

        def stage(staged):
            return lambda: stage_experts(host, pool, *staged)

        row = {"misses": m}
        row["fetch"] = time_graph([compute(s, (host, *st)) for s, _, _, st in calls], args.iters)
        row["stage"] = time_graph([(lambda a, b: (lambda: (a(), b())))(stage(st), compute(s))
                                   for s, _, _, st in calls], args.iters)
        row["ce"] = time_graph([(lambda a, b: (lambda: (a(), b())))(ce(e, r), compute(s))
                                for s, e, r, _ in calls], args.iters)
        row["stage_only"] = time_graph([stage(st) for _, _, _, st in calls], args.iters)
        row["ce_only"] = time_graph([ce(e, r) for _, e, r, _ in calls], args.iters) if m else 0.0
        if base is None:
            base = row["fetch"]
        gbs = {k: (m * ebytes / (row[k] - base) / 1e3 if m and row[k] > base else None) for k in ("fetch", "stage", "ce")}
        row["marginal_gbs"] = gbs
        res["rows"].append(row)
        fmt_g = " / ".join(f"{v:.1f}" if v else "-" for v in gbs.values())
        print(f"{m:>6} {row['fetch']:>8.1f} {row['stage']:>8.1f} {row['ce']:>8.1f} {row['stage_only']:>10.1f} "
              f"{row['ce_only']:>8.1f}   {fmt_g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
