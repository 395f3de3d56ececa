"""Miss-fetch throughput of the offload copy path vs plain pinned host->device copies, same run.

    python benchmarks/moe_fetch.py [--hidden 2048 --inter 512 --experts 256 --layers 4 --slots 256]

Prints pinned H2D GB/s (bench bw's measurement), the GB/s of the runtime's Copier filling misses
(copy stream + events, one copy per array per expert), the ratio (issue 3 wants >= 0.8), and a
decode-like loop: random top-8 routing through an offload runtime with `--slots` slots, reporting
hit rate, bytes moved and achieved PCIe GB/s. CUDA only.
"""
from __future__ import annotations

import argparse
import time

import torch

from moestream.moe.bench import h2d_gbs
from moestream.moe.formats import dense_format
from moestream.moe.runtime import RuntimeOptions, build_runtime
from moestream.moe.store import ExpertStore


def make_store(layers, E, H, I, dtype):
    st = ExpertStore(list(range(layers)), E, H, I, dense_format(dtype), "cpu")
    for layer in range(layers):
        for name, per_layer in st.banks.items():
            per_layer[layer].normal_(0, 0.02)
    st.pin_host(1 << 62)
    return st


def fetch_gbs(rt, layers, E, iters=3) -> float:
    """Fill every slot with misses through the runtime's Copier; GB/s of expert bytes."""
    best = float("inf")
    for it in range(iters):
        rt.resize(rt.residency.num_slots)  # cold cache: every copy is a miss
        items = [(layer, e) for layer in range(layers) for e in range(E)][:rt.residency.num_slots]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for layer in range(layers):
            batch = [(l, e, rt.residency.access((l, e))[0]) for l, e in items if l == layer]
            rt.copier.copy(rt.pool, batch)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return len(items) * rt.store.bytes_per_expert() / best / 1e9


def decode_loop(rt, layers, E, H, steps, dtype) -> dict:
    x = torch.randn(1, H, device="cuda", dtype=dtype)
    g = torch.Generator().manual_seed(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        rt.begin_step({"decode": True})
        for layer in range(layers):
            ids = torch.randperm(E, generator=g)[:8].view(1, 8).cuda()
            w = torch.full((1, 8), 0.125, device="cuda", dtype=dtype)
            rt.forward(layer, x, ids, w)
        rt.end_step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    t = rt.stats()["total"]
    return {"s": dt, "hit_rate": rt.stats()["hit_rate"], "bytes": t["bytes_h2d"], "gbs": t["bytes_h2d"] / dt / 1e9}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    dt = torch.bfloat16
    st = make_store(a.layers, a.experts, a.hidden, a.inter, dt)
    pinned = h2d_gbs(st.bank(0), min(64, a.experts), torch.device("cuda"), True, 5)
    rt = build_runtime("offload", st, torch.device("cuda"), RuntimeOptions(cache_slots=a.slots, prefetch=False))
    fetch = fetch_gbs(rt, a.layers, a.experts)
    print(f"{torch.cuda.get_device_name()}  expert {a.hidden}x{a.inter} bf16 "
          f"({st.bytes_per_expert() / 2**20:.2f} MiB)")
    print(f"pinned H2D (bench bw) {pinned:.2f} GB/s | miss fetch (Copier) {fetch:.2f} GB/s | ratio {fetch / pinned:.2f}")
    d = decode_loop(rt, a.layers, a.experts, a.hidden, a.steps, dt)
    print(f"decode loop: {a.steps} steps x {a.layers} layers, top-8 of {a.experts}, {a.slots} slots: "
          f"hit rate {d['hit_rate']:.3f}, {d['bytes'] / 1e9:.2f} GB in {d['s']:.3f} s = {d['gbs']:.2f} GB/s")


if __name__ == "__main__":
    main()
