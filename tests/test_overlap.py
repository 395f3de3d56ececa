"""Overlapped decode (--overlap-schedule, engine/llm_engine.py): a decode step is launched before the last one's
tokens are read, its input tokens taken on the device from the last step's argmax, and the tokens are emitted one
step later. Whatever the overlap, every request gets exactly the tokens, stops, finish reasons and texts of the
same run without it; the scheduler's pages, slots and prefix tree stay consistent (check_integrity), no
placeholder token is ever visible, and steps really are overlapped (counted). On CUDA the same path runs with the
graphs (tests/test_cuda_graphs.py covers the graph replay itself); here the CPU runs it with --overlap-schedule on.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moestream import LLM, SamplingParams
from moestream.scheduler.request import PENDING, Request

COMMON = dict(device="cpu", dtype="float32", max_running_requests=4, chunked_prefill_size=32, moe_cpu_threads=1)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompts(vocab: int, n: int = 4):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (int(L),), generator=g).tolist() for L in (5, 19, 40, 9)[:n]]


def _count_launches(llm, monkeypatch) -> dict:
    """Counts of overlapped launches that read a step in flight (prev) and that start one (no prev)."""
    runner = llm.llm_engine.runner
    counts = {"chained": 0, "started": 0}
    orig = runner.launch

    def launch(sched, prev=None):
        counts["chained" if prev is not None else "started"] += 1
        return orig(sched, prev)

    monkeypatch.setattr(runner, "launch", launch)
    return counts


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params)
    llm.scheduler.check_integrity()
    assert llm.llm_engine._inflight is None and not llm.scheduler.running
    return [(o.token_ids, o.finish_reason, o.text) for o in outs]


@pytest.mark.parametrize("variant, backend, kw", [
    ("qwen3", "fused", {}),
    ("qwen35", "fused", {}),  # Gated DeltaNet state, prefix-cache snapshots at page boundaries
    ("qwen35", "offload", {"moe_cache_size": 3}),
])
def test_overlapped_decode_gives_the_same_tokens(variant, backend, kw, tiny_checkpoint, monkeypatch):
    """Greedy requests of different lengths, one stopped by a stop token mid-run, one by max_tokens, in one batch and
    then again (prefix-cache hits): the overlapped run equals the run without overlap, and it overlapped."""
    path = tiny_checkpoint(variant)
    ref = LLM(path, moe_backend=backend, overlap_schedule="off", **COMMON, **kw)
    prompts = _prompts(ref.model_config.vocab_size)
    base = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (12, 7, 16, 1)]
    want = _run(ref, prompts, base)
    stop_tok = want[2][0][5]  # request 2 stops at its 6th token (or earlier where that token comes before)
    params = list(base)
    params[2] = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_tok])
    want = _run(ref, prompts, params)
    assert want[2][1] == "stop" and len(want[2][0]) <= 6
    llm = LLM(path, moe_backend=backend, overlap_schedule="on", **COMMON, **kw)
    counts = _count_launches(llm, monkeypatch)
    for _ in range(2):  # the second time the prompts hit the prefix cache
        got = _run(llm, prompts, params)
        assert got == want
        assert all(PENDING not in toks for toks, _, _ in got)
    assert counts["started"] >= 2 and counts["chained"] >= 10


def test_sampled_requests_overlap_and_logprob_requests_do_not(tiny_checkpoint, monkeypatch):
    """Sampled requests (seeded, temperature / top-k / top-p / min-p) overlap like greedy ones — their draws are made
    on the device with each request's generator in the same order — and give the tokens of a run without overlap; a
    batch holding a logprobs request (read on the host between logits and token) steps without overlap."""
    path = tiny_checkpoint("qwen3")
    sampled = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
               SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True),
               SamplingParams(max_tokens=9, temperature=1.3, top_k=7, top_p=0.9, seed=9, ignore_eos=True),
               SamplingParams(max_tokens=11, temperature=0.7, min_p=0.05, seed=2, ignore_eos=True)]
    ref = LLM(path, overlap_schedule="off", **COMMON)
    prompts = _prompts(ref.model_config.vocab_size)
    want = _run(ref, prompts, sampled)
    llm = LLM(path, overlap_schedule="on", **COMMON)
    counts = _count_launches(llm, monkeypatch)
    assert _run(llm, prompts, sampled) == want
    assert counts["chained"] >= 6
    lp = [sampled[0], SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)]  # all end together
    want = _run(ref, prompts[:3], lp)
    before = dict(counts)
    assert _run(llm, prompts[:3], lp) == want
    assert counts == before


def test_abort_and_drain_while_a_step_is_in_flight(tiny_checkpoint):
    """Through LLMEngine: one request aborted while an overlapped step holds its pending token (its tokens are those
    emitted, no placeholder left, pages and slot freed), a drain between steps (the step's tokens come with the next
    step), a new request admitted later (the step in flight is read first): every other request gets the tokens of a
    run without overlap."""
    path = tiny_checkpoint("qwen35")
    sp = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    ref = LLM(path, overlap_schedule="off", **COMMON)
    prompts = _prompts(ref.model_config.vocab_size, 3)
    want = [o.token_ids for o in ref.generate(prompts, sp)]
    llm = LLM(path, overlap_schedule="on", **COMMON)
    eng = llm.llm_engine
    reqs = [Request(f"r{i}", list(p), sp) for i, p in enumerate(prompts[:2])]
    for r in reqs:
        eng.add_request(r)
    got: dict[str, list[int]] = {r.id: [] for r in reqs}

    def step():
        for o in eng.step():
            if o.new_token is not None:
                got.setdefault(o.request.id, []).append(o.new_token)

    for _ in range(5):
        step()
    assert eng._inflight is not None and reqs[0].pending
    assert eng.abort("r0")
    assert PENDING not in reqs[0].output_ids and reqs[0].pages == [] and reqs[0].state_slot == -1
    assert reqs[0].output_ids == got["r0"] == want[0][:len(got["r0"])]
    step()
    eng.drain()
    assert eng._inflight is None and eng.has_work()
    late = Request("r2", list(prompts[2]), sp)
    eng.add_request(late)
    while eng.has_work():
        step()
    llm.scheduler.check_integrity()
    assert got["r1"] == want[1] and got["r2"] == want[2]
    assert reqs[1].output_ids == want[1] and late.output_ids == want[2]


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_cuda_decode_build_on_a_cpu(overlap, tiny_checkpoint, monkeypatch):
    """The CUDA decode steps' batch (runner._build_decode_cuda: one host buffer, one copy; the pending rows' places in
    the last step's tokens carried in it), made here on a CPU for every decode step, gives the tokens of the CPU's own
    decode build, with and without overlap; and its tensors equal the general build's."""
    from moestream.engine.runner import ModelRunner

    path = tiny_checkpoint("qwen35")
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = LLM(path, overlap_schedule="off", **COMMON)
    prompts = _prompts(ref.model_config.vocab_size)
    want = [o.token_ids for o in ref.generate(prompts, sp)]
    llm = LLM(path, overlap_schedule=overlap, **COMMON)
    runner = llm.llm_engine.runner
    built = [0]

    def build(self, sched, prev=None):
        if not self.spec_k and all(s.n == 1 and s.samples for s in sched.seqs) and not sched.prompt:
            batch, rows = self._build_decode_cuda(sched, self.engine.caches.kv, prev)
            general, _ = self._build_general(sched)
            if prev is None:
                assert torch.equal(batch.input_ids, general.input_ids)
            for name in ("positions", "kv_write_index", "state_slots", "logits_index"):
                assert torch.equal(getattr(batch, name), getattr(general, name)), name
            assert [torch.equal(a.kv_index, b.kv_index) for a, b in zip(batch.seqs, general.seqs)] == \
                [True] * len(batch.seqs)
            assert batch.extra["decode_lengths"].tolist() == [q.total for q in general.seqs]
            built[0] += 1
            return batch, rows
        return self._build_general(sched)

    monkeypatch.setattr(ModelRunner, "build", build)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == want
    assert built[0] >= 11
    llm.scheduler.check_integrity()


def test_a_failed_overlapped_step_leaves_no_placeholder(tiny_checkpoint, monkeypatch):
    """A launch that raises while a step is in flight: the step raises, nothing is left in flight, and once the
    server's handler sends the requests back to the queue (Scheduler.isolate_running) no request holds a pending
    placeholder, the pages and slots add up, and the requests finish with the tokens of a run without overlap."""
    path = tiny_checkpoint("qwen3")
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = LLM(path, overlap_schedule="off", **COMMON)
    prompts = _prompts(ref.model_config.vocab_size, 2)
    want = [o.token_ids for o in ref.generate(prompts, sp)]
    llm = LLM(path, overlap_schedule="on", **COMMON)
    eng = llm.llm_engine
    reqs = [Request(f"r{i}", list(p), sp) for i, p in enumerate(prompts)]
    for r in reqs:
        eng.add_request(r)
    for _ in range(4):
        eng.step()
    assert eng._inflight is not None
    orig = eng.runner.launch

    def boom(sched, prev=None):
        raise RuntimeError("injected")

    monkeypatch.setattr(eng.runner, "launch", boom)
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    assert eng._inflight is None
    eng.scheduler.isolate_running()
    assert all(not r.pending and PENDING not in r.output_ids for r in reqs)
    eng.scheduler.check_integrity()
    monkeypatch.setattr(eng.runner, "launch", orig)
    while eng.has_work():
        eng.step()
    assert [r.output_ids for r in reqs] == want


@pytest.mark.parametrize("backend", ["cpu", "hybrid"])
def test_cpu_and_hybrid_overlap_on_cuda_only_when_asked(backend, tiny_checkpoint, monkeypatch):
    """Engine.overlap_ok: on a CUDA device cpu and hybrid (the bridge's worker) overlap with --overlap-schedule on
    only — auto leaves them stepwise until measured — while fused and offload overlap under auto; on a CPU device
    cpu and hybrid never do. (The device is stood in for: the rule reads its type and the runtime's capturability.)"""
    from types import SimpleNamespace

    llm = LLM(tiny_checkpoint("qwen3"), moe_backend=backend, moe_cache_size=3, moe_decode_kernel="pairs",
              max_running_requests=4)
    eng = llm.engine
    assert eng.runtime.capturable()  # the bridge path: no host sync in a decode step
    for mode, cpu_want, cuda_want in (("auto", False, False), ("on", False, True), ("off", False, False)):
        monkeypatch.setattr(eng, "ecfg", dataclasses.replace(eng.ecfg, overlap_schedule=mode))
        assert eng.overlap_ok() is cpu_want, mode
        monkeypatch.setattr(eng, "device", SimpleNamespace(type="cuda"))
        assert eng.overlap_ok() is cuda_want, mode
        monkeypatch.undo()
    plan = eng.plan
    monkeypatch.setattr(eng, "device", SimpleNamespace(type="cuda"))
    monkeypatch.setattr(eng, "plan", dataclasses.replace(plan, backend="offload") if dataclasses.is_dataclass(plan)
                        else SimpleNamespace(backend="offload"))
    assert eng.overlap_ok()  # offload under auto on CUDA
    llm.close()


def test_hybrid_overlaps_under_auto_only_while_its_arms_hold_the_fetch_form(tiny_checkpoint, monkeypatch):
    """hybrid under --overlap-schedule auto on CUDA: stepwise while its arms explore or hold the split (an arm's time
    runs from launch to results), overlapped while they hold the fetch form for that batch size (offload's step, no
    worker job); asked per batch size, and re-asked by LLMEngine before every overlapped launch."""
    from types import SimpleNamespace

    from moestream.moe.share import FETCH, SPLIT

    llm = LLM(tiny_checkpoint("qwen3"), moe_backend="hybrid", moe_cache_size=3, moe_decode_kernel="pairs",
              max_running_requests=4)
    eng = llm.engine
    arms = eng.runtime.decode.arms
    assert arms is not None
    monkeypatch.setattr(eng, "device", SimpleNamespace(type="cuda"))
    assert not eng.overlap_ok(1) and not eng.overlap_ok()  # nothing held yet
    arms._state(1)["chosen"] = FETCH
    arms._state(4)["chosen"] = SPLIT
    assert eng.overlap_ok(1) and not eng.overlap_ok(4) and not eng.overlap_ok(2) and not eng.overlap_ok()
    monkeypatch.setattr(eng, "ecfg", dataclasses.replace(eng.ecfg, overlap_schedule="off"))
    assert not eng.overlap_ok(1)
    monkeypatch.undo()
    # the loop re-asks: a step in flight is read instead of overlapped once the rule says no
    asked = []
    monkeypatch.setattr(eng, "overlap_ok", lambda rows=None: asked.append(rows) or False)
    llm.llm_engine.engine_overlap(3)
    assert asked == [3]
    llm.close()


def test_overlap_stops_when_the_engine_says_no_mid_run(tiny_checkpoint, monkeypatch):
    """The step loop asks Engine.overlap_ok (with the batch size) before every overlapped launch, not only before the
    first: once it says no, the step in flight is read and the next steps run stepwise; when it says yes again they
    overlap again; the tokens equal a run without overlap."""
    path = tiny_checkpoint("qwen3")
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = LLM(path, overlap_schedule="off", **COMMON)
    prompts = _prompts(ref.model_config.vocab_size, 2)
    want = [o.token_ids for o in ref.generate(prompts, sp)]
    ref.close()
    llm = LLM(path, overlap_schedule="on", **COMMON)
    eng = llm.llm_engine
    allow = {"on": True}
    asked = []
    orig = llm.engine.overlap_ok
    monkeypatch.setattr(llm.engine, "overlap_ok", lambda rows=None: asked.append(rows) or (allow["on"] and orig(rows)))
    reqs = [Request(f"r{i}", list(p), sp) for i, p in enumerate(prompts)]
    for r in reqs:
        eng.add_request(r)
    for _ in range(5):
        eng.step()
    assert eng._inflight is not None and 2 in asked
    allow["on"] = False
    eng.step()
    assert eng._inflight is None  # read, and this step ran stepwise
    eng.step()
    assert eng._inflight is None
    allow["on"] = True
    eng.step()
    assert eng._inflight is not None
    while eng.has_work():
        eng.step()
    llm.scheduler.check_integrity()
    assert [r.output_ids for r in reqs] == want
    llm.close()
