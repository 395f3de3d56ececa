"""Prefix cache: the radix tree's bookkeeping, and greedy tokens identical with and without the cache on
both architectures (attention-only Qwen3-MoE, and Qwen3.5 with Gated DeltaNet state snapshots), for
repeated prompts, concurrent requests sharing a prefix, agent-like growing conversations, preemption
and eviction of pages and snapshots."""
from __future__ import annotations

import pytest
import torch

from moestream import LLM, SamplingParams
from moestream.kvcache.pools import PagePool
from moestream.kvcache.prefix import PrefixCache
from moestream.scheduler.request import Request

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


# ---- the tree alone -------------------------------------------------------------------------------
def _grow(tree: PrefixCache, ids: list[int]) -> list:
    """Insert ids' full pages as one request would (pages from the pool), holding them."""
    P, parent, nodes = tree.page_size, tree.root, []
    for i in range(len(ids) // P):
        page = tree.pages.alloc(1)[0]
        node, adopted = tree.insert(parent, tuple(ids[i * P:(i + 1) * P]), page)
        if not adopted:
            tree.pages.free([page])
        tree.acquire([node])
        nodes.append(node)
        parent = node
    return nodes


def test_tree_match_refcount_and_lru_eviction():
    pool = PagePool(8)
    tree = PrefixCache(pool, 2)
    a = _grow(tree, [1, 2, 3, 4, 5, 6])  # 3 pages
    b = _grow(tree, [1, 2, 3, 4, 9, 9])  # shares 2 pages, 1 new
    assert pool.num_used == 4 and tree.num_pages == 4
    assert a[:2] == b[:2] and a[2] is not b[2]
    assert [n.page for n in tree.match([1, 2, 3, 4, 5, 6, 7], 7)] == [n.page for n in a]
    assert len(tree.match([1, 2, 3, 4, 5, 6], 5)) == 2  # at most max_tokens tokens, full pages only
    assert tree.match([2, 2], 2) == []
    assert tree.evict(4) == 0  # everything referenced
    tree.release(a)
    tree.check_integrity()
    assert tree.num_evictable == 1  # a's last page only: the shared ones are still b's
    tree.release(b)
    assert tree.num_evictable == 4
    tree.acquire(tree.match([1, 2, 3, 4, 9, 9], 6))  # b's path is now the most recently used
    tree.release(tree.match([1, 2, 3, 4, 9, 9], 6))
    assert tree.evict(1) == 1
    assert len(tree.match([1, 2, 3, 4, 5, 6], 6)) == 2 and len(tree.match([1, 2, 3, 4, 9, 9], 6)) == 3
    assert tree.evict(10) == 3 and pool.num_used == 0 and tree.num_pages == 0
    tree.check_integrity()
    pool.check_integrity()


def test_tree_snapshots_gate_hits_and_are_lru():
    pool = PagePool(8)
    tree = PrefixCache(pool, 2, needs_snapshot=True, snap_slots=[10, 11])
    nodes = _grow(tree, [1, 2, 3, 4, 5, 6, 7, 8])
    assert tree.match([1, 2, 3, 4, 5, 6, 7, 8, 0], 9) == []  # no snapshot: nothing to resume from
    s = tree.alloc_snapshot()
    assert tree.attach_snapshot(nodes[1], s)
    assert tree.match([1, 2, 3, 4, 5, 6, 7, 8, 0], 9) == nodes[:2]
    assert not tree.attach_snapshot(nodes[1], tree.alloc_snapshot())  # has one: the slot goes back
    assert tree.attach_snapshot(nodes[3], tree.alloc_snapshot())
    assert tree.match([1, 2, 3, 4, 5, 6, 7, 8, 0], 9) == nodes
    assert tree.match([1, 2, 3, 4, 5, 6, 7, 8, 0], 7) == nodes[:2]
    tree.acquire(nodes[:2])  # touch: node 1 is now more recent than node 3
    tree.release(nodes[:2])
    third = tree.alloc_snapshot()  # none free: the least recently used snapshot (node 3's) is dropped
    assert nodes[3].snap == -1 and nodes[1].snap >= 0 and tree.evicted_snaps == 1
    tree.free_snapshot(third)
    tree.release(nodes)
    tree.evict(8)
    assert not tree.snap_nodes and sorted(tree.free_snaps) == [10, 11]
    tree.check_integrity()


def test_tree_spills_to_the_host_tier_and_fetches_back():
    """Evicted pages move to host pages (queued copies, in decision order) and stay matchable; a hit fetches
    them back into fresh device pages; when the host tier is full its least recently used leaf is dropped."""
    pool = PagePool(4)
    tree = PrefixCache(pool, 2, host_pages=2)
    a = _grow(tree, [1, 2, 3, 4, 5, 6])  # pages 0, 1, 2
    tree.release(a)
    assert tree.evict(2) == 2  # leaves first: a[2] to host page 0, then a[1] to host page 1
    assert tree.host_ops == [("kv_out", 2, 0), ("kv_out", 1, 1)]
    assert [(n.page, n.host) for n in a] == [(0, -1), (-1, 1), (-1, 0)] and pool.num_used == 1
    assert tree.num_evictable == 1 and tree.match([1, 2, 3, 4, 5, 6, 0], 7) == a  # still a hit
    tree.check_integrity()
    tree.host_ops.clear()
    b = _grow(tree, [7, 8, 9, 9])  # pages 1, 2
    tree.release(b)
    # a[0] is the least recently used page with no child on the device: it spills, and the full host tier
    # drops its least recently used unreferenced leaf (a[2]) to make room
    assert tree.evict(1) == 1
    assert tree.host_ops == [("kv_out", 0, 0)] and (a[0].page, a[0].host) == (-1, 0) and not a[1].children
    assert b[1].page >= 0 and pool.num_used == 2 and tree.spilled_pages == 3
    tree.check_integrity()
    tree.host_ops.clear()
    hit = tree.match([1, 2, 3, 4, 0], 5)
    assert hit == a[:2]
    tree.acquire(hit)
    for n in hit:  # from the top, as the scheduler does
        tree.fetch(n, pool.alloc(1)[0])
    assert tree.host_ops == [("kv_in", 0, hit[0].page), ("kv_in", 1, hit[1].page)]
    assert sorted(n.page for n in hit) == [0, 3] and tree.fetched_pages == 2 and not tree.spilled
    tree.release(hit)
    tree.check_integrity()
    tree.evict(1)  # LRU: b's leaf spills to a free host page, nothing dropped
    tree.clear()
    assert tree.num_pages == 0 and not tree.spilled and pool.num_used == 0 and len(tree.host_free) == 2
    tree.check_integrity()


def test_tree_snapshots_spill_to_the_host_tier():
    pool = PagePool(4)
    tree = PrefixCache(pool, 2, needs_snapshot=True, snap_slots=[10], host_snaps=1)
    n = _grow(tree, [1, 2, 3, 4])
    assert tree.attach_snapshot(n[1], tree.alloc_snapshot())
    slot = tree.alloc_snapshot()  # none free: n[1]'s snapshot moves to the host tier
    assert slot == 10 and n[1].snap == -1 and n[1].hsnap == 0 and tree.host_ops == [("state_out", 10, 0)]
    assert tree.match([1, 2, 3, 4, 0], 5) == n  # resumable from the host copy
    tree.load_host_snapshot(n[1], 3)
    assert tree.host_ops[-1] == ("state_in", 0, 3) and tree.fetched_snaps == 1
    assert tree.attach_snapshot(n[0], slot)
    tree.free_snapshot(tree.alloc_snapshot())  # n[0]'s goes out; the full host tier drops its LRU one (n[1]'s)
    assert n[1].hsnap == -1 and n[0].hsnap == 0 and tree.match([1, 2, 3, 4, 0], 5) == n[:1]
    tree.check_integrity()


def test_host_pool_runs_the_queued_copies_in_order():
    """kv_out / kv_in move whole pages of every layer, state_out / state_in whole snapshots, in queue order:
    a device page spilled and refilled by a fetch in one step, and a host page fetched and then refilled by
    a spill, each hand over the right bytes."""
    from moestream.kvcache.pools import HostPool, KVPool, StatePool

    kv = KVPool(2, 3, 4, 1, 2, torch.float32, torch.device("cpu"))
    st = StatePool(2, 1, 3, 4, 1, 2, 2, torch.float32, torch.float32, torch.device("cpu"), num_snapshots=1)
    host = HostPool(kv, st, num_pages=2, num_snaps=1, pin=False)
    kv.k.copy_(torch.arange(kv.k.numel(), dtype=torch.float32).view_as(kv.k))
    kv.v.copy_(-kv.k)
    st.rec.copy_(torch.arange(st.rec.numel(), dtype=torch.float32).view_as(st.rec))
    page = lambda t, p: t[:, p * 4:(p + 1) * 4].clone()  # noqa: E731
    p0, p1 = page(kv.k, 0), page(kv.k, 1)
    host.run([("kv_out", 1, 1)], kv, st)  # host page 1 <- device page 1
    host.run([("kv_out", 0, 0), ("kv_in", 1, 0), ("kv_out", 2, 1)], kv, st)
    assert torch.equal(page(kv.k, 0), p1) and torch.equal(page(kv.v, 0), -p1)  # fetched after page 0 left
    assert torch.equal(host.k[:, 0:4], p0)  # page 0's bytes went to host page 0
    assert torch.equal(host.k[:, 4:8], page(kv.k, 2))  # host page 1 refilled after it was fetched
    snap = st.rec[:, 1].clone()
    host.run([("state_out", 1, 0), ("state_in", 0, 0)], kv, st)
    assert torch.equal(st.rec[:, 0], snap) and torch.equal(host.rec[:, 0], snap)
    assert host.page_bytes == 2 * 2 * 4 * 1 * 2 * 4 and host.snap_bytes == StatePool.bytes_per_slot(
        2, 3, 4, 1, 2, 2, torch.float32, torch.float32)


# ---- the engine ----------------------------------------------------------------------------------
VARIANTS = ["qwen3", "qwen35"]


def _llm(path, **kw):
    return LLM(path, device="cpu", dtype="float32", page_size=kw.pop("page_size", 4), **kw)


def _run(llm, reqs, arrivals=None):
    """Drive the step loop to the end; arrivals: {step: [requests]} added at that step. Checks the
    scheduler's invariants after every step."""
    engine, arrivals = llm.llm_engine, dict(arrivals or {})
    for r in reqs:
        engine.add_request(r)
    pending = [r for rs in arrivals.values() for r in rs]
    step = 0
    while any(r.finish_reason is None for r in reqs + pending):
        for r in arrivals.pop(step, []):
            engine.add_request(r)
        engine.step()
        engine.scheduler.check_integrity()
        step += 1
    return step


def _rand(n, seed, vocab):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """Greedy tokens of each prompt computed alone without the prefix cache."""
    cache: dict = {}
    llms: dict = {}

    def get(variant, prompt, max_tokens=10):
        key = (variant, tuple(prompt), max_tokens)
        if key not in cache:
            if variant not in llms:
                llms[variant] = _llm(tiny_checkpoint(variant), prefix_cache=False)
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            cache[key] = llms[variant].generate([prompt], sp)[0].token_ids
        return cache[key]

    return get


@pytest.mark.parametrize("variant", VARIANTS)
def test_repeated_and_branching_prompts(variant, tiny_checkpoint, reference):
    llm = _llm(tiny_checkpoint(variant))
    V = llm.model_config.vocab_size
    base = _rand(37, 1, V)
    prompts = [base + [5, 6, 7], base + [8, 9], base + [5, 6, 7], base[:20]]
    outs = [llm.generate([p], GREEDY)[0] for p in prompts]
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference(variant, p)
    # base + [5,6,7]: nothing cached; base + [8,9]: the first's 36 tokens (its prompt-end snapshot for
    # the hybrid model), + 1 copied from the page [b36, 5, 6, 7] (attention: copy-on-write); the same
    # prompt again: 36 + 3 of that page (all but its last token) or 36; base[:20]: 16 + 3 copied
    # (attention) or none (no snapshot at 16 for the hybrid model)
    want = [0, 37, 39, 19] if variant == "qwen3" else [0, 36, 36, 0]
    assert [o.cached_tokens for o in outs] == want
    st = llm.scheduler.stats()["prefix_cache"]
    assert st["requests"] == 4 and st["cached_tokens"] == sum(want)
    assert st["saved_prefill_tokens"] == sum(want) and st["prompt_tokens"] == sum(map(len, prompts))
    assert "prefix_cache" in llm.stats()


@pytest.mark.parametrize("variant", VARIANTS)
def test_agent_turns_reuse_the_previous_turn(variant, tiny_checkpoint, reference):
    """Each turn resends the conversation so far (prompt + answer) plus a few new tokens: it starts
    after the last full page the previous turn computed (its rolling decode snapshot when hybrid)."""
    llm = _llm(tiny_checkpoint(variant))
    V = llm.model_config.vocab_size
    conv = _rand(23, 2, V)
    for turn in range(3):
        out = llm.generate([conv], GREEDY)[0]
        assert out.token_ids == reference(variant, conv)
        if turn:
            assert out.cached_tokens == prev_computed // 4 * 4
        prev_computed = len(conv) + len(out.token_ids) - 1  # the last sampled token is not computed
        conv = conv + out.token_ids + _rand(5, 10 + turn, V)


@pytest.mark.parametrize("variant", VARIANTS)
def test_concurrent_requests_share_a_running_prefix(variant, tiny_checkpoint, reference):
    """B and C arrive while A still runs: they reuse A's pages (and prompt-end snapshot), all three decode
    together on shared pages, and each gets its tokens from alone without the cache."""
    llm = _llm(tiny_checkpoint(variant), chunked_prefill_size=16)
    V = llm.model_config.vocab_size
    base = _rand(40, 3, V)
    a = Request("a", base + [1], GREEDY)
    b = Request("b", base + [2, 3], GREEDY)
    c = Request("c", base + [1], GREEDY)
    _run(llm, [a], {4: [b], 6: [c]})
    for r in (a, b, c):
        assert r.output_ids == reference(variant, r.prompt_ids)
    assert a.cached_tokens == 0 and b.cached_tokens == 40 and c.cached_tokens == 40
    tree = llm.scheduler.prefix
    assert tree.num_evictable == tree.num_pages == llm.engine.caches.kv.pages.num_used


@pytest.mark.parametrize("variant", VARIANTS)
def test_preemption_and_eviction_keep_tokens(variant, tiny_checkpoint, reference):
    """A pool of 24 pages of 4 tokens for 4 requests of 30+ tokens sharing 16: pages are evicted and
    requests preempted (and resumed from the cache), and the tokens stay the ones computed alone."""
    llm = _llm(tiny_checkpoint(variant), num_tokens=96, prefix_cache_snapshots=3)
    V = llm.model_config.vocab_size
    shared = _rand(16, 4, V)
    reqs = [Request(f"r{i}", shared + _rand(14 + i, 20 + i, V), SamplingParams(max_tokens=24, temperature=0.0,
                                                                               ignore_eos=True))
            for i in range(4)]
    _run(llm, reqs)
    for r in reqs:
        assert r.output_ids == reference(variant, r.prompt_ids, 24)
    assert sum(r.preemptions for r in reqs) > 0
    tree = llm.scheduler.prefix
    assert tree.evicted_pages > 0
    if variant == "qwen35":
        assert tree.evicted_snaps > 0
    # the conversations go on, one at a time, the last finished first: the LRU kept its pages and last
    # snapshot (3 snapshot slots for 4 requests: the others' may have been dropped)
    hits = []
    for r in sorted(reqs, key=lambda r: -r.finished_at):
        p = r.prompt_ids + r.output_ids
        again = llm.generate([p], GREEDY)[0]
        assert again.token_ids == reference(variant, p)
        hits.append((again.cached_tokens, (len(p) - 1) // 4 * 4))  # (got, all it had computed)
        llm.scheduler.check_integrity()
    assert hits[0][0] == hits[0][1], hits


def test_tree_match_partial_takes_the_longest_shared_head():
    pool = PagePool(8)
    tree = PrefixCache(pool, 4)
    a = _grow(tree, [1, 2, 3, 4, 5, 6, 7, 8])
    b = _grow(tree, [1, 2, 3, 4, 5, 6, 9, 9])
    c = _grow(tree, [1, 2, 3, 4, 5, 9, 9, 9])
    assert tree.match_partial(a[0], [1, 2, 3, 4, 5, 6, 9, 0, 0], 4, 9) == (b[1], 3)
    assert tree.match_partial(a[0], [1, 2, 3, 4, 5, 6, 7, 8, 0], 4, 7) == (a[1], 3)  # at most max_tokens
    assert tree.match_partial(a[0], [1, 2, 3, 4, 5, 7], 4, 6) in ((a[1], 1), (b[1], 1), (c[1], 1))
    assert tree.match_partial(a[0], [1, 2, 3, 4, 0, 6], 4, 6) == (None, 0)
    assert tree.match_partial(tree.root, [1, 2, 0], 0, 3) == (a[0], 2)


def test_copy_on_write_of_a_partly_shared_page(tiny_checkpoint, monkeypatch):
    """Attention-only model, pages of 4: a prompt that leaves a cached path 2 tokens into a page reuses the
    full pages and copies those 2 positions' K/V from the cached page into its own (while the request that
    computed it still runs, and after it ended); logprobs equal the cache-free run's. Skipping the copy
    changes them, so the test can fail."""
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    llm, ref = _llm(tiny_checkpoint("qwen3")), _llm(tiny_checkpoint("qwen3"), prefix_cache=False)
    V = llm.model_config.vocab_size
    base = _rand(38, 8, V)  # 9 full pages and 2 tokens
    a, b = Request("a", base + [1, 2], sp), Request("b", base + [3, 4, 5], sp)
    _run(llm, [a], {2: [b]})
    c = llm.generate([base + [6, 7]], sp)[0]
    assert (a.cached_tokens, b.cached_tokens, c.cached_tokens) == (0, 38, 38)
    for ids, got_ids, got_lps in ((b.prompt_ids, b.output_ids, b.output_lps),
                                  (base + [6, 7], c.token_ids, c.logprobs)):
        want = ref.generate([ids], sp)[0]
        assert got_ids == want.token_ids
        assert max(abs(x[0] - y[0]) for x, y in zip(got_lps, want.logprobs)) < 1e-4
    monkeypatch.setattr(llm.engine.caches.kv, "copy_heads", lambda copies: None)
    d = llm.generate([base + [8, 9]], sp)[0]
    want = ref.generate([base + [8, 9]], sp)[0]
    assert d.cached_tokens == 38
    assert max(abs(x[0] - y[0]) for x, y in zip(d.logprobs, want.logprobs)) > 1e-3


def _evicting_turns(llm, sp):
    """Three 30-token conversations in a 16-page pool (pages of 4) evict each other's pages; then the first
    goes on for a turn. Returns (outputs of the 4 requests, their prompts)."""
    V = llm.model_config.vocab_size
    convs = [_rand(30, 30 + i, V) for i in range(3)]
    outs = [llm.generate([c], sp)[0] for c in convs]
    nxt = convs[0] + outs[0].token_ids + _rand(3, 40, V)
    return outs + [llm.generate([nxt], sp)[0]], convs + [nxt]


@pytest.mark.parametrize("variant", VARIANTS)
def test_host_tier_brings_evicted_pages_back(variant, tiny_checkpoint, monkeypatch):
    """With --prefix-cache-host-gb the evicted pages (and, on the hybrid model, snapshots: 2 slots for three
    conversations) move to host memory, and the first conversation's next turn fetches its 9 pages back
    instead of recomputing them (without the host tier: nothing cached), with the cache-free logprobs.
    Dropping the fetch copies changes them, so the test can fail."""
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    kw = dict(num_tokens=64, prefix_cache_snapshots=2)
    ref = _llm(tiny_checkpoint(variant), prefix_cache=False, num_tokens=64)
    outs, prompts = _evicting_turns(_llm(tiny_checkpoint(variant), **kw), sp)
    assert outs[-1].cached_tokens == 0
    llm = _llm(tiny_checkpoint(variant), prefix_cache_host_gb=0.001, **kw)
    outs, prompts = _evicting_turns(llm, sp)
    for o, p in zip(outs, prompts):
        want = ref.generate([p], sp)[0]
        assert o.token_ids == want.token_ids
        assert max(abs(x[0] - y[0]) for x, y in zip(o.logprobs, want.logprobs)) < 1e-4
    assert outs[-1].cached_tokens == 36  # 30 + 9 computed tokens of the first turn: 9 full pages
    st = llm.scheduler.stats()["prefix_cache"]
    assert st["spilled_pages"] > 0 and st["fetched_pages"] > 0 and st["host_spill_bytes"] > 0
    if variant == "qwen35":
        assert st["spilled_snapshots"] > 0 and st["fetched_snapshots"] == 1
    llm.scheduler.check_integrity()
    from moestream.server.metrics import Metrics

    m = Metrics("x")
    m.update_engine(llm.scheduler.stats())
    assert f'moestream_prefix_cache_host_spill_bytes{{model="x"}} {float(st["host_spill_bytes"])}' in \
        m.exposition().decode()
    bad = _llm(tiny_checkpoint(variant), prefix_cache_host_gb=0.001, **kw)
    host = bad.engine.caches.host
    run = host.run
    monkeypatch.setattr(host, "run", lambda ops, kv, st: run([o for o in ops if not o[0].endswith("_in")], kv, st))
    outs, prompts = _evicting_turns(bad, sp)
    want = ref.generate([prompts[-1]], sp)[0]
    assert outs[-1].cached_tokens == 36
    assert max(abs(x[0] - y[0]) for x, y in zip(outs[-1].logprobs, want.logprobs)) > 1e-3


@pytest.mark.parametrize("chunk", [2048, 8])
def test_a_shared_prefix_gets_a_snapshot_where_requests_branch(chunk, tiny_checkpoint, reference):
    """Hybrid model: B shares A's first 40 tokens (10 pages) but A's snapshots sit past them, so B recomputes
    everything, and takes a snapshot at 40 on the way (inside its chunk, or after the chunk ending there);
    C, sharing the same 40 tokens, then resumes at 40. Tokens equal the cache-free runs."""
    llm = _llm(tiny_checkpoint("qwen35"), chunked_prefill_size=chunk)
    V = llm.model_config.vocab_size
    base = _rand(40, 11, V)
    prompts = [base + _rand(10, 12 + i, V) for i in range(3)]
    outs = [llm.generate([p], GREEDY)[0] for p in prompts]
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference("qwen35", p)
    assert [o.cached_tokens for o in outs] == [0, 0, 40]
    off = _llm(tiny_checkpoint("qwen35"), chunked_prefill_size=chunk, prefix_cache_prompt_snapshot="off")
    assert [off.generate([p], GREEDY)[0].cached_tokens for p in prompts] == [0, 0, 0]


def test_a_hit_without_its_snapshot_would_differ(tiny_checkpoint, reference, monkeypatch):
    """The hybrid tests can fail: dropping the snapshot load (resuming from a zero state) changes tokens."""
    llm = _llm(tiny_checkpoint("qwen35"))
    V = llm.model_config.vocab_size
    base = _rand(37, 5, V)
    llm.generate([base + [1]], GREEDY)
    state = llm.engine.caches.state
    copy = state.copy
    monkeypatch.setattr(state, "copy", lambda pairs: copy([p for p in pairs if p[0] < state.num_slots]))
    out = llm.generate([base + [2]], GREEDY)[0]
    assert out.cached_tokens == 36
    assert out.token_ids != reference("qwen35", base + [2])


def test_disabled_prefix_cache(tiny_checkpoint):
    llm = _llm(tiny_checkpoint("qwen35"), prefix_cache=False)
    assert llm.scheduler.prefix is None and llm.engine.caches.state.num_snapshots == 0
    p = _rand(30, 6, llm.model_config.vocab_size)
    outs = [llm.generate([p], GREEDY)[0] for _ in range(2)]
    assert outs[1].cached_tokens == 0 and outs[0].token_ids == outs[1].token_ids
    assert llm.engine.caches.kv.pages.num_used == 0 and "prefix_cache" not in llm.scheduler.stats()


# ---- usage and stats -----------------------------------------------------------------------------
def test_usage_reports_cached_tokens():
    from moestream.server import protocol as P

    assert P.usage_dict(100, 7, 64)["prompt_tokens_details"] == {"cached_tokens": 64}
    assert P.usage_dict(100, 7)["prompt_tokens_details"] == {"cached_tokens": 0}
    msg = P.anthropic_message_response("m", "x", text="hi", input_tokens=100, output_tokens=7,
                                       cache_read_input_tokens=64)
    assert msg["usage"] == {"input_tokens": 36, "output_tokens": 7, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 64}
    enc = P.AnthropicStreamEncoder("m", "x", input_tokens=100)
    enc.start()
    tail = enc.finish("stop", 7, cache_read_input_tokens=64)
    assert '"cache_read_input_tokens": 64' in tail and '"input_tokens": 36' in tail


def test_engine_loop_sends_cached_tokens_and_stats(tiny_checkpoint):
    from moestream.server.engine_proc import EngineArgs, EngineLoop
    from moestream.server.messages import Add, Outputs
    from moestream.server.metrics import Metrics

    class Outbox:
        def __init__(self):
            self.msgs = []

        def send(self, msg):
            self.msgs.append(msg)

    loop = EngineLoop(EngineArgs(str(tiny_checkpoint("qwen3")), {"device": "cpu", "dtype": "float32",
                                                                 "page_size": 4}), Outbox())
    prompt = list(range(3, 33))
    finals = []
    for rid in ("a", "b"):
        loop.outbox.msgs.clear()
        loop._add(Add(rid, prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
        for _ in range(50):
            loop._step()
            items = [d for m in loop.outbox.msgs if isinstance(m, Outputs) for _, d in m.items
                     if d.finish_reason is not None]
            if items:
                finals.append(items[0])
                break
    assert [f.cached_tokens for f in finals] == [0, 29]  # all but the last token: 7 pages of 4 and 1 copied from the 8th
    stats = loop.stats()
    assert stats["prefix_cache"]["cached_tokens"] == 29 and stats["prefix_cache"]["hit_rate"] == 29 / 60
    m = Metrics("x")
    m.update_engine(stats)
    text = m.exposition().decode()
    assert 'moestream_prefix_cache_hit_rate{model="x"} 0.483' in text
    assert 'moestream_prefix_cache_cached_tokens{model="x"} 29.0' in text


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs 2 CPU cores (one per rank)")
def test_tensor_parallel_ranks_load_and_save_snapshots(tiny_checkpoint, reference, one_torch_thread):
    """State copies travel in the ForwardBatch: every rank resumes a hit from its own snapshot shard."""
    from moestream.parallel import TPWorkers

    w = TPWorkers(2, "cpu")
    try:
        with _llm(tiny_checkpoint("qwen35"), tp_size=2, tp_workers=w, moe_cpu_threads=1) as llm:
            V = llm.model_config.vocab_size
            base = _rand(37, 7, V)
            outs = [llm.generate([p], GREEDY)[0] for p in (base + [1], base + [2])]
            assert [o.cached_tokens for o in outs] == [0, 36]
            for p, o in zip((base + [1], base + [2]), outs):
                assert o.token_ids == reference("qwen35", p)
    finally:
        w.close()


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs 2 CPU cores (one per rank)")
def test_tensor_parallel_ranks_run_the_host_tier_copies(tiny_checkpoint, reference, one_torch_thread):
    """Host-tier copies travel in the ForwardBatch: each rank spills and fetches its own shard of pages and
    snapshots, and the fetched turn has the cache-free tokens."""
    from moestream.parallel import TPWorkers

    w = TPWorkers(2, "cpu")
    try:
        with _llm(tiny_checkpoint("qwen35"), tp_size=2, tp_workers=w, moe_cpu_threads=1, num_tokens=64,
                  prefix_cache_snapshots=2, prefix_cache_host_gb=0.002) as llm:
            outs, prompts = _evicting_turns(llm, GREEDY)
            for o, p in zip(outs, prompts):
                assert o.token_ids == reference("qwen35", p)
            st = llm.scheduler.stats()["prefix_cache"]
            assert outs[-1].cached_tokens == 36 and st["fetched_pages"] > 0 and st["fetched_snapshots"] == 1
    finally:
        w.close()


@pytest.mark.parametrize("when,chunk,chunks,inside", [("on", 64, [30], [(0, 28)]), ("on", 8, [8, 8, 8, 6], [(24, 4)]),
                                                      ("off", 8, [8, 8, 8, 6], []), ("on", 7, [7, 7, 7, 7, 2], [])])
def test_prompt_snapshot_inside_the_chunk(tiny_checkpoint, reference, when, chunk, chunks, inside):
    """A hybrid model's state at a prompt's last page boundary (28 of 30 tokens, pages of 4) is taken inside
    the prefill chunk that crosses it (no cut, no extra chunk), or copied after a chunk that ends there (chunks
    of 7); a repeat of the prompt resumes from it. --prefix-cache-prompt-snapshot off takes none. Tokens equal
    the cache-free run either way."""
    prompt = list(range(3, 33))
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm = _llm(tiny_checkpoint("qwen35"), prefix_cache_prompt_snapshot=when, chunked_prefill_size=chunk)
    seen, snaps = [], []
    orig = llm.engine.forward

    def spy(batch):
        seen.append(batch.num_tokens)
        snaps.extend((s.cached, e) for s in batch.seqs for e, _ in s.snapshots)
        return orig(batch)

    llm.engine.forward = spy
    first = llm.generate([prompt], sp)[0]
    assert seen == chunks and snaps == inside
    again = llm.generate([prompt], sp)[0]
    assert again.token_ids == first.token_ids == reference("qwen35", prompt, 1)
    assert again.cached_tokens == (28 if when == "on" else 0)


def test_cached_prompt_tail_computed_like_the_whole_prompt_on_cpu_kernels(tiny_checkpoint, tmp_path):
    """A GGUF on the CPU kernels: a prompt's tail after a prefix-cache hit is a short chunk, here one token (the
    rest is in 7 cached pages and the head of the 8th, copied), computed with the int8-activation kernels like
    the whole prompt — their rounding is per row, so the tail's row rounds as it did among the prompt's 30 —
    and the repeat's logits equal the first run's."""
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    from moestream.kernels import cpu_quant

    if not cpu_quant.available():
        pytest.skip("CPU quant kernels could not be built here")
    path, _ = gguf_writer.write_gguf(tiny_checkpoint("qwen3"), tmp_path / "m.gguf", Q.Q8_0)
    llm = LLM(path, device="cpu", dtype="float32", page_size=4)
    seen = []
    orig = llm.engine.model.forward

    def spy(batch):
        seen.append((batch.prompt, cpu_quant.available()))
        return orig(batch)

    llm.engine.model.forward = spy
    prompt = list(range(5, 35))
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
    first, again = (llm.generate([prompt], sp)[0] for _ in range(2))
    assert again.cached_tokens == 29 and first.cached_tokens == 0
    assert again.token_ids == first.token_ids
    # a row's kernel result does not depend on the rows beside it: equal to float32 summation noise (~1e-6);
    # a tail computed another way (float activations) would move ~1e-2
    assert max(abs(a[0] - b[0]) for a, b in zip(again.logprobs, first.logprobs)) < 1e-4
    assert set(seen) == {(True, True), (False, True)}  # the kernels compute prompt and decode rows alike


@pytest.mark.parametrize("cache", [True, False])
def test_a_request_that_outgrows_the_whole_kv_pool_finishes_with_length(tiny_checkpoint, cache):
    """A 43-token prompt in a 48-token pool with max_tokens 10 (it fits, its answer cannot): the request
    finishes with "length" once the pool is full, with the tokens it had — before, it preempted itself and was
    recomputed forever. A short request beside it is not disturbed."""
    import threading

    llm = _llm(tiny_checkpoint("qwen3"), prefix_cache=cache, num_tokens=48)
    cap = llm.engine.caches.kv.num_pages * llm.engine.caches.kv.page_size
    long_prompt, short = list(range(3, 46)), [5, 6, 7]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", llm.generate([long_prompt, short], sp)))
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "the long request never finished"
    long_out, short_out = box["out"]
    assert long_out.finish_reason == "length" and len(long_prompt) + len(long_out.token_ids) == cap + 1
    assert short_out.finish_reason == "length" and len(short_out.token_ids) == 10
    alone = llm.generate([short], sp)[0]
    assert short_out.token_ids == alone.token_ids


def _until_finished(llm, req, max_steps: int) -> list:
    """Add req and step the engine until it finishes, at most max_steps steps (a request that never can stops
    here, unfinished), checking the scheduler's invariants after each; the steps' outputs."""
    llm.llm_engine.add_request(req)
    outs = []
    for _ in range(max_steps):
        if req.finish_reason is not None:
            break
        outs += llm.llm_engine.step()
        llm.scheduler.check_integrity()
    return outs


@pytest.mark.parametrize("host_gb", [0.0, 0.001])
def test_a_prompt_recomputed_without_its_snapshot_fits_a_pool_of_one_prompt(host_gb, tiny_checkpoint, reference):
    """The hybrid model with no snapshot slots (the 35B model's FP8 file at 4 GiB had none to spare): the same
    prompt again matches the first run's pages but cannot resume from them, so it is computed again — in a pool
    that holds it once. Its filled pages share the cached nodes (its own copies go back to the pool; with a host
    tier, a spilled node takes the new page). Before, it held both and preempted itself for ever (the FP8 edge run
    timed out in its second pass, 2026-12-06)."""
    llm = _llm(tiny_checkpoint("qwen35"), num_tokens=112, prefix_cache_snapshots=0, prefix_cache_host_gb=host_gb)
    prompt = _rand(96, 7, llm.model_config.vocab_size)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i in range(2):
        req = Request(f"again{i}", list(prompt), sp)
        _until_finished(llm, req, 200)
        assert req.finish_reason == "length" and req.preemptions == 0, (i, req.preemptions)
        assert req.output_ids == reference("qwen35", prompt, 12)
        assert req.cached_tokens == 0  # no snapshot: nothing resumed
    st = llm.scheduler.stats()["prefix_cache"]
    if host_gb:
        assert st["spilled_pages"] > 0  # the second run's pages took over spilled nodes


def test_flat_index_is_every_position_through_the_page_table():
    """KVPool.flat_index (built every step for every sequence): position p of a sequence is row
    pages[p // page_size] * page_size + p % page_size of the pool, for any range; past the pages it raises."""
    import random

    from moestream.kvcache.pools import KVPool

    kv = KVPool(1, 64, 4, 1, 2, torch.float32, torch.device("cpu"))
    ps = kv.page_size
    rng = random.Random(0)
    for _ in range(300):
        pages = rng.sample(range(64), rng.randint(1, 12))
        start = rng.randint(0, len(pages) * ps)
        end = rng.randint(start, len(pages) * ps)
        want = [pages[p // ps] * ps + p % ps for p in range(start, end)]
        got = kv.flat_index(pages, start, end, "cpu")
        assert got.dtype == torch.int64 and got.tolist() == want, (pages, start, end)
    with pytest.raises(IndexError):
        kv.flat_index([3, 5], 0, 2 * ps + 1, "cpu")


def test_a_request_that_can_never_get_its_pages_ends_with_an_error(tiny_checkpoint, monkeypatch):
    """The safety net behind the page sharing above: with the old page holding put back (a request kept its own
    copy of every page the tree already had), the repeated prompt preempts itself while running alone; after
    STALL_LIMIT attempts at one length it ends with an error instead of being recomputed for ever, and the engine
    serves the next request."""
    from moestream.scheduler import scheduler as sched_mod

    def holds_both(self, req):  # the pre-fix _cache_pages
        P, tree = self.kv.page_size, self.prefix
        parent = req.nodes[-1] if req.nodes else tree.root
        for i in range(len(req.nodes), req.num_computed // P):
            node, _ = tree.insert(parent, tuple(req.all_ids[i * P:(i + 1) * P]), req.pages[i])
            tree.acquire([node])
            req.nodes.append(node)
            parent = node

    monkeypatch.setattr(sched_mod.Scheduler, "_cache_pages", holds_both)
    # (a 400-token prompt in a 448-token pool of 16-token pages: with both copies held it stalls at its prompt)
    llm = _llm(tiny_checkpoint("qwen35"), num_tokens=448, page_size=16, prefix_cache_snapshots=0,
               chunked_prefill_size=64)
    prompt = _rand(400, 7, llm.model_config.vocab_size)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = []
    for i in range(2):
        req = Request(f"again{i}", list(prompt), sp)
        outs += _until_finished(llm, req, 300)
        assert req.finish_reason is not None, f"request {i} never finished"
    last = outs[-1]
    assert last.request.id == "again1" and last.error and "could not hold" in last.error, (last.error, req.finish_reason)
    assert llm.llm_engine.scheduler.running == [] and not llm.scheduler.waiting
    short = llm.generate([prompt[:20]], sp)[0]  # the engine goes on
    assert short.finish_reason == "length" and len(short.token_ids) == 12
