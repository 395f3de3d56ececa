"""Decode pair kernels on compressed expert rows (moe/qpairs.py) vs the dense bf16 pair kernels (moe/pairs.py).

CUDA only. From the repo root on the GPU machine:
    PYTHONPATH=$PWD python3 benchmarks/qpair_bench.py                 # default formats, T = 1 and 4
    PYTHONPATH=$PWD python3 benchmarks/qpair_bench.py --sweep q8_0     # also time other launch constants

Shape: Qwen3.6-35B-A3B experts (H=2048, I=512, k=8). A pool of --slots experts per format (256: about
0.9 GB of Q8_0, far more than the 60 MB L2), and --calls different src vectors of k distinct random rows
per token, recorded back to back in one CUDA graph (as a decode step records its 40 layers), so every
call reads its experts from HBM and launch overhead is that of a replayed graph. Reported per format:

    us/call     graph replay time / calls (one quant_pair_outputs = gate_up + down kernels)
    GB/s        weight bytes the call reads (P pairs x one expert's stored bytes) / us per call
    vs bf16     us/call of the dense bf16 pair kernels on the same shape / this format's us/call
"""
from __future__ import annotations

import argparse
import itertools

import torch

from moestream.moe import pairs, qpairs
from moestream.moe.formats import PROJS, gguf_expert_format, hf_expert_format
from moestream.quant import FP8_BLOCK, FP8_CHANNEL, MXFP4, NVFP4
from moestream.quant.synthetic import random_raw

GGUF = {"q8_0": "Q8_0", "q4_k_m": "Q4_K/Q4_K/Q6_K", "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K", "q4_0": "Q4_0",
        "q5_0": "Q5_0", "q2_k": "Q2_K", "q3_k": "Q3_K", "iq4_xs": "IQ4_XS", "iq4_nl": "IQ4_NL",
        "gguf_mxfp4": "MXFP4", "gguf_nvfp4": "NVFP4", "iq3_s": "IQ3_S"}
HF = {"fp8_block": FP8_BLOCK, "fp8_channel": FP8_CHANNEL, "nvfp4": NVFP4, "mxfp4": MXFP4}
DEFAULT = "bf16,q8_0,q4_k_m,q4_0,q6_k,iq4_xs,fp8_block,nvfp4,mxfp4"


def make_pool(name: str, slots: int, H: int, I: int, dev):
    """(fmt or None for bf16, pool, stored bytes of one expert)."""
    if name == "bf16":
        g = torch.Generator(device=dev).manual_seed(0)
        pool = {"gate_up": torch.randn(slots, 2 * I, H, device=dev, generator=g, dtype=torch.bfloat16) * 0.02,
                "down": torch.randn(slots, H, I, device=dev, generator=g, dtype=torch.bfloat16) * 0.02}
        return None, pool, 3 * H * I * 2
    if name in GGUF:
        g, u, d = (GGUF[name].split("/") * 3)[:3] if "/" in GGUF[name] else (GGUF[name],) * 3
        fmt = gguf_expert_format({"gate": g, "up": u, "down": d}, H, I)
        pool = {p: random_raw(fmt.quant(p), (slots, *fmt.logical(H, I)[p]), dev, seed=j).reshape(slots, -1)
                for j, p in enumerate(PROJS)}
    else:
        q = HF[name]
        fmt = hf_expert_format(q, {f"{p}.{s.name}": s.dtype for p in PROJS for s in q.parts}, H, I)
        pool = {}
        for j, p in enumerate(PROJS):
            for part, t in random_raw(q, (slots, *fmt.logical(H, I)[p]), dev, seed=j).items():
                pool[f"{p}.{part}"] = t.reshape(slots, -1).view(torch.uint8)
    return fmt, pool, sum(s[0] for s in fmt.shapes(H, I).values())


def make_srcs(calls: int, T: int, k: int, slots: int, dev):
    """`calls` src vectors: each token's k experts distinct (a router's top-k), random over the pool."""
    g = torch.Generator().manual_seed(1)
    return [torch.stack([torch.randperm(slots, generator=g)[:k] for _ in range(T)]).reshape(-1).to(dev)
            for _ in range(calls)]


def time_graph(fn, srcs, iters: int) -> float:
    """us per fn(src) call: all calls recorded in one CUDA graph, replayed `iters` times."""
    for s in srcs[:2]:
        fn(s)  # compile / autotune (pairs.py) before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in srcs:
            fn(s)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * len(srcs))


def bench(name, T, args, dev, base_us=None, cfg=None):
    fmt, pool, ebytes = make_pool(name, args.slots, args.H, args.I, dev)
    x = torch.randn(T, args.H, device=dev, dtype=torch.bfloat16)
    w = torch.rand(T, args.k, device=dev)
    srcs = make_srcs(args.calls, T, args.k, args.slots, dev)
    if fmt is None:
        fn = lambda s: pairs.pair_outputs(x, w, s, pool)  # noqa: E731
    elif cfg is not None:
        fn = lambda s: qpairs._quant_pair_outputs_triton(x, w, s, pool, fmt, cfg)  # noqa: E731
    else:
        fn = lambda s: qpairs.quant_pair_outputs(x, w, s, pool, fmt)  # noqa: E731
    us = time_graph(fn, srcs, args.iters)
    gbs = T * args.k * ebytes / us / 1e3
    return us, gbs, (base_us / us if base_us else 1.0), fmt


def sweep(name, T, args, dev):
    """Time each stage alone over launch constants (BN rows, BV columns, warps); print the best few."""
    fmt, pool, _ = make_pool(name, args.slots, args.H, args.I, dev)
    x = torch.randn(T, args.H, device=dev, dtype=torch.bfloat16)
    w = torch.rand(T * args.k, device=dev)
    srcs = make_srcs(args.calls, T, args.k, args.slots, dev)
    P = T * args.k
    h = torch.empty(P, args.I, device=dev, dtype=torch.bfloat16)
    y = torch.empty(P, args.H, device=dev)
    for stage in ("gate_up", "down"):
        res = []
        for bn, bv, warps in itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8)):
            if bn * bv > 32768:
                continue
            cfg = (bn, bv, warps)
            if stage == "gate_up":
                fn = lambda s: qpairs.gate_up_triton(x, s, pool, fmt, args.k, h, cfg)  # noqa: E731
            else:
                fn = lambda s: qpairs.down_triton(h, w, s, pool, fmt, y, cfg)  # noqa: E731
            try:
                res.append((time_graph(fn, srcs, max(1, args.iters // 4)), cfg))
            except Exception as e:  # a constant set the compiler refuses (registers, shared memory)
                print(f"  {stage} {cfg}: {type(e).__name__}")
        res.sort()
        default = qpairs.default_config(stage, args.I if stage == "gate_up" else args.H,
                                        args.H if stage == "gate_up" else args.I, P)
        dflt = next((us for us, c in res if c == default), float("nan"))
        print(f"  sweep {name} T={T} {stage}: default {default} {dflt:.2f} us; best " +
              ", ".join(f"{c} {us:.2f} us" for us, c in res[:5]), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=DEFAULT)
    ap.add_argument("--T", default="1,4", help="tokens per call (batch)")
    ap.add_argument("--H", type=int, default=2048)
    ap.add_argument("--I", type=int, default=512)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--calls", type=int, default=40, help="calls per graph (a decode step's layers)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", default="", help="formats whose launch constants to sweep")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("qpair_bench needs a CUDA GPU")
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}  H={args.H} I={args.I} k={args.k} slots={args.slots} "
          f"calls/graph={args.calls}")
    print(f"{'format':<12} {'T':>2} {'us/call':>9} {'GB/s':>8} {'vs bf16':>8}  triton")
    for T in (int(t) for t in args.T.split(",")):
        base = None
        for name in args.formats.split(","):
            us, gbs, rel, fmt = bench(name, T, args, dev, base)
            if name == "bf16":
                base = us
            tri = "dense" if fmt is None else ("yes" if qpairs.supports(fmt) else "no (torch)")
            print(f"{name:<12} {T:>2} {us:>9.2f} {gbs:>8.0f} {rel:>7.2f}x  {tri}", flush=True)
        for name in filter(None, args.sweep.split(",")):
            sweep(name, T, args, dev)


if __name__ == "__main__":
    main()
