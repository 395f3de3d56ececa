"""Prefill (pp512) and decode of one GGUF with the prefix cache on and off, per backend: where prefill time
goes when the cache splits a hybrid model's prompt at its last page boundary (issue 19 / 13).

    PYTHONPATH=$PWD python3 benchmarks/pp_check.py MODEL.gguf [fused] [offload:22.84] ... [--ab: prefix cache on, then off]
        [--profile FILE: one more pp512 under torch.profiler; the top CUDA and CPU ops by total time to FILE]
"""
from __future__ import annotations

import json
import sys
import time

import torch


def main() -> None:
    from moestream import LLM, SamplingParams

    argv = list(sys.argv[1:])
    prof_out = None
    if "--profile" in argv:
        i = argv.index("--profile")
        prof_out = argv[i + 1]
        del argv[i:i + 2]
    args = [a for a in argv if a != "--ab"]
    path, specs = args[0], args[1:] or ["fused"]
    g = torch.Generator().manual_seed(0)
    out = []
    for spec in specs:
        backend, _, cap = spec.partition(":")
        for cache in ((True, False) if "--ab" in sys.argv else (True,)):
            t = time.perf_counter()
            llm = LLM(path, device="cuda", moe_backend=backend, gpu_memory_gb=float(cap) if cap else None,
                      max_running_requests=4, max_seq_len_override=1024, chunked_prefill_size=2048,
                      prefix_cache=cache)
            load = time.perf_counter() - t
            vocab = llm.model_config.vocab_size
            sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
            prompt = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
            llm.generate([prompt(512)], sp)
            pps, steps = [], []
            for _ in range(3):
                llm.generate([prompt(512)], sp)
                pps.append(llm.last_timing["prefill_tok_s"])
            if prof_out:
                profile(llm, prompt(512), sp, f"{prof_out}.{backend}{cap}.txt")
            llm.generate([prompt(8)], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
            llm.generate([prompt(8)], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
            mem = {k: round(v / 2**30, 3) for k, v in llm.engine.memory_report().items()}
            rec = {"backend": backend, "cap": cap, "prefix_cache": cache, "pp512": pps,
                   "tg": llm.last_timing["decode_tok_s"], "load_s": load, "memory_gib": mem}
            print(json.dumps(rec), flush=True)
            out.append(rec)
            del llm
            torch.cuda.empty_cache()


def profile(llm, ids, sp, path: str) -> None:
    """One prefill of `ids` under torch.profiler: the ops with the most CUDA time, then the most CPU time."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([ids], sp)
        torch.cuda.synchronize()
    avg = prof.key_averages()
    text = (f"pp{len(ids)} {llm.last_timing['prefill_tok_s']:.0f} tok/s under the profiler\n"
            + avg.table(sort_by="device_time_total", row_limit=30) + "\n"
            + avg.table(sort_by="cpu_time_total", row_limit=25))
    with open(path, "w") as f:
        f.write(text)
    print(text[:3000], flush=True)


if __name__ == "__main__":
    main()
