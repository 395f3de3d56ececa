"""Where one recorded decode step's GPU time goes, kernel by kernel (CUDA only).

    PYTHONPATH=$PWD python3 benchmarks/step_profile.py --model /path/model.gguf --backend fused [--gpu-memory-gb 24]
    PYTHONPATH=$PWD python3 benchmarks/step_profile.py --random --backend fused      # Qwen3.6 shape, random bf16
    PYTHONPATH=$PWD python3 benchmarks/step_profile.py --model F.gguf --backend fused --prefill 512   # a prompt

Decodes a few tokens (so the batch-1 step of its KV bucket is recorded as a CUDA graph), then replays
that graph alone N times (--rows 1,4: the batch-4 step's graph too): under CUDA events (the step's GPU time)
and under the torch profiler (every kernel inside the graph, by name: launches per step, µs per step). The gap
between the step's time and the sum of its kernels' times is the per-kernel overhead of the graph (launch
latency, tails).
--steps N profiles N whole batch-1 decode steps instead of a replay (any backend; cpu and hybrid need it: their
graph waits on the CPU expert worker, which only a real step serves): wall ms a step, kernels by name, the CPU
worker's compute ms a step, and what is left (the GPU waiting for the CPU beyond its compute, handoffs, host).
--prefill N profiles one N-token prompt instead (kernels by GPU time, host ops by self CPU time): where the
all-resident Q4_K_M prefill (2,895 tok/s against llama.cpp's 4,955 on the H200) spends its time.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch


def load(args):
    from moestream import LLM

    kw = dict(device=args.device, moe_backend=args.backend, max_running_requests=4, overlap_schedule=args.overlap)
    if args.gpu_memory_gb:
        kw["gpu_memory_gb"] = args.gpu_memory_gb
    if args.random:
        import decode_sweep

        return LLM(dict(decode_sweep.QWEN36), dtype="bfloat16", **kw)
    return LLM(args.model, **kw)


def step_graph(llm, rows: int = 1):
    """The last recorded decode graph of `rows` rows (None: none recorded)."""
    graphs = getattr(llm.engine, "graphs", None)
    entries = [e for (b, *_), e in (graphs.entries.items() if graphs else []) if b == rows and e.graph is not None]
    return entries[-1].graph if entries else None


def kernel_table(graph, reps: int) -> list[dict]:
    return profiled(lambda: [graph.replay() for _ in range(reps)], reps)[0]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profiled(run, reps: int, cpu: bool = False) -> tuple[list[dict], list[dict]]:
    """(GPU kernels by name: launches and µs per rep, most time first; with cpu, the host's top-level torch ops by
    self CPU time per rep) of run() under the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()
    acts = ([ProfilerActivity.CUDA] if gpu else []) + ([ProfilerActivity.CPU] if cpu or not gpu else [])
    with profile(activities=acts) as prof:
        run()
        sync()
    agg, host = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[ev.name[:90]]
            a[0] += 1
            a[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        elif cpu:
            a = host[ev.name[:90]]
            a[0] += 1
            a[1] += ev.self_cpu_time_total
    rows = [{"kernel": k, "per_step": c / reps, "us_per_step": t / reps} for k, (c, t) in agg.items()]
    ops = [{"op": k, "calls": c / reps, "self_cpu_us": t / reps} for k, (c, t) in host.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"]), sorted(ops, key=lambda r: -r["self_cpu_us"])


def prefill_profile(llm, args) -> None:
    """--prefill N: one N-token prompt's prefill (max_tokens 1) after a warm-up prompt of the same length: wall
    time, GPU kernel time (sum of kernels; the gap to the wall is the host's and the copies' waits), top kernels
    and top host ops."""
    from moestream import SamplingParams

    vocab = llm.model_config.vocab_size
    g = torch.Generator().manual_seed(4)
    prompt = lambda: torch.randint(0, vocab, (args.prefill,), generator=g).tolist()  # noqa: E731
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate([prompt()], sp)  # kernels compiled, autotuned
    p = prompt()
    sync()
    t0 = time.perf_counter()
    llm.generate([p], sp)
    sync()
    wall = time.perf_counter() - t0
    kernels, ops = profiled(lambda: llm.generate([prompt()], sp), 1, cpu=True)
    gpu_ms = sum(r["us_per_step"] for r in kernels) / 1e3
    out = {"backend": args.backend, "cap_gb": args.gpu_memory_gb, "prefill_tokens": args.prefill,
           "wall_ms": wall * 1e3, "prefill_tok_s": args.prefill / wall, "kernel_ms": gpu_ms,
           "kernels": sum(r["per_step"] for r in kernels), "top_kernels": kernels[:30], "top_host_ops": ops[:25]}
    print(f"{args.backend} cap={args.gpu_memory_gb}: {args.prefill}-token prefill {wall * 1e3:.1f} ms "
          f"({out['prefill_tok_s']:.0f} tok/s); {out['kernels']:.0f} kernels = {gpu_ms:.1f} ms of kernel time")
    for r in kernels[:30]:
        print(f"  {r['us_per_step']:9.1f} us  x{r['per_step']:6.1f}  {r['kernel']}")
    print("  host ops (self CPU time):")
    for r in ops[:25]:
        print(f"  {r['self_cpu_us']:9.1f} us  x{r['calls']:6.1f}  {r['op']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def steady(llm, args, out: dict) -> None:
    """--steady N: end-to-end decode of N tokens at batch 1 and 4 with the graphs already recorded (tok/s, ms a
    step, and the host's share: ms a step above the replay's GPU time), then the host ops of a batch-1 decode
    (self CPU time per token, top 25): where a step's time outside the GPU goes."""
    from moestream import SamplingParams

    vocab = llm.model_config.vocab_size
    g = torch.Generator().manual_seed(5)
    sp = SamplingParams(max_tokens=args.steady, temperature=0, ignore_eos=True)
    for B in (1, 4):
        prompts = [torch.randint(0, vocab, (64,), generator=g).tolist() for _ in range(B)]
        llm.generate(prompts, sp)  # this batch size's graphs recorded, kernels tuned
        llm.generate(prompts, sp)
        t = llm.last_timing
        agg = t["decode_tokens"] / t["decode_s"] if t["decode_s"] else 0.0
        step_ms = B / agg * 1e3 if agg else 0.0
        out[f"steady_bs{B}"] = {"tok_s": agg, "step_ms": step_ms}
        print(f"  steady decode bs{B}: {agg:.1f} tok/s aggregate, {step_ms:.2f} ms a step")
    out["host_ms_bs1"] = out["steady_bs1"]["step_ms"] - out["replay_ms"]
    print(f"  bs1 step {out['steady_bs1']['step_ms']:.2f} ms - replay {out['replay_ms']:.2f} ms = "
          f"{out['host_ms_bs1']:.2f} ms of host time a step; bs4/bs1 "
          f"{out['steady_bs4']['tok_s'] / max(out['steady_bs1']['tok_s'], 1e-9):.2f}")
    from moestream.scheduler.request import Request

    n = 32
    eng = llm.llm_engine
    req = Request("host-ops", torch.randint(0, vocab, (64,), generator=g).tolist(),
                  SamplingParams(max_tokens=n + 8, temperature=0, ignore_eos=True))
    eng.add_request(req)
    while len(req.output_ids) < 2:  # the prefill and the first decode steps (an overlapped step started) first
        eng.step()
    _, ops = profiled(lambda: [eng.step() for _ in range(n)], n, cpu=True)
    while eng.has_work():
        eng.step()
    out["host_ops_bs1"] = ops[:25]
    print("  host ops of batch-1 decode steps alone (self CPU us a step, 32 steps):")
    for r in ops[:25]:
        print(f"  {r['self_cpu_us']:9.1f} us  x{r['calls']:6.1f}  {r['op']}")


def stepped_profile(llm, args) -> dict:
    """--steps N: N batch-1 decode steps of one request, end to end, under the torch profiler (GPU kernels), after
    they ran once unprofiled for their wall time; the MoE runtime's counters over the same steps. The kernels that
    wait on the CPU worker (the bridge's collect) are totalled apart: their time is the worker's compute plus the
    handoffs; the rest of the kernel time is the GPU's own work."""
    from moestream import SamplingParams
    from moestream.scheduler.request import Request

    vocab = llm.model_config.vocab_size
    g = torch.Generator().manual_seed(6)
    eng, rt, n = llm.llm_engine, llm.engine.runtime, args.steps

    def run_steps(tag: str, profile: bool):
        req = Request(tag, torch.randint(0, vocab, (64,), generator=g).tolist(),
                      SamplingParams(max_tokens=n + 8, temperature=0, ignore_eos=True))
        eng.add_request(req)
        while len(req.output_ids) < 3:  # the prefill and the first decode steps (graphs recorded, overlap started)
            eng.step()
        sync()
        before = dict(rt.stats()["total"])
        t0 = time.perf_counter()
        if profile:
            rows, _ = profiled(lambda: [eng.step() for _ in range(n)], n)
        else:
            for _ in range(n):
                eng.step()
            rows = []
        sync()
        wall = (time.perf_counter() - t0) / n
        after = dict(rt.stats()["total"])
        while eng.has_work():
            eng.step()
        delta = {k: (after[k] - before.get(k, 0)) / n for k in after if isinstance(after[k], (int, float))}
        return wall, rows, delta

    llm.generate([torch.randint(0, vocab, (64,), generator=g).tolist()],  # warm: graphs, tuning, hybrid's share
                 SamplingParams(max_tokens=max(n, 160), temperature=0, ignore_eos=True))  # (its exploration: ~112 steps)
    wall, _, delta = run_steps("steps-wall", False)
    pwall, rows, _ = run_steps("steps-prof", True)
    kernel_ms = sum(r["us_per_step"] for r in rows) / 1e3
    wait_ms = sum(r["us_per_step"] for r in rows if "collect" in r["kernel"]) / 1e3
    cpu_ms = delta.get("cpu_s", 0.0) * 1e3
    out = {"backend": args.backend, "cap_gb": args.gpu_memory_gb, "steps": n, "step_ms": wall * 1e3,
           "tok_s": 1 / wall, "profiled_step_ms": pwall * 1e3, "kernel_ms": kernel_ms,
           "kernels_per_step": sum(r["per_step"] for r in rows), "collect_ms": wait_ms,
           "gpu_own_ms": kernel_ms - wait_ms, "cpu_compute_ms": cpu_ms,
           "handoff_ms": wait_ms - cpu_ms if wait_ms else 0.0, "gpu_idle_ms": pwall * 1e3 - kernel_ms,
           # the worker's side: waiting for the GPU's requests, and its own grouping + answering around each call
           "cpu_wait_ms": delta.get("cpu_wait_s", 0.0) * 1e3, "cpu_handoff_ms": delta.get("cpu_handoff_s", 0.0) * 1e3,
           "per_step_counters": delta, "top": rows[:30]}
    print(f"{args.backend} cap={args.gpu_memory_gb}: {n} batch-1 steps, {out['step_ms']:.2f} ms a step "
          f"({out['tok_s']:.1f} tok/s; {out['profiled_step_ms']:.2f} profiled); kernels {kernel_ms:.2f} ms "
          f"({out['kernels_per_step']:.0f}) = GPU's own {out['gpu_own_ms']:.2f} + collect (waiting on the CPU) "
          f"{wait_ms:.2f}; CPU worker computing {cpu_ms:.2f} ms, waiting for requests {out['cpu_wait_ms']:.2f}, "
          f"grouping / answering {out['cpu_handoff_ms']:.2f}; GPU without a kernel {out['gpu_idle_ms']:.2f} ms")
    print("  counters a step: " + ", ".join(f"{k} {v:.4g}" for k, v in delta.items() if v))
    for r in rows[:30]:
        print(f"  {r['us_per_step']:9.1f} us  x{r['per_step']:6.1f}  {r['kernel']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--random", action="store_true")
    ap.add_argument("--backend", default="fused")
    ap.add_argument("--gpu-memory-gb", type=float, default=0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    ap.add_argument("--prefill", type=int, default=0, help="profile one prompt of this many tokens instead")
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a smoke test of --prefill)")
    ap.add_argument("--overlap", default="auto", help="--overlap-schedule (auto, on, off)")
    ap.add_argument("--steady", type=int, default=0, help="then N-token decodes at batch 1 and 4, and their host ops")
    ap.add_argument("--rows", default="1", help="the recorded decode steps replayed, by rows: e.g. 1,4 (bs1 first)")
    ap.add_argument("--steps", type=int, default=0, help="profile N whole decode steps instead of a replay (cpu, hybrid)")
    args = ap.parse_args()
    from moestream import SamplingParams

    llm = load(args)
    if args.prefill:
        prefill_profile(llm, args)
        return
    if args.steps:
        out = stepped_profile(llm, args)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
        return
    vocab = llm.model_config.vocab_size
    gen = torch.Generator().manual_seed(3)
    out = {"backend": args.backend, "cap_gb": args.gpu_memory_gb}
    for B in sorted({int(b) for b in args.rows.split(",")}):  # the batch-1 step first: the keys without a suffix
        ids = [torch.randint(0, vocab, (64,), generator=gen).tolist() for _ in range(B)]
        llm.generate(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        t = llm.last_timing
        tok_s = t["decode_tokens"] / t["decode_s"] if t["decode_s"] else 0.0
        g = step_graph(llm, B)
        sfx = "" if B == 1 else f"_bs{B}"
        out[f"decode_tok_s_bs{B}"] = tok_s
        if g is None:
            print(json.dumps({**out, f"graph{sfx}": None}))
            continue
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.reps):
            g.replay()
        torch.cuda.synchronize()
        out["replay_ms" + sfx] = (time.perf_counter() - t0) / args.reps * 1e3
        rows = kernel_table(g, args.reps)
        out["kernels_per_step" + sfx] = sum(r["per_step"] for r in rows)
        out["kernel_ms_per_step" + sfx] = sum(r["us_per_step"] for r in rows) / 1e3
        out["top" + sfx] = rows[:30]
        print(f"{args.backend} cap={args.gpu_memory_gb} rows {B}: decode {tok_s:.1f} tok/s aggregate; replay "
              f"{out['replay_ms' + sfx]:.2f} ms/step, {out['kernels_per_step' + sfx]:.0f} kernels = "
              f"{out['kernel_ms_per_step' + sfx]:.2f} ms of kernel time")
        for r in rows[:30]:
            print(f"  {r['us_per_step']:9.1f} us  x{r['per_step']:6.1f}  {r['kernel']}")
    if "replay_ms" not in out:
        return
    if args.steady:
        steady(llm, args, out)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
