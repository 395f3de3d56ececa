"""Micro-benchmark of one routed-expert layer call on CUDA: moe/grouped.py's grouped GEMM vs the torch loop.

Shape of Qwen3.6-35B-A3B: H=2048, I=512, 256 experts, top-8; T=512 tokens (a prefill chunk) routed
uniformly (each token 8 distinct random experts). For each format (bf16, GGUF Q8_0, Q4_K, ..., HF fp8_block,
fp8_channel, fp8_tensor, nvfp4, mxfp4: each part's stored bytes a uint8 row per expert, as the store keeps them):

  grouped   DeviceExperts.compute (grouped kernels) + accumulate: what a fused-prefill layer call runs
  kernels   grouped_moe alone (sort, block table, two launches, k-order sum)
  loop      partial_outputs (per expert: gather, dequantize, 3 GEMMs) + accumulate: the previous path

Prints us per layer call (median of --iters, CUDA events), TFLOP/s (2 * T * k * 3 * H * I flops) and the
normwise difference grouped vs loop. Usage: python benchmarks/grouped_bench.py [--tokens 512]
[--formats bf16,Q8_0,Q4_K] [--sweep: the 5 fastest launch configurations of grouped_moe instead]
[--stages 1,2,3: grouped_moe under each num_stages instead]; a format `Q8_0R:scale` runs Q8_0R (the GPU stores' row
layout of Q8_0) under MOESTREAM_Q8R_GROUPED=scale.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

from moestream.moe.compute import DeviceExperts, RouteGroups, WeightRef, accumulate, partial_outputs
from moestream.moe.formats import PROJS, gguf_expert_format, hf_expert_format
from moestream.moe.grouped import grouped_moe
from moestream.quant import get_format, gguf_format
from moestream.quant.synthetic import random_raw

H, I, E, K = 2048, 512, 256, 8


def make_bank(name: str, dev, experts: int = E) -> tuple[dict, object]:
    """Bank of `experts` experts in format `name` (bf16: N(0, 1/K); GGUF: random blocks, finite scales)."""
    g = torch.Generator(device=dev).manual_seed(0)
    if name == "bf16":
        gu = torch.randn(experts, 2 * I, H, device=dev, generator=g, dtype=torch.bfloat16) * H ** -0.5
        down = torch.randn(experts, H, I, device=dev, generator=g, dtype=torch.bfloat16) * I ** -0.5
        return {"gate_up": gu, "down": down}, None
    shapes = {"gate": (experts, I, H), "up": (experts, I, H), "down": (experts, H, I)}
    if name.lower() in ("fp8_block", "fp8_channel", "fp8_tensor", "nvfp4", "mxfp4"):
        qf = get_format(name.lower())
        bank = {}
        for i, (p, s) in enumerate(shapes.items()):
            for part, t in random_raw(qf, s, dev, seed=i).items():
                bank[f"{p}.{part}"] = t.reshape(experts, -1).contiguous().view(torch.uint8)
        dtypes = {f"{p}.{part.name}": part.dtype for p in PROJS for part in qf.parts}
        return bank, hf_expert_format(qf, dtypes, H, I)
    q = gguf_format(name)
    bank = {p: random_raw(q, s, dev, seed=i).reshape(experts, -1) for i, (p, s) in enumerate(shapes.items())}
    return bank, gguf_expert_format({p: name for p in shapes}, H, I)


def time_us(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)


def bench(name: str, tokens: int, iters: int, dev) -> None:
    bank, fmt = make_bank(name, dev)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(tokens, H, device=dev, generator=g, dtype=torch.bfloat16)
    ids = torch.rand(tokens, E, device=dev, generator=g).topk(K, dim=1).indices
    w = torch.softmax(torch.randn(tokens, K, device=dev, generator=g), -1)
    rows = torch.arange(E, device=dev)
    gpu = DeviceExperts()

    def refs_of(groups):
        return {e: WeightRef(bank, e, fmt) for e in groups.experts}

    def grouped():
        groups = RouteGroups.of(ids)
        return accumulate(x, groups, gpu.compute(x, w, groups, refs_of(groups)))

    def loop():
        groups = RouteGroups.of(ids)
        return accumulate(x, groups, partial_outputs(x, w, groups, refs_of(groups)))

    flops = 2 * tokens * K * 3 * H * I
    yg, yl, yk = grouped(), loop(), grouped_moe(x, ids, w, bank, rows, fmt)
    diff = ((yg.double() - yl.double()).norm() / yl.double().norm()).item()
    diffk = ((yk.double() - yl.double()).norm() / yl.double().norm()).item()
    res = {"grouped": time_us(grouped, iters),
           "kernels": time_us(lambda: grouped_moe(x, ids, w, bank, rows, fmt), iters),
           "loop": time_us(loop, max(3, iters // 5))}
    line = "  ".join(f"{k} {v:9.1f} us {flops / v / 1e6:6.1f} TFLOP/s" for k, v in res.items())
    print(f"{name:6s} T={tokens}  {line}  speedup {res['loop'] / res['grouped']:.1f}x  "
          f"|grouped-loop|/|loop| {diff:.2e} (kernels {diffk:.2e})", flush=True)


def sweep(name: str, tokens: int, dev) -> None:
    """grouped_moe under each launch configuration (grouped.CONFIG); prints the 5 fastest."""
    import itertools

    from moestream.moe import grouped as G

    bank, fmt = make_bank(name, dev)
    x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
    ids = torch.rand(tokens, E, device=dev).topk(K, dim=1).indices
    w = torch.softmax(torch.randn(tokens, K, device=dev), -1)
    rows = torch.arange(E, device=dev)
    saved, res = dict(G.CONFIG), []
    for bm, (bn, bk), nw, st in itertools.product((16, 32, 64), ((64, 64), (128, 64), (64, 128), (128, 128)),
                                                  (4, 8), (3, 4)):
        G.CONFIG.update(bn=bn, bk=bk, num_warps=nw, num_stages=st, bm=bm)
        res.append((time_us(lambda: grouped_moe(x, ids, w, bank, rows, fmt), 5), dict(G.CONFIG)))
    G.CONFIG.update(saved)
    flops = 2 * tokens * K * 3 * H * I
    for us, cfg in sorted(res, key=lambda r: r[0])[:5]:
        print(f"{name:6s} T={tokens} {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s {cfg}", flush=True)


def stages(name: str, tokens: int, iters: int, dev, values: list[int]) -> None:
    """grouped_moe at the default configuration under each num_stages in `values` (the loads' software pipelining:
    1 = none, loads straight to registers)."""
    from moestream.moe import grouped as G

    bank, fmt = make_bank(name, dev)
    x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
    ids = torch.rand(tokens, E, device=dev).topk(K, dim=1).indices
    w = torch.softmax(torch.randn(tokens, K, device=dev), -1)
    rows = torch.arange(E, device=dev)
    saved, flops = dict(G.CONFIG), 2 * tokens * K * 3 * H * I
    for st in values:
        G.CONFIG.update(num_stages=st)
        us = time_us(lambda: grouped_moe(x, ids, w, bank, rows, fmt), iters)
        print(f"{name:6s} T={tokens} num_stages {st}: {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s", flush=True)
    G.CONFIG.update(saved)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--formats", default="bf16,Q8_0,Q4_K")
    ap.add_argument("--sweep", action="store_true", help="time grouped_moe under other launch configurations")
    ap.add_argument("--stages", default="", help="time grouped_moe under these num_stages (e.g. 1,2,3)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("grouped_bench needs a CUDA GPU")
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), f"H={H} I={I} E={E} k={K}")
    with torch.inference_mode():
        for spec in args.formats.split(","):
            name, _, mode = spec.partition(":")  # Q8_0R:scale = Q8_0R under MOESTREAM_Q8R_GROUPED=scale
            os.environ["MOESTREAM_Q8R_GROUPED"] = mode or "tile"
            if args.stages:
                stages(name, args.tokens, args.iters, dev, [int(v) for v in args.stages.split(",")])
            elif args.sweep:
                sweep(name, args.tokens, dev)
            else:
                bench(name, args.tokens, args.iters, dev)


if __name__ == "__main__":
    main()
