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

    slot = 64 * MiB

    def snapshots(e):
        return e.prefix_cache_snapshots if e.prefix_cache_snapshots is not None else 2 * e.max_running_requests

    def sizes_for(e):
        return dataclasses.replace(BIG, state_bytes=slot * (e.max_running_requests + snapshots(e)),
                                   wanted_kv_tokens=4096, min_kv_tokens=4096)

    fake = SimpleNamespace(hardware=gpu(140), _snapshots=snapshots)
    e = EngineConfig(moe_backend="offload", gpu_memory_gb=4.0, max_running_requests=4, chunked_prefill_size=256)
    with pytest.raises(ConfigError):
        plan_memory(sizes_for(e), fake.hardware, e)
    plan, used = Engine._plan_fitting(fake, sizes_for, e, None)
    assert used.prefix_cache_snapshots == 4 and plan.cache_slots >= BIG.top_k  # halved once: fits
    with pytest.raises(ConfigError):
        Engine._plan_fitting(fake, sizes_for, e.replace(prefix_cache_snapshots=8), None)


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
    assert base.prefill_slots == 8 and base.cache_slots < 32  # few slots: a buffer of top-k rows
    for rows, want in (("64", 64), ("200", 64), ("2", 8), ("16", 16)):
        monkeypatch.setenv("MOESTREAM_PREFILL_ROWS", rows)
        p = plan_memory(small, hw, e)
        assert p.prefill_slots == want and p.cache_slots == base.cache_slots
        freed = 2 * (want - base.prefill_slots) * small.expert_bytes / small.kv_bytes_per_token
        assert abs(p.kv_tokens - (base.kv_tokens - freed)) <= 1 and p.kv_tokens >= 8192
