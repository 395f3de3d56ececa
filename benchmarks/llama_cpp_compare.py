"""moestream vs llama.cpp, side by side, on tiny random-weight GGUF files.

llama.cpp is an independent implementation of the GGUF conventions moestream's loader undoes
(llama's q/k row permutation, Qwen3.5's (1 + w) norms, A = -exp(A_log), squeezed conv1d and the
tiled Gated DeltaNet value-head order), so agreeing with it checks those conversions on files laid
out the way its own converter lays them out (tests/gguf_writer.py).

For each architecture (llama, qwen3moe, qwen35moe) and weight type (F32 as the control, Q8_0,
Q4_K), the script writes a tiny GGUF with an embedded tokenizer, encodes a text prompt with both
tokenizers (reported), then feeds the same prompt token ids to both engines and decodes N tokens
greedily:
- moestream: `moestream.LLM` on CPU in fp32, temperature 0, EOS ignored;
- llama.cpp: `llama_cpp.Llama.eval` step by step, taking the argmax of the last position's logits
  (what temperature 0 / top_k=1 picks), f32 KV cache.
Logits are compared on identical contexts: moestream is run teacher-forced over llama.cpp's tokens,
so every step has a (max |diff|, argmax agreement, top-1/top-2 margin) even after the greedy
tokens part ways. F32 files are the control: no quantization anywhere, so any layout mistake shows.

On quantized files llama.cpp's CPU backend also rounds activations to 8 bits before each quantized
matmul, which moestream does not. To show that this is the whole difference, moestream is run again
with that rounding emulated, and then once more with 1e-6 relative noise added before the rounding
(the size of the float32 differences between any two implementations), which measures the noise
floor that rounding itself sets. llama.cpp is also compared with itself (the same contexts in one
batch vs token by token) and its sampler at temperature 0 / top_k=1 with the argmax used here.

Run:  python benchmarks/llama_cpp_compare.py [--new-tokens 32]
Needs the test extras (transformers, libgguf) and llama-cpp-python, which is not a moestream
dependency (`pip install llama-cpp-python` builds llama.cpp); without it the script says so and exits.
Writes benchmarks/results/llama_cpp_compare.json and .md.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import importlib.util
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. It was 1999, and é 中文 <|im_end|> done."
ARCHS = ("llama", "qwen3moe", "qwen35moe")
QTYPES = ("F32", "Q8_0", "Q4_K")
JITTER = 1e-6  # relative input noise for the rounding noise floor (the engines' activations differ by ~3e-7-1e-6)


# ---- tiny models ------------------------------------------------------------------------------
# Every matrix row length (hidden 256, intermediate/expert/shared 256, attention and value widths
# 256) is a multiple of 256, so every 2-D weight can be Q4_K (super-blocks of 256).

def build_hf(arch: str, out: Path, seed: int) -> Path:
    import tiny_models

    if arch == "qwen3moe":
        # no dense layer (mlp_only_layers): llama.cpp's qwen3moe wants a router in every layer
        tiny_models.make_qwen3_moe(out, seed=seed, hidden_size=256, intermediate_size=256, mlp_only_layers=[],
                                   moe_intermediate_size=256, head_dim=64)
    elif arch == "qwen35moe":
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [3, 3, 2], "mrope_interleaved": True}  # 64 * 0.25 / 2 = 8 frequencies
        tiny_models.make_qwen3_5_moe(out, layout="causal", seed=seed, hidden_size=256, head_dim=64,
                                     moe_intermediate_size=256, shared_expert_intermediate_size=256,
                                     linear_key_head_dim=64, linear_value_head_dim=64, rope_parameters=rope)
    else:
        _make_llama(out, seed)
    _scale_to_width(out)
    return out


def _scale_to_width(out: Path) -> None:
    """tiny_models draws weights with std 0.2, sized for width 64; at width 256 that doubles every
    projection's gain, so activations grow layer after layer and small perturbations grow with them.
    Halve the projections (not embeddings, lm_head, routers or the conv kernel) to keep the designed gain."""
    from safetensors.torch import save_file

    import tiny_models

    sd = tiny_models.read_state_dict(out)
    keep = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "conv1d.weight")
    sd = {k: (t.clone() if t.dim() < 2 or k.endswith(keep) else t * 0.5).contiguous() for k, t in sd.items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


def _make_llama(out: Path, seed: int) -> None:
    """A tiny dense Llama with tied embeddings (like SmolLM2), weights drawn like tiny_models'."""
    import transformers

    import tiny_models
    from moestream.demo_tokenizer import build_tokenizer

    vocab = build_tokenizer(out)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    tiny_models._reinit(model, seed)
    model.save_pretrained(out)


def write_gguf(hf_dir: Path, out: Path, qtype_name: str) -> Path:
    """tests/gguf_writer.py's layout (llama.cpp's converter conventions) with quantizers for every
    type: gguf.quants for Q8_0, libgguf (llama.cpp's own reference quantizers) for Q4_K."""
    import gguf
    import libgguf

    import gguf_writer as gw
    import tiny_models

    Q = gguf.GGMLQuantizationType
    qtype = Q[qtype_name]
    cfg = json.loads((hf_dir / "config.json").read_text())
    tc = cfg.get("text_config", cfg)
    arch = gw.ARCH[cfg["architectures"][0]]
    w = gguf.GGUFWriter(str(out), arch)
    gw._metadata(w, arch, tc, cfg, hf_dir)
    if arch == "qwen35moe":  # llama.cpp requires the M-RoPE sections (text-only positions make them moot)
        w.add_array(arch + ".rope.dimension_sections", [*tc["rope_parameters"]["mrope_section"], 0])

    def add(name: str, t: torch.Tensor, leaf: str) -> None:
        q = gw._qtype_for(t, leaf, qtype)
        arr = t.float().contiguous().numpy()
        if q == Q.F32:
            w.add_tensor(name, arr)
        elif q == Q.Q8_0:
            w.add_tensor(name, gguf.quants.quantize(arr, q), raw_dtype=q)
        else:
            raw = libgguf.quantize_rows(arr.reshape(-1, arr.shape[-1]), libgguf.GGMLQuantizationType[q.name])
            w.add_tensor(name, raw.reshape(*arr.shape[:-1], -1), raw_dtype=q)

    sd = tiny_models.read_state_dict(hf_dir)
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in sd.items():
        local = name.removeprefix("model.")
        if ".mlp.experts." in local:
            _, layer, _, _, e, proj, _ = local.split(".")
            experts.setdefault((int(layer), proj), {})[int(e)] = t
            continue
        gname, leaf = gw._gguf_name(local, arch)
        add(gname, gw._to_gguf_layout(arch, leaf, t.float(), tc), leaf)
    for (layer, proj), per in sorted(experts.items()):
        add(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight",
            torch.stack([per[e] for e in sorted(per)]).float(), "exps")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# ---- the two engines --------------------------------------------------------------------------

def run_moestream(path: Path, prompt: list[int], n: int) -> dict:
    from moestream import LLM, SamplingParams
    from test_engine_parity import full_logits

    t0 = time.perf_counter()
    llm = LLM(path, device="cpu", dtype="float32")
    out = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
    return {"llm": llm, "tokens": list(out.token_ids), "seconds": time.perf_counter() - t0,
            "logits_on": lambda ids: full_logits(llm, ids)}


def run_llama_cpp(llama_cpp, path: Path, prompt: list[int], n: int) -> dict:
    t0 = time.perf_counter()
    # logits_all: llama-cpp-python keeps logits in .scores only then; type 0 = GGML_TYPE_F32 KV cache
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + n + 8, n_batch=512, n_threads=os.cpu_count(),
                          seed=0, logits_all=True, type_k=0, type_v=0, verbose=False)
    llm.reset()
    llm.eval(prompt)
    tokens, logits = [], []
    for _ in range(n):
        z = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        logits.append(z)
        tok = int(z.argmax())
        tokens.append(tok)
        llm.eval([tok])
    seconds = time.perf_counter() - t0
    # llama.cpp's own sampler at temperature 0 / top_k 1 must pick the same tokens as the argmax above
    llm.reset()
    sampled = list(itertools.islice(llm.generate(prompt, top_k=1, temp=0.0), n))
    # llama.cpp against itself: the same contexts in one batch instead of one token at a time
    llm.reset()
    llm.eval(prompt + tokens[:-1])
    batched = np.array(llm.scores[len(prompt) - 1:len(prompt) + n - 1], dtype=np.float32)
    return {"llm": llm, "tokens": tokens, "logits": np.stack(logits), "batched_logits": batched, "seconds": seconds,
            "sampler_tokens": sampled}


# ---- llama.cpp's activation rounding, emulated ------------------------------------------------
# ggml's CPU backend multiplies a quantized weight by activations quantized to its "vec_dot_type":
# Q8_0 blocks of 32 (scale stored as fp16) for Q8_0 weights, Q8_K blocks of 256 (fp32 scale) for
# K-quants. Rounding the inputs of moestream's matching Linear layers the same way should bring
# its logits onto llama.cpp's if that rounding is the whole difference.

def _q8_round(x, block: int, fp16_scale: bool):
    """ggml's float32 steps: q = round-half-even(x * (127 / amax)); value = q * scale, where the scale is
    fp16(amax / 127) for Q8_0 and 1 / (127 / amax) for Q8_K."""
    b = x.float().reshape(-1, block)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(b * inv).clamp(-127, 127)
    scale = (amax / 127).half().float() if fp16_scale else torch.where(amax > 0, 1 / inv, torch.zeros_like(inv))
    return (q * scale).reshape(x.shape).to(x.dtype)


def emulated_logits(ms: dict, path: Path, qtype: str, ids: list[int], jitter: float = 0.0):
    """moestream's logits with llama.cpp's activation rounding on every matmul whose GGUF weight is
    quantized; returns (logits, hooked Linear count, quantized GGUF tensors not covered).
    jitter > 0 multiplies each rounded input by (1 + jitter * N(0, 1)) first: float32-sized noise, to
    measure how far rounding alone amplifies the differences any two float implementations have."""
    from moestream.models.gguf_loader import open_gguf

    ckpt = open_gguf(path)
    quantized = {t.name for t in ckpt.reader.tensors if ckpt.reader.type_name(t) not in ("F32", "F16", "BF16")}
    by_hf = {ckpt._hf_name(n) or n: n for n in quantized if n != "token_embd.weight"}  # token_embd: an exact row lookup
    if ckpt.config_dict()["tie_word_embeddings"] and "token_embd.weight" in quantized:
        by_hf["lm_head.weight"] = "token_embd.weight"  # ... and the tied output head's matmul
    block, fp16 = (32, True) if qtype == "Q8_0" else (256, False)
    gen = torch.Generator().manual_seed(0)

    def rnd(x):
        if jitter:
            x = x * (1 + jitter * torch.randn(x.shape, generator=gen, dtype=x.dtype))
        return _q8_round(x, block, fp16)

    hook = lambda mod, args: (rnd(args[0]), *args[1:])  # noqa: E731
    handles, covered = [], set()
    for name, mod in ms["llm"].engine.model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name + ".weight" in by_hf:
            handles.append(mod.register_forward_pre_hook(hook))
            covered.add(by_hf[name + ".weight"])
    # Routed experts kept in GGUF blocks run through moestream.quant.qlinear (QuantizedExpertFormat):
    # wrap it for this pass only.
    import moestream.quant as mq

    plain, expert_calls = mq.qlinear, []

    def rounded_qlinear(x, *args, **kw):
        expert_calls.append(1)
        return plain(rnd(x), *args, **kw)

    mq.qlinear = rounded_qlinear
    try:
        z = ms["logits_on"](ids)
    finally:
        mq.qlinear = plain
        for h in handles:
            h.remove()
    if expert_calls:
        covered |= {n for n in quantized if n.endswith("_exps.weight")}
    return z, len(handles), sorted(set(by_hf.values()) - covered)


# ---- comparison -------------------------------------------------------------------------------

def compare(arch: str, qtype: str, path: Path, prompt: list[int], n: int, llama_cpp) -> dict:

    ms = run_moestream(path, prompt, n)
    lc = run_llama_cpp(llama_cpp, path, prompt, n)
    context = prompt + lc["tokens"][:-1]  # llama.cpp's context at every step; moestream teacher-forced on it
    steps = slice(len(prompt) - 1, None)
    theirs = torch.from_numpy(lc["logits"])

    def versus(z: torch.Tensor) -> dict:
        return {"max_abs": float((z - theirs).abs().max()), "rel": float((z - theirs).norm() / theirs.norm()),
                "argmax_agree": int((z.argmax(-1) == theirs.argmax(-1)).sum())}

    ours = ms["logits_on"](context)[steps]
    diff = (ours - theirs).abs().amax(-1)
    top2 = ours.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    first = next((i for i, (a, b) in enumerate(zip(ms["tokens"], lc["tokens"])) if a != b), None)
    res = {
        "arch": arch, "qtype": qtype, "file_bytes": path.stat().st_size, "steps": n,
        "tokens_equal": ms["tokens"] == lc["tokens"], "first_divergence": first,
        "moestream_tokens": ms["tokens"], "llama_cpp_tokens": lc["tokens"],
        "llama_cpp_sampler_equals_argmax": lc["sampler_tokens"] == lc["tokens"],
        "logit_std": float(theirs.std()), "median_margin": float(margin.median()),
        "moestream_vs_llama_cpp": versus(ours),
        # llama.cpp against itself: the same contexts in one batch instead of token by token
        "llama_cpp_batched_vs_stepwise": versus(torch.from_numpy(lc["batched_logits"])),
        "per_step_max_abs_diff": [round(float(d), 6) for d in diff],
        "per_step_margin": [round(float(m), 6) for m in margin],
        "argmax_disagreements": [{"step": i, "margin": round(float(margin[i]), 4),
                                  "max_abs_diff": round(float(diff[i]), 4)}
                                 for i in range(n) if ours[i].argmax() != theirs[i].argmax()],
        "moestream_s": round(ms["seconds"], 2), "llama_cpp_s": round(lc["seconds"], 2),
    }
    if first is not None:
        res["divergence"] = {"margin": float(margin[first]), "margin_in_logit_std": float(margin[first] / theirs.std()),
                             "max_abs_diff": float(diff[first])}
    if qtype != "F32":
        emu, hooked, missed = emulated_logits(ms, path, qtype, context)
        jit = emulated_logits(ms, path, qtype, context, jitter=JITTER)[0][steps]
        emu = emu[steps]
        res["emulated_rounding_vs_llama_cpp"] = {**versus(emu), "hooked_linears": hooked, "not_emulated": missed}
        if first is not None:
            res["divergence"]["emulated_picks_llama_cpp_token"] = bool(emu[first].argmax() == theirs[first].argmax())
        res["rounding_noise_floor"] = {"jitter": JITTER, "max_abs": float((jit - emu).abs().max()),
                                       "rel": float((jit - emu).norm() / emu.norm())}
    return res


def tokenization(path: Path, llama_cpp) -> dict:
    from moestream.models.gguf_loader import open_gguf

    ours = open_gguf(path).tokenizer().encode(PROMPT_TEXT)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, vocab_only=True, verbose=False)
    theirs = llm.tokenize(PROMPT_TEXT.encode(), add_bos=False, special=True)
    return {"text": PROMPT_TEXT, "moestream": ours, "llama_cpp": theirs, "equal": ours == theirs}


# ---- report -----------------------------------------------------------------------------------

def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}


def versions(llama_cpp) -> dict:
    from importlib.metadata import version


    ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    ggml.ggml_version.restype = ggml.ggml_commit.restype = ctypes.c_char_p
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {"moestream": f"{version('moestream')} ({commit.stdout.strip() or 'no git'})", "torch": torch.__version__,
            "gguf": version("gguf"), "libgguf": version("libgguf"), "llama_cpp_python": llama_cpp.__version__,
            "ggml": f"{ggml.ggml_version().decode()} (llama.cpp {ggml.ggml_commit().decode()})",
            "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode().strip()}


def table(results: list[dict]) -> list[str]:
    rows = ["| arch | weights | same tokens (first divergence) | argmax agree | max abs / rel logit diff | "
            "rel diff (argmax agree), llama.cpp rounding emulated | rounding noise floor (rel) | "
            "llama.cpp batch vs step (rel) | "
            "top-2 margin at divergence (in logit std) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        v = r["moestream_vs_llama_cpp"]
        same = "yes" if r["tokens_equal"] else f"no ({r['first_divergence']})"
        e = r.get("emulated_rounding_vs_llama_cpp")
        emu = "-" if e is None else f"{e['rel']:.1e} ({e['argmax_agree']}/{r['steps']})"
        floor = f"{r['rounding_noise_floor']['rel']:.1e}" if "rounding_noise_floor" in r else "-"
        div = r.get("divergence")
        at_div = "-" if div is None else f"{div['margin']:.3f} ({div['margin_in_logit_std']:.2f})"
        rows.append(f"| {r['arch']} | {r['qtype']} | {same} | {v['argmax_agree']}/{r['steps']} | "
                    f"{v['max_abs']:.2g} / {v['rel']:.1e} | {emu} | {floor} | "
                    f"{r['llama_cpp_batched_vs_stepwise']['rel']:.1e} | {at_div} |")
    return rows


def reading(results: list[dict]) -> list[str]:
    """Statements derived from the numbers: what each difference is."""
    out = []
    f32 = [r for r in results if r["qtype"] == "F32"]
    if f32:
        worst = max(r["moestream_vs_llama_cpp"]["rel"] for r in f32)
        ok = all(r["tokens_equal"] for r in f32)
        out.append(f"- **F32 files** (nothing quantized): relative logit difference at most {worst:.1e}; same tokens: "
                   f"{'all' if ok else 'NOT all'}. "
                   + ("That is float32 rounding between two implementations: the GGUF conventions moestream undoes "
                      "(llama q/k permutation; Qwen3.5 tiled value heads, (1 + w) norms, A = -exp(A_log), conv1d, "
                      "M-RoPE sections) are read the way llama.cpp reads them." if ok and worst < 1e-4 else
                      "This is more than float32 rounding: a layout disagreement to investigate."))
    quant = [r for r in results if r["qtype"] != "F32"]
    if quant:
        def span(key):
            vals = [r[key]["rel"] for r in quant]
            return f"{min(vals):.1e} to {max(vals):.1e}"
        out.append(
            f"- **Quantized files**: relative logit difference {span('moestream_vs_llama_cpp')}. moestream dequantizes "
            "the weights exactly and computes in float32; llama.cpp's CPU backend also rounds the activations "
            "before every dot product with a quantized weight (to Q8_0 blocks of 32 for Q8_0 weights, Q8_K blocks "
            "of 256 for Q4_K). Rounding moestream's matmul inputs the same way (forward pre-hooks on its Linear "
            f"layers and on the routed experts' qlinear) leaves {span('emulated_rounding_vs_llama_cpp')}.")
        above = [f"{r['arch']} {r['qtype']}" for r in quant
                 if r["emulated_rounding_vs_llama_cpp"]["rel"] > r["rounding_noise_floor"]["rel"]]
        out.append(
            "- Rounding noise floor: with the rounding emulated, multiplying every rounded input by "
            f"(1 + {JITTER:g} N(0,1)) (float32-sized noise, about what separates any two float implementations) "
            f"moves moestream's own logits by {span('rounding_noise_floor')}: a value sitting near a rounding "
            "boundary goes one quantum up in one engine and down in the other, the random model amplifies it, and in "
            "the MoE models it can also flip an expert choice. "
            + ("Every remainder above is within that floor of its file, so it is rounding noise, not a model "
               "difference." if not above else
               f"The remainder EXCEEDS that floor for {', '.join(above)}: not explained by rounding, investigate.")
            + " llama.cpp shows the same noise against itself: its logits for the same contexts computed in one batch "
            "vs token by token differ by "
            + ", ".join(f"{r['llama_cpp_batched_vs_stepwise']['rel']:.0e} ({r['arch']} {r['qtype']})" for r in quant)
            + " (relative).")
    for r in results:
        div = r.get("divergence")
        if div is None:
            continue
        out.append(f"- {r['arch']} {r['qtype']}: the greedy tokens part at step {r['first_divergence']}, where "
                   f"moestream's top-2 margin is {div['margin']:.3f} ({div['margin_in_logit_std']:.2f} logit std; "
                   f"median margin over the run {r['median_margin']:.3f}) and the engines' logits differ by up to "
                   f"{div['max_abs_diff']:.3f}"
                   + ("" if "emulated_picks_llama_cpp_token" not in div else
                      "; with llama.cpp's rounding emulated moestream picks "
                      + ("llama.cpp's token there" if div["emulated_picks_llama_cpp_token"]
                         else "its own token there too"))
                   + ". After that the contexts differ, so the tokens do.")
    out.append("- Random tiny models have flat output distributions (no token dominates), so small top-2 margins are "
               "common and a token flipped by rounding noise says nothing about either engine's correctness.")
    return out


def write_markdown(report: dict, path: Path) -> None:
    tok = report["tokenization"]
    v = report["versions"]
    lines = [
        "# moestream vs llama.cpp: greedy tokens and logits on tiny GGUF models",
        "",
        f"- date: {report['date']}",
        f"- command: `{report['command']}`",
        f"- machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, {report['machine']['platform']}",
        "- versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if k != "llama_cpp_system_info"),
        f"- llama.cpp CPU backend: `{v['llama_cpp_system_info']}`",
        "- models: random weights (tests/tiny_models.py builders, widths 256 so every matrix can be Q4_K), written "
        "like llama.cpp's converter (tests/gguf_writer.py layout) with the demo tokenizer embedded; qwen3moe without "
        "a dense layer (llama.cpp's qwen3moe requires a router in every layer)",
        f"- run: the prompt's {len(report['prompt_ids'])} token ids fed to both engines, {report['new_tokens']} greedy "
        "tokens (EOS ignored); moestream fp32 on CPU; llama.cpp argmax of each step's logits, f32 KV cache. Logits "
        "are compared on llama.cpp's context at every step (moestream teacher-forced over llama.cpp's tokens).",
        f"- tokenization of the prompt text by the two engines' GGUF tokenizers: "
        f"{'identical' if tok['equal'] else 'DIFFERENT'} ({len(tok['moestream'])} tokens; every file embeds the same "
        "tokenizer)",
        "",
        *table(report["results"]),
        "",
        "*argmax agree*: steps where both engines' logits on the same context pick the same token. *rounding noise "
        "floor*: how much moestream's logits move, with llama.cpp's activation rounding emulated, under relative "
        f"input noise of {JITTER:g}. *llama.cpp batch vs step*: llama.cpp's logits for the same contexts computed "
        "in one batch vs token by token.",
        "",
        "## Reading",
        "",
        *report["reading"],
        "",
    ]
    path.write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--qtypes", default=",".join(QTYPES))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("llama_cpp is not installed (pip install llama-cpp-python; it builds llama.cpp, not a moestream "
              "dependency): skipping the llama.cpp comparison.")
        return 0
    missing = [m for m in ("transformers", "libgguf") if importlib.util.find_spec(m) is None]
    if missing:  # the tiny model builders and the Q4_K quantizer
        print(f"{', '.join(missing)} missing: install moestream's test extras (pip install -e '.[test]').")
        return 1
    sys.path.insert(0, str(ROOT / "tests"))

    torch.manual_seed(args.seed)
    results, tok = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            hf_dir = build_hf(arch, Path(tmp) / arch, args.seed)
            for qtype in args.qtypes.split(","):
                path = write_gguf(hf_dir, Path(tmp) / f"{arch}-{qtype}.gguf", qtype)
                if tok is None:
                    tok = tokenization(path, llama_cpp)
                r = compare(arch, qtype, path, tok["moestream"], args.new_tokens, llama_cpp)
                results.append(r)
                v = r["moestream_vs_llama_cpp"]
                print(f"{arch:9s} {qtype:5s} same tokens: {r['tokens_equal']!s:5s} argmax agree {v['argmax_agree']}/"
                      f"{r['steps']}  max|dlogit| {v['max_abs']:.2e}  rel {v['rel']:.1e}", flush=True)
    report = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join([str(Path(sys.argv[0]).resolve().relative_to(ROOT))] + sys.argv[1:]),
        "machine": machine(), "versions": versions(llama_cpp), "new_tokens": args.new_tokens,
        "prompt_ids": tok["moestream"], "tokenization": tok, "results": results, "reading": reading(results),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llama_cpp_compare.json").write_text(json.dumps(report, indent=1) + "\n")
    write_markdown(report, args.out / "llama_cpp_compare.md")
    print("\n".join(table(results)))
    print("\n".join(report["reading"]))
    print(f"wrote {args.out / 'llama_cpp_compare.json'} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
