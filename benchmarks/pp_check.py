"""Prefill (pp512) and decode of one GGUF with the prefix cache on and off, per backend: where prefill time
goes when the cache splits a hybrid model's prompt at its last page boundary (issue 19 / 13).

    PYTHONPATH=$PWD python3 benchmarks/pp_check.py MODEL.gguf [fused] [offload:22.84] ... [--ab: prefix cache on, then off]
"""
from __future__ import annotations

import json
import sys
import time

import torch


def main() -> None:
    from moestream import LLM, SamplingParams

    args = [a for a in sys.argv[1:] if a != "--ab"]
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
            llm.generate([prompt(8)], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
            llm.generate([prompt(8)], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
            mem = {k: round(v / 2**30, 3) for k, v in llm.engine.memory_report().items()}
            rec = {"backend": backend, "cap": cap, "prefix_cache": cache, "pp512": pps,
                   "tg": llm.last_timing["decode_tok_s"], "load_s": load, "memory_gib": mem}
            print(json.dumps(rec), flush=True)
            out.append(rec)
            del llm
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
