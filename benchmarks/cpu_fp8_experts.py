"""One MoE layer call of HF FP8 experts on the CPU (Qwen3.6-35B-A3B's expert shape: H 2048, I 512, top-8 of 256):
the compiled layer call (kernels/cpu_quant.moe_layer, type "fp8": one call for the layer's pairs) against the path
FP8 experts took before it (compute.partial_outputs' per-expert loop: three fp8_matmul calls and a torch SwiGLU per
expert), on the same bank, same threads.

    PYTHONPATH=$PWD python benchmarks/cpu_fp8_experts.py [--tokens 1,4] [--threads 2] [--calls 40] [--out F.json]

The bank (256 experts, 128 x 128 float32 block scales, random e4m3 codes) is larger than the caches, and every call
routes to fresh random experts, so the bytes come from DRAM. Prints µs per layer call and the expert bytes read per
second (each distinct expert's codes and scales once per call)."""
from __future__ import annotations

import argparse
import json
import time
from unittest import mock

import numpy as np
import torch

from moestream.moe import cpu_moe
from moestream.moe.compute import RouteGroups, WeightRef, partial_outputs
from moestream.moe.formats import hf_expert_format
from moestream.quant import FP8_BLOCK
from moestream.quant.synthetic import random_raw

H, I, E, K = 2048, 512, 256, 8


def make_bank(experts: int) -> tuple[dict, object]:
    bank, dtypes = {}, {}
    for j, (proj, shape) in enumerate((("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))):
        one = random_raw(FP8_BLOCK, shape, seed=j)
        for part, t in one.items():
            dtypes[f"{proj}.{part}"] = t.dtype
            row = t.contiguous().reshape(-1).view(torch.uint8)
            bank[f"{proj}.{part}"] = row.repeat(experts, 1)  # distinct memory per expert (same values)
    return bank, hf_expert_format(FP8_BLOCK, dtypes, H, I)


def time_calls(bank, fmt, T: int, calls: int, layer_call: bool) -> tuple[float, int]:
    rng = np.random.default_rng(T)
    x = torch.randn(T, H)
    w = torch.rand(T, K)
    with mock.patch.object(cpu_moe, "kernel_types", cpu_moe.kernel_types if layer_call else (lambda fmt: None)):
        ids_all = [torch.from_numpy(np.stack([rng.choice(E, K, replace=False) for _ in range(T)])) for _ in range(calls + 2)]
        for ids in ids_all[:2]:  # warm-up
            groups = RouteGroups.of(ids)
            partial_outputs(x, w, groups, {e: WeightRef(bank, e, fmt) for e in groups.experts})
        t0, n_exp = time.perf_counter(), 0
        for ids in ids_all[2:]:
            groups = RouteGroups.of(ids)
            partial_outputs(x, w, groups, {e: WeightRef(bank, e, fmt) for e in groups.experts})
            n_exp += len(groups.experts)
    return (time.perf_counter() - t0) / calls, n_exp // calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bank, fmt = make_bank(E)
    per_expert = sum(a.shape[1] for a in bank.values())
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        for layer_call in (False, True):
            s, n = time_calls(bank, fmt, T, args.calls, layer_call)
            r = {"tokens": T, "path": "layer call" if layer_call else "per-expert fp8_matmul", "us": s * 1e6,
                 "experts": n, "gb_s": n * per_expert / s / 1e9}
            rows.append(r)
            print(f"T={T} {r['path']:24s} {r['us']:9.0f} us/call  {n:3d} experts  {r['gb_s']:6.2f} GB/s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(), "bytes_per_expert":
                       per_expert, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
