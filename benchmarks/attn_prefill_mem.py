"""Prefill attention of one chunk after a long cached context, Qwen3.6 heads (16 query / 2 KV heads of 256), on CUDA:
peak memory above the pool and time per chunk of the gathered path (kv_rows of the whole context, then SDPA in query
slices), of the paged prefill kernel (layers/attn_prefill.py, the engine's choice once K/V pass GATHER_BYTES) and of
the torch key blocks (Attention._attend_blocks, its fallback).
  python benchmarks/attn_prefill_mem.py [--chunk 2048] [--contexts 30720,63488,129024,260096] [--dtype bf16|fp8]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from moestream.layers import attention as am
from moestream.layers import attn_prefill
from moestream.layers.attention import Attention, kv_rows


def measure(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()  # warm
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    peak = torch.cuda.max_memory_allocated() - base
    return out, ms, peak / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--contexts", default="6144,30720,63488,129024,260096")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--out")
    a = ap.parse_args()
    H, Hk, D = 16, 2, 256
    attn = Attention(H * D, H, Hk, D, 1e-6, False, False, True)
    kvd = torch.bfloat16 if a.dtype == "bf16" else torch.float8_e4m3fn
    rows = []
    for cached in (int(c) for c in a.contexts.split(",")):
        S = cached + a.chunk
        torch.manual_seed(0)
        kp = torch.randn(S, Hk, D, device="cuda").to(kvd)
        vp = torch.randn(S, Hk, D, device="cuda").to(kvd)
        index = torch.arange(S, device="cuda")
        q = torch.randn(a.chunk, H, D, device="cuda", dtype=torch.bfloat16)
        gathered = lambda: attn._attend(q, kv_rows(kp, index, q.dtype), kv_rows(vp, index, q.dtype), cached)
        blocked = lambda: attn._attend_blocks(q, kp, vp, index, cached)
        kernel = lambda: attn_prefill.prefill_attention(q, kp, vp, index, cached, attn.scale)
        r = {"cached": cached, "chunk": a.chunk, "kv_dtype": a.dtype,
             "kv_gather_mib": 2 * S * Hk * D * 2 / 2**20, "takes_blocks": 2 * S * Hk * D * 2 > am.GATHER_BYTES}
        try:
            o1, r["gathered_ms"], r["gathered_peak_mib"] = measure(gathered)
        except torch.OutOfMemoryError as e:  # pragma: no cover
            o1, r["gathered_error"] = None, str(e)[:120]
        torch.cuda.empty_cache()
        o2, r["blocked_ms"], r["blocked_peak_mib"] = measure(blocked)
        o3, r["kernel_ms"], r["kernel_peak_mib"] = measure(kernel)
        r["tflops_kernel"] = round(4 * a.chunk * H * D * (cached + a.chunk / 2) / (r["kernel_ms"] * 1e-3) / 1e12, 1)
        if o1 is not None:
            r["blocked_max_diff"] = float((o1.float() - o2.float()).abs().max())
            r["kernel_max_diff"] = float((o1.float() - o3.float()).abs().max())
        print(json.dumps(r), flush=True)
        rows.append(r)
        del kp, vp, q, o1, o2, o3
        torch.cuda.empty_cache()
    if a.out:
        json.dump(rows, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
