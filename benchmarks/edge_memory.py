"""Memory at the edge (issue 17): per `--gpu-memory-gb` cap, the longest prompt the plan allows (up to --prompt),
then decode (and the same prompt again: decode at that context with its graphs recorded, prefill from the
prefix cache), then batch-4 decode, with the peak device memory measured against the cap and the plan's total.

    python benchmarks/edge_memory.py MODEL.gguf --caps 4,8,12,24 [--prompt 32768] [--decode 32] [--backend auto]
        [--json OUT.json] [--md OUT.md]

Each cap runs in its own process (a fresh CUDA context: the driver's reservations of one cap's run must not
count for the next). Reported per cap: the plan (backend, expert slots, KV tokens, the chunked-prefill size it
chose, its byte split and total = budget parts + CUDA context + headroom), the prompt length run (the plan's
context less the decode, at most --prompt), TTFT (the prefill's seconds), decode tok/s at batch 1 after that
prompt and at batch 4 after short prompts, and memory: peak device memory in use (all of the process: sampled
every 20 ms by a thread calling cudaMemGetInfo, plus after each phase), torch's peak reserved bytes, the CUDA
stack limit (a raised limit reserves memory outside torch; benchmarks/mem_probe.py), and an out-of-memory or a
refused plan as the result when that is what happened, and host memory at load (RSS and its parts next to the
expert banks and how much of them is the checkpoint's mapping: `host_at_load_gib`). The target: peak <= cap, and the plan's total within 5% of
the peak. On a CPU (a dry run) the caps are not applied and memory is not measured.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class PeakSampler:
    """Device memory in use (cudaMemGetInfo: every process on the GPU) sampled on a thread every `period` s."""

    def __init__(self, device, period: float = 0.02):
        import torch

        self.torch, self.device, self.period = torch, device, period
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        free, total = self.torch.cuda.mem_get_info(self.device)
        self.peak = max(self.peak, total - free)
        return total - free

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def __enter__(self):
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()


def one(args) -> dict:
    import torch

    from moestream import LLM, SamplingParams

    cuda = args.device.startswith("cuda")
    cap = float(args.one)
    rec: dict = {"cap_gib": cap, "backend_asked": args.backend, "kv_cache_dtype": args.kv_cache_dtype,
                 "lm_head_quant": args.lm_head_quant}
    gib = lambda n: round(n / 2**30, 3)  # noqa: E731
    t = time.perf_counter()
    try:
        llm = LLM(args.model, device=args.device, dtype="bfloat16" if cuda else "float32", moe_backend=args.backend,
                  gpu_memory_gb=cap if cuda else None, max_running_requests=4,
                  max_seq_len_override=args.prompt + args.decode + 16, kv_cache_dtype=args.kv_cache_dtype,
                  lm_head_quant=args.lm_head_quant)
    except Exception as e:  # a refused plan is a result
        rec.update(error=f"{type(e).__name__}: {e}", load_s=time.perf_counter() - t)
        return rec
    rec["load_s"] = round(time.perf_counter() - t, 1)
    eng = llm.engine
    plan = eng.plan
    b = plan.bytes
    parts = {k: getattr(b, k) for k in ("dense", "state", "workspace", "experts_device", "prefill_buffer", "kv")}
    rec["plan"] = {"backend": plan.backend, "reason": plan.reason, "cache_slots": plan.cache_slots,
                   "residency": round(plan.residency, 4), "kv_tokens": plan.kv_tokens,
                   "chunked_prefill_size": eng.ecfg.chunked_prefill_size, "max_seq_len": eng.max_seq_len,
                   "bytes_gib": {k: gib(v) for k, v in parts.items()}, "context_gib": gib(b.context),
                   "total_gib": gib(sum(parts.values()) + b.context)}
    hm = getattr(eng, "host_memory", None) or {}
    rec["host_at_load_gib"] = {k: gib(v) for k, v in hm.items() if isinstance(v, (int, float))}
    print(plan.describe(), flush=True)
    vocab = llm.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    sp = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    n = max(1, min(args.prompt, plan.kv_tokens, eng.max_seq_len) - args.decode - 1)
    rec["prompt_tokens"] = n
    phases = rec["phases"] = {}
    sampler = PeakSampler(eng.device) if cuda else None

    def mark(name: str, **kw) -> None:
        d = dict(kw)
        if cuda:
            from mem_probe import stack_limit

            torch.cuda.synchronize()
            d.update(device_used_gib=gib(sampler.sample()), torch_max_reserved_gib=gib(torch.cuda.max_memory_reserved()),
                     stack_limit=stack_limit())
        phases[name] = d
        print(f"  {name}: {d}", flush=True)

    try:
        if cuda:
            sampler.__enter__()
        llm.generate([ids(8)], sp(2))  # kernels, graphs
        mark("warm")
        prompt = ids(n)
        llm.generate([prompt], sp(args.decode))
        tm = llm.last_timing
        mark("long_prompt", ttft_s=round(tm["prefill_s"], 3), prefill_tok_s=round(tm["prefill_tok_s"], 1),
             decode_tok_s=round(tm["decode_tok_s"], 2))
        # the same prompt again: its decode graphs (one per KV-length bucket) are recorded now, so this is the
        # decode rate at that context (the first run's includes recording them); its prefill is a prefix-cache hit
        llm.generate([prompt], sp(args.decode))
        tm = llm.last_timing
        mark("long_again", ttft_s=round(tm["prefill_s"], 3), decode_tok_s=round(tm["decode_tok_s"], 2))
        llm.generate([ids(64) for _ in range(4)], sp(args.decode))
        mark("bs4", decode_tok_s=round(llm.last_timing["decode_tok_s"], 2))
    except Exception as e:  # out of memory inside a request is a result too
        rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    finally:
        if cuda:
            sampler.__exit__()
            rec["peak_device_used_gib"] = gib(sampler.peak)
            rec["peak_over_cap"] = rec["peak_device_used_gib"] > cap
            rec["plan_total_vs_peak"] = round(rec["plan"]["total_gib"] / max(rec["peak_device_used_gib"], 1e-9), 3)
    return rec


def table(results: list[dict]) -> str:
    rows = ["| cap GiB | backend | slots (residency) | KV tokens | prompt run | TTFT s | decode tok/s bs1 / bs4 | "
            "decode again tok/s (TTFT s) | peak used GiB | plan total GiB (÷ peak) | stack limit | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        p, ph = r.get("plan") or {}, r.get("phases") or {}
        lp, b4, again = ph.get("long_prompt", {}), ph.get("bs4", {}), ph.get("long_again", {})
        rows.append(
            f"| {r['cap_gib']} | {p.get('backend', '–')} | {p.get('cache_slots', '–')} ({p.get('residency', '–')}) | "
            f"{p.get('kv_tokens', '–')} | {r.get('prompt_tokens', '–')} | {lp.get('ttft_s', '–')} | "
            f"{lp.get('decode_tok_s', '–')} / {b4.get('decode_tok_s', '–')} | "
            f"{again.get('decode_tok_s', '–')} ({again.get('ttft_s', '–')}) | {r.get('peak_device_used_gib', '–')} | "
            f"{p.get('total_gib', '–')} ({r.get('plan_total_vs_peak', '–')}) | "
            f"{max((v.get('stack_limit', 0) for v in ph.values()), default='–')} | {r.get('error', '')[:80]} |")
    return "\n".join(rows)


def main() -> None:
    from mem_probe import run_isolated

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--caps", default="4,8,12,24")
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument("--kv-cache-dtype", default="auto", help="as serve's (fp8: e4m3, half a bf16 cache)")
    ap.add_argument("--lm-head-quant", default="none", help="as serve's (q8_0: a 16-bit head stored as Q8_0)")
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("@@result " + json.dumps(one(args)), flush=True)
        return
    results = []
    for cap in args.caps.split(","):
        cmd = [sys.executable, __file__, args.model, "--one", cap, "--prompt", str(args.prompt), "--decode",
               str(args.decode), "--backend", args.backend, "--device", args.device, "--kv-cache-dtype",
               args.kv_cache_dtype, "--lm-head-quant", args.lm_head_quant]
        print(f"== cap {cap} GiB", flush=True)
        rec = run_isolated(cmd, args.timeout, {"cap_gib": float(cap)})
        results.append(rec)
        if "error" in rec:
            print("  error:", rec["error"][-800:], flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        if args.md:
            Path(args.md).write_text(table(results) + "\n")
    print(table(results), flush=True)


if __name__ == "__main__":
    main()
