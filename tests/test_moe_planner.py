"""The memory planner (a pure function), bad sizes as clear errors, and `moestream bench bw`."""
from __future__ import annotations

import json

import pytest

from moestream import LLM
from moestream.cli import main
from moestream.config import EngineConfig
from moestream.core import ConfigError
from moestream.moe.bench import load_profile
from moestream.moe.planner import Bandwidths, Hardware, ModelSizes, plan_memory

GiB = 1 << 30
MiB = 1 << 20
# a Qwen3.5-35B-A3B-like model in bf16: 40 layers x 256 experts of 6 MiB, 1.5 GiB dense
BIG = ModelSizes(num_moe_layers=40, num_experts=256, top_k=8, expert_bytes=6 * MiB, dense_bytes=3 * GiB // 2,
                 kv_bytes_per_token=20480, state_bytes=64 * MiB, workspace_bytes=512 * MiB,
                 wanted_kv_tokens=1 << 17, min_kv_tokens=32)


def gpu(free_gb, host_gb=128):
    return Hardware("cuda", "Test GPU", int(free_gb * GiB), host_gb * GiB, host_gb * GiB - 2 * GiB, 16)


def test_plan_offload_on_small_gpu_fills_budget():
    p = plan_memory(BIG, gpu(8), EngineConfig(moe_backend="auto"))
    assert p.backend == "offload" and "no bench profile" in p.reason
    b = p.bytes
    used = b.dense + b.state + b.workspace + b.experts_device + b.prefill_buffer + b.kv
    assert used <= b.budget == int(0.9 * 8 * GiB)
    assert p.cache_slots > BIG.top_k and p.kv_tokens >= 8192 and 0 < p.residency < 1
    assert p.prefill_slots == 64 and b.pin_budget > 0
    d = p.as_dict()
    assert d["cache_slots"] == p.cache_slots and d["bytes"]["kv"] == b.kv
    assert "expert plan: backend offload" in p.describe()


def test_auto_pin_budget_leaves_the_prefix_cache_host_tier_its_memory():
    """Expert banks are pinned up to host memory less a headroom and less the prefix cache's host tier."""
    hw = gpu(8, host_gb=64)  # 62 GiB available, headroom max(4 GiB, share of 64 GiB)
    base = plan_memory(BIG, hw, EngineConfig(moe_backend="offload")).bytes.pin_budget
    tier = plan_memory(BIG, hw, EngineConfig(moe_backend="offload", prefix_cache_host_gb=10)).bytes.pin_budget
    assert 0 < tier == base - 10 * GiB
    off = EngineConfig(moe_backend="offload", prefix_cache_host_gb=10, prefix_cache=False)
    assert plan_memory(BIG, hw, off).bytes.pin_budget == base


def test_auto_choices():
    assert plan_memory(BIG, gpu(139), EngineConfig()).backend == "fused"
    cpu = Hardware("cpu", "cpu", 400 * GiB, 512 * GiB, 400 * GiB, 32)
    p = plan_memory(BIG, cpu, EngineConfig())
    assert p.backend == "fused" and "CPU device" in p.reason
    fast_cpu = Bandwidths(pcie_pinned_gbs=25.0, cpu_expert_gbs=40.0)
    p = plan_memory(BIG, gpu(8), EngineConfig(), fast_cpu)
    assert p.backend == "hybrid" and abs(p.hybrid_fetch_fraction - 25 / 65) < 1e-9
    slow_cpu = Bandwidths(pcie_pinned_gbs=25.0, cpu_expert_gbs=2.0)
    assert plan_memory(BIG, gpu(8), EngineConfig(), slow_cpu).backend == "offload"
    # a budget whose hybrid cache would hold under 2 % of the experts (or not one layer's top-k): every expert on the CPU
    for gb, slots in ((4.0, 107), (3.3, 0)):
        if slots:
            assert plan_memory(BIG, gpu(gb), EngineConfig(moe_backend="hybrid"), fast_cpu).cache_slots == slots
        tiny = plan_memory(BIG, gpu(gb), EngineConfig(), fast_cpu)
        assert tiny.backend == "cpu" and f"leaves hybrid {slots} cache slots" in tiny.reason, tiny.reason
    assert plan_memory(BIG, gpu(4.8), EngineConfig(), fast_cpu).backend == "hybrid"  # 230 slots, 2.2 % of the experts
    # a budget whose cache would hold over 45 % of the experts: offload (a call misses too few for the CPU to pay)
    for gb, backend in ((32, "hybrid"), (40, "offload"), (60, "offload")):
        held = plan_memory(BIG, gpu(gb), EngineConfig(moe_backend="hybrid"), fast_cpu)
        p = plan_memory(BIG, gpu(gb), EngineConfig(), fast_cpu)
        assert p.backend == backend and (held.cache_slots > 0.45 * held.total_experts) == (backend == "offload"), gb
        if backend == "offload":
            assert f"the cache holds {held.cache_slots / held.total_experts:.0%} of the experts" in p.reason, p.reason
    assert plan_memory(BIG, gpu(40), EngineConfig(moe_backend="hybrid"), fast_cpu).backend == "hybrid"  # asked for


def test_auto_measures_bandwidths_only_where_it_weighs_hybrid():
    """Without a saved profile the engine hands the planner a measuring function: called once where auto must
    weigh hybrid against offload (experts do not fit), never where they fit, nor for a backend asked by name."""
    calls = []

    def measure(bw):
        return lambda: calls.append(1) or bw

    fast, slow = Bandwidths(pcie_pinned_gbs=25.0, cpu_expert_gbs=40.0), Bandwidths(pcie_pinned_gbs=25.0, cpu_expert_gbs=2.0)
    assert plan_memory(BIG, gpu(139), EngineConfig(), measure(fast)).backend == "fused" and not calls
    assert plan_memory(BIG, gpu(8), EngineConfig(moe_backend="offload"), measure(fast)).backend == "offload"
    assert not calls
    p = plan_memory(BIG, gpu(8), EngineConfig(), measure(fast))
    assert p.backend == "hybrid" and "CPU experts run at 40.0 GB/s" in p.reason and calls == [1]
    assert abs(p.hybrid_fetch_fraction - 25 / 65) < 1e-9 and p.pcie_gbs == 25.0
    assert plan_memory(BIG, gpu(8), EngineConfig(), measure(slow)).backend == "offload" and calls == [1, 1]


def test_quick_bandwidths_measures_the_models_own_format():
    """The load-time probe behind that function: the CPU experts' rate in the expert format given (CPU only here:
    no PCIe figure)."""
    import torch

    from moestream.moe.bench import expert_format, quick_bandwidths

    from moestream.moe.formats import layered_gguf_format

    mix = layered_gguf_format({0: {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"},
                               1: {"gate": "Q4_K", "up": "Q4_K", "down": "Q4_K"}}, 256, 256)  # Q4_K_M-style
    assert not hasattr(mix, "types")  # per-layer types: the probe measures one layer's format
    for fmt in (expert_format("bf16", torch.bfloat16, 256, 256), expert_format("q4_k", torch.bfloat16, 256, 256), mix):
        bw = quick_bandwidths(torch.device("cpu"), fmt, 256, 256, top_k=2, dtype=torch.bfloat16, cpu_threads=1)
        assert bw.cpu_expert_gbs > 0 and bw.pcie_pinned_gbs == 0.0


def test_gpu_memory_cap_and_rate():
    from moestream.moe.planner import CAP_HEADROOM

    p = plan_memory(BIG, gpu(139), EngineConfig(moe_backend="offload", gpu_memory_gb=6))
    assert p.bytes.budget == 6 * GiB - CAP_HEADROOM  # the cap covers the whole process (see the next test)
    p = plan_memory(BIG, gpu(139), EngineConfig(moe_backend="hybrid", moe_cache_rate=0.1))
    assert p.cache_slots == 1024
    p = plan_memory(BIG, gpu(139), EngineConfig(moe_backend="cpu"))
    assert p.cache_slots == 0 and p.prefill_slots == 64 and p.bytes.experts_device == 0


def test_gpu_memory_cap_covers_the_cuda_context():
    """--gpu-memory-gb caps the process: the measured CUDA context comes off the budget the plan splits
    (and the plan shows it); --memory-ratio shares free memory, which the context has already left."""
    import dataclasses

    from moestream.moe.planner import CAP_HEADROOM

    hw = dataclasses.replace(gpu(139), context_bytes=700 * MiB)
    capped = plan_memory(BIG, hw, EngineConfig(moe_backend="offload", gpu_memory_gb=6))
    b = capped.bytes
    assert b.budget == 6 * GiB - 700 * MiB - CAP_HEADROOM and b.context == 700 * MiB + CAP_HEADROOM
    assert b.dense + b.state + b.workspace + b.experts_device + b.prefill_buffer + b.kv + b.context <= 6 * GiB
    assert "CUDA context + runtime headroom 1.18 GiB" in capped.describe()
    bare = dataclasses.replace(gpu(139), context_bytes=0)
    plain = plan_memory(BIG, bare, EngineConfig(moe_backend="offload", gpu_memory_gb=6))
    assert plain.bytes.budget == 6 * GiB - CAP_HEADROOM
    assert plain.cache_slots > capped.cache_slots  # the context's 700 MiB would have been expert slots
    ratio = plan_memory(BIG, hw, EngineConfig(moe_backend="offload", memory_ratio=0.05))
    assert ratio.bytes.budget == int(0.05 * 139 * GiB) and ratio.bytes.context == 0


@pytest.mark.parametrize("cfg,match", [
    (dict(moe_backend="offload", moe_cache_size=7), "below one layer's top-k"),
    (dict(moe_backend="offload", moe_cache_rate=0.0001), "below one layer's top-k"),
    (dict(moe_backend="offload", gpu_memory_gb=1.0), "does not cover dense weights"),
    (dict(moe_backend="fused"), "use --moe-backend offload"),
    (dict(moe_backend="offload", moe_cache_size=5000), "lower --moe-cache-size"),
])
def test_bad_sizes_are_clear_errors(cfg, match):
    with pytest.raises(ConfigError, match=match):
        plan_memory(BIG, gpu(8), EngineConfig(**cfg))


@pytest.mark.parametrize("opts,match", [
    (dict(pin_budget_gb=-1), "--pin-budget-gb"),
    (dict(gpu_memory_gb=-2), "--gpu-memory-gb"),
    (dict(moe_cache_size=-3), "--moe-cache-size"),
])
def test_negative_sizes_rejected(opts, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**opts)


def test_engine_rejects_cache_below_top_k(tiny_checkpoint):
    with pytest.raises(ConfigError, match="top-k"):
        LLM(tiny_checkpoint("qwen3"), device="cpu", dtype="float32", moe_backend="offload", moe_cache_size=1)
    with pytest.raises(ConfigError, match="does not cover"):
        LLM(tiny_checkpoint("qwen3"), device="cpu", dtype="float32", gpu_memory_gb=0.001)


def test_bench_bw_on_cpu_writes_profile(tmp_path, monkeypatch, capsys):
    import torch

    threads = torch.get_num_threads()  # the bench sets torch's process-wide threads; restore them
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rc = main(["bench", "bw", "--device", "cpu", "--hidden", "128", "--inter", "64", "--experts", "4",
               "--top-k", "2", "--host-mib", "8", "--iters", "1", "--dtype", "float32", "--cpu-threads", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "host memory read" in out and "n/a" in out and "auto would choose" in out
    prof = json.loads((tmp_path / "moestream" / "benchbw.json").read_text())
    assert prof["host_read_gbs"] > 0 and prof["cpu_expert_gbs"] > 0 and prof["pcie_pinned_gbs"] is None
    assert prof["cpu_expert_gbs"] == min(prof["cpu_expert_measured_gbs"], prof["host_read_gbs"])
    assert torch.get_num_threads() == threads
    assert load_profile(torch.device("cpu")) == prof  # what the engine reads
    other = tmp_path / "x.json"
    assert main(["bench", "bw", "--device", "cpu", "-o", str(other), "--hidden", "64", "--inter", "32",
                 "--experts", "2", "--top-k", "2", "--host-mib", "4", "--iters", "1", "--dtype", "float32",
                 "--cpu-threads", "1"]) == 0
    assert json.loads(other.read_text())["geometry"]["hidden"] == 64


def test_explicit_num_tokens_is_reserved_before_expert_slots():
    """An explicit --num-tokens is honoured first and the expert cache takes what is left (the cache
    used to be sized first and leave too little for the asked KV pool: seen on the H200 sweep)."""
    p = plan_memory(BIG, gpu(140), EngineConfig(moe_backend="offload", gpu_memory_gb=24, num_tokens=32768))
    b = p.bytes
    assert p.kv_tokens == 32768 and b.kv == 32768 * BIG.kv_bytes_per_token
    assert p.cache_slots > BIG.top_k
    assert b.dense + b.state + b.workspace + b.experts_device + b.prefill_buffer + b.kv <= b.budget


def test_an_explicit_context_length_keeps_one_request_of_kv():
    """--max-seq-len-override 32k: the KV pool holds one 32k-token request before expert slots take the rest (the
    plan used to reserve 8k tokens and give the rest to slots: a 32k prompt did not fit at 8 / 12 GiB)."""
    base = plan_memory(BIG, gpu(140), EngineConfig(moe_backend="offload", gpu_memory_gb=8))
    p = plan_memory(BIG, gpu(140), EngineConfig(moe_backend="offload", gpu_memory_gb=8, max_seq_len_override=32816))
    assert base.kv_tokens < 32816 <= p.kv_tokens
    assert p.cache_slots < base.cache_slots and p.cache_slots > BIG.top_k


def test_prefill_chunks_shrink_before_a_plan_is_refused():
    """Where the budget cannot hold the prefill workspace of --chunked-prefill-size tokens, the planner halves the
    chunk (down to PREFILL_CHUNK_FLOOR) before refusing; a budget that fits keeps the asked chunk, and one that
    no chunk fits is refused with the first error."""
    from moestream.moe.planner import PREFILL_CHUNK_FLOOR, plan_fitting_chunk

    import dataclasses

    def sizes_for(e):  # the workspace follows the chunk, as model_sizes computes it (1 MiB a token here)
        return dataclasses.replace(BIG, workspace_bytes=256 * MiB + e.chunked_prefill_size * MiB)

    e = EngineConfig(moe_backend="offload", chunked_prefill_size=4096)
    plan, used = plan_fitting_chunk(sizes_for, gpu(139), e)
    assert used is e and plan.prefill_chunk == 4096  # room for everything: nothing changes
    with pytest.raises(ConfigError):
        plan_memory(sizes_for(e), gpu(6), e)  # 4 GiB of workspace does not fit a 5.4 GiB budget with the rest
    plan, used = plan_fitting_chunk(sizes_for, gpu(6), e)
    assert used.chunked_prefill_size < 4096 and plan.prefill_chunk == used.chunked_prefill_size
    assert plan.bytes.workspace == 256 * MiB + used.chunked_prefill_size * MiB
    b = plan.bytes
    assert b.dense + b.state + b.workspace + b.experts_device + b.prefill_buffer + b.kv <= b.budget
    assert f"prefill chunks of {used.chunked_prefill_size} tokens" in plan.describe()
    with pytest.raises(ConfigError, match="does not cover dense weights"):
        plan_fitting_chunk(sizes_for, gpu(1.5), e)  # dense 1.5 GiB alone: no chunk helps
    assert PREFILL_CHUNK_FLOOR <= used.chunked_prefill_size


def test_engine_runs_with_the_chunk_its_plan_fitted(tiny_checkpoint, monkeypatch):
    """The engine adopts the smaller chunk its plan needed (the scheduler computes prompts in chunks of it)."""
    import moestream.engine.engine as eng_mod
    from moestream.moe import planner

    real = planner.plan_memory

    def tight(m, hw, e, bw=None):  # this model's plan "fits" only with chunks of at most 512 tokens
        if e.chunked_prefill_size > 512:
            raise ConfigError("the cpu budget does not cover the workspace (test)")
        return real(m, hw, e, bw)

    monkeypatch.setattr(planner, "plan_memory", tight)
    monkeypatch.setattr(eng_mod, "plan_memory", tight)
    llm = LLM(tiny_checkpoint("qwen3"), device="cpu", chunked_prefill_size=2048)
    assert llm.engine.ecfg.chunked_prefill_size == 512 and llm.engine.plan.prefill_chunk == 512
    assert llm.llm_engine.scheduler.chunk == 512
    from moestream import SamplingParams

    out = llm.generate([[5] * 300], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 2


def test_default_prefix_snapshots_shrink_before_a_plan_is_refused():
    """A budget that holds the model with 2 state snapshots but not the default 8: the engine's fit keeps fewer
    snapshots instead of refusing; an explicit --prefix-cache-snapshots is honoured (refused)."""
    import dataclasses
    from types import SimpleNamespace

    from moestream.engine.engine import Engine

    slot = 128 * MiB

    def snapshots(e):
        return e.prefix_cache_snapshots if e.prefix_cache_snapshots is not None else 2 * e.max_running_requests

    def sizes_for(e):
        return dataclasses.replace(BIG, state_bytes=slot * (e.max_running_requests + snapshots(e)),
                                   wanted_kv_tokens=4096, min_kv_tokens=4096)

    fake = SimpleNamespace(hardware=gpu(140), _snapshots=snapshots)
    e = EngineConfig(moe_backend="offload", gpu_memory_gb=4.0, max_running_requests=4, chunked_prefill_size=256)
    with pytest.raises(ConfigError):
        plan_memory(sizes_for(e), fake.hardware, e)
    plan, used = Engine._fit_snapshots(fake, sizes_for, e, None)
    assert used.prefix_cache_snapshots == 4 and plan.cache_slots >= BIG.top_k  # halved once: fits
    with pytest.raises(ConfigError):
        Engine._fit_snapshots(fake, sizes_for, e.replace(prefix_cache_snapshots=8), None)


def test_torch_allocator_capped_at_the_cap_less_the_context(monkeypatch):
    """Engine._cap_torch: under --gpu-memory-gb torch's allocator may hold the cap less the measured CUDA context, as a
    fraction of the card, set for the device's index (a bare 'cuda' device is refused by torch: every CUDA engine
    failed to start when it was passed); without a cap, the whole card. Runs without a GPU (torch.cuda mocked)."""
    import types

    import torch

    from moestream.engine.engine import Engine

    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=80 * GiB))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def setter(fraction, device=None):
        assert isinstance(device, int), device  # what torch accepts: an index (or a device with one)
        calls.append((fraction, device))

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", setter)
    for dev, cap, want in (("cuda", 4.0, (4 * GiB - GiB // 2) / (80 * GiB)), ("cuda:1", 4.0, None),
                           ("cuda", None, 1.0)):
        eng = types.SimpleNamespace(device=torch.device(dev), ecfg=types.SimpleNamespace(gpu_memory_gb=cap),
                                    hardware=types.SimpleNamespace(context_bytes=GiB // 2))
        Engine._cap_torch(eng)
        fraction, index = calls[-1]
        assert index == (1 if dev == "cuda:1" else 0)
        if want is not None:
            assert fraction == pytest.approx(want)
    eng = types.SimpleNamespace(device=torch.device("cpu"), ecfg=None, hardware=None)
    Engine._cap_torch(eng)  # a CPU engine: nothing to cap
    assert len(calls) == 3


def test_prefill_rows_override(monkeypatch):
    """MOESTREAM_PREFILL_ROWS sets the prefill double buffer's rows (within [top-k, 64]); the KV gives way for them,
    the slots do not change (the planner reserved 64 rows' room before sizing them)."""
    e = EngineConfig(moe_backend="offload", gpu_memory_gb=4.0)
    hw = Hardware(device="cuda", name="t", free_bytes=80 * GiB, host_total_bytes=64 * GiB,
                  host_available_bytes=60 * GiB, physical_cores=8, context_bytes=GiB // 2)
    small = ModelSizes(num_moe_layers=40, num_experts=256, top_k=8, expert_bytes=2 * MiB, dense_bytes=2 * GiB,
                       kv_bytes_per_token=20 << 10, state_bytes=256 * MiB, workspace_bytes=300 * MiB,
                       wanted_kv_tokens=1 << 17, min_kv_tokens=512)
    base = plan_memory(small, hw, e)
    # few slots: the 64 rows the planner set aside before sizing them are the buffer (it once gave them slots // 4)
    assert base.prefill_slots == 64 and base.cache_slots < 32
    for rows, want in (("64", 64), ("200", 64), ("2", 8), ("16", 16), ("8", 8)):
        monkeypatch.setenv("MOESTREAM_PREFILL_ROWS", rows)
        p = plan_memory(small, hw, e)
        assert p.prefill_slots == want and p.cache_slots == base.cache_slots
        freed = 2 * (want - base.prefill_slots) * small.expert_bytes / small.kv_bytes_per_token
        assert abs(p.kv_tokens - (base.kv_tokens - freed)) <= 1 and p.kv_tokens >= 8192


# ---- the Qwen3.6-35B-A3B-shaped Q4_K_M GGUF (benchmarks/make_qwen36_q4km.py) at small caps ----------------------
# Built from its config and the file's quant mix, no weights: what the planner is given for the real 20.9 GB file.
QWEN36 = {"architectures": ["Qwen3_5MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 40,
          "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)],
          "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 256,
          "num_experts_per_tok": 8, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
          "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
          "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "max_position_embeddings": 262144,
          "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                              "mrope_section": [11, 11, 10], "mrope_interleaved": True}}
Q_BYTES = {"Q4_K": 144, "Q6_K": 210}  # bytes per 256 weights
# CUDA context measured on the H200 of the 2026-12-05 Q4_K_M run (its plans: "CUDA context + runtime headroom 1.17 GiB")
H200_CONTEXT = 686 * MiB


def _q4km_type(name: str, n: int):
    """The GGUF type of a dense parameter a GPU keeps compressed (Q4_K_M as llama.cpp picks it: Q6_K in the first
    and last eighth of the layers and every third between, for the value-like projections); None: held 16-bit (F32
    in the file, or the shared expert's gate/up, kept dense on a GPU to fuse with the router)."""
    import re

    if name in ("embed_tokens.weight", "lm_head.weight"):
        return "Q4_K" if name.startswith("embed") else "Q6_K"
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
    if m is None:
        return None
    i, part = int(m[1]), m[2]
    more = i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
    if part in ("linear_attn.in_proj_qkv", "self_attn.v_proj", "mlp.shared_expert.down_proj"):
        return "Q6_K" if more else "Q4_K"
    if part in ("linear_attn.in_proj_z", "linear_attn.out_proj", "self_attn.q_proj", "self_attn.k_proj",
                "self_attn.o_proj"):
        return "Q4_K"
    return None


def _qwen36_q4km():
    """(ModelConfig, dense bytes held on a GPU, KV bytes a token, one linear-state slot's bytes, bytes of an expert)."""
    import torch

    from moestream.config import ModelConfig
    from moestream.kvcache import KVPool, StatePool
    from moestream.models.qwen_moe import QwenMoeModel

    cfg = ModelConfig.from_hf(QWEN36)
    with torch.device("meta"):
        model = QwenMoeModel(cfg).to(torch.bfloat16)
    dense = 0
    for name, p in model.named_parameters():
        kind = _q4km_type(name, cfg.num_layers)
        dense += p.numel() * Q_BYTES[kind] // 256 if kind else p.numel() * 2
        if name.endswith("linear_attn.out_proj.weight"):
            dense += p.shape[1] * 8  # its value columns gathered at the input (in_perm, int64)
    kv = KVPool.bytes_per_token(len(cfg.full_attention_layers), cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    slot = StatePool.bytes_per_slot(len(cfg.linear_attention_layers), cfg.linear_conv_dim, cfg.linear_conv_kernel,
                                    cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                    torch.bfloat16, torch.float32)
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    expert = 2 * H * I * Q_BYTES["Q4_K"] // 256 + H * I * Q_BYTES["Q6_K"] // 256  # the largest: a Q6_K down
    return cfg, dense, kv, slot, expert


def _qwen36_engine(context=H200_CONTEXT):
    """What Engine._plan_fitting reads of an engine (one rank, this model's sizes), on the H200 host."""
    from types import SimpleNamespace

    from moestream.engine.engine import Engine
    from moestream.moe.planner import model_sizes

    cfg, dense, kv, slot, expert = _qwen36_q4km()

    def snapshots(e):
        return e.prefix_cache_snapshots if e.prefix_cache_snapshots is not None else 2 * e.max_running_requests

    def sizes_for(e):
        return model_sizes(cfg, e, dense, cfg.max_position_embeddings, kv,
                           slot * (e.max_running_requests + snapshots(e)), expert)

    hw = Hardware("cuda", "H200", 139 * GiB, 128 * GiB, 120 * GiB, 16, context_bytes=context)
    fake = SimpleNamespace(hardware=hw, tp=None, _snapshots=snapshots)
    fake._smaller_options = lambda e: Engine._smaller_options(fake, e)
    fake._options_down_to = lambda e, floor: Engine._options_down_to(fake, e, floor)
    return fake, sizes_for, (lambda e: Engine._plan_fitting(fake, sizes_for, e, None))


def test_qwen36_q4km_shape_from_config():
    """The shape the small-cap tests plan: dense 1.36 GiB held on a GPU (what the real file's GGUF dense_bytes gave:
    1,462,091,008 bytes, and the H200 runs printed), 20 KiB of KV a token, 61.4 MiB of GDN state a request."""
    cfg, dense, kv, slot, expert = _qwen36_q4km()
    assert dense == 1_462_091_008 and f"{dense / GiB:.2f}" == "1.36"
    assert kv == 20480 and slot == 64_389_120 and expert == 2_039_808
    # every expert as a slot row (the largest layer's size); the banks at their own sizes are 18.16 GiB
    assert cfg.num_moe_layers * cfg.num_experts * expert / GiB == pytest.approx(19.45, abs=0.005)


@pytest.mark.parametrize("backend", ["cpu", "offload", "hybrid"])
def test_qwen36_q4km_at_llamacpp_cap_refused_with_the_reason(backend):
    """llama.cpp's -ncmoe 40 VRAM (2.22 GiB) cannot hold this model's plan: the dense layers alone (1.36 GiB) exceed
    the cap less the H200's CUDA context (0.67) and the runtime headroom (0.34, scaled to the cap), before any
    request state, KV or workspace. Refused with one line saying so, after every smaller option was tried."""
    fake, sizes_for, fit = _qwen36_engine()
    with pytest.raises(ConfigError) as err:
        fit(EngineConfig(moe_backend=backend, gpu_memory_gb=2.22))
    msg = str(err.value)
    assert "the cuda budget of 1.21 GiB (the 2.22 GiB cap less the CUDA context 0.67 GiB and runtime headroom 0.34 " \
           "GiB) does not cover dense weights (1.36 GiB), state pool (0.06 GiB) and workspace (0.28 GiB)" in msg
    assert "refused down to 1 running request(s), 0 prefix-cache snapshots and prefill chunks of 256 tokens" in msg
    assert "\n" not in msg


def _plan_total(p):
    b = p.bytes
    return b.dense + b.state + b.workspace + b.experts_device + b.prefill_buffer + b.kv + b.context


@pytest.mark.parametrize("cap,requests,snaps,chunk", [(2.8, 1, 0, 256), (3.0, 1, 0, 1024), (3.2, 4, 1, 1024)])
def test_qwen36_q4km_cpu_backend_small_caps(cap, requests, snaps, chunk):
    """--moe-backend cpu on a small card: the prefill double buffer goes first (experts on the CPU threads), then the
    chunk down to 1,024 tokens, the prefix snapshots and the running requests, then the chunk down to 256, until the
    KV holds a useful context (4,096 tokens) or nothing smaller is left; every item the plan counts, plus context
    and headroom, stays within the cap. (Before PREFILL_CHUNK_KEEP: 2 requests at 3.0 GiB and 2 snapshots at 3.2,
    each with 256-token chunks, i.e. every expert read 4x as often for a long prompt.)"""
    import math

    from moestream.moe.planner import cap_headroom

    _, sizes_for, fit = _qwen36_engine()
    plan, used = fit(EngineConfig(moe_backend="cpu", gpu_memory_gb=cap))
    b = plan.bytes
    assert plan.prefill_slots == 0 and b.prefill_buffer == 0 and b.experts_device == 0
    assert "prefill buffer none" in plan.describe()
    assert used.max_running_requests == plan.running_requests == requests
    assert (used.prefix_cache_snapshots or 0) == snaps and used.chunked_prefill_size == chunk
    assert b.state == 64_389_120 * (requests + snaps) and b.headroom == cap_headroom(int(cap * GiB))
    assert _plan_total(plan) <= int(cap * GiB) and b.context == H200_CONTEXT + b.headroom
    if cap == 2.8:  # one request: the best there is, below a useful context
        assert 1024 < plan.kv_tokens < 4096
    else:
        assert plan.kv_tokens >= 4096
    assert math.isclose(b.dense / GiB, 1.3617, abs_tol=1e-4)


@pytest.mark.parametrize("backend", ["offload", "hybrid", "cpu"])
def test_qwen36_q4km_32k_context_at_4gib(backend):
    """A 4 GiB card started for 32k-token prompts (--max-seq-len-override): the plan holds one whole request of KV
    (the requests share it) before expert slots take the rest, shrinking snapshots and requests where it must,
    instead of giving the KV to slots and keeping 4k tokens (the H200 run of 2026-12-05 planned 4,135 tokens and the benchmark cut its 32k prompt to 4k). Where no
    option holds the asked context, the plan is refused with one line that says so."""
    _, _, fit = _qwen36_engine()
    ctx = 32768 + 32 + 16
    plan, used = fit(EngineConfig(moe_backend=backend, gpu_memory_gb=4, max_seq_len_override=ctx))
    assert plan.kv_tokens >= ctx and _plan_total(plan) <= 4 * GiB
    if backend != "cpu":
        # a 32k prompt streams every expert once per chunk: chunks of 1,024 tokens in rounds of 64 rows, with 2
        # requests and 1 snapshot (the run of 2026-12-05 had 256-token chunks and 8 rows: TTFT 181 s on the H200)
        assert plan.cache_slots >= 8 and plan.prefill_slots == 64 and used.chunked_prefill_size == 1024
        assert (used.max_running_requests, used.prefix_cache_snapshots) == (2, 1)
    short, _ = fit(EngineConfig(moe_backend=backend, gpu_memory_gb=4))  # no context asked: 4 requests, 4k+ each
    assert short.running_requests == 4 and 4096 <= short.kv_tokens < ctx
    with pytest.raises(ConfigError) as err:
        fit(EngineConfig(moe_backend=backend, gpu_memory_gb=2.9, max_seq_len_override=ctx))
    msg = str(err.value)
    if backend == "cpu":  # a plan fits (no slots needed), with less KV than asked
        assert msg.startswith(f"--max-seq-len-override {ctx}: the budget holds KV for at most 6785 tokens")
    else:  # no plan fits beside the asked KV: the planner's reason, and why
        assert "room for 0 expert slots" in msg
        assert f"the KV of one --max-seq-len-override {ctx}-token request, 0.63 GiB, is held before any expert slot" in msg
    assert "\n" not in msg


# ---- the Qwen3.6-35B-A3B-shaped FP8 checkpoint (benchmarks/make_qwen36_fp8.py: vocabulary 248,320) at 4 GiB ---------
FP8_LINEARS = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a",
               "linear_attn.out_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")


def _qwen36_fp8_dense(layers: int = 40, head_q8: bool = False) -> tuple[dict, int, int, int]:
    """(config, dense bytes on a GPU with the embedding there, the embedding's bytes, the head's): FP8 codes + float32
    scales per 128x128 block for the quantized linears, bf16 for the rest (router, norms, conv, head). The formula
    equals HFCheckpoint.dense_bytes on the file the generator writes: 2,179,620,864 bytes for --layers 4, measured
    2026-12-06 on the dev VM (test_qwen36_fp8_dense_matches_the_file's below)."""
    import re

    import torch

    from moestream.config import ModelConfig
    from moestream.models.qwen_moe import QwenMoeModel

    conf = {**QWEN36, "vocab_size": 248320, "num_hidden_layers": layers,
            "layer_types": QWEN36["layer_types"][:layers]}
    cfg = ModelConfig.from_hf(conf)
    with torch.device("meta"):
        model = QwenMoeModel(cfg).to(torch.bfloat16)
    fp8 = re.compile(r"layers\.\d+\.(" + "|".join(re.escape(n) for n in FP8_LINEARS) + r")\.weight")
    total = 0
    for name, p in model.named_parameters():
        if fp8.fullmatch(name):
            r, c = p.shape
            total += r * c + -(-r // 128) * -(-c // 128) * 4
        else:
            total += p.numel() * 2
    V, H = cfg.vocab_size, cfg.hidden_size
    head = V * (H // 32) * 34 if head_q8 else V * H * 2
    return conf, total - V * H * 2 + head, V * H * 2, head


def test_qwen36_fp8_dense_matches_the_file():
    """The formula against HFCheckpoint.dense_bytes of the generator's 4-layer file (measured; writing it takes 5 GB,
    so CI checks the arithmetic): the full shape's dense layers are then 2.30 GiB with the embedding in host memory,
    0.88 GiB of them the bf16 head — the figure the H100 plan printed on 2026-12-06 (call 3)."""
    _, dense4, _, _ = _qwen36_fp8_dense(4)
    assert dense4 == 2_179_620_864
    _, dense, emb, head = _qwen36_fp8_dense(40)
    assert round((dense - emb) / GiB, 2) == 2.30 and round(head / GiB, 3) == 0.947


def _qwen36_fp8_engine(head_q8: bool, hint: bool = False):
    """fit(e) as Engine._plan_fitting with the FP8 shape's sizes (head_q8: the head planned in Q8_0); hint: instead
    hint(e), Engine._fitting_hint's sentence for a refused e (the head in bf16, its Q8_0 saving known)."""
    from types import SimpleNamespace

    from moestream.config import ModelConfig
    from moestream.engine.engine import Engine
    from moestream.moe.planner import model_sizes

    conf, dense, emb, head = _qwen36_fp8_dense(40, head_q8)
    cfg = ModelConfig.from_hf(conf)
    _, _, _, slot, _ = _qwen36_q4km()  # (the same GDN state)
    expert = 3 * 512 * 2048 + 3 * 4 * 16 * 4  # FP8 codes + the three matrices' block scales

    def snapshots(e):
        return e.prefix_cache_snapshots if e.prefix_cache_snapshots is not None else 2 * e.max_running_requests

    def make_sizes(dense_bytes):
        def sizes_for(e):
            kv = 10 * 2 * 2 * 256 * (1 if e.kv_cache_dtype.startswith("fp8") else 2)  # 10 attention layers, 2 KV heads
            return model_sizes(cfg, e, dense_bytes, cfg.max_position_embeddings, kv,
                               slot * (e.max_running_requests + snapshots(e)), expert)
        return sizes_for

    hw = Hardware("cuda", "H100", 79 * GiB, 128 * GiB, 120 * GiB, 16, context_bytes=H200_CONTEXT)
    V, H = cfg.vocab_size, cfg.hidden_size
    fake = SimpleNamespace(hardware=hw, tp=None, _snapshots=snapshots, num_kv_layers=10,
                           head_q8=None if head_q8 else (V * H * 2, V * (H // 32) * 34))
    fake._smaller_options = lambda e: Engine._smaller_options(fake, e)
    fake._options_down_to = lambda e, floor: Engine._options_down_to(fake, e, floor)
    fake._plan_fitting = lambda sizes_for, e, bw: Engine._plan_fitting(fake, sizes_for, e, bw)
    if hint:
        return lambda e: Engine._fitting_hint(fake, make_sizes, dense - emb, e, None)
    return lambda e: Engine._plan_fitting(fake, make_sizes(dense - emb), e, None)


def test_a_refused_plan_names_the_options_that_fit():
    """The FP8 shape refused at 4 GiB with a 32k context: the refusal's hint names what the user did not give and
    would make it fit (both options; only the head where the KV is fp8 already); nothing where nothing fits."""
    hint = _qwen36_fp8_engine(False, hint=True)
    base = dict(moe_backend="offload", gpu_memory_gb=4, max_seq_len_override=32816)
    assert hint(EngineConfig(**base)).startswith("it fits with --kv-cache-dtype fp8 --lm-head-quant q8_0 (")
    assert hint(EngineConfig(**base, kv_cache_dtype="fp8")).startswith("it fits with --lm-head-quant q8_0 (")
    assert hint(EngineConfig(**{**base, "gpu_memory_gb": 3.0})) is None


@pytest.mark.parametrize("kv,head_q8,fits", [("auto", False, False), ("fp8", False, False), ("auto", True, False),
                                             ("fp8", True, True)])
def test_qwen36_fp8_32k_context_at_4gib(kv, head_q8, fits):
    """Issue 17's FP8 case: a 32k-token context at 4 GiB. The bf16 head (0.95 GiB) and a bf16 KV (0.63 GiB a
    32,816-token request) leave no room for the 8 expert slots offload needs (refused so on the H100, 2026-12-06);
    neither --kv-cache-dtype fp8 (0.31 GiB) nor --lm-head-quant q8_0 (0.50 GiB) alone makes room; both do, within
    the cap."""
    fit = _qwen36_fp8_engine(head_q8)
    ctx = 32768 + 32 + 16
    e = EngineConfig(moe_backend="offload", gpu_memory_gb=4, max_seq_len_override=ctx, kv_cache_dtype=kv,
                     lm_head_quant="q8_0" if head_q8 else "none")
    if not fits:
        with pytest.raises(ConfigError, match="expert slots"):
            fit(e)
        return
    plan, used = fit(e)
    assert plan.kv_tokens >= ctx and plan.cache_slots >= 8 and _plan_total(plan) <= 4 * GiB
    # 1,024-token chunks with a 32-row buffer and one request (without the row caps: 256-token chunks, 8 rows and 4
    # requests, i.e. 128 streams of the model's 30 GB of experts for a 32k prompt instead of 32)
    assert (used.chunked_prefill_size, plan.prefill_slots, used.max_running_requests) == (1024, 32, 1)


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_qwen36_q4km_offload_small_caps(backend):
    """offload / hybrid at 3.0 and 3.2 GiB. 3.0: nothing holds 1,024-token chunks even with 8 prefill rows a half; at
    the chunk floor a small budget reserves one useful context and top-k prefill rows before the slots (it used to
    reserve 8,192 tokens and 64 rows, leaving no slot): 2 requests. 3.2: 1,024-token chunks fit with the buffer capped
    at 32 rows and one request, which the planner now prefers to 4 requests at 256-token chunks and 8 rows (what it
    planned before the row caps): a long prompt streams the experts 4x less often, in 4x fewer rounds a chunk, and at
    this residency a decode batch of 4 is no faster than one (PCIe-bound: batch 4 / batch 1 0.76-1.02 measured at 5.6 %
    residency, benchmarks/RESULTS.md, seventeenth session). Both with >= top-k slots and >= 4,096 KV tokens."""
    _, _, fit = _qwen36_engine()
    for cap, requests, rows, chunk in ((3.0, 2, 8, 256), (3.2, 1, 32, 1024)):
        plan, used = fit(EngineConfig(moe_backend=backend, gpu_memory_gb=cap))
        assert plan.backend == backend and used.max_running_requests == requests
        assert plan.prefill_slots == rows and used.chunked_prefill_size == chunk
        assert used.prefill_rows_cap == (32 if cap == 3.2 else None)
        assert plan.cache_slots >= 8 and plan.kv_tokens >= 4096
        assert _plan_total(plan) <= int(cap * GiB)


@pytest.mark.parametrize("backend,cap,want", [
    # (backend, slots, prefill rows, KV tokens, chunk, requests) as the planner gave before the small-cap changes
    # changed: offload at 4 GiB was (23, 8, 19348, 512, 4): the 64 rows set aside went to KV; now they are the buffer
    # and the chunk is not halved below PREFILL_CHUNK_KEEP while snapshots can give way
    ("offload", 4, (61, 64, 8229, 2048, 4)), ("offload", 8, (2040, 64, 8260, 2048, 4)),
    ("offload", 12, (4146, 64, 8217, 2048, 4)), ("offload", 24, (10240, 64, 30400, 2048, 4)),
    ("hybrid", 8, (2040, 64, 8260, 2048, 4)), ("auto", 24, (0, 0, 43149, 2048, 4)),
    ("cpu", 8, (0, 64, 131072, 2048, 4)), ("cpu", 24, (0, 64, 131072, 2048, 4)),
    # changed: at 4 GiB the cpu backend's 64-row prefill buffer (0.24 GiB) left 1,728 KV tokens; the KV reserve now
    # comes first and the buffer has top-k rows
    ("cpu", 4, (0, 8, 12884, 2048, 4)),
])
def test_qwen36_q4km_plans_at_4_to_24_gib(backend, cap, want):
    from moestream.moe.planner import CAP_HEADROOM

    _, _, fit = _qwen36_engine()
    plan, used = fit(EngineConfig(moe_backend=backend, gpu_memory_gb=cap))
    got = (plan.cache_slots, plan.prefill_slots, plan.kv_tokens, used.chunked_prefill_size, used.max_running_requests)
    assert got == want
    assert plan.bytes.headroom == CAP_HEADROOM  # the full headroom from 4 GiB up


def test_cap_headroom_scales_below_4_gib():
    from moestream.moe.planner import CAP_HEADROOM, CAP_MODULES, cap_headroom

    assert cap_headroom(4 * GiB) == cap_headroom(80 * GiB) == CAP_HEADROOM
    assert cap_headroom(0) == CAP_MODULES
    assert CAP_MODULES < cap_headroom(2 * GiB) < cap_headroom(3 * GiB) < CAP_HEADROOM
    p = plan_memory(BIG, gpu(139), EngineConfig(moe_backend="cpu", gpu_memory_gb=3))
    assert p.bytes.budget == 3 * GiB - cap_headroom(3 * GiB) and p.bytes.headroom == cap_headroom(3 * GiB)


def test_snapshots_the_gpu_cannot_keep_go_to_a_host_tier(monkeypatch):
    """Where the plan kept fewer prefix-cache snapshots on the GPU than the default count (and no
    --prefix-cache-host-gb was given), the engine builds a pinned host tier of just the others: the device keeps at
    least one slot to take a snapshot in, and the least recently used move out to host memory instead of being
    dropped. None on a CPU device, with tensor parallel ranks, with no device slot left, or nothing cut."""
    import types

    import torch

    import moestream.engine.engine as eng_mod
    from moestream.engine.engine import Engine

    made = []

    class Pool:  # records what the engine asks of kvcache.HostPool
        split = staticmethod(eng_mod.HostPool.split)

        def __new__(cls, kv, state, pages, snaps, pin):
            made.append((pages, snaps, pin))
            return "tier"

    monkeypatch.setattr(eng_mod, "HostPool", Pool)

    def fake(device="cuda", kept=2, asked=8, tp=None, host_gb=0.0):
        return types.SimpleNamespace(device=torch.device(device), tp=tp, num_state_snapshots=kept, asked_snapshots=asked,
                                     ecfg=EngineConfig(prefix_cache_host_gb=host_gb), _cache_bytes=lambda: (20480, 64 * MiB))

    def tier(eng):
        eng.spilled_snapshots = lambda: Engine.spilled_snapshots(eng)
        return Engine._build_host_tier(eng, None, None)

    assert tier(fake()) == "tier" and made[-1] == (0, 6, True)  # 3.2 GiB: 2 of 8 kept, 6 in host memory
    for eng in (fake(device="cpu"), fake(kept=0), fake(asked=2), fake(tp=object())):
        assert tier(eng) is None
    assert len(made) == 1
    e = fake(host_gb=1.0)  # an asked tier keeps its own split
    e.ecfg = e.ecfg.replace(tp_size=1)
    assert tier(e) == "tier" and made[-1][2] is True and made[-1][1] == (GiB // 2) // (64 * MiB)


def test_a_snapshots_only_host_tier_resumes_prompts(tiny_checkpoint, monkeypatch):
    """The tier of spilled snapshots (no pages) end to end on the hybrid tiny model, forced on a CPU (unpinned): one
    device snapshot slot, three conversations, then the first one's next turn resumes from its snapshot fetched back
    from host memory (without the tier: from nothing), with the cache-free tokens."""
    import torch

    import moestream.engine.engine as eng_mod
    from moestream import SamplingParams
    from moestream.engine.engine import Engine
    from moestream.kvcache import HostPool

    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def turns(llm):
        V = llm.model_config.vocab_size
        convs = [torch.randint(0, V, (30,), generator=torch.Generator().manual_seed(30 + i)).tolist() for i in range(3)]
        outs = [llm.generate([c], sp)[0] for c in convs]
        nxt = convs[0] + outs[0].token_ids + [5, 6, 7]
        return outs + [llm.generate([nxt], sp)[0]], convs + [nxt]

    kw = dict(device="cpu", dtype="float32", page_size=4, num_tokens=512, prefix_cache_snapshots=1)
    path = tiny_checkpoint("qwen35")
    outs, _ = turns(LLM(path, **kw))
    assert outs[-1].cached_tokens == 0  # its snapshot was pushed out by the later conversations'
    monkeypatch.setattr(Engine, "spilled_snapshots", lambda self: 8)
    monkeypatch.setattr(eng_mod, "HostPool", lambda kv, st, pages, snaps, pin: HostPool(kv, st, pages, snaps, pin=False))
    llm = LLM(path, **kw)
    assert llm.engine.caches.host.num_pages == 0 and llm.engine.caches.host.num_snaps == 8
    outs, prompts = turns(llm)
    ref = LLM(path, device="cpu", dtype="float32", page_size=4, num_tokens=512, prefix_cache=False)
    for o, p in zip(outs, prompts):
        assert o.token_ids == ref.generate([p], sp)[0].token_ids
    st = llm.scheduler.stats()["prefix_cache"]
    assert outs[-1].cached_tokens > 0 and st["spilled_snapshots"] > 0 and st["fetched_snapshots"] == 1


def test_banks_count_each_layers_own_expert_size():
    """A per-layer GGUF mix (Q4_K_M: Q6_K downs in some layers): host banks and fused experts on the device are each
    layer's own bytes, slot and prefill rows the largest layer's. (The Qwen3.6 Q4_K_M file's banks are 18.16 GiB, as
    its load reported on the H100; counted as slot rows they were 19.45 GiB, and fused was refused 1.3 GiB early.)"""
    from types import SimpleNamespace

    from moestream.moe.formats import layered_gguf_format
    from moestream.moe.planner import bank_bytes, model_sizes

    H = I = 256
    q4, q6 = {"gate": "Q4_K", "up": "Q4_K", "down": "Q4_K"}, {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}
    fmt = layered_gguf_format({0: q6, 1: q4, 2: q4, 3: q6}, H, I)
    row = fmt.bytes_per_expert(H, I)
    small, big = 3 * H * I * 144 // 256, 2 * H * I * 144 // 256 + H * I * 210 // 256
    assert row == big
    assert bank_bytes(fmt, H, I, [0, 1, 2, 3], 8) == 8 * (2 * small + 2 * big)
    assert bank_bytes(fmt, H, I, [0, 1, 2, 3, 4], 8) == 8 * (2 * small + 3 * big)  # a layer it does not type: a row
    cfg = SimpleNamespace(hidden_size=H, moe_intermediate_size=I, top_k=2, num_experts=8, num_moe_layers=4)
    banks = bank_bytes(fmt, H, I, [0, 1, 2, 3], 8)
    e = EngineConfig(moe_backend="offload", num_tokens=4096)
    m = model_sizes(cfg, e, 1 * MiB, 4096, 1024, 1 * MiB, row, banks)
    hw = Hardware("cuda", "test", 8 * GiB, 64 * GiB, 60 * GiB, 8)
    p = plan_memory(m, hw, e)
    assert p.bytes.host_banks == banks < 32 * row and p.bytes.prefill_buffer == 2 * p.prefill_slots * row
    fused = plan_memory(m, hw, EngineConfig(moe_backend="fused", num_tokens=4096))
    assert fused.bytes.experts_device == banks
    cpu = plan_memory(m, Hardware("cpu", "test", 60 * GiB, 64 * GiB, 60 * GiB, 8), EngineConfig(num_tokens=4096))
    assert cpu.bytes.experts_device == banks


def test_bench_cpu_rate_is_the_bridges_layer_call(monkeypatch):
    """bench bw's CPU experts rate times the call the cpu / hybrid backends' bridge makes (cpu_moe.LayerCall, a new
    set of experts each call) where the kernels read the bank — a bf16 bank included — and compute.CpuExperts'
    path where they do not (float32 rows)."""
    import torch

    from moestream.kernels import cpu_quant
    from moestream.moe import bench, cpu_moe
    from moestream.moe.compute import CpuExperts

    if not cpu_quant.available():
        pytest.skip("CPU kernels not built here")
    seen, submits = [], []
    real = cpu_moe.LayerCall.__call__
    monkeypatch.setattr(cpu_moe.LayerCall, "__call__",
                        lambda self, x, experts, *a: seen.append(tuple(experts)) or real(self, x, experts, *a))
    real_submit = CpuExperts.submit
    monkeypatch.setattr(CpuExperts, "submit", lambda self, *a, **k: submits.append(1) or real_submit(self, *a, **k))
    cpu = CpuExperts(1)
    try:
        for dtype, bridged in ((torch.bfloat16, True), (torch.float32, False)):
            seen.clear(), submits.clear()
            fmt = bench.expert_format("bf16", dtype, 128, 64)
            bank = bench.make_bank(fmt, 8, 128, 64)
            assert bench.expert_gbs(bank, 2, 128, dtype, torch.device("cpu"), 3, cpu, fmt) > 0
            assert bool(seen) == bridged and bool(submits) != bridged
            if bridged:
                assert len(set(seen)) == 4 and all(len(e) == 2 for e in seen)  # 8 experts, 2 a call, rotating
    finally:
        cpu.close()
