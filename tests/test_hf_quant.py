"""Quantized HF safetensors (FP8 block / per-tensor, ModelOpt FP8 and NVFP4, MXFP4): routed experts stay
compressed in host banks, copies and slots, dense weights are dequantized at load, and every backend
gives the greedy tokens of the same model written with the dequantized weights in fp32.

The checkpoints are the tiny transformers models of tests/tiny_models.py, quantized here by an
independent quantizer; the oracle dequantizes in float64 from the stored codes (torch's own float8
conversion and a hand-written e2m1 table), never through moestream.quant.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import tiny_models
from moestream import LLM, SamplingParams
from moestream.config import ModelConfig
from moestream.core import CheckpointError, ConfigError

SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
COMMON = dict(device="cpu", dtype="float32", chunked_prefill_size=7, max_running_requests=4, moe_cpu_threads=1)
BACKENDS = [
    ("fused", {}),
    ("offload", {"moe_cache_size": 3, "moe_prefetch": "on"}),
    ("cpu", {}),
    ("hybrid", {"moe_cache_size": 3, "moe_prefetch": "on"}),
    # CUDA's decode path (quantized pair kernels, device slot cache, CPU bridge) through its torch references
    ("offload", {"moe_cache_size": 3, "moe_decode_kernel": "pairs"}),
    ("hybrid", {"moe_cache_size": 3, "moe_decode_kernel": "pairs"}),
]
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
EXPERT = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
# not quantized in any scheme (HF FP8 and ModelOpt leave routers and the LM head in bf16)
KEEP = ("lm_head", "mlp.gate", "mlp.shared_expert_gate")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------
# An independent quantizer: parts as a checkpoint stores them + the float64 dequantized weight
# ---------------------------------------------------------------------------------------------
def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).float().to(torch.float8_e4m3fn)


def fp8_block(w, block, scale_dtype):
    (bn, bk), (n, k) = block, w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    pad = torch.zeros(nb * bn, kb * bk, dtype=torch.float64)
    pad[:n, :k] = w.double().abs()
    scale = (pad.reshape(nb, bn, kb, bk).amax(dim=(1, 3)) / 448.0).to(scale_dtype)
    full = scale.double().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    q = _fp8(w.double() / full)
    return {"weight": q, "weight_scale_inv": scale}, q.double() * full


def fp8_tensor(w):
    scale = (w.double().abs().max() / 448.0).float()
    q = _fp8(w.double() / scale.double())
    return {"weight": q, "weight_scale": scale}, q.double() * scale.double()


def _e2m1_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest e2m1 code (sign bit 8) of each element and its value."""
    idx = (x.abs().clamp(max=6.0).unsqueeze(-1) - E2M1).abs().argmin(-1)
    neg = x < 0
    return idx | (neg.long() << 3), torch.where(neg, -E2M1[idx], E2M1[idx])


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Element 2i in the low nibble, 2i+1 in the high one."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def nvfp4(w):
    n, k = w.shape
    g = (w.double().abs().max() / (6.0 * 448.0)).float()
    blocks = w.double().reshape(n, k // 16, 16)
    bs = _fp8(blocks.abs().amax(-1) / 6.0 / g.double())
    eff = (bs.double() * g.double()).unsqueeze(-1)
    codes, vals = _e2m1_codes(torch.where(eff > 0, blocks / eff, torch.zeros_like(blocks)))
    parts = {"weight": _pack(codes.reshape(n, k)), "weight_scale": bs, "weight_scale_2": g,
             "input_scale": torch.tensor(1.0)}  # an activation scale: present in real files, not used
    return parts, (vals * eff).reshape(n, k)


def mxfp4(w):
    *lead, n, k = w.shape
    blocks = w.double().reshape(*lead, n, k // 32, 32)
    exp = torch.floor(torch.log2(blocks.abs().amax(-1))) - 2  # amax / 2^exp in [4, 8): clamped to 6
    scale = torch.pow(2.0, exp).unsqueeze(-1)
    codes, vals = _e2m1_codes(blocks / scale)
    return {"blocks": _pack(codes), "scales": (exp + 127).to(torch.uint8)}, (vals * scale).reshape(w.shape)


# ---------------------------------------------------------------------------------------------
# Writing quantized checkpoints
# ---------------------------------------------------------------------------------------------
def _stack(sd: dict) -> dict:
    """Per-expert weights -> stacked gate_up [E, 2I, H] (gate rows first) and down [E, H, I]."""
    out, groups = {}, {}
    for key, t in sd.items():
        m = EXPERT.match(key)
        if m is None:
            out[key] = t
        else:
            groups.setdefault(m["pre"], {}).setdefault(m["proj"], {})[int(m["e"])] = t
    for pre, g in groups.items():
        n = len(g["gate"])
        out[f"{pre}.gate_up_proj"] = torch.stack([torch.cat([g["gate"][e], g["up"][e]]) for e in range(n)])
        out[f"{pre}.down_proj"] = torch.stack([g["down"][e] for e in range(n)])
    return out


def _quantize(sd: dict, scheme: str) -> tuple[dict, dict]:
    """(quantized tensors, the same model with every quantized weight replaced by its fp32 dequantization)."""
    qsd, ref = {}, {}
    for key, w in sd.items():
        module = key.rsplit(".", 1)[0]
        linear = key.endswith(".weight") and w.dim() == 2 and "embed_tokens" not in key and "visual" not in key
        stacked = key.endswith(("experts.gate_up_proj", "experts.down_proj"))
        if scheme == "mxfp4":  # gpt-oss style: only the stacked routed experts
            if stacked:
                parts, deq = mxfp4(w)
                qsd.update({f"{key}_{p}": t for p, t in parts.items()})
                ref[key] = deq.float()
                continue
        elif stacked:  # transformers' stacked per-tensor FP8: one scale per expert and half
            halves = w.chunk(2, dim=1) if key.endswith("gate_up_proj") else (w,)
            qs = [[fp8_tensor(h[e]) for h in halves] for e in range(w.shape[0])]
            qsd[key] = torch.stack([torch.cat([p["weight"] for p, _ in row]) for row in qs])
            scales = torch.stack([torch.stack([p["weight_scale"] for p, _ in row]) for row in qs])
            qsd[key + "_scale_inv"] = scales[..., None]  # [E, halves, 1]
            ref[key] = torch.stack([torch.cat([d for _, d in row]) for row in qs]).float()
            continue
        elif linear and not module.endswith(KEEP):
            if scheme == "fp8_block":
                parts, deq = fp8_block(w, (128, 128), torch.float32)
            elif scheme == "fp8_block_bf16":  # other block size, bf16 scales: more than one block per matrix
                parts, deq = fp8_block(w, (16, 32), torch.bfloat16)
            elif scheme == "modelopt_fp8":
                parts, deq = fp8_tensor(w)
            else:
                parts, deq = nvfp4(w)
            qsd.update({f"{module}.{p}": t for p, t in parts.items()})
            ref[key] = deq.float()
            continue
        qsd[key] = ref[key] = w
    return qsd, ref


QUANT_CONFIGS = {
    "fp8_block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128], "modules_to_not_convert": list(KEEP)},
    "fp8_block_bf16": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [16, 32], "modules_to_not_convert": ["lm_head", "*.mlp.gate",
                                                                                 "*.shared_expert_gate"]},
    "nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "producer": {"name": "modelopt"},
              "ignore": ["lm_head", "*mlp.gate", "*shared_expert_gate*"]},
    "mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.language_model.layers.*.self_attn",
                                                                 "model.language_model.layers.*.mlp.gate", "lm_head"]},
}
# ModelOpt's older exports describe the quantization only in hf_quant_config.json
HF_QUANT_CONFIG = {"producer": {"name": "modelopt", "version": "0.19.0"},
                   "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": list(KEEP)}}


def _write(src: Path, dst: Path, tensors: dict, quant: dict | None = None, hf_quant: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    if quant is not None:
        cfg["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(cfg))
    if hf_quant is not None:
        (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return dst


CASES = {  # name: (variant, scheme, stacked experts); qwen35 is the real Qwen3.5/3.6 layout (with a vision tower)
    "fp8_block-qwen3": ("qwen3", "fp8_block", False),
    "fp8_block16x32-qwen35": ("qwen35", "fp8_block_bf16", False),
    "modelopt_fp8-qwen3-stacked": ("qwen3", "modelopt_fp8", True),
    "nvfp4-qwen35": ("qwen35", "nvfp4", False),
    "mxfp4-qwen35-stacked": ("qwen35", "mxfp4", True),
}


@pytest.fixture(scope="module")
def quantized(tiny_checkpoint, tmp_path_factory):
    """quantized(case) -> (quantized dir, dequantized fp32 dir, quantized tensors), cached."""
    cache: dict = {}

    def get(case: str):
        if case not in cache:
            variant, scheme, stacked = CASES[case]
            src = tiny_checkpoint(variant)
            sd = tiny_models.read_state_dict(src)
            qsd, ref = _quantize(_stack(sd) if stacked else sd, scheme)
            out = tmp_path_factory.mktemp(case)
            qdir = _write(src, out / "q", qsd, QUANT_CONFIGS.get(scheme),
                          HF_QUANT_CONFIG if scheme == "modelopt_fp8" else None)
            cache[case] = (qdir, _write(src, out / "ref", ref), qsd)
        return cache[case]

    return get


def _prompts(vocab):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (4, 17, 30)]


def _tokens(llm):
    return [o.token_ids for o in llm.generate(_prompts(llm.model_config.vocab_size), SP)]


def _expert_bytes(qsd: dict, layer: int, num_experts: int) -> int:
    """Compressed bytes of one expert of `layer`, counted from the checkpoint's tensors."""
    one = re.compile(rf"layers\.{layer}\.mlp\.experts\.0\.(gate|up|down)_proj\.(?!input_scale)")
    stacked = re.compile(rf"layers\.{layer}\.mlp\.experts\.(gate_up|down)_proj_")
    total = sum(t.numel() * t.element_size() for k, t in qsd.items() if one.search(k))
    total += sum(t.numel() * t.element_size() for k, t in qsd.items() if stacked.search(k)) // num_experts
    plain = [k for k in qsd if re.search(rf"layers\.{layer}\.mlp\.experts\.(gate_up|down)_proj$", k)]
    total += sum(qsd[k].numel() * qsd[k].element_size() for k in plain) // num_experts
    return total


FP4_CASES = [c for c, (_, scheme, _) in CASES.items() if scheme in ("nvfp4", "mxfp4")]


@pytest.mark.parametrize("case", list(CASES))
def test_compressed_experts_every_backend(case, quantized, monkeypatch):
    """The torch decoders of the compressed experts give the oracle's tokens exactly. FP4 experts run with the
    compiled kernels off here: those round x to int8 (test_fp4_experts_take_the_cpu_kernels); FP8's kernel
    multiplies float32 x and stays on."""
    qdir, refdir, qsd = quantized(case)
    if case in FP4_CASES:
        monkeypatch.setenv("MOESTREAM_CPU_KERNELS", "0")
    ref = LLM(refdir, moe_backend="fused", **COMMON)
    want = _tokens(ref)
    ref_store = ref.engine.runtime.store
    for backend, kw in BACKENDS:
        llm = LLM(qdir, moe_backend=backend, **COMMON, **kw)
        store, cfg = llm.engine.runtime.store, llm.model_config
        assert store.fmt.quantized and store.fmt.name.startswith("hf:"), store.fmt.name
        layer = store.moe_layers[0]
        per_expert = _expert_bytes(qsd, layer, cfg.num_experts)
        assert store.bytes_per_expert() == per_expert < ref_store.bytes_per_expert() // 3
        assert all(b.dtype == torch.uint8 for b in store.bank(layer).values())
        assert sum(b.numel() for b in store.bank(layer).values()) == cfg.num_experts * per_expert
        if backend == "fused":  # the compressed rows decode to exactly the oracle's dequantized experts
            for lay in store.moe_layers:
                for got, exp in zip(store.weights(lay, torch.float32), ref_store.weights(lay)):
                    assert torch.equal(got, exp)
        assert _tokens(llm) == want, (backend, kw)
        pairs = kw.get("moe_decode_kernel") == "pairs"
        assert getattr(llm.engine.runtime, "pairs", False) == pairs, (backend, kw)  # the path asked for was taken
        if backend in ("offload", "hybrid"):
            t = llm.stats()["total"]
            assert all(a.dtype == torch.uint8 for a in llm.engine.runtime.pool.arrays.values())
            moved = t["bytes_h2d"] // per_expert if pairs else t["copies"]  # pairs: reads over the bus
            assert t["bytes_h2d"] == moved * per_expert > 0
        llm.engine.runtime.close()


def _fp4_kernel_calls(llm, counts: dict, tid: int) -> int:
    """Compiled HF FP4 (or FP8: tid) expert computations of a run: layer calls (counted by the wrappers of
    _count_fp4_calls) plus the CPU decode plan's steps when its MoE blocks hold FP4 expert tables."""
    from moestream.models.cpu_decode import M

    plan = getattr(llm.engine.model, "cpu_decode", None)
    moe = [d for d in (plan.moe if plan is not None else []) if d is not None]
    in_plan = plan.steps if moe and all(d[M["TG"]] == tid for d in moe) else 0
    return sum(counts.values()) + in_plan


def _count_fp4_calls(monkeypatch, tid: int) -> dict:
    """Count the kernels' layer entry points called with HF FP4 type ids (cpu_moe.run, LayerCall, the bridge's
    compiled worker)."""
    from moestream.kernels import cpu_quant

    counts = {"moe_layer": 0, "moe_layer_unchecked": 0, "bridge_step": 0}
    checks = {"moe_layer": lambda a: cpu_quant.type_id(a[2][0]) == tid,
              "moe_layer_unchecked": lambda a: int(a[2][0]) == tid,
              "bridge_step": lambda a: int(a[1]["wtype"].reshape(-1)[0]) == tid}
    for name, check in checks.items():
        real = getattr(cpu_quant, name)

        def wrapped(*a, _real=real, _name=name, _check=check, **kw):
            counts[_name] += bool(_check(a))
            return _real(*a, **kw)

        monkeypatch.setattr(cpu_quant, name, wrapped)
    return counts


@pytest.mark.parametrize("case", [c for c, (_, scheme, _) in CASES.items() if "fp8" in scheme])
def test_fp8_experts_take_the_cpu_layer_call(case, quantized, monkeypatch):
    """FP8 experts (128 x 128 float32 block scales, 16 x 32 bf16 ones, per-tensor) on the CPU run through the compiled layer call (type
    "fp8": one call a layer, float32 activations, not a torch dequantization a matrix) on every backend that computes
    experts on this CPU, and give the oracle's tokens exactly: the CPU decode plan's one-call MoE blocks (fused, cpu),
    the layer call (offload, hybrid), the CPU bridge (pairs)."""
    from moestream.kernels import cpu_quant

    qdir, refdir, _ = quantized(case)
    tid = cpu_quant.HF_TYPES["fp8"]
    want = _tokens(LLM(refdir, moe_backend="fused", **COMMON))
    counts = _count_fp4_calls(monkeypatch, tid)
    for backend, kw in BACKENDS:
        for k in counts:
            counts[k] = 0
        llm = LLM(qdir, moe_backend=backend, **COMMON, **kw)
        assert _tokens(llm) == want, (backend, kw)
        assert _fp4_kernel_calls(llm, counts, tid) > 0, (backend, kw)  # the compiled FP8 layer call ran
        llm.engine.runtime.close()


@pytest.mark.parametrize("case", FP4_CASES)
def test_fp4_experts_take_the_cpu_kernels(case, quantized, monkeypatch):
    """NVFP4 / MXFP4 experts on the CPU with the compiled kernels on (qmatmul.cpp's HF FP4 kernels: the stored
    codes and scales, x rounded to int8 per 16 values): every backend's decode steps compute them there — the
    CPU decode plan's one-call MoE blocks (fused, cpu), the layer call (offload, hybrid), the CPU bridge (pairs)
    — and give one another's tokens. Against the torch path (kernels off: the oracle's tokens, test above) the
    int8 rounding moves the logits by ~3% of their norm on these random models (logits within 6e-2, as the GGUF
    kernels' tiny test bounds), so a greedy pick may flip where the torch path's top-2 margin is within that
    change: tokens must agree up to such a near-tie, never at a clear margin."""
    from moestream.kernels import cpu_quant
    from test_engine_parity import full_logits

    qdir, _, _ = quantized(case)
    scheme = CASES[case][1]
    tid = cpu_quant.HF_TYPES[scheme]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    ids = list(range(4, 10))  # 6 rows: every expert of the one-pass logits below takes the kernels
    monkeypatch.setenv("MOESTREAM_CPU_KERNELS", "0")
    torch_llm = LLM(qdir, moe_backend="fused", **COMMON)
    prompts = _prompts(torch_llm.model_config.vocab_size)
    want = torch_llm.generate(prompts, sp)
    exact = full_logits(torch_llm, ids)
    monkeypatch.setenv("MOESTREAM_CPU_KERNELS", "1")
    counts = _count_fp4_calls(monkeypatch, tid)
    ours = full_logits(LLM(qdir, moe_backend="fused", **COMMON), ids)  # prompt rows take the kernels too
    assert sum(counts.values()) > 0
    rel = ((ours - exact).norm() / exact.norm()).item()
    assert 1e-6 < rel < 6e-2, rel
    change = (ours - exact).abs().max().item()
    runs = []
    for backend, kw in BACKENDS:
        for k in counts:
            counts[k] = 0
        llm = LLM(qdir, moe_backend=backend, **COMMON, **kw)
        got = llm.generate(prompts, sp)
        assert _fp4_kernel_calls(llm, counts, tid) > 0, (backend, kw)  # the compiled FP4 path ran
        runs.append([o.token_ids for o in got])
        llm.engine.runtime.close()
    assert all(r == runs[0] for r in runs), "backends disagree"
    for w, g in zip(want, runs[0]):
        for i, (a, b) in enumerate(zip(w.token_ids, g)):
            if a != b:  # a flipped pick: only where the torch path's top-2 margin is within the logits' change
                top = w.logprobs[i][1]
                assert top[0][1] - top[1][1] < 2 * change, (i, top, change)
                break


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_compressed_prefill_takes_the_grouped_kernels(case, quantized, monkeypatch):
    """Prefill chunks of FP8 / NVFP4 / MXFP4 experts on a GPU take moe/grouped.py's kernels (tiles decoded in
    registers: no per-expert dequantize + GEMM loop), counted, on fused (the device banks) and offload (slots and
    the prefill buffer), and offload gives fused's greedy tokens (a pair's value does not depend on which bank or
    call computed it)."""
    from moestream.moe import grouped

    qdir, _, _ = quantized(case)
    # the dense layers compressed in both runs: under "auto" fused (every expert fits) dequantizes them to bf16 for
    # cuBLAS while offload keeps them compressed, and the two GEMVs' roundings flip near-tied tokens of a tiny
    # random model (the first H200 run of this test, 2026-12-06) — a dense-layer difference, not the experts'
    monkeypatch.setenv("MOESTREAM_DENSE_QUANT", "1")
    calls = []
    real = grouped.grouped_pairs
    monkeypatch.setattr(grouped, "grouped_pairs", lambda *a, **k: calls.append(1) or real(*a, **k))

    def tokens(backend, **kw):
        llm = LLM(qdir, moe_backend=backend, device="cuda", dtype="bfloat16", chunked_prefill_size=7,
                  max_running_requests=4, **kw)
        assert llm.engine.runtime.store.fmt.name.startswith("hf:")
        out = _tokens(llm)
        llm.engine.runtime.close()
        return out

    want = tokens("fused")
    assert calls, "fused prefill did not take the grouped kernels"
    for kw in ({"moe_cache_size": 3, "moe_prefetch": "on"}, {"moe_cache_size": 5, "moe_prefetch": "off"}):
        calls.clear()
        assert tokens("offload", **kw) == want, kw
        assert calls, f"offload {kw} did not take the grouped kernels"


@pytest.mark.parametrize("case", ["fp8_block-qwen3", "fp8_block16x32-qwen35", "modelopt_fp8-qwen3-stacked",
                                  "nvfp4-qwen35"])
def test_gpu_dense_layout_keeps_quantized_dense_layers(case, quantized, monkeypatch):
    """What a GPU keeps compressed (MOESTREAM_DENSE_QUANT=gpu forces that choice on this CPU): every quantized dense
    linear of an HF checkpoint stays as stored — an HFQuantLinear holding its codes and scales, nothing dequantized —
    the plan's dense bytes are the bytes held (fewer than the dequantized model's), and the logits are those of the
    model whose weights are the dequantized parts (torch tiles: MOESTREAM_CPU_KERNELS=0)."""
    from moestream.layers.quant_linear import HFQuantLinear
    from test_engine_parity import full_logits

    qdir, refdir, qsd = quantized(case)
    monkeypatch.setenv("MOESTREAM_CPU_KERNELS", "0")
    monkeypatch.setenv("MOESTREAM_DENSE_QUANT", "gpu")
    llm = LLM(qdir, **COMMON)
    model = llm.engine.model
    kept = {n for n, m in model.named_modules() if isinstance(m, HFQuantLinear)}
    # the checkpoint's quantized dense weights: 1-byte element codes outside the routed experts
    want = {k.removesuffix(".weight").removeprefix(llm.model_config.weight_prefix) for k, t in qsd.items()
            if k.endswith(".weight") and t.element_size() == 1 and not EXPERT.match(k) and ".mtp." not in k
            and not k.startswith("mtp.")}
    assert kept and kept == want
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                if n.endswith((".raw", ".raw_scale", ".raw_scale2")))
    assert llm.engine.plan.bytes.dense == held
    monkeypatch.setenv("MOESTREAM_DENSE_QUANT", "0")
    ref = LLM(refdir, **COMMON)
    assert ref.engine.plan.bytes.dense > held
    ids = list(range(4, 11))  # one prefill chunk (COMMON's chunked_prefill_size)
    ours, theirs = full_logits(llm, ids), full_logits(ref, ids)
    assert (ours - theirs).norm() / theirs.norm() < 1e-4
    assert _tokens(llm) == _tokens(ref)


@pytest.mark.parametrize("case", ["fp8_block-qwen3", "mxfp4-qwen35-stacked"])
def test_dense_expert_format_dequantizes_at_load(case, quantized):
    qdir, refdir, _ = quantized(case)
    llm = LLM(qdir, moe_backend="fused", moe_expert_format="dense", **COMMON)
    ref = LLM(refdir, moe_backend="fused", **COMMON)
    assert not llm.engine.runtime.store.fmt.quantized
    for lay in ref.engine.runtime.store.moe_layers:
        for got, exp in zip(llm.engine.runtime.store.weights(lay), ref.engine.runtime.store.weights(lay)):
            assert torch.equal(got, exp)
    for (name, p), (_, q) in zip(llm.engine.model.named_parameters(), ref.engine.model.named_parameters()):
        assert torch.equal(p, q), name  # dense weights: dequantized at load to the oracle's values


def test_checkpoint_errors_name_the_tensor(quantized, tmp_path):
    qdir, _, qsd = quantized("fp8_block-qwen3")
    gone = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    d = _write(qdir, tmp_path / "no_scale", {k: t for k, t in qsd.items() if k != gone})
    with pytest.raises(CheckpointError, match=re.escape(gone)):
        LLM(d, **COMMON)
    gone = "model.layers.2.mlp.experts.5.down_proj.weight_scale_inv"
    d = _write(qdir, tmp_path / "no_expert_scale", {k: t for k, t in qsd.items() if k != gone})
    with pytest.raises(CheckpointError, match=re.escape(gone)):
        LLM(d, **COMMON)
    d = _write(qdir, tmp_path / "excluded", qsd, {**QUANT_CONFIGS["fp8_block"], "modules_to_not_convert": ["k_proj"]})
    with pytest.raises(CheckpointError, match=r"excludes model\.layers\.\d+\.self_attn\.k_proj"):
        LLM(d, **COMMON)


def test_quantization_configs(tiny_checkpoint):
    raw = json.loads((tiny_checkpoint("qwen3") / "config.json").read_text())
    official = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "modules_to_not_convert": ["lm_head"]}
    q = ModelConfig.from_hf({**raw, "quantization_config": official}).quantization
    assert q == {"method": "fp8", "format": "fp8_block", "block_size": (128, 128), "exclude": ("lm_head",)}
    q = ModelConfig.from_hf({**raw, "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                                            "group_size": 16}}).quantization
    assert q["format"] == "nvfp4"
    assert ModelConfig.from_hf(raw).quantization is None


@pytest.mark.parametrize("qcfg, message", [
    ({"quant_method": "gptq", "bits": 4}, "'gptq' is not supported"),
    ({"quant_method": "compressed-tensors"}, "'compressed-tensors' is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "'W4A8_AWQ' is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "group_size 32"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "'e5m2' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
])
def test_unsupported_quantization_is_a_config_error(qcfg, message, tiny_checkpoint):
    raw = json.loads((tiny_checkpoint("qwen3") / "config.json").read_text())
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_hf({**raw, "quantization_config": qcfg})
