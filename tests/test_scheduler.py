"""The scheduler on its own, driven by a fake engine: no model, no tensors.

`FakeEngine.run` plays the model runner: it keeps what a real engine's caches would hold — the token at each
KV position of each page, and for linear-state models the tokens each state slot has consumed — applies
the cache copies a ScheduledBatch carries in the order the engine's forward pass does, and checks before
every "pass" that each sequence's first `cached` positions and its state really hold its tokens. So every
page, hit, copy-on-write, snapshot and fork the scheduler decides is checked against the caches it
implies. The next token is a hash of the tokens before it: recomputing (after a preemption) gives the same.
"""
from __future__ import annotations

import pytest
import torch

from moestream.core import SamplingParams
from moestream.kvcache import KVPool, StatePool
from moestream.scheduler.batch import ScheduledBatch, StepResult
from moestream.scheduler.request import Request, Status
from moestream.scheduler.scheduler import Scheduler, SchedulerConfig

V, P, EOS = 97, 4, 0


class Caches:
    def __init__(self, pages: int, slots: int, linear: bool, snapshots: int = 0):
        self.kv = KVPool(0, pages, P, 1, 1, torch.float32, torch.device("cpu"))  # no layers: allocators only
        # one tiny layer so the pool has linear state (and snapshot slots) as a Qwen3.5 model's does
        self.state = StatePool(1 if linear else 0, slots, 1, 2, 1, 1, 1, torch.float32, torch.float32,
                               torch.device("cpu"), num_snapshots=snapshots)
        self.host = None


def next_token(ids: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(ids)) * 31 + len(ids)) % (V - 1) + 1  # never EOS


class FakeEngine:
    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.kv: dict[tuple[int, int], int] = {}  # (page, offset) -> token whose K/V sits there
        self.state: dict[int, tuple] = {}  # slot -> tokens consumed
        self.computed = 0  # tokens run through the fake model

    def run(self, batch: ScheduledBatch) -> StepResult:
        for slot in batch.state_resets:
            self.state[slot] = ()
        for src, dst, n in batch.kv_copies:
            for o in range(n):
                self.kv[dst, o] = self.kv[src, o]
        for src, dst in batch.state_loads:
            self.state[dst] = self.state[src]
        for s in batch.seqs:
            self._pass(s)
        for src, dst in batch.state_saves:
            self.state[dst] = self.state[src]
        for kid, parent in batch.forks:  # the parent's prompt, copied into the child's own pages and slot
            for p in range(len(kid.prompt_ids)):
                self.kv[kid.pages[p // P], p % P] = self.kv[parent.pages[p // P], p % P]
            self.state[kid.state_slot] = self.state.get(parent.state_slot, ())
        sampled = [(s.req, next_token(s.req.all_ids), None) for s in batch.seqs if s.samples]
        sampled += [(kid, next_token(kid.all_ids), None) for kid, _ in batch.forks]
        return StepResult(sampled=sampled)

    def _pass(self, s) -> None:
        req, ids, linear = s.req, s.req.all_ids, self.sched.state.conv is not None
        assert len(req.pages) >= self.sched.kv.pages_for(s.end)
        for p in range(s.cached):  # what attention would read
            assert self.kv.get((req.pages[p // P], p % P)) == ids[p], (req.id, p)
        if linear:
            assert self.state.get(req.state_slot) == tuple(ids[:s.cached]), req.id
        for p in range(s.cached, s.end):
            assert req.pages[p // P] not in self.sched.prefix.owned if self.sched.prefix else True  # never rewritten
            self.kv[req.pages[p // P], p % P] = ids[p]
        for e, slot in s.snapshots:
            self.state[slot] = tuple(ids[:s.cached + e])
        if linear:
            self.state[req.state_slot] = tuple(ids[:s.end])
        self.computed += s.n


def make(pages=64, slots=4, chunk=16, linear=False, snapshots=0, prefix=True, max_seq_len=512):
    cfg = SchedulerConfig(max_running=slots, chunk=chunk, max_seq_len=max_seq_len, vocab_size=V, prefix_cache=prefix)
    sched = Scheduler(cfg, Caches(pages, slots, linear, snapshots), {EOS})
    return sched, FakeEngine(sched)


def req(rid: str, prompt: list[int], max_tokens: int = 6, **kw) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))


def add(sched: Scheduler, *reqs: Request) -> None:
    for r in reqs:
        sched.check(r)
        sched.add(r)


def drive(sched: Scheduler, eng: FakeEngine, on_batch=None, limit: int = 500) -> list:
    """Step until nothing is left; the scheduler's books are checked after every step."""
    outs = []
    for _ in range(limit):
        if not sched.has_work():
            return outs
        batch = sched.schedule()
        assert batch is not None, "work left but nothing scheduled"
        if on_batch:
            on_batch(batch)
        outs += sched.postprocess(batch, eng.run(batch))
        sched.check_integrity()
    raise AssertionError("the scheduler did not finish")


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(next_token(ids))
    return ids[len(prompt):]


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (n,), generator=g).tolist() for n in lengths]


def test_chunked_prefill_decodes_first_and_keeps_the_budget():
    sched, eng = make(chunk=8)
    a, b = req("a", prompts(5)[0], max_tokens=8), req("b", prompts(30, seed=1)[0], max_tokens=3)
    add(sched, a, b)
    seen = []

    def check(batch):
        assert batch.num_tokens <= 8
        kinds = [s.prefill for s in batch.seqs]
        assert kinds == sorted(kinds)  # decoding requests first, then prefill chunks
        seen.append([(s.req.id, s.n) for s in batch.seqs])

    drive(sched, eng, check)
    assert seen[0] == [("a", 5), ("b", 3)] and seen[1] == [("a", 1), ("b", 7)]
    assert a.output_ids == alone(a.prompt_ids, 8) and b.output_ids == alone(b.prompt_ids, 3)
    assert a.finish_reason == b.finish_reason == "length"
    assert sched.kv.pages.num_used == sched.prefix.num_pages  # only cached pages are left


def test_preemption_recomputes_the_same_tokens():
    ps = prompts(14, 10, 18, seed=3)
    sched, eng = make(pages=12, slots=3, chunk=64, prefix=False)  # 48 tokens of KV for ~66 at the end
    reqs = [req(f"r{i}", p, max_tokens=8) for i, p in enumerate(ps)]
    add(sched, *reqs)
    drive(sched, eng)
    assert sum(r.preemptions for r in reqs) > 0
    assert [r.output_ids for r in reqs] == [alone(p, 8) for p in ps]
    assert sched.kv.pages.num_used == 0 and sched.state.slots.num_used == 0


def test_a_prefix_hit_computes_only_the_rest():
    shared = prompts(13, seed=4)[0]
    sched, eng = make()
    first = req("first", shared + [7, 8, 9], max_tokens=2)
    add(sched, first)
    drive(sched, eng)
    before = eng.computed
    second = req("second", shared + [5, 6], max_tokens=2)
    add(sched, second)
    starts = []
    drive(sched, eng, lambda b: starts.extend(s.cached for s in b.seqs if s.req is second))
    # 12 tokens in full cached pages, then the head of the 4th page (token 13 is shared): copied, not computed
    assert starts[0] == 13 and second.cached_tokens == 13
    assert eng.computed - before == len(second.prompt_ids) - 13 + 1  # the rest, then one decode step
    assert second.output_ids == alone(second.prompt_ids, 2)
    assert sched.stats()["prefix_cache"]["hits"] == 1


def test_linear_state_hits_resume_from_a_snapshot():
    sched, eng = make(linear=True, snapshots=4, chunk=8)
    ps = prompts(22, seed=5)[0]
    add(sched, req("a", ps, max_tokens=3))
    drive(sched, eng)
    assert sched.prefix.stats()["snapshots"] > 0
    b = req("b", ps[:20] + [3, 4], max_tokens=3)
    add(sched, b)
    loads = []
    drive(sched, eng, lambda batch: loads.extend(batch.state_loads))
    assert loads and b.cached_tokens and b.cached_tokens % P == 0  # resumed at a page boundary with a state
    assert b.output_ids == alone(b.prompt_ids, 3)


def test_children_copy_the_parent_prefill():
    sched, eng = make()
    prompt = prompts(11, seed=6)[0]
    parent = req("p", prompt, max_tokens=4)
    kids = [Request(f"k{i}", list(prompt), parent.params, parent="p") for i in range(2)]
    add(sched, parent, *kids)
    assert len(sched.held["p"]) == 2
    forks = []
    drive(sched, eng, lambda b: forks.extend((k.id, p.id) for k, p in b.forks))
    assert forks == [("k0", "p"), ("k1", "p")]
    assert eng.computed == len(prompt) + 3 * 3  # the prompt once, then each request's decode steps
    assert all(r.output_ids == alone(prompt, 4) for r in [parent, *kids]) and not sched.held


def test_stops_and_the_pool_limit():
    sched, eng = make(pages=8, prefix=False)  # 32 tokens of KV
    a_prompt = prompts(6, seed=7)[0]
    a = req("a", a_prompt, max_tokens=10, stop_token_ids=[alone(a_prompt, 2)[1]])
    long = req("long", prompts(20, seed=8)[0], max_tokens=100)
    add(sched, a, long)
    drive(sched, eng)
    assert a.output_ids == alone(a_prompt, 2) and a.finish_reason == "stop"
    # the whole pool holds 32 tokens: "length" at 33 (the last token needs no K/V) instead of preempting forever
    assert long.num_tokens == 33 and long.finish_reason == "length"
    assert long.output_ids == alone(long.prompt_ids, 13)


def test_abort_frees_at_once():
    sched, eng = make()
    gone, kept = req("gone", prompts(9, seed=9)[0], max_tokens=50), req("kept", prompts(5, seed=11)[0])
    add(sched, gone, kept)
    sched.postprocess(batch := sched.schedule(), eng.run(batch))
    assert sched.abort("gone") and gone.status == Status.FINISHED and gone.finish_reason == "abort"
    assert not sched.abort("gone") and gone.pages == [] and gone.state_slot == -1
    sched.check_integrity()
    drive(sched, eng)
    assert kept.output_ids == alone(kept.prompt_ids, 6) and len(gone.output_ids) == 1


def test_a_failed_step_gives_its_requests_back():
    sched, eng = make(linear=True, snapshots=2, chunk=64)
    reqs = [req(f"r{i}", p, max_tokens=3) for i, p in enumerate(prompts(9, 12, seed=10))]
    add(sched, *reqs)
    batch = sched.schedule()
    sched.step_failed(batch)  # the engine raised: nothing of the batch was computed
    sched.isolate_running()
    assert sched.suspects == {"r0", "r1"} and not sched.running
    assert sched.prefix.stats()["snapshots"] == 0 and len(sched.prefix.free_snaps) == 2
    sizes = []
    drive(sched, eng, lambda b: sizes.append(len(b.seqs)))
    assert max(sizes) == 1  # suspects run alone
    assert [r.output_ids for r in reqs] == [alone(r.prompt_ids, 3) for r in reqs] and not sched.suspects


@pytest.mark.parametrize("n", [0, 512])
def test_check_refuses_what_cannot_run(n):
    sched, _ = make(pages=8, max_seq_len=64)
    with pytest.raises(Exception, match="empty|context"):
        sched.check(req("x", [1] * n))
