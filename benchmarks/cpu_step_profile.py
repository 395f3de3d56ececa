"""Where a CPU decode step's compiled call spends its time, part by part, against each part's read-bandwidth bound.

    PYTHONPATH=$PWD python benchmarks/cpu_step_profile.py [--threads 2] [--model moe|file:PATH.gguf] [--tokens 300]
        [--context 8] [--gbs 26]

Loads the GGUF (`moe`: cpu_vs_llama.py's tiny Qwen3-MoE Q4_K_M, written here) on the CPU as cpu_vs_llama.py does,
decodes --tokens greedy tokens after --context prompt tokens once to warm up, then again with the compiled decode
calls' profile on (decode.cpp's ms_decode_profile: wall-clock seconds of each part between the calling thread's
marks, so a parallel part includes its region's start and end) and the one-call step (CpuDecodePlan.logits) timed
around it. Per part: µs per decode step, the weight bytes it reads per step (from the file's tensor sizes; routed
experts: top-k of E per layer, the shared one whole) and those bytes at --gbs GB/s (this 2-core VM: ~26 with 2
threads, 12.9 with 1).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PARTS = ["embed", "norms", "qkv", "q/k norm+rope+kv", "attention", "o_proj", "router", "top-k", "experts", "shared",
         "residual add", "gdn in_proj", "gdn conv+recurrence", "gdn out_proj", "dense mlp", "head"]


def part_bytes(path: Path) -> dict[str, float]:
    """Weight bytes a decode step of one row reads per part, from the GGUF's tensor sizes."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    kv = {f.name: f for f in r.fields.values()}
    arch = bytes(kv["general.architecture"].parts[-1]).decode()
    top_k = int(kv[f"{arch}.expert_used_count"].parts[-1][0]) if f"{arch}.expert_used_count" in kv else 0
    out: dict[str, float] = {}
    for t in r.tensors:
        n, b = t.name, float(t.n_bytes)
        if n.startswith("token_embd"):
            part, b = "embed", b / int(t.shape[-1])  # one row (gguf's shape is [cols, rows])
        elif n == "output.weight":
            part = "head"
        elif any(k in n for k in ("attn_q.", "attn_k.", "attn_v.", "attn_qkv.")):
            part = "qkv"
        elif "attn_output" in n:
            part = "o_proj"
        elif "ffn_gate_inp" in n and "shexp" not in n:
            part = "router"
        elif "_exps" in n:
            part, b = "experts", b * top_k / int(t.shape[-1])
        elif "shexp" in n:
            part = "shared"
        elif "ssm_" in n or "attn_gate" in n:
            part = "gdn in_proj" if "ssm_out" not in n else "gdn out_proj"
        elif n.startswith("blk.") and any(k in n for k in ("ffn_gate.", "ffn_up.", "ffn_down.")):
            part = "dense mlp"
        else:
            continue
        out[part] = out.get(part, 0.0) + b
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="moe", help="moe (cpu_vs_llama.py's tiny Qwen3-MoE) or file:PATH.gguf")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--context", type=int, default=8)
    ap.add_argument("--gbs", type=float, default=26.0, help="read bandwidth for the bound column (GB/s)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype: float32 on CPU), float16 or fp8")
    args = ap.parse_args(argv)
    import cpu_vs_llama
    from moestream import LLM, SamplingParams
    from moestream.kernels import cpu_quant
    from moestream.models import cpu_decode

    path = Path(args.model[5:]) if args.model.startswith("file:") else \
        cpu_vs_llama.write_moe_gguf(Path(tempfile.mkdtemp()) / "qwen3moe-q4_k_m.gguf")[0]
    torch.set_num_threads(args.threads)
    llm = LLM(str(path), device="cpu", moe_backend="cpu", moe_cpu_threads=args.threads, prefix_cache=False,
              kv_cache_dtype=args.kv_cache_dtype)
    sp = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    vocab = llm.model_config.vocab_size
    prompt = [10 + i % (vocab - 10) for i in range(args.context)]  # any context length, ids in the vocabulary
    calls = []
    orig = cpu_decode.CpuDecodePlan.logits

    def timed(self, batch):
        t0 = time.perf_counter()
        out = orig(self, batch)
        calls.append(time.perf_counter() - t0)
        return out

    cpu_decode.CpuDecodePlan.logits = timed
    llm.generate([prompt], sp)  # warm-up: kernels built, caches filled
    calls.clear()
    mod = cpu_quant.module()
    n = mod.ms_decode_profile(1, None, None)
    t0 = time.perf_counter()
    llm.generate([prompt], sp)
    wall = time.perf_counter() - t0
    secs, counts = np.zeros(n), np.zeros(n, dtype=np.int64)
    mod.ms_decode_profile(0, secs.ctypes.data, counts.ctypes.data)
    steps = len(calls)
    nbytes = part_bytes(path) if args.model == "moe" or path.suffix == ".gguf" else {}
    print(f"{steps} one-call steps; step (wall / tokens) {wall / args.tokens * 1e3:.3f} ms; "
          f"plan.logits {np.median(calls) * 1e3:.3f} ms median, compiled parts {secs.sum() / steps * 1e3:.3f} ms")
    print(f"{'part':22s} {'µs/step':>8s} {'calls':>6s} {'KB read':>8s} {'bound µs':>9s}")
    for i, name in enumerate(PARTS[:n]):
        if not counts[i]:
            continue
        b = nbytes.get(name, 0.0)
        print(f"{name:22s} {secs[i] / steps * 1e6:8.1f} {counts[i] / steps:6.1f} {b / 1e3:8.1f} "
              f"{b / (args.gbs * 1e9) * 1e6:9.1f}")
    total = sum(nbytes.values())
    print(f"{'all weights':22s} {secs.sum() / steps * 1e6:8.1f} {'':6s} {total / 1e3:8.1f} "
          f"{total / (args.gbs * 1e9) * 1e6:9.1f}")
    if not args.model.startswith("file:"):
        path.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
