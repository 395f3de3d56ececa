"""Decode sweep at full Qwen3.6-35B-A3B shape on capped VRAM, against the roofline of DESIGN.md §6.

Run on the GPU machine (device tool), from the repo root:
    PYTHONPATH=$PWD python3 benchmarks/decode_sweep.py --out $OUT/sweep.json
Local smoke test of the same code path on CPU with a tiny shape:
    python benchmarks/decode_sweep.py --tiny --device cpu
`--model FILE` measures a checkpoint (e.g. the Qwen3.6-shaped Q4_K_M GGUF) instead of random bf16 weights.
Under routing locality (random weights route uniformly): `--trace synthetic:qwen36` (a preset of
moe/synth.py made for this model's shape, one stream per request) or `--trace FILE` (a recorded trace of a
model of this shape): every decode step's top-k ids are forced from the trace (moe/trace.py RouteForcer).

The model is built in memory with random bf16 weights (LLM(config_dict)); routed experts live in host
banks and the expert plan is re-made for every (backend, VRAM cap) on the same weights
(Engine.reconfigure_experts), so the 60 GiB of experts are made once.

For every run: decode tok/s per request and aggregate, prefill tok/s and TTFT of a 2k-token prompt,
hit rate, bytes per token over PCIe, achieved PCIe GB/s, CPU expert GB/s, the bound and measured/bound.
Bound per decoded token (bs=1), with A = routed expert bytes a token touches, D = dense bytes read per
token, h = hit rate and bandwidths measured in this run:
    offload/hybrid: T >= (D + h A) / B_vram + (1 - h) A / B_pcie     (hybrid: min over the split)
    cpu:            T >= max(D / B_vram, A / B_dram)
    fused:          T >= (D + A) / B_vram
"""
from __future__ import annotations

import argparse
import json
import logging
import time

import torch

QWEN36 = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "vocab_size": 248320, "hidden_size": 2048,
    "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "layer_types": ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(40)],
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "torch_dtype": "bfloat16",
}
TINY = {**QWEN36, "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "head_dim": 32, "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_experts": 16,
        "num_experts_per_tok": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "max_position_embeddings": 8192}


def measure_bandwidths(device: torch.device) -> dict:
    """B_vram (device copy, read+write), B_pcie (pinned H2D, 6 MiB chunks), B_dram (host read)."""
    out = {}
    host = torch.empty(512 << 20, dtype=torch.uint8)
    host.random_(0, 255)
    t = time.perf_counter()
    for _ in range(3):
        host.view(torch.float32).sum()
    out["dram_gbs"] = 3 * host.numel() / (time.perf_counter() - t) / 1e9
    if device.type != "cuda":
        return out
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    out["vram_gbs"] = 10 * 2 * a.numel() / (time.perf_counter() - t) / 1e9
    del a, b
    chunk = 6 << 20
    src = torch.empty(256 * chunk, dtype=torch.uint8).pin_memory()
    dst = torch.empty(256 * chunk, dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(256):
        dst[i * chunk:(i + 1) * chunk].copy_(src[i * chunk:(i + 1) * chunk], non_blocking=True)
    torch.cuda.synchronize()
    out["pcie_gbs"] = 256 * chunk / (time.perf_counter() - t) / 1e9
    del src, dst
    torch.cuda.empty_cache()  # the engine built next plans on the device's free memory
    return out


def totals(llm) -> dict:
    return dict(llm.engine.runtime.stats()["total"])


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}


def decode_run(llm, bs: int, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    from moestream import SamplingParams

    g = torch.Generator().manual_seed(bs)
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(bs)]
    sp = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    # warm the cache with as many tokens as the measured run: a run right after a plan is rebuilt otherwise measures the
    # slot cache filling (eighteenth session: hit 0.71 at batch 1 with 99.8 % of the experts resident)
    llm.generate(prompts, SamplingParams(max_tokens=max(4, new_tokens), temperature=0, ignore_eos=True))
    before = totals(llm)
    llm.generate(prompts, sp)
    d = delta(totals(llm), before)
    t = llm.last_timing
    agg = t["decode_tokens"] / t["decode_s"] if t["decode_s"] else 0.0
    return {"bs": bs, "decode_tok_s_agg": agg, "decode_tok_s_per_req": agg / bs, "stats": d,
            "decode_s": t["decode_s"], "decode_tokens": t["decode_tokens"], "graph_replay_ms": replay_ms(llm, bs)}


def replay_ms(llm, bs: int) -> float | None:
    """GPU time of one recorded decode step of this batch size (replayed alone): the step's time
    without the host's share (scheduling, sampling, detokenizing)."""
    graphs = getattr(llm.engine, "graphs", None)
    rt = llm.engine.runtime
    if graphs is None or not rt.capturable() or graphs.owner != (id(rt), getattr(rt, "epoch", 0)):
        return None  # no graphs recorded for this runtime (old ones point at freed memory)
    entries = [e for (b, *_), e in graphs.entries.items() if b == bs and e.graph is not None]
    if not entries:
        return None
    g = entries[-1].graph
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        g.replay()  # replays advance KV/state of finished requests' slots only: harmless here
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / 10 * 1e3


def prefill_run(llm, n: int, vocab: int) -> dict:
    from moestream import SamplingParams

    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(99)).tolist()
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0]
    t = llm.last_timing
    return {"prefill_tok_s": t["prefill_tok_s"], "ttft_s": out.ttft_s}


def bound_s(backend: str, h: float, A: float, D: float, bw: dict) -> float | None:
    vram, pcie, dram = bw.get("vram_gbs"), bw.get("pcie_gbs"), bw.get("dram_gbs")
    if not vram:
        return None
    vram, pcie, dram = vram * 1e9, (pcie or 0) * 1e9, dram * 1e9
    if backend == "fused":
        return (D + A) / vram
    if backend == "cpu":
        return max(D / vram, A / dram)
    t_off = (D + h * A) / vram + (1 - h) * A / pcie
    if backend == "offload":
        return t_off
    # hybrid: misses split so PCIe and CPU finish together
    miss = (1 - h) * A
    return (D + h * A) / vram + miss / (pcie + dram)


def summarize(run: dict, backend: str, A: float, D: float, bw: dict, steps_tokens: int) -> dict:
    s = run["stats"]
    hits, misses = s.get("hits", 0), s.get("misses", 0)
    h = hits / (hits + misses) if hits + misses else (1.0 if backend == "fused" else 0.0)
    toks = max(run["decode_tokens"], 1)
    copy_s = s.get("copy_s", 0.0)
    # the measured generate() also prefills its prompts: their streamed experts are not decode traffic
    bpe = A / (8 * 40)
    decode_bytes = s.get("bytes_h2d", 0) - (s.get("prefill_streamed", 0) + s.get("prefill_lookahead", 0)) * bpe
    run.update({
        "hit_rate": h,
        "pcie_bytes_per_token": decode_bytes / toks,
        "pcie_gbs_achieved": decode_bytes / run["decode_s"] / 1e9 if run["decode_s"] else 0.0,
        "copy_busy_gbs": s.get("bytes_h2d", 0) / copy_s / 1e9 if copy_s else None,
        "cpu_expert_gbs": s.get("cpu_experts", 0) * A / (8 * 40) / run["decode_s"] / 1e9 if run["decode_s"] else 0.0,
        # the CPU worker's rate while it computes (its waits for the GPU's requests left out)
        "cpu_busy_gbs": s.get("cpu_experts", 0) * A / (8 * 40) / s["cpu_s"] / 1e9 if s.get("cpu_s") else None,
        "cpu_busy_share": s["cpu_s"] / run["decode_s"] if s.get("cpu_s") and run["decode_s"] else None,
    })
    if run["bs"] == 1:
        b = bound_s(backend, h, A, D, bw)
        run["bound_tok_s"] = 1.0 / b if b else None
        run["measured_over_bound"] = run["decode_tok_s_agg"] / run["bound_tok_s"] if b else None
    return run


def profile_decode(llm, vocab: int, steps: int = 6) -> None:
    """Where one decode step's time goes: torch profiler, top ops by self CPU and CUDA time."""
    from moestream import SamplingParams

    ids = torch.randint(0, vocab, (32,), generator=torch.Generator().manual_seed(5)).tolist()
    llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    graphs = getattr(llm.engine, "graphs", None)
    if graphs is not None:
        graphs.enabled = False  # profile the kernels the graph would replay
    with profile(activities=acts) as prof:
        llm.generate([ids], SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    if graphs is not None:
        graphs.enabled = True
    key = "self_cpu_time_total" if not torch.cuda.is_available() else "self_device_time_total"
    try:
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
    except Exception:  # older torch names the column cuda
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))


def force_routes(llm, spec: str, streams: int, tokens: int = 1024, rows_per_request: int = 1,
                 by_position: bool = False, draft: bool = False) -> None:
    """Drive decode routing from a trace file or a synthetic preset made for this model's main layers (an MTP
    block's layer keeps its router; draft with by_position: a synthetic trace made for the MTP layers too, which
    then route the drafter's passes with the same locality); rows_per_request > 1: verify steps' rows;
    by_position: RouteForcer's mode that routes a token alike in any step (speculative runs)."""
    from moestream.moe import synth
    from moestream.moe.trace import RouteForcer, read_trace

    mc, rt = llm.model_config, llm.engine.runtime
    layers = [layer for layer in rt.store.moe_layers
              if layer not in rt.ctx.lookahead.draft_layers or (draft and by_position)]
    if spec.startswith("synthetic:"):
        p = synth.preset(spec.split(":", 1)[1], num_layers=len(layers), num_experts=mc.num_experts,
                         top_k=mc.top_k, bytes_per_expert=rt.store.bytes_per_expert(), batch=streams, tokens=tokens)
        trace = synth.generate(p, moe_layers=layers)
    else:
        trace = read_trace(spec)
    rows = llm.engine_config.max_running_requests * rows_per_request
    llm.engine.set_route_tap(RouteForcer(trace, llm.engine.device, max_rows=rows, by_position=by_position,
                                         streams=streams if by_position else None))
    print(f"decode routing forced from {spec}" + (" by token position" if by_position else ""), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--model", help="a checkpoint (e.g. the Qwen3.6-shaped Q4_K_M GGUF) instead of random bf16 weights")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--caps", default="24,12,8")
    ap.add_argument("--backends", default="offload,hybrid,cpu")
    ap.add_argument("--batch", default="1,4,6")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--no-fused", action="store_true")
    ap.add_argument("--out", default="sweep.json")
    ap.add_argument("--profile", action="store_true", help="profile decode at the first (backend, cap)")
    ap.add_argument("--prefetch", default="off", help="on, off or on,off (each (backend, cap) run with each)")
    ap.add_argument("--cpu-threads", default="0", help="--moe-cpu-threads values, e.g. 0,15 (cpu/hybrid runs with each)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (--disable-cuda-graph)")
    ap.add_argument("--decode-kernel", default="auto", help="auto, pairs or grouped (--moe-decode-kernel)")
    ap.add_argument("--trace", default=None,
                    help="force decode routing from a trace: FILE, or synthetic:PRESET (qwen36, qwen36-skewed, uniform)")
    ap.add_argument("--cache-policy", default="lru", help="--moe-cache-policy (lru keeps the device-side cache)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from moestream import LLM

    cfg = TINY if args.tiny else QWEN36
    dev = torch.device(args.device)
    bw = measure_bandwidths(dev)  # before any engine: a capped engine's allocator could not hold its buffers
    print("bandwidths", json.dumps(bw), flush=True)
    t0 = time.perf_counter()
    first_backend = args.backends.split(",")[0]
    first_cap = float(args.caps.split(",")[0]) if dev.type == "cuda" and first_backend != "fused" else None
    llm = LLM(args.model or cfg, device=args.device, **({} if args.model else {"dtype": "bfloat16"}), moe_backend=first_backend, gpu_memory_gb=first_cap,
              max_running_requests=6, num_tokens=32768, chunked_prefill_size=2048, max_seq_len_override=8192,
              cuda_graphs=not args.eager, moe_decode_kernel=args.decode_kernel, moe_cache_policy=args.cache_policy)
    print(f"built model in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.trace:
        force_routes(llm, args.trace, max(int(x) for x in args.batch.split(",")))
    mc = llm.model_config
    store = llm.engine.runtime.store
    A = mc.top_k * mc.num_moe_layers * store.bytes_per_expert()
    embed = mc.vocab_size * mc.hidden_size * 2
    D = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters()) - embed
    results = {"date": time.strftime("%Y-%m-%d"), "model": args.model or "random bf16", "bandwidths": bw, "A_bytes": A, "D_bytes": D,
               "trace": args.trace, "cache_policy": args.cache_policy,
               "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "runs": []}
    threads = [int(x) for x in args.cpu_threads.split(",")]
    plan = [(b, None if b == "fused" else float(c), pf, th) for b in args.backends.split(",")
            for c in (args.caps.split(",") if b != "fused" else ["0"]) for pf in args.prefetch.split(",")
            for th in (threads if b in ("cpu", "hybrid") else [0])]
    if not args.no_fused:
        plan.append(("fused", None, "off", 0))
    for backend, cap, prefetch, th in plan:
        t = time.perf_counter()
        try:
            p = llm.engine.reconfigure_experts(moe_backend=backend, gpu_memory_gb=cap if dev.type == "cuda" else None,
                                               moe_cache_size=None, moe_prefetch=prefetch, moe_cpu_threads=th)
        except Exception as e:  # a plan that does not fit is a result too
            print(f"{backend} cap {cap}: {type(e).__name__}: {e}", flush=True)
            results["runs"].append({"backend": backend, "cap_gb": cap, "error": str(e)})
            continue
        pre = prefill_run(llm, args.prefill, mc.vocab_size)
        for bs in (int(x) for x in args.batch.split(",")):
            r = decode_run(llm, bs, 32, args.new_tokens, mc.vocab_size)
            r = summarize(r, backend, A, D, bw, args.new_tokens)
            r.update(backend=backend, cap_gb=cap, prefetch=prefetch, cpu_threads=p.cpu_threads, slots=p.cache_slots if hasattr(p, "cache_slots") else None,
                     residency=p.residency, **(pre if bs == 1 else {}))
            results["runs"].append(r)
            print(json.dumps(r), flush=True)
        print(f"{backend} cap {cap}: {time.perf_counter() - t:.0f} s", flush=True)
        if args.profile and (backend, cap, prefetch, th) == plan[0] and not results.get("profiled"):
            results["profiled"] = True
            profile_decode(llm, mc.vocab_size)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print_table(results)


def print_table(results: dict) -> None:
    print(f"\n{'backend':8} {'cap':>5} {'bs':>3} {'tok/s agg':>9} {'tok/s/req':>9} {'hit':>5} {'MB/tok':>7} "
          f"{'PCIe GB/s':>9} {'CPU GB/s':>8} {'thr':>3} {'prefill':>8} {'TTFT s':>7} {'bound':>7} {'meas/bnd':>8} {'replay ms':>9}")
    for r in results["runs"]:
        if "error" in r:
            print(f"{r['backend']:8} {r['cap_gb']!s:>5}  error: {r['error'][:80]}")
            continue
        f = lambda v, spec: format(v, spec) if isinstance(v, (int, float)) else "-"
        print(f"{r['backend'] + ('' if r.get('prefetch', 'on') == 'on' else '-nopf'):8} {f(r['cap_gb'], '5.0f')} {r['bs']:3d} {r['decode_tok_s_agg']:9.1f} "
              f"{r['decode_tok_s_per_req']:9.1f} {r['hit_rate']:5.2f} {r['pcie_bytes_per_token'] / 1e6:7.1f} "
              f"{r['pcie_gbs_achieved']:9.1f} {f(r.get('cpu_expert_gbs'), '8.1f')} {f(r.get('cpu_threads'), '3d')} {f(r.get('prefill_tok_s'), '8.0f')} {f(r.get('ttft_s'), '7.2f')} "
              f"{f(r.get('bound_tok_s'), '7.1f')} {f(r.get('measured_over_bound'), '8.2f')} "
              f"{f(r.get('graph_replay_ms'), '9.2f')}")


if __name__ == "__main__":
    main()
