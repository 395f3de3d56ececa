"""CPU-only engine speed at the Qwen3.6-35B-A3B layer shape, fewer layers so it fits a small machine.

    PYTHONPATH=$PWD python3 benchmarks/cpu_engine.py [--layers 4] [--prompts 512,2048] [--out F]

Random bf16 weights made in memory (hidden 2048, 256 experts top-8, I = 512, 3 GDN : 1 attention, vocab
248,320); prefill tok/s for each prompt length and decode tok/s at batch 1 and 4, each measured twice in
the same process: with moestream.kernels.linear as it is (16-bit weights widened to float32 for 16+ rows
where the CPU has no native 16-bit GEMMs) and with torch's own 16-bit kernel forced ("native")."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_sweep import QWEN36  # noqa: E402
from moestream import LLM, SamplingParams  # noqa: E402
from moestream import hardware  # noqa: E402


def run(llm, prompts: list[int], vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    for n in prompts:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        t = time.perf_counter()
        llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        out[f"prefill_{n}_tok_s"] = n / (time.perf_counter() - t)
    for bs in (1, 4):
        ps = [torch.randint(0, vocab, (32,), generator=g).tolist() for _ in range(bs)]
        llm.generate(ps, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        t = llm.last_timing
        out[f"decode_bs{bs}_tok_s"] = t["decode_tokens"] / t["decode_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", default="512,2048")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = {**QWEN36, "num_hidden_layers": args.layers,
           "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * (args.layers // 4)
           + ["linear_attention"] * (args.layers % 4)}
    t = time.perf_counter()
    llm = LLM(cfg, device="cpu", dtype="bfloat16", max_running_requests=4, num_tokens=8192, max_seq_len_override=8192)
    res = {"date": time.strftime("%Y-%m-%d"), "layers": args.layers, "threads": torch.get_num_threads(),
           "native_bf16": hardware.cpu_has_native(torch.bfloat16), "torch": torch.__version__}
    print(f"built {args.layers} layers in {time.perf_counter() - t:.0f} s; native bf16 GEMM: {res['native_bf16']}",
          flush=True)
    prompts = [int(p) for p in args.prompts.split(",")]
    llm.generate([[1] * 32], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm up
    res["as_is"] = run(llm, prompts, cfg["vocab_size"])
    print("as is ", json.dumps(res["as_is"]), flush=True)
    real = hardware.cpu_has_native
    hardware.cpu_has_native = lambda dtype: True
    try:
        res["native"] = run(llm, prompts, cfg["vocab_size"])
    finally:
        hardware.cpu_has_native = real
    print("native", json.dumps(res["native"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
