"""Decode steps replayed as CUDA graphs give the eager tokens (CUDA only; skipped without a GPU)."""
from __future__ import annotations

import logging

import pytest
import torch

from moestream import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SP = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def no_capture_failure(caplog):
    """Every test here means its graphs to be recorded: a capture that failed (decode then runs eagerly, and a graph
    run's tokens equal the eager run's trivially) fails the test (on the 2026-12-07 H100 run an experiment's
    side-stream fork, left unjoined at the step's end, failed every capture: tokens alone could not show it)."""
    caplog.set_level(logging.WARNING, logger="moestream")
    yield
    failed = [r.getMessage() for r in caplog.records if "CUDA graph capture failed" in r.getMessage()]
    assert not failed, failed[0]


def fixed_split(monkeypatch):
    """hybrid's live split held at its prior, half of a call's misses to the CPU (moe/share.py): a tiny model's
    experts cross PCIe in well under a CPU call's fixed cost, so the measured split would fetch them all and the
    CPU pairs inside the graph would go untested; held, the split depends on the routes alone (same in both runs)."""
    from moestream.moe import share

    monkeypatch.setattr(share, "PRIOR_FIXED_S", 0.0)
    monkeypatch.setattr(share.LiveShare, "observe", lambda self, fit: None)
    monkeypatch.setenv("MOESTREAM_HYBRID_ARMS", "0")  # every step on the split (the arms follow step times)


@pytest.mark.parametrize("arch", ["qwen3", "qwen35"])
@pytest.mark.parametrize("backend,kw", [("fused", {}), ("offload", {"moe_cache_size": 5}),
                                        ("offload", {"moe_cache_size": 20}),
                                        # the next layer's predicted experts copied on a side stream (fork/join
                                        # recorded in the graph)
                                        ("offload", {"moe_cache_size": 20, "moe_prefetch": "on"}),
                                        # 20 slots: with 5 every slot holds a pair of the layer being computed,
                                        # so nothing is prefetched (the split is held at its prior, so the CPU
                                        # still gets misses: 123 CPU experts, 124 prefetches on the CPU twin)
                                        ("hybrid", {"moe_cache_size": 20, "moe_prefetch": "on"}),
                                        # CPU pairs through the bridge (moe/bridge.py), inside the graph
                                        ("cpu", {}), ("hybrid", {"moe_cache_size": 5})])
def test_graph_decode_equals_eager(arch, backend, kw, tiny_checkpoint, monkeypatch):
    fixed_split(monkeypatch)
    common = dict(device="cuda", dtype="bfloat16", moe_backend=backend, max_running_requests=4, **kw)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (3, 300, 17)]
    outs, counts = {}, {}
    for graphs in (False, True):
        llm = LLM(tiny_checkpoint(arch), cuda_graphs=graphs, **common)
        one = [o.token_ids for o in llm.generate(prompts[:1], SP)]  # batch 1
        many = [o.token_ids for o in llm.generate(prompts, SP)]  # batch 3, two KV buckets
        outs[graphs] = (one, many)
        eng = llm.engine
        assert eng.runtime.capturable()
        if backend == "fused":  # the step's counts, one launch at its end (inside the graph when recorded)
            t = eng.runtime.stats()["total"]
            counts[graphs] = (t["hits"], t["expert_calls"], eng.runtime.cache.expert_hits())
        if graphs:
            assert eng.graphs.recorded >= 2 and eng.graphs.replays > 40
        if backend in ("cpu", "hybrid"):
            assert eng.runtime.bridge is not None and sum(eng.runtime.bridge.cpu_experts) > 0
        if backend in ("offload", "hybrid"):
            eng.runtime.check_integrity()
            t = eng.runtime.stats()["total"]
            # hits and misses count decode calls (device cache); expert_calls also counts prefill chunks
            assert 0 < t["hits"] + t["misses"] <= t["expert_calls"] and t["misses"] > 0
            if kw.get("moe_prefetch") == "on":
                assert 0 < t["prefetch_hits"] <= t["prefetch_issued"]
    assert outs[True] == outs[False]
    assert counts.get(True) == counts.get(False)


@pytest.mark.parametrize("arch", ["qwen3", "qwen35"])
def test_prefetch_gives_fused_tokens(arch, tiny_checkpoint):
    """Offload with the lookahead prefetch (side-stream copies into slots while other slots are read) gives fused's
    tokens under CUDA graphs, at batch 1 and 3, with a cache small enough that prefetches evict."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (5, 200, 33)]
    outs = {}
    for backend, kw in (("fused", {}), ("offload", {"moe_cache_size": 12, "moe_prefetch": "on"})):
        llm = LLM(tiny_checkpoint(arch), device="cuda", dtype="bfloat16", moe_backend=backend, max_running_requests=4,
                  **kw)
        outs[backend] = ([o.token_ids for o in llm.generate(prompts[:1], SP)],
                         [o.token_ids for o in llm.generate(prompts, SP)])
        if backend == "offload":
            t = llm.engine.runtime.stats()["total"]
            assert t["prefetch_issued"] > 0 and t["evictions"] > 0 and llm.engine.graphs.replays > 0
            llm.engine.runtime.check_integrity()
    assert outs["offload"] == outs["fused"]


@pytest.mark.parametrize("backend,kw", [("fused", {}), ("offload", {"moe_cache_size": 5}), ("hybrid", {"moe_cache_size": 5}),
                                        # every expert through the CPU bridge, the drafter's passes too (a95b72c)
                                        ("cpu", {})])
def test_graph_verify_steps_equal_eager(backend, kw, tiny_checkpoint, monkeypatch):
    """--speculative mtp: verify steps (the newest token and its drafts, laid out as decode rows) are recorded and
    replayed as CUDA graphs that keep the drafter's hidden rows, and give the eager tokens at batch 1 and 3."""
    fixed_split(monkeypatch)
    common = dict(device="cuda", dtype="bfloat16", moe_backend=backend, max_running_requests=4, speculative="mtp",
                  num_speculative_tokens=2, **kw)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (4, 150, 23)]
    outs = {}
    for graphs in (False, True):
        llm = LLM(tiny_checkpoint("qwen35_mtp"), cuda_graphs=graphs, **common)
        outs[graphs] = ([o.token_ids for o in llm.generate(prompts[:1], SP)],
                        [o.token_ids for o in llm.generate(prompts, SP)])
        assert llm.stats()["speculative"]["verify_steps"] > 0
        if graphs:
            eng = llm.engine
            assert any(key[2] > 1 and key[3] for key in eng.graphs.entries) and eng.graphs.replays > 10
    assert outs[True] == outs[False]


def test_graph_hybrid_arms_equal_eager(tiny_checkpoint, monkeypatch):
    """hybrid's two step forms (the live split; every miss fetched, no CPU bridge in the step) are recorded as
    separate graphs (the key's variant) and replayed as the arms pick them: the eager tokens. The arms alternate
    by step count here (not by measured time), so both runs take the same forms."""
    from moestream.moe import share, strategies

    class Alternate(share.Arms):
        n = 0

        def pick(self, rows):
            return share.SPLIT if Alternate.n % 3 else share.FETCH

        def observe(self, rows, arm, seconds):
            Alternate.n += 1

    fixed_split(monkeypatch)
    monkeypatch.setenv("MOESTREAM_HYBRID_ARMS", "1")
    monkeypatch.setattr(strategies, "Arms", Alternate)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (6, 90)]
    outs = {}
    for graphs in (False, True):
        Alternate.n = 0
        llm = LLM(tiny_checkpoint("qwen35"), device="cuda", dtype="bfloat16", moe_backend="hybrid", moe_cache_size=5,
                  max_running_requests=4, cuda_graphs=graphs)
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, SP)]
        if graphs:
            assert {key[4] for key in llm.engine.graphs.entries} == {0, 1} and llm.engine.graphs.replays > 20
        assert sum(llm.engine.runtime.bridge.cpu_experts) > 0
    assert outs[True] == outs[False]


@pytest.mark.parametrize("arch", ["qwen3", "qwen35"])
@pytest.mark.parametrize("backend,kw", [("fused", {}), ("offload", {"moe_cache_size": 5}), ("cpu", {}),
                                        ("hybrid", {"moe_cache_size": 5})])
def test_overlapped_decode_equals_stepwise(arch, backend, kw, tiny_checkpoint, monkeypatch):
    """--overlap-schedule auto on CUDA (graphs replaying; each step launched before the last one's tokens are read,
    its input ids taken on the device) gives the tokens of --overlap-schedule off, one request stopped early by a
    stop token (a wasted row after its last token), batch 1 and 3; and the steps were overlapped (cpu and hybrid: the
    CPU worker serving the launched step's job after the pending one's)."""
    if backend == "hybrid":  # the split held (else a tiny model's misses all cross PCIe: no CPU pair overlapped)
        fixed_split(monkeypatch)
    common = dict(device="cuda", dtype="bfloat16", moe_backend=backend, max_running_requests=4, **kw)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (3, 300, 17)]
    outs, chained = {}, []
    on = "on" if backend in ("cpu", "hybrid") else "auto"  # (auto leaves cpu / hybrid stepwise until measured)
    for mode in ("off", on):
        llm = LLM(tiny_checkpoint(arch), overlap_schedule=mode, **common)
        runner, orig = llm.llm_engine.runner, llm.llm_engine.runner.launch
        n = [0]

        def launch(sched, prev=None, orig=orig, n=n):
            n[0] += prev is not None
            return orig(sched, prev)

        monkeypatch.setattr(runner, "launch", launch)
        one = [o.token_ids for o in llm.generate(prompts[:1], SP)]
        stop = one[0][9]
        sps = [SP, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]), SP]
        many = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, sps)]
        llm.scheduler.check_integrity()
        outs[mode] = (one, many)
        chained.append(n[0])
    assert outs[on] == outs["off"]
    assert chained[0] == 0 and chained[1] > 40
    if backend in ("cpu", "hybrid"):
        assert sum(llm.engine.runtime.bridge.cpu_experts) > 0 and not llm.engine.runtime.bridge._pending


@pytest.mark.parametrize("arch", ["qwen3", "qwen35"])
def test_graph_hybrid_large_cache_equal_eager(arch, tiny_checkpoint):
    """hybrid over a cache holding over 45 % of the experts runs offload's step (share.HeldFetch: only the fetch
    form's graphs, no job for the CPU worker): the eager tokens, an intact cache, the graphs replayed."""
    from moestream.moe import share

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (3, 300, 17)]
    size = {"qwen3": 24, "qwen35": 32}[arch]  # (all experts + scratch rows would be fused: a cache of every one)
    outs = {}
    for graphs in (False, True):
        llm = LLM(tiny_checkpoint(arch), device="cuda", dtype="bfloat16", moe_backend="hybrid", moe_cache_size=size,
                  max_running_requests=4, cuda_graphs=graphs)
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, SP)]
        rt = llm.engine.runtime
        rt.check_integrity()
        assert isinstance(rt.decode.arms, share.HeldFetch) and rt.bridge.seq == 0
        if graphs:  # recorded and replayed, not eager after a failed capture
            assert {key[4] for key in llm.engine.graphs.entries} == {1}
            assert llm.engine.graphs.enabled and llm.engine.graphs.replays > 20
    assert outs[True] == outs[False]
