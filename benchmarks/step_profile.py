"""Where one recorded decode step's GPU time goes, kernel by kernel (CUDA only).

    PYTHONPATH=$PWD python3 benchmarks/step_profile.py --model /path/model.gguf --backend fused [--gpu-memory-gb 24]
    PYTHONPATH=$PWD python3 benchmarks/step_profile.py --random --backend fused      # Qwen3.6 shape, random bf16

Decodes a few tokens (so the batch-1 step of its KV bucket is recorded as a CUDA graph), then replays
that graph alone N times: under CUDA events (the step's GPU time) and under the torch profiler (every
kernel inside the graph, by name: launches per step, µs per step). The gap between the step's time and
the sum of its kernels' times is the per-kernel overhead of the graph (launch latency, tails).
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch


def load(args):
    from moestream import LLM

    kw = dict(device="cuda", moe_backend=args.backend, max_running_requests=4)
    if args.gpu_memory_gb:
        kw["gpu_memory_gb"] = args.gpu_memory_gb
    if args.random:
        import decode_sweep

        return LLM(dict(decode_sweep.QWEN36), dtype="bfloat16", **kw)
    return LLM(args.model, **kw)


def step_graph(llm):
    graphs = getattr(llm.engine, "graphs", None)
    entries = [e for (b, _), e in (graphs.entries.items() if graphs else []) if b == 1 and e.graph is not None]
    return entries[-1].graph if entries else None


def kernel_table(graph, reps: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    agg = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[ev.name[:90]]
            a[0] += 1
            a[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    rows = [{"kernel": k, "per_step": c / reps, "us_per_step": t / reps} for k, (c, t) in agg.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--random", action="store_true")
    ap.add_argument("--backend", default="fused")
    ap.add_argument("--gpu-memory-gb", type=float, default=0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    from moestream import SamplingParams

    llm = load(args)
    vocab = llm.model_config.vocab_size
    ids = torch.randint(0, vocab, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    llm.generate([ids], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    t = llm.last_timing
    tok_s = t["decode_tokens"] / t["decode_s"] if t["decode_s"] else 0.0
    g = step_graph(llm)
    out = {"backend": args.backend, "cap_gb": args.gpu_memory_gb, "decode_tok_s_bs1": tok_s}
    if g is None:
        print(json.dumps({**out, "graph": None}))
        return
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.reps):
        g.replay()
    torch.cuda.synchronize()
    out["replay_ms"] = (time.perf_counter() - t0) / args.reps * 1e3
    rows = kernel_table(g, args.reps)
    out["kernels_per_step"] = sum(r["per_step"] for r in rows)
    out["kernel_ms_per_step"] = sum(r["us_per_step"] for r in rows) / 1e3
    out["top"] = rows[:30]
    print(f"{args.backend} cap={args.gpu_memory_gb}: decode {tok_s:.1f} tok/s; replay {out['replay_ms']:.2f} ms/step, "
          f"{out['kernels_per_step']:.0f} kernels = {out['kernel_ms_per_step']:.2f} ms of kernel time")
    for r in rows[:30]:
        print(f"  {r['us_per_step']:9.1f} us  x{r['per_step']:6.1f}  {r['kernel']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
