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
    dma      the GPU posts "call i reached" to pinned host memory, a host thread (Python here: an upper bound of a
             compiled one's latency) sees it and queues the misses' copies on a copy stream followed by a flag copy,
             and a kernel waits for the flag before the plain pair kernels: the whole round trip of a copy-engine
             miss path whose experts the GPU decides
    ce_only / stage_only   the copies alone

The marginal miss rate of a way is m x one expert's bytes / (its µs at m - fetch's µs at m = 0): what the decode
path's PCIe bytes actually move at, against the copy engine's bulk rate that `bench bw` reports.
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from moestream.moe import qpairs
from moestream.moe.pairs import stage_experts
from moestream.moe.store import page_locked_zeros

import qpair_bench

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CUDA machines have it
    triton = None

if triton is not None:
    @triton.jit
    def _post_kernel(seq_ptr, req_ptr):
        """This call's request: the step's sequence number, published to host memory (system-scope release)."""
        tl.atomic_xchg(req_ptr, tl.load(seq_ptr, volatile=True), sem="release", scope="sys")

    @triton.jit
    def _wait_kernel(seq_ptr, flag_ptr, err_ptr, LIMIT: tl.constexpr):
        """Until the copy stream's flag for this call reaches the step's sequence number (or LIMIT polls)."""
        s = tl.load(seq_ptr, volatile=True)
        n = 0
        while (tl.load(flag_ptr, volatile=True) < s) & (n < LIMIT):
            n += 1
        if n >= LIMIT:
            tl.store(err_ptr, 1)


class DmaWorker:
    """The host side of the `dma` way: one thread serving every call of every replayed step in order."""

    def __init__(self, dev, host, pool, calls):
        self.dev, self.host, self.pool, self.calls = dev, host, pool, calls
        n = len(calls)
        self.req = torch.zeros(n, dtype=torch.long, pin_memory=True)
        self.flag_src = torch.zeros(n, dtype=torch.long, pin_memory=True)
        self.flag = torch.zeros(n, dtype=torch.long, device=dev)
        self.dseq = torch.zeros(1, dtype=torch.long, device=dev)
        self.err = torch.zeros(1, dtype=torch.int32, device=dev)
        self.stream = torch.cuda.Stream(dev)
        self.steps, self.stop = 0, False
        self._req = self.req.numpy()
        self._flag_src = self.flag_src.numpy()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def call(self, i, compute):
        def run():
            _post_kernel[(1,)](self.dseq, self.req[i:])
            _wait_kernel[(1,)](self.dseq, self.flag[i:], self.err, LIMIT=1 << 26)
            compute()
        return run

    def _loop(self):
        torch.cuda.set_device(self.dev.index if self.dev.index is not None else torch.cuda.current_device())
        with torch.cuda.stream(self.stream):
            while not self.stop:
                step = self.steps + 1
                for i, (_, experts, rows, _) in enumerate(self.calls):
                    while self._req[i] < step:
                        if self.stop:
                            return
                        time.sleep(0)
                    for e, r in zip(experts, rows):
                        for n, dst in self.pool.items():
                            dst[r].copy_(self.host[n][e], non_blocking=True)
                    self._flag_src[i] = step
                    self.flag[i:i + 1].copy_(self.flag_src[i:i + 1], non_blocking=True)
                self.steps = step

    def close(self):
        self.stop = True
        self.thread.join(timeout=5)


def time_dma(worker: DmaWorker, fns, iters: int) -> float:
    """µs per call of the dma way: each replay is a step (its sequence number set before it, in stream order)."""
    seq = [0]

    def launch(graph=None):
        seq[0] += 1
        worker.dseq.fill_(seq[0])
        if graph is None:
            for f in fns:
                f()
        else:
            graph.replay()

    launch()  # eager: compile, and the worker's first step
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            launch(graph)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / (iters * len(fns)))
    if int(worker.err.item()):
        raise RuntimeError("dma: a wait kernel gave up (the worker did not answer)")
    return best * 1e6


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
    print(f"{'misses':>6} {'fetch':>8} {'stage':>8} {'ce':>8} {'dma':>8} {'stage_only':>10} {'ce_only':>8}   us a call; "
          "marginal GB/s fetch / stage / ce / dma")
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
        if m:
            worker = DmaWorker(dev, host, pool, calls)
            try:
                row["dma"] = time_dma(worker, [worker.call(i, compute(s)) for i, (s, _, _, _) in enumerate(calls)],
                                      args.iters)
            finally:
                worker.close()
        else:
            row["dma"] = row["fetch"]
        row["stage_only"] = time_graph([stage(st) for _, _, _, st in calls], args.iters)
        row["ce_only"] = time_graph([ce(e, r) for _, e, r, _ in calls], args.iters) if m else 0.0
        if base is None:
            base = row["fetch"]
        gbs = {k: (m * ebytes / (row[k] - base) / 1e3 if m and row[k] > base else None)
               for k in ("fetch", "stage", "ce", "dma")}
        row["marginal_gbs"] = gbs
        res["rows"].append(row)
        fmt_g = " / ".join(f"{v:.1f}" if v else "-" for v in gbs.values())
        print(f"{m:>6} {row['fetch']:>8.1f} {row['stage']:>8.1f} {row['ce']:>8.1f} {row['dma']:>8.1f} {row['stage_only']:>10.1f} "
              f"{row['ce_only']:>8.1f}   {fmt_g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
