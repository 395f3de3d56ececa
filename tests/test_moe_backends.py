"""Every expert backend gives fused's greedy tokens, with a cache small enough to miss and evict."""
from __future__ import annotations

import json

import pytest
import torch

from moestream import LLM, SamplingParams

ARCHS = ["qwen3", "qwen35"]
SP = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# 7-token chunks: prompts prefill over several steps, mixed with other requests' decode tokens
# one CPU-expert thread: these tiny models are dominated by thread hand-offs, not arithmetic
COMMON = dict(device="cpu", dtype="float32", chunked_prefill_size=7, max_running_requests=4, moe_cpu_threads=1)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompts(vocab):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (4, 17, 30)]


@pytest.fixture(scope="module")
def fused_tokens(tiny_checkpoint):
    cache = {}

    def get(arch):
        if arch not in cache:
            llm = LLM(tiny_checkpoint(arch), moe_backend="fused", **COMMON)
            ps = prompts(llm.model_config.vocab_size)
            cache[arch] = (ps, [o.token_ids for o in llm.generate(ps, SP)])
        return cache[arch]

    return get


def run(tiny_checkpoint, arch, backend, **kw):
    llm = LLM(tiny_checkpoint(arch), moe_backend=backend, **COMMON, **kw)
    ps = prompts(llm.model_config.vocab_size)
    return llm, [o.token_ids for o in llm.generate(ps, SP)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend,kw", [
    ("offload", {"moe_cache_size": 3, "moe_prefetch": "on"}),
    ("offload", {"moe_cache_size": 12, "moe_prefetch": "off"}),
    ("offload", {"moe_cache_size": 10}),  # the default (prefetch off)
    # the pair kernels' torch reference with the device-side slot cache (the CUDA decode path)
    ("offload", {"moe_cache_size": 3, "moe_decode_kernel": "pairs"}),
    ("offload", {"moe_cache_size": 12, "moe_decode_kernel": "pairs"}),
    # lookahead prefetch on the pair path: the next layer's predicted experts admitted and copied ahead
    ("offload", {"moe_cache_size": 14, "moe_decode_kernel": "pairs", "moe_prefetch": "on"}),
    ("hybrid", {"moe_cache_size": 14, "moe_decode_kernel": "pairs", "moe_prefetch": "on"}),
    ("fused", {"moe_decode_kernel": "pairs"}),
    # CPU pairs through the bridge (moe/bridge.py): a worker thread answers each layer's posted request
    ("cpu", {"moe_decode_kernel": "pairs"}),
    ("hybrid", {"moe_cache_size": 3, "moe_decode_kernel": "pairs"}),
    ("cpu", {}),
    ("hybrid", {"moe_cache_size": 3, "moe_prefetch": "on"}),
    # frequency-aware victim choice (moe/residency.py): the grouped path's host cache
    ("offload", {"moe_cache_size": 6, "moe_cache_policy": "wlfu"}),
    ("offload", {"moe_cache_size": 5, "moe_cache_policy": "lfu", "moe_prefetch": "on"}),
    ("hybrid", {"moe_cache_size": 6, "moe_cache_policy": "lrfu"}),
])
def test_backend_tokens_equal_fused(arch, backend, kw, tiny_checkpoint, fused_tokens, monkeypatch):
    if backend == "hybrid":  # every step on the split, also where the cache holds over 45 % of the experts (14 of
        monkeypatch.setenv("MOESTREAM_HYBRID_ARMS", "0")  # qwen3's 24), which would run offload's step (HeldFetch)
    ps, want = fused_tokens(arch)
    llm, got = run(tiny_checkpoint, arch, backend, **kw)
    assert got == want
    st = llm.stats()
    json.dumps(st)  # served as /v1/stats: every value JSON-serialisable
    t = st["total"]
    assert st["backend"] == backend == st["plan"]["backend"]
    if backend == "hybrid" and kw.get("moe_decode_kernel") == "pairs":  # the live share, fitted to the CPU's calls
        assert 0.0 <= st["hybrid"]["fetch_share"] <= 1.0 and st["hybrid"]["measured_windows"] >= 1
    # every routed expert computed exactly once, on the device or on the CPU
    assert t["gpu_experts"] + t["cpu_experts"] == t["expert_calls"] > 0
    for layer in st["layers"].values():
        assert layer["gpu_experts"] + layer["cpu_experts"] == layer["expert_calls"]
    # per-expert hits (the web page's heat map) add up to each layer's hits; cpu caches nothing
    assert ("expert_hits" in st) == (backend != "cpu")
    for layer, hits in st.get("expert_hits", {}).items():
        assert len(hits) == st["num_experts"] and sum(hits) == st["layers"][layer]["hits"]
    if backend in ("offload", "hybrid"):
        assert t["misses"] > 0 and t["evictions"] > 0 and t["hits"] > 0
        nbytes = llm.engine.runtime.store.bytes_per_expert()
        if kw.get("moe_decode_kernel") == "pairs":  # misses are read by the kernel (once per pair), then admitted
            assert t["bytes_h2d"] >= t["misses"] * nbytes and t["copies"] > 0
        else:
            assert t["bytes_h2d"] > 0 and t["copies"] * nbytes == t["bytes_h2d"]
        assert t["prefill_streamed"] > 0  # prefill chunks went through the double buffer
        assert 0 <= st["hit_rate"] <= 1 and llm.engine.runtime.step_hit_rate() is not None
        llm.engine.runtime.check_integrity()
        assert st["cache"]["resident"] <= kw["moe_cache_size"]
    if backend == "offload":
        assert t["cpu_experts"] == 0
    if backend == "cpu":
        assert t["gpu_experts"] == 0 and t["hits"] == 0 and t["bytes_h2d"] == 0
    if backend == "hybrid":
        assert t["cpu_experts"] > 0 and t["gpu_experts"] > 0
    if backend in ("cpu", "hybrid") and kw.get("moe_decode_kernel") == "pairs":
        bridge = llm.engine.runtime.bridge
        assert bridge is not None and bridge.seq > 0 and sum(bridge.cpu_experts) > 0  # decode went through it
        assert t["cpu_s"] >= sum(bridge.cpu_seconds) > 0  # the worker's compute time reaches the stats
        assert 0 <= t["cpu_kernel_s"] <= t["cpu_s"] and t["cpu_kernel_s"] == pytest.approx(sum(bridge.kernel_seconds))
        # the worker's waits for the GPU's requests and its handoffs reach the stats too (on a CPU device the posts
        # come from this thread: the worker waits between them)
        assert t["cpu_wait_s"] == pytest.approx(sum(bridge.wait_seconds)) and t["cpu_wait_s"] > 0
        assert t["cpu_handoff_s"] == pytest.approx(sum(bridge.handoff_seconds)) and t["cpu_handoff_s"] >= 0
    if kw.get("moe_prefetch", "off") == "off":
        assert t["prefetch_issued"] == 0 and t["prefill_lookahead"] == 0
    elif backend in ("offload", "hybrid"):
        assert t["prefetch_issued"] > 0
        assert t["prefetch_hits"] + t["prefetch_unused"] <= t["prefetch_issued"]
        if kw.get("moe_decode_kernel") == "pairs":  # a prefetched expert is counted a hit of the call it served
            assert 0 < t["prefetch_hits"] <= t["hits"]


def test_hybrid_exactly_once_per_decode_step(tiny_checkpoint):
    """Per layer call in decode: hits + misses == distinct routed experts == device + CPU computations
    (a miss is either fetched or computed on CPU, never both)."""
    llm = LLM(tiny_checkpoint("qwen3"), moe_backend="hybrid", moe_cache_size=4, **COMMON)
    seen = decode_call_counts(llm, [[1, 2, 3], [7, 8, 9, 10]], ("hits", "misses", "gpu_experts", "cpu_experts"))
    for n, _, d in seen:
        assert d["hits"] + d["misses"] == n == d["gpu_experts"] + d["cpu_experts"], d
    assert seen and sum(d["cpu_experts"] for _, _, d in seen) > 0


def decode_call_counts(llm, prompts, keys):
    """Generate `prompts`; per decode layer call: (distinct routed experts, tokens, {key: change of the
    runtime's counter `key` over the call})."""
    rt = llm.engine.runtime
    seen = []
    orig = rt.forward

    def spy(layer, x, ids, w):
        before = rt.book.total()
        y = orig(layer, x, ids, w)
        after = rt.book.total()
        if not rt.prefill_mode:
            seen.append((len(torch.unique(ids)), ids.shape[0],
                         {k: getattr(after, k) - getattr(before, k) for k in keys}))
        return y

    for block in llm.engine.model.moe_blocks():
        block.runtime.forward = spy
    llm.generate(prompts, SP)
    return seen


def test_prefill_streaming_keeps_decode_working_set(tiny_checkpoint):
    """A long prefill through offload does not flush the cache: the resident set is unchanged by it."""
    llm = LLM(tiny_checkpoint("qwen3"), moe_backend="offload", moe_cache_size=6, **COMMON)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    rt = llm.engine.runtime
    before = list(rt.residency.slot_of)
    llm.generate([list(range(40))], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert list(rt.residency.slot_of) == before  # max_tokens=1: prefill steps only
    assert rt.stats()["total"]["prefill_streamed"] > 0


def test_stats_shape_and_resize(tiny_checkpoint):
    llm, _ = run(tiny_checkpoint, "qwen35", "offload", moe_cache_size=4)
    st = llm.stats()
    assert set(st["layers"]) == {str(i) for i in range(4)}
    assert st["plan"]["cache_slots"] == 4 and st["plan"]["residency"] == 4 / 32
    assert "timing" in st and "copy_s" in st["total"]
    rt = llm.engine.runtime
    rt.resize(6)
    _, again = run(tiny_checkpoint, "qwen35", "offload", moe_cache_size=4)
    assert rt.stats()["cache"]["slots"] == 6
    assert [o.token_ids for o in llm.generate(prompts(llm.model_config.vocab_size), SP)] == again


def test_cpu_bridge_failure_fails_the_step_not_the_engine(tiny_checkpoint, fused_tokens):
    """A CPU expert exception inside a bridged decode step surfaces as that step's error; the worker and
    the engine go on and later requests get fused's tokens."""
    ps, want = fused_tokens("qwen3")
    llm = LLM(tiny_checkpoint("qwen3"), moe_backend="cpu", moe_decode_kernel="pairs", **COMMON)
    bridge = llm.engine.runtime.bridge
    real = bridge._compute
    calls = []

    def broken(i, layer):
        calls.append(layer)
        raise MemoryError("injected")

    bridge._compute = broken
    with pytest.raises(RuntimeError, match="CPU experts failed.*injected"):
        llm.generate(ps[:1], SP)
    assert calls
    bridge._compute = real
    llm2_tokens = [o.token_ids for o in llm.generate(ps, SP)]
    assert llm2_tokens == want


@pytest.mark.parametrize("arch", ARCHS)
def test_reconfigure_keeps_fused_tokens(tiny_checkpoint, fused_tokens, arch):
    """Engine.reconfigure_experts (the benchmarks' sweep) swaps the runtime on the loaded weights: every
    block then runs the new one (none keeps the old), and each backend still gives fused's tokens."""
    ps, want = fused_tokens(arch)
    llm = LLM(tiny_checkpoint(arch), moe_backend="fused", **COMMON)
    for backend, kw in (("offload", {"moe_cache_size": 3}), ("hybrid", {"moe_cache_size": 3}), ("fused", {})):
        old = llm.engine.runtime
        plan = llm.engine.reconfigure_experts(moe_backend=backend, **kw)
        assert plan.backend == backend and llm.engine.runtime is not old
        assert all(b.runtime is llm.engine.runtime for b in llm.engine.model.moe_blocks())
        assert [o.token_ids for o in llm.generate(ps, SP)] == want, backend


def test_a_refused_reconfigure_changes_nothing(tiny_checkpoint, fused_tokens):
    """A re-plan the budget or options cannot take raises with the reason and leaves the engine as it was: its
    options, plan and a working runtime (the benchmarks' sweep went on with an engine that had none: every later
    configuration failed with AttributeError on the H200)."""
    from moestream.core import ConfigError

    ps, want = fused_tokens("qwen3")
    llm = LLM(tiny_checkpoint("qwen3"), moe_backend="offload", moe_cache_size=3, **COMMON)
    ecfg, plan = llm.engine.ecfg, llm.engine.plan
    with pytest.raises(ConfigError, match="top-k"):
        llm.engine.reconfigure_experts(moe_backend="offload", moe_cache_size=1)
    assert llm.engine.ecfg == ecfg and llm.engine.plan == plan and llm.engine.runtime is not None
    assert all(b.runtime is llm.engine.runtime for b in llm.engine.model.moe_blocks())
    assert [o.token_ids for o in llm.generate(ps, SP)] == want
    assert llm.engine.reconfigure_experts(moe_backend="cpu").backend == "cpu"  # and the next one works
    assert [o.token_ids for o in llm.generate(ps, SP)] == want
    llm.close()


def test_a_replaced_runtime_is_freed_though_llm_froze_it(tiny_checkpoint):
    """LLM moves everything alive after load out of the cyclic collector's reach (gc.freeze); a runtime is a
    reference cycle (the stats book holds its parts' methods), so the one built at load must be handed back to the
    collector when it is replaced, or its device slot pool stays allocated beside the new one (on the H200: 24.5
    GiB held at an 8.5 GiB cap). The new runtime is frozen in its place."""
    import gc
    import weakref

    llm = LLM(tiny_checkpoint("qwen3"), moe_backend="hybrid", moe_cache_size=3, moe_decode_kernel="pairs", **COMMON)
    llm.generate([[1, 2, 3]], SP)
    assert gc.get_freeze_count() > 0
    rt = llm.engine.runtime
    old = [weakref.ref(p) for p in (rt, rt.cache, rt.decode, rt.prefill)]
    del rt
    llm.engine.reconfigure_experts(moe_backend="offload", moe_cache_size=3)
    assert all(r() is None for r in old)
    assert gc.get_freeze_count() > 0  # frozen again, the new runtime with it
    llm.close()


@pytest.mark.parametrize("prompts_", [[[1, 2, 3]], [[1, 2, 3], [7, 8, 9, 10]]])
def test_fused_pairs_count_distinct_experts(tiny_checkpoint, prompts_):
    """fused on the pair path counts each decode layer call's distinct experts: on the device for a batch,
    on the host for one token (its top-k are distinct; no kernel in the step)."""
    llm = LLM(tiny_checkpoint("qwen3"), moe_backend="fused", moe_decode_kernel="pairs", **COMMON)
    assert llm.engine.runtime.pairs
    seen = decode_call_counts(llm, prompts_, ("hits", "expert_calls", "gpu_experts"))
    for n, _, d in seen:
        assert d == {"hits": n, "expert_calls": n, "gpu_experts": n}, (d, n)
    assert seen and max(tokens for _, tokens, _ in seen) == len(prompts_)


@pytest.mark.parametrize("prompts_", [[[1, 2, 3]], [[1, 2, 3], [7, 8, 9, 10]]])
def test_fused_pairs_count_a_step_in_one_launch(tiny_checkpoint, prompts_, monkeypatch):
    """The pair path's counts of a decode step's layer calls are made together at the step's end (one count_routed
    launch per kind of call, not one a layer), and add up to the same totals as counting call by call (the test
    above reads the counters after every call, which counts each call on its own)."""
    from moestream.moe import caches

    totals, real = {}, caches.count_routed
    for together in (True, False):
        llm = LLM(tiny_checkpoint("qwen3"), moe_backend="fused", moe_decode_kernel="pairs", **COMMON)
        rt = llm.engine.runtime
        launches = []
        monkeypatch.setattr(caches, "count_routed", lambda ids, *a, **k: (launches.append(ids.shape[0]),
                                                                          real(ids, *a, **k)))
        if not together:  # each call counted on its own, as before the step's counts were batched
            real_rows = rt.cache.pair_rows

            def one_by_one(*a, **k):
                out = real_rows(*a, **k)
                rt.cache.count_step()
                return out
            monkeypatch.setattr(rt.cache, "pair_rows", one_by_one)
        llm.generate(prompts_, SP)
        t = rt.stats()["total"]
        totals[together] = (t["hits"], t["expert_calls"], rt.cache.expert_hits())
        layers = len(rt.store.moe_layers)
        if together:  # every decode step's calls in one launch (prefill chunks count through book)
            assert launches and set(launches) == {layers} and layers > 1
        else:
            assert set(launches) == {1}
    assert totals[True] == totals[False]


@pytest.mark.parametrize("quant", ["q8_0", "q4_k_m"])
def test_the_plan_counts_the_dense_bytes_a_loaded_gguf_holds(quant, tmp_path, monkeypatch):
    """The benchmark's Qwen3.6-shaped GGUF (tiny): fusing its projections of mixed types dequantizes some of the
    linears the plan counted as compressed; the engine plans again once they are loaded, so the slot cache
    takes only what the budget has (on the H200 the full file's dense layers held 3.06 GiB where 2.40 were
    planned). MOESTREAM_DENSE_QUANT=gpu takes the GPU's choice here."""
    import sys
    from pathlib import Path

    from moestream.engine.engine import dense_bytes_held

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import make_qwen36_q4km as mk

    path = tmp_path / f"{quant}.gguf"
    mk.main([str(path), "--tiny", "--quant", quant])
    monkeypatch.setenv("MOESTREAM_DENSE_QUANT", "gpu")
    llm = LLM(path, device="cpu", moe_backend="offload", moe_cache_size=4, max_running_requests=2)
    assert llm.engine.plan.bytes.dense == dense_bytes_held(llm.engine.model)
    llm.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefetch_top_copies_fewer_and_keeps_tokens(arch, tiny_checkpoint, fused_tokens, monkeypatch):
    """MOESTREAM_PREFETCH_TOP=1: the pair path's lookahead copies only each token's likeliest next-layer expert
    (fewer copies than all top_k), with fused's tokens."""
    ps, want = fused_tokens(arch)
    kw = {"moe_cache_size": 14, "moe_decode_kernel": "pairs", "moe_prefetch": "on"}
    issued = {}
    for top in ("0", "1"):
        monkeypatch.setenv("MOESTREAM_PREFETCH_TOP", top)
        llm, got = run(tiny_checkpoint, arch, "offload", **kw)
        assert got == want
        issued[top] = llm.stats()["total"]["prefetch_issued"]
    assert 0 < issued["1"] < issued["0"]


@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_arms_run_offloads_step_and_keep_fused_tokens(arch, tiny_checkpoint, fused_tokens, monkeypatch):
    """hybrid's arms (moe/share.Arms) run some decode steps as offload's (every miss fetched, no job for the CPU
    worker) and the others on the live split: fused's tokens either way, the worker's jobs are the split's steps,
    and the arms' counts reach the stats; MOESTREAM_HYBRID_ARMS=0 keeps every step on the split."""
    from moestream.moe import share, strategies

    monkeypatch.setattr(strategies, "Arms", lambda: share.Arms(block=1, trials=1, hold=2, warmup=0))
    ps, want = fused_tokens(arch)
    llm, got = run(tiny_checkpoint, arch, "hybrid", moe_cache_size=3, moe_decode_kernel="pairs")
    assert got == want
    arms = llm.stats()["hybrid"]["arms"]
    steps = {a: sum(d["steps"][a] for d in arms.values()) for a in (share.SPLIT, share.FETCH)}
    assert steps[share.FETCH] > 0 and steps[share.SPLIT] > 0
    assert any(d["explorations"] > 0 for d in arms.values()), arms
    assert llm.engine.runtime.bridge.seq == steps[share.SPLIT]  # a fetch step gives the worker no job
    llm.engine.runtime.check_integrity()
    monkeypatch.setenv("MOESTREAM_HYBRID_ARMS", "0")
    llm, got = run(tiny_checkpoint, arch, "hybrid", moe_cache_size=3, moe_decode_kernel="pairs")
    assert got == want and "arms" not in llm.stats()["hybrid"]


@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_over_a_large_cache_runs_offloads_step(arch, tiny_checkpoint, fused_tokens, monkeypatch):
    """Where hybrid's cache holds over planner.HYBRID_MAX_RESIDENCY of the experts, every decode step is offload's
    (share.HeldFetch: no job for the CPU worker, every miss fetched and admitted), fused's tokens; under the ceiling,
    and with MOESTREAM_HYBRID_ARMS=0 above it, the split runs (the worker computes misses)."""
    from moestream.moe import share

    ps, want = fused_tokens(arch)
    total = {"qwen3": 24, "qwen35": 32}[arch]  # MoE layers x experts of the tiny models
    scratch = 8  # pool rows of one step's pairs beside the cached ones (max_running_requests 4 x top-2)
    big = int(0.45 * total) + 1 + scratch
    llm, got = run(tiny_checkpoint, arch, "hybrid", moe_cache_size=big, moe_decode_kernel="pairs")
    assert got == want
    rt = llm.engine.runtime
    assert rt.cache.dcache.scratch == scratch and rt.decode.residency() == (big - scratch) / total > 0.45
    assert isinstance(rt.decode.arms, share.HeldFetch)
    t = llm.stats()["total"]
    assert rt.bridge.seq == 0 and sum(rt.bridge.cpu_experts) == 0 and t["misses"] > 0 and t["hits"] > 0
    arms = llm.stats()["hybrid"]["arms"]
    assert arms and all(d["chosen"] == share.FETCH and d["steps"][share.SPLIT] == 0 for d in arms.values()), arms
    rt.check_integrity()
    small = int(0.45 * total) - 1 + scratch
    llm, got = run(tiny_checkpoint, arch, "hybrid", moe_cache_size=small, moe_decode_kernel="pairs")
    assert got == want and not isinstance(llm.engine.runtime.decode.arms, share.HeldFetch)
    monkeypatch.setenv("MOESTREAM_HYBRID_ARMS", "0")
    llm, got = run(tiny_checkpoint, arch, "hybrid", moe_cache_size=big, moe_decode_kernel="pairs")
    assert got == want and llm.engine.runtime.bridge.seq > 0 and sum(llm.engine.runtime.bridge.cpu_experts) > 0


def test_hybrid_held_split_runs_the_tuned_share(tiny_checkpoint, fused_tokens, monkeypatch):
    """While the arms hold the split, each split step's route reads the tuner's share (Arms.share_for), written to the
    live share tensor before the step; fused's tokens whatever the share."""
    from moestream.moe import share, strategies

    class SplitArms(share.Arms):  # the split always wins its exploration; then it is held and tuned
        def observe(self, rows, arm, seconds):
            super().observe(rows, arm, seconds if arm == share.SPLIT else seconds + 1.0)

        def share_for(self, rows, fitted):
            got = super().share_for(rows, fitted)
            asked.append(got)
            return got

    asked, written = [], []
    real_use = share.LiveShare.use

    def use(self, value, fixed):
        written.append((value, fixed))
        real_use(self, value, fixed)
        assert self.tensor.tolist() == pytest.approx([value, fixed])

    monkeypatch.setattr(share.LiveShare, "use", use)
    monkeypatch.setattr(strategies, "Arms", lambda: SplitArms(block=1, trials=1, hold=1000, warmup=0, tune_step=0.2))
    ps, want = fused_tokens("qwen3")
    llm, got = run(tiny_checkpoint, "qwen3", "hybrid", moe_cache_size=3, moe_decode_kernel="pairs")
    assert got == want
    tuned = [a for a in asked if a is not None]
    assert len(tuned) >= 3 and len({a[0] for a in tuned}) >= 2  # the centre and its neighbours ran
    for a in tuned:  # every tuned share reached the tensor
        assert a in written
    arms = llm.stats()["hybrid"]["arms"]
    assert any("tuned_share" in d for d in arms.values()), arms


def test_reading_a_bridged_steps_results_waits_asleep_first(tiny_checkpoint, fused_tokens, monkeypatch):
    """A decode step with a job for the CPU worker (cpu, hybrid's split) is waited for on the bridge's blocking
    event before the runner reads its results (CpuBridge.wait_launched), so the reading thread does not spin a core
    in a CUDA sync while the worker's threads compute: once per bridged step, while the step is pending, before
    finish_step. On the CPU no event is recorded, so one is put where end_step leaves it."""
    from moestream.moe.bridge import CpuBridge

    log = []

    class Event:
        def synchronize(self):
            log.append("sleep")

    end, wait, finish = CpuBridge.end_step, CpuBridge.wait_launched, CpuBridge.finish_step

    def end_step(self):
        end(self)
        self._pending[-1] = (self._pending[-1][0], Event())
        log.append("end")

    def wait_launched(self):
        log.append("wait" if self._pending else "wait-idle")
        wait(self)

    def finish_step(self):
        log.append("finish" if self._pending else "finish-idle")
        return finish(self)

    monkeypatch.setattr(CpuBridge, "end_step", end_step)
    monkeypatch.setattr(CpuBridge, "wait_launched", wait_launched)
    monkeypatch.setattr(CpuBridge, "finish_step", finish_step)
    ps, want = fused_tokens("qwen3")
    llm, got = run(tiny_checkpoint, "qwen3", "cpu", moe_decode_kernel="pairs")
    assert got == want
    steps = llm.engine.runtime.bridge.seq
    assert steps > 0 and log.count("end") == steps
    # every bridged step: launched, slept on, then finished (the event's own wait in finish_step follows)
    busy = [x for x in log if x in ("end", "wait", "sleep", "finish")]
    assert busy[:4] == ["end", "wait", "sleep", "finish"]
    assert busy.count("wait") == busy.count("finish") == steps and log.count("sleep") >= steps


@pytest.mark.parametrize("arch", ["qwen3", "qwen35"])
def test_fused_device_prefill_wiring_and_counts(arch, tiny_checkpoint, monkeypatch):
    """fused on the pair path prefills through strategies.DeviceBankPrefill: no host route, the call counted in
    the pair path's device tensors. Its kernel (grouped_moe) runs on CUDA only and is held to the grouped path's
    values bit for bit in tests/test_grouped.py; here, on the CPU, a torch twin of it stands in, and the tokens,
    hits, expert calls and per-expert hits equal the grouped path's (the fallback this device takes)."""
    from moestream.moe import strategies
    from moestream.moe.compute import RouteGroups, WeightRef, accumulate, partial_outputs

    prompts = [[5 + i for i in range(n)] for n in (4, 17, 30)]

    def run():
        llm = LLM(tiny_checkpoint(arch), moe_backend="fused", moe_decode_kernel="pairs", **COMMON)
        rt = llm.engine.runtime
        assert isinstance(rt.prefill, strategies.DeviceBankPrefill)
        out = [o.token_ids for o in llm.generate(prompts, SP)]
        t = llm.stats()["total"]
        return out, {k: t[k] for k in ("hits", "expert_calls", "gpu_experts", "tokens", "routed")}, \
            rt.cache.expert_hits()

    want = run()  # CPU: every prefill call falls back to the grouped strategy
    used = []

    def twin(self, x, topk_ids, topk_w, bank, fmt):
        used.append(topk_ids.shape[0])
        groups = RouteGroups.of(topk_ids)
        refs = {e: WeightRef(bank, e, fmt if fmt.quantized else None) for e in groups.experts}
        return accumulate(x, groups, partial_outputs(x, topk_w, groups, refs))

    monkeypatch.setattr(strategies, "grouped_bank_ready", lambda x, bank, fmt: True)
    monkeypatch.setattr(strategies.DeviceBankPrefill, "moe", twin)
    got = run()
    assert used and max(used) > 1  # prefill chunks took the device path
    assert got == want


def test_hybrid_overlapped_steps_finish_in_launch_order(tiny_checkpoint, monkeypatch):
    """Overlapped decode over hybrid's arms (CUDA overlaps cpu and hybrid; the step hooks are the same here): each
    step is begun while the one before is pending, and a fetch step (no job for the worker) sits between split steps.
    wait_step sleeps on the bridge only when the oldest step launched gave the worker a job (else the bridge's oldest
    pending step is a newer one), finish_step finishes the bridge's step only for a split step, and nothing stays
    pending; a worker job whose step never posted its layers is released, not waited for."""
    from moestream.moe import share

    llm = LLM(tiny_checkpoint("qwen3"), moe_backend="hybrid", moe_cache_size=3, moe_decode_kernel="pairs", **COMMON)
    strat = llm.engine.runtime.decode
    bridge = strat.bridge
    arms = iter([share.SPLIT, share.FETCH, share.SPLIT])
    monkeypatch.setattr(strat.arms, "pick", lambda rows: next(arms))
    monkeypatch.setattr(strat.arms, "observe", lambda *a: None)
    log = []
    wait = bridge.wait_launched
    monkeypatch.setattr(bridge, "wait_launched", lambda: (log.append("wait"), wait())[1])
    info = lambda overlapped: {"decode": True, "num_tokens": 1, "overlapped": overlapped}  # noqa: E731
    seq0 = bridge.seq
    strat.begin_step(info(False), True)  # A: split
    strat.end_step(True)
    strat.begin_step(info(True), True)  # B: fetch, launched while A is pending
    strat.end_step(True)
    assert [b for b, _ in strat._steps] == [True, False] and len(bridge._pending) == 1
    strat.wait_step()
    strat.finish_step()  # A read
    assert log == ["wait"] and not bridge._pending
    strat.begin_step(info(True), True)  # C: split, launched while B is pending
    strat.end_step(True)
    strat.wait_step()
    strat.finish_step()  # B read: nothing of the bridge's
    assert log == ["wait"] and [s for s, _ in bridge._pending] == [seq0 + 2]
    strat.wait_step()
    strat.finish_step()  # C read
    assert log == ["wait", "wait"] and not bridge._pending and not strat._steps and bridge.seq == seq0 + 2
    llm.close()


@pytest.mark.parametrize("backend,kw", [("cpu", {}), ("hybrid", {"moe_cache_size": 3})])
def test_shared_expert_runs_while_the_worker_computes(backend, kw, tiny_checkpoint, fused_tokens, monkeypatch):
    """cpu / hybrid decode through the bridge: a block's shared expert (its down projection) is issued after the
    layer's request is posted and before its answer is collected — on a GPU it runs while the worker computes —
    and the tokens stay fused's."""
    from moestream.moe import bridge as bridge_mod

    events = []
    for name in ("post", "collect"):
        orig = getattr(bridge_mod.CpuBridge, name)
        monkeypatch.setattr(bridge_mod.CpuBridge, name,
                            lambda self, layer, *a, _o=orig, _n=name: (events.append((_n, layer)), _o(self, layer, *a))[1])
    llm, got = run(tiny_checkpoint, "qwen35", backend, moe_decode_kernel="pairs", **kw)
    assert got == fused_tokens("qwen35")[1]
    blocks = [b for b in llm.engine.model.moe_blocks() if b.shared_in is not None]
    assert blocks
    for b in blocks:
        down = b.shared_expert.down_proj
        orig_fwd = down.forward
        monkeypatch.setattr(down, "forward", lambda x, _f=orig_fwd, _l=b.layer: (events.append(("shared", _l)), _f(x))[1])
    events.clear()
    llm.generate([[5, 6, 7]], SP)
    order = [e for e in events if e[1] == blocks[0].layer]
    decode = [order[i:i + 3] for i in range(len(order) - 2) if order[i][0] == "post"]
    assert decode and all(w == [("post", blocks[0].layer), ("shared", blocks[0].layer), ("collect", blocks[0].layer)]
                          for w in decode), order[:12]
