"""Expert backends on CUDA (skipped without a GPU): tokens equal fused, copies on the copy stream,
pinned host banks, and `bench bw` measuring PCIe."""
from __future__ import annotations

import json

import pytest
import torch

from moestream import LLM, SamplingParams
from moestream.cli import main

pytestmark = pytest.mark.cuda
SP = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
COMMON = dict(device="cuda", dtype="float32", chunked_prefill_size=7, max_running_requests=4)


@pytest.fixture(autouse=True)
def no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False


def tokens(llm):
    ps = [[5 + i for i in range(n)] for n in (4, 17, 30)]
    return [o.token_ids for o in llm.generate(ps, SP)]


@pytest.mark.parametrize("arch", ["qwen3", "qwen35"])
def test_cuda_backends_equal_fused(arch, tiny_checkpoint):
    want = tokens(LLM(tiny_checkpoint(arch), moe_backend="fused", **COMMON))
    for backend, kw in [("offload", {"moe_cache_size": 3, "moe_prefetch": "on"}), ("offload", {"moe_cache_size": 5, "moe_prefetch": "off"}),
                        ("hybrid", {"moe_cache_size": 3}), ("cpu", {})]:
        llm = LLM(tiny_checkpoint(arch), moe_backend=backend, **COMMON, **kw)
        assert tokens(llm) == want, (backend, kw)
        t = llm.stats()["total"]
        assert t["gpu_experts"] + t["cpu_experts"] == t["expert_calls"]
        if backend != "cpu":
            assert t["misses"] > 0 and t["evictions"] > 0 and t["bytes_h2d"] > 0 and t["copy_s"] > 0
            assert llm.engine.pinning["pinned_bytes"] > 0  # default pin budget pins these small banks
        if backend == "cpu":
            assert t["prefill_streamed"] > 0  # prefill chunks ran on the GPU through the double buffer
        llm.engine.runtime.close()


def test_cuda_pin_budget_zero_is_pageable_and_still_correct(tiny_checkpoint):
    want = tokens(LLM(tiny_checkpoint("qwen3"), moe_backend="fused", **COMMON))
    llm = LLM(tiny_checkpoint("qwen3"), moe_backend="offload", moe_cache_size=4, pin_budget_gb=0, **COMMON)
    assert llm.engine.pinning["pinned_bytes"] == 0
    assert tokens(llm) == want


def test_cuda_bench_bw(tmp_path):
    out = tmp_path / "bw.json"
    assert main(["bench", "bw", "--device", "cuda", "-o", str(out), "--experts", "16", "--iters", "3",
                 "--host-mib", "64"]) == 0
    prof = json.loads(out.read_text())
    assert prof["pcie_pinned_gbs"] > 1 and prof["pcie_pageable_gbs"] > 0 and prof["gpu_expert_gbs"] > 0
    assert prof["recommended"] in ("offload", "hybrid")
    kern = prof["pcie_kernel"]  # the staging kernel's own reads of pinned rows (Triton is on the GPU image)
    assert kern["all_gbs"] > 1 and kern["two_gbs"] > 0.1 and kern["two_call_us"] > 0
    both = prof["concurrent"]  # host reads and pinned copies at once: both ran, the sum is theirs
    assert both["cpu_gbs"] > 0 and both["pcie_gbs"] > 1
    assert abs(both["sum_gbs"] - both["cpu_gbs"] - both["pcie_gbs"]) < 0.02


def test_host_to_device_does_not_wait_for_the_gpu():
    """moe/compute.host_to_device (a prefill round's expert rows, a chunk's hit counts) copies without a stream
    sync, where torch.tensor(list, device="cuda") synchronizes (CUDA's sync debug mode raises on it)."""
    from moestream.moe.compute import host_to_device

    dev = torch.device("cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            torch.tensor([1, 2, 3], device=dev)  # the mode does catch a synchronizing copy
        t = host_to_device([4, -1, 7], dev)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert t.device.type == "cuda" and t.dtype == torch.long and t.tolist() == [4, -1, 7]


def test_cuda_auto_measures_bandwidths_without_a_profile(tiny_checkpoint, tmp_path, monkeypatch):
    """No saved `bench bw` profile: the function the engine hands the planner measures pinned PCIe and the CPU
    experts in the model's own expert format, once (memoized), on the real device."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    llm = LLM(tiny_checkpoint("qwen3"), moe_backend="auto", **COMMON)
    eng = llm.engine
    measure = eng._measure_bandwidths(eng.runtime.store.fmt)
    bw = measure()
    assert bw.pcie_pinned_gbs > 0.1 and bw.cpu_expert_gbs > 0
    assert measure() is bw
    llm.engine.runtime.close()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_cuda_gguf_misses_fetched_in_the_pair_kernels(tmp_path, monkeypatch, tiny_checkpoint, qtype):
    """A tiny GGUF's compressed experts, offload and hybrid with a small cache: the greedy tokens of fused whether the
    pair kernels copy a decode call's misses themselves (MOESTREAM_FETCH_IN_PAIRS=1, the default: one-token calls;
    "all": batched calls too) or the copy kernel stages them first ("0"), and the fetch kernels are taken exactly
    where the setting says (asserted, not assumed)."""
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    from moestream.moe import qpairs

    path, _ = gguf_writer.write_gguf(tiny_checkpoint("qwen35_causal"), tmp_path / "m.gguf", getattr(Q, qtype))
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 14, 3], list(range(20, 60))]
    kw = dict(device="cuda", dtype="float32", max_running_requests=4)

    def run(llm):  # each prompt alone (one-token decode calls), then both together (two-token calls)
        return [llm.generate([p], sp)[0].token_ids for p in prompts] + [o.token_ids for o in llm.generate(prompts, sp)]

    want = run(LLM(path, moe_backend="fused", **kw))
    real, taken = qpairs.fetches_in_pairs, []

    def spy(x, fmt, pool, tokens):
        r = real(x, fmt, pool, tokens)
        taken.append((tokens, r))
        return r

    monkeypatch.setattr(qpairs, "fetches_in_pairs", spy)
    for how in ("1", "all", "0"):
        monkeypatch.setenv("MOESTREAM_FETCH_IN_PAIRS", how)
        for backend in ("offload", "hybrid"):
            taken.clear()
            llm = LLM(path, moe_backend=backend, moe_cache_size=3, **kw)
            assert run(llm) == want, (how, backend)
            assert llm.stats()["total"]["misses"] > 0
            fetched = {t for t, r in taken if r}
            assert fetched == ({1} if how == "1" else {1, 2} if how == "all" else set()), (how, backend, fetched)
            llm.engine.runtime.close()
