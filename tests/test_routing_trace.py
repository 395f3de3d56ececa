"""Routing traces: recorded from real runs, replayed to the engine's exact cache counts, forced back into
the router; the synthetic generator's parameters do what they say."""
from __future__ import annotations

import numpy as np
import pytest

from moestream import LLM, SamplingParams
from moestream.core import ConfigError
from moestream.moe import synth
from moestream.moe.replay import replay
from moestream.moe.residency import POLICIES
from moestream.moe.trace import RouteForcer, Trace, TraceHeader, read_trace, write_trace
from moestream.config import MOE_CACHE_POLICIES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SP = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
COMMON = dict(device="cpu", dtype="float32", chunked_prefill_size=7, max_running_requests=4, moe_cpu_threads=1,
              moe_backend="offload", moe_prefetch="off")


def prompts(vocab):
    rng = np.random.default_rng(5)
    return [rng.integers(0, vocab, n).tolist() for n in (5, 16, 23)]


@pytest.mark.parametrize("policy,kw", [
    ("lru", {"moe_cache_size": 3}),
    ("lru", {"moe_cache_size": 7}),
    ("lfu", {"moe_cache_size": 5}),
    ("lrfu", {"moe_cache_size": 7}),
    ("wlfu", {"moe_cache_size": 7}),
    ("lru", {"moe_cache_size": 11, "moe_decode_kernel": "pairs"}),  # the device-side cache (CUDA decode path)
    # the decode prefetcher, replayed from the recorded predictions
    ("lru", {"moe_cache_size": 5, "moe_prefetch": "on"}),
    ("wlfu", {"moe_cache_size": 9, "moe_prefetch": "on"}),
])
def test_replay_of_a_recorded_run_gives_the_engines_counts(tiny_checkpoint, tmp_path, policy, kw):
    path = tmp_path / "run.trace"
    llm = LLM(tiny_checkpoint("qwen35"), record_routing=str(path), moe_cache_policy=policy, **{**COMMON, **kw})
    ps = prompts(llm.model_config.vocab_size)
    outs = llm.generate(ps, SP)
    total = llm.stats()["total"]
    llm.close()
    trace = read_trace(path)
    h = trace.header
    cfg = llm.model_config
    assert (h.num_experts, h.top_k, h.num_layers) == (cfg.num_experts, cfg.top_k, cfg.num_layers)
    assert h.moe_layers == [i for i, m in enumerate(cfg.moe_layers) if m]
    # every token computed is a row: the prompts, then each generated token but the last
    assert int(trace.step_rows.sum()) == sum(map(len, ps)) + sum(len(o.token_ids) - 1 for o in outs)
    assert (~trace.step_decode).any() and trace.decode_tokens > 0
    pairs = kw.get("moe_decode_kernel") == "pairs"
    prefetch = kw.get("moe_prefetch") == "on"
    r = replay(trace, kw["moe_cache_size"], policy, "pairs" if pairs else "grouped",
               scratch=COMMON["max_running_requests"] * h.top_k, prefetch=prefetch)
    assert (r.hits, r.misses) == (total["hits"], total["misses"])
    assert (r.prefetch_issued, r.prefetch_hits) == (total["prefetch_issued"], total["prefetch_hits"])
    assert trace.pred is not None and trace.pred.shape == trace.ids.shape
    if prefetch:
        assert r.prefetch_issued > 0 and r.prefetch_hits > 0
        assert replay(trace, kw["moe_cache_size"], policy).misses != r.misses  # prefetch changed the counts
    assert r.misses > 0 and (r.hits > 0 or kw["moe_cache_size"] < 5)


def test_forced_routes_drive_the_cache(tiny_checkpoint):
    """A RouteForcer replaces the router's top-k in decode steps: the engine's counts are the replay's."""
    llm = LLM(tiny_checkpoint("qwen35"), moe_cache_size=4, **COMMON)
    cfg = llm.model_config
    layers = [i for i, m in enumerate(cfg.moe_layers) if m]
    rng = np.random.default_rng(0)
    rows = np.stack([np.stack([rng.choice(cfg.num_experts, cfg.top_k, replace=False) for _ in layers])
                     for _ in range(40)]).astype(np.uint16)
    header = TraceHeader("forced", cfg.num_layers, layers, cfg.num_experts, cfg.top_k)
    trace = Trace(header, rows, np.ones(40, dtype=np.int64), np.ones(40, dtype=bool))
    engine = llm.engine
    engine.set_route_tap(RouteForcer(trace, engine.device, max_rows=4))
    before = llm.stats()["total"]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True))
    after = llm.stats()["total"]
    # 12 decode steps of one row each read the trace's first 12 rows; the prefill does not touch the cache
    r = replay(Trace(header, rows[:12], np.ones(12, dtype=np.int64), np.ones(12, dtype=bool)), 4, "lru")
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (r.hits, r.misses)


def test_trace_file_round_trip_and_cut_records(tmp_path):
    tr = synth.generate(synth.preset("qwen36", tokens=20, batch=3, num_layers=4, num_experts=32, top_k=4))
    path = tmp_path / "t.trace"
    write_trace(path, tr)
    back = read_trace(path)
    assert back.header == tr.header
    assert np.array_equal(back.ids, tr.ids) and np.array_equal(back.step_rows, tr.step_rows)
    # a writer killed mid-record leaves a file that reads up to its last whole step
    data = path.read_bytes()
    (tmp_path / "cut.trace").write_bytes(data[:-5])
    cut = read_trace(tmp_path / "cut.trace")
    assert len(cut.step_rows) == 19 and np.array_equal(cut.ids, tr.ids[:-3])
    (tmp_path / "bad").write_bytes(b"hello")
    with pytest.raises(ConfigError, match="not a moestream routing trace"):
        read_trace(tmp_path / "bad")


def test_config_names_every_policy():
    assert set(MOE_CACHE_POLICIES) == set(POLICIES)


def _hit_rate(params, slots, policy="lru"):
    return replay(synth.generate(params), slots, policy).hit_rate


def test_synthetic_locality_parameters():
    base = dict(tokens=300, num_layers=4, num_experts=64, top_k=4)
    uniform = synth.preset("uniform", **base)
    tr = synth.generate(uniform)
    assert all(len(set(row)) == 4 for row in tr.ids.reshape(-1, 4).tolist())  # top-k distinct
    assert synth.generate(uniform).ids.tobytes() == tr.ids.tobytes()  # deterministic per seed
    slots = 64  # a quarter of the 256 experts
    # no locality: a cache hits about its residency fraction
    assert abs(_hit_rate(uniform, slots) - 0.25) < 0.05
    # reusing the previous token's experts makes a small cache hit far more often
    sticky = synth.preset("uniform", reuse=0.8, **base)
    assert _hit_rate(sticky, slots) > 0.7
    # popularity skew alone too
    skewed = synth.preset("uniform", zipf=1.2, **base)
    assert _hit_rate(skewed, slots) > 0.45
    # follow = 1: layer l's slot j is a fixed function of layer l-1's slot j
    chain = synth.generate(synth.preset("uniform", follow=1.0, **base))
    pairs = {(a, b) for a, b in zip(chain.ids[:, 0].ravel().tolist(), chain.ids[:, 1].ravel().tolist())}
    assert len({a for a, _ in pairs}) == len(pairs)  # each layer-0 expert maps to exactly one layer-1 expert
    with pytest.raises(ConfigError):
        synth.preset("uniform", reuse=0.7, follow=0.5)


def test_forcer_spreads_a_batch_over_streams():
    """A trace of R streams: a step of T <= R rows reads streams 0..T-1 of one trace step; more rows than
    streams read trace steps far apart."""
    tr = synth.generate(synth.preset("uniform", tokens=8, batch=2, num_layers=2, num_experts=16, top_k=2))
    grid = tr.ids.reshape(8, 2, 2, 2)
    f = RouteForcer(tr, __import__("torch").device("cpu"), max_rows=4)
    assert np.array_equal(f.rows_for(2), grid[0])
    assert np.array_equal(f.rows_for(1), grid[1, :1])
    four = f.rows_for(4)  # trace step 2 for rows 0-1, step 2 + 8 // 2 = 6 for rows 2-3
    assert np.array_equal(four[:2], grid[2]) and np.array_equal(four[2:], grid[6])


def test_opt_bound_is_above_every_policy_and_exact_when_all_fit():
    from moestream.moe.replay import opt_hit_rate

    tr = synth.generate(synth.preset("qwen36", tokens=60, num_layers=3, num_experts=32, top_k=4))
    for slots in (8, 24, 48):
        bound = opt_hit_rate(tr, slots)
        assert all(replay(tr, slots, p).hit_rate <= bound + 1e-9 for p in POLICIES)
    # every expert fits: only the first use of each misses, for OPT and LRU alike
    distinct = len({(layer, int(e)) for layer in range(3) for e in np.unique(tr.ids[:, layer])})
    assert replay(tr, 96, "lru").misses == distinct
    assert opt_hit_rate(tr, 96) == replay(tr, 96, "lru").hit_rate


def test_cli_record_then_bench_cache(tiny_checkpoint, tmp_path, capsys):
    from moestream.cli import main

    path = tmp_path / "gen.trace"
    assert main(["generate", "--model-path", str(tiny_checkpoint("qwen35")), "--prompt", "hello there",
                 "--max-tokens", "6", "--device", "cpu", "--no-chat", "--record-routing", str(path)]) == 0
    trace = read_trace(path)
    assert trace.decode_tokens == 5
    capsys.readouterr()
    assert main(["bench", "cache", "--trace", str(path), "--slots", "3,8", "--pcie-gbs", "10", "--prefetch",
                 "--lookahead", "2"]) == 0
    out = capsys.readouterr().out
    for policy in POLICIES:
        assert sum(line.startswith(policy + " ") for line in out.splitlines()) == 2, out
        assert sum(line.startswith(policy + "+pf ") for line in out.splitlines()) == 2, out
        assert sum(line.startswith(policy + "+la2 ") for line in out.splitlines()) == 2, out
    assert sum(line.startswith("opt-bound ") for line in out.splitlines()) == 2, out  # on by default
    assert main(["bench", "cache", "--trace", str(path), "--slots", "3", "--no-opt", "--policies", "lru"]) == 0
    assert "opt-bound" not in capsys.readouterr().out
    assert main(["bench", "cache", "--trace", str(path), "--lookahead", "0"]) == 2
    # bad input: one line, exit status 2
    assert main(["bench", "cache", "--trace", str(tmp_path / "missing.trace")]) == 2
    assert main(["bench", "cache", "--trace", str(path), "--policies", "lru,nope"]) == 2
    assert main(["generate", "--prompt", "x", "--record-routing", str(tmp_path / "no" / "dir" / "t")]) == 2
    err = capsys.readouterr().err
    assert "cannot read routing trace" in err and "unknown --policies nope" in err and "no directory" in err
    assert "--lookahead" in err
    synth_path = tmp_path / "s.trace"
    assert main(["bench", "trace", "--preset", "qwen36", "--tokens", "4", "--batch", "2", "-o", str(synth_path)]) == 0
    assert read_trace(synth_path).ids.shape == (8, 40, 8)
    assert main(["bench", "trace", "--preset", "nope", "-o", str(synth_path)]) == 2
    assert main(["bench", "cache", "--trace", str(synth_path), "--prefetch"]) == 2  # no predictions to replay
    assert "--prefetch needs a recorded trace" in capsys.readouterr().err


def test_synthetic_share_makes_streams_route_alike():
    base = dict(tokens=50, batch=3, num_layers=2, num_experts=64, top_k=4)
    same = synth.generate(synth.preset("qwen36", share=1.0, **base)).ids.reshape(50, 3, 2, 4)
    assert np.array_equal(same[:, 1], same[:, 0]) and np.array_equal(same[:, 2], same[:, 0])
    apart = synth.generate(synth.preset("qwen36", share=0.0, **base)).ids.reshape(50, 3, 2, 4)
    assert (apart[:, 1] != apart[:, 0]).mean() > 0.5


def test_lookahead_learns_a_layer_to_layer_map_online():
    from moestream.moe.lookahead import CoocPredictor

    base = dict(tokens=200, num_layers=4, num_experts=64, top_k=4)
    chain = synth.generate(synth.preset("uniform", follow=1.0, **base))  # layer l+1 a fixed map of layer l
    plain = replay(chain, 24, "lru")
    ahead = replay(chain, 24, "lru", lookahead=4, lift=True)
    assert ahead.policy == "lru+la4" and ahead.prefetch_issued > 0
    assert ahead.prefetch_hits > 0.5 * ahead.prefetch_issued  # most predictions are right once learned
    assert ahead.misses < 0.7 * plain.misses
    assert ahead.hits + ahead.misses == plain.hits + plain.misses  # prefetch admits, it does not count accesses
    # online: the first step knows nothing, so it prefetches nothing
    one = Trace(chain.header, chain.ids[:1], np.ones(1, dtype=np.int64), np.ones(1, dtype=bool))
    assert replay(one, 24, "lru", lookahead=4).prefetch_issued == 0
    # no locality between layers: the table learns nothing useful, and prefetching cannot help much
    flat = synth.generate(synth.preset("uniform", **base))
    assert replay(flat, 24, "lru", lookahead=2, lift=True).misses > 0.9 * replay(flat, 24, "lru").misses
    # the predictor skips residents and never predicts an expert it never saw follow these
    p = CoocPredictor(2, 8, k=3)
    p.learn(0, np.array([[0, 1]]), np.array([[5, 6]]))
    assert p.predict(0, np.array([[0]]), lambda e: e == 5) == [6]
    assert p.predict(0, np.array([[2]]), lambda e: False) == []
    with pytest.raises(ValueError):
        replay(chain, 24, "lru", prefetch=True, lookahead=2)


def test_candidate_policies_replay_within_belady():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import cache_policy_sweep as sweep
    from moestream.moe import residency
    from moestream.moe.replay import opt_hit_rate

    tr = synth.generate(synth.preset("qwen36", tokens=80, num_layers=3, num_experts=32, top_k=4))
    added = [c.name for c in sweep.CANDIDATES if c.name not in residency.POLICIES]
    try:
        for c in sweep.CANDIDATES:
            residency.POLICIES.setdefault(c.name, c)
        for slots in (12, 24, 40):  # one token's 12 keys to 40 of the 96
            bound = opt_hit_rate(tr, slots)
            for c in sweep.CANDIDATES:
                r = replay(tr, slots, c.name)
                assert 0 < r.hit_rate <= bound + 1e-9, (c.name, slots)
        distinct = replay(tr, 96, "lru").misses  # everything fits: only first uses miss, for every policy
        assert all(replay(tr, 96, c.name).misses == distinct for c in sweep.CANDIDATES)
    finally:
        for name in added:
            del residency.POLICIES[name]


def test_follow_maps_are_the_generators_and_bound_lookahead():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from cache_policy_sweep import follow_ceiling

    p = synth.preset("uniform", follow=1.0, tokens=60, num_layers=3, num_experts=32, top_k=4)
    chain = synth.generate(p)
    fmap = synth.follow_maps(p)
    assert np.array_equal(chain.ids[:, 1], fmap[1][chain.ids[:, 0]])
    assert np.array_equal(chain.ids[:, 2], fmap[2][chain.ids[:, 1]])
    assert follow_ceiling(chain, 24) > 0.6  # every miss past layer 0 is an image of the previous layer's experts
    flat = synth.generate(synth.preset("uniform", tokens=60, num_layers=3, num_experts=32, top_k=4))
    assert follow_ceiling(flat, 24) < 0.25  # only chance overlaps (4 of 32 images)


def test_forcer_by_position_follows_each_requests_tokens():
    """by_position: a row reads its request's stream at its token's position, whichever step computes it; a
    request's rows in one step (a verify step) read consecutive trace steps; requests beyond the trace's streams
    start far apart. Streams are numbered by the requests' first decode step (lowest free number), not by their
    state slots: the next requests get the same streams in the same batch order whatever slots they get."""
    from moestream.batch import SeqMeta

    torch = __import__("torch")
    tr = synth.generate(synth.preset("uniform", tokens=16, batch=2, num_layers=2, num_experts=16, top_k=2))
    grid = tr.ids.reshape(16, 2, 2, 2)
    f = RouteForcer(tr, torch.device("cpu"), max_rows=8, by_position=True, streams=4)
    meta = lambda slot, cached, n: SeqMeta(start=0, length=n, cached=cached, state_slot=slot,  # noqa: E731
                                           kv_index=torch.zeros(cached + n, dtype=torch.long))
    rows = f.rows_at(*f._positions([meta(1, 5, 3), meta(2, 9, 1), meta(7, 2, 1)]))
    assert np.array_equal(rows[:3], grid[5:8, 0])  # slot 1 (stream 0), positions 5-7: trace steps 5-7
    assert np.array_equal(rows[3], grid[9, 1])  # slot 2: stream 1
    assert np.array_equal(rows[4], grid[(2 + 8) % 16, 0])  # slot 7: stream 2, from step 16 / ceil(4 / 2) = 8
    # one row at position 6 of slot 1 reads what the 3-row step gave it: a token routes alike in any step
    assert np.array_equal(f.rows_at(*f._positions([meta(1, 6, 1), meta(2, 10, 1)]))[0], rows[1])
    f.begin_step({"num_tokens": 4, "decode": True, "seqs": [meta(1, 5, 3), meta(2, 9, 1)]})
    assert np.array_equal(f.host[:, :4].numpy().transpose(1, 0, 2), rows[:4])
    # new requests (their prompts computed) in slots 2 and 1, in that batch order: streams 0 and 1 again
    f.begin_step({"num_tokens": 7, "decode": False, "seqs": [meta(2, 0, 4), meta(1, 0, 3)]})
    again = f.rows_at(*f._positions([meta(2, 4, 1), meta(1, 3, 1)]))
    assert np.array_equal(again[0], grid[4, 0]) and np.array_equal(again[1], grid[3, 1])
    f.begin_step({"num_tokens": 1, "decode": True, "draft": True, "seqs": [meta(1, 8, 1)], "draft_layer": 9})
    assert f.T == 0  # an MTP drafter pass keeps the router's choice (layer 9 is not in the trace)
    ids = torch.zeros(1, 2, dtype=torch.long)
    assert f(9, None, ids) is ids


def test_forcer_routes_a_traced_draft_layer_by_position():
    """A trace made for the main layers and the MTP layer (here layer 2 of 0-2): a drafter pass's rows read that
    layer's trace rows at the positions the pass computes; a draft layer the trace lacks keeps the router."""
    from moestream.batch import SeqMeta

    torch = __import__("torch")
    tr = synth.generate(synth.preset("qwen36", tokens=16, batch=2, num_layers=3, num_experts=16, top_k=2),
                        moe_layers=[0, 1, 2])
    grid = tr.ids.reshape(16, 2, 3, 2)
    f = RouteForcer(tr, torch.device("cpu"), max_rows=8, by_position=True, streams=2)
    meta = lambda slot, cached, n: SeqMeta(start=0, length=n, cached=cached, state_slot=slot,  # noqa: E731
                                           kv_index=torch.zeros(cached + n, dtype=torch.long))
    f.begin_step({"num_tokens": 2, "decode": True, "seqs": [meta(0, 6, 1), meta(1, 3, 1)]})  # streams 0, 1
    f.begin_step({"num_tokens": 2, "decode": True, "draft": True, "seqs": [meta(1, 4, 1), meta(0, 7, 1)],
                  "draft_layer": 2})
    assert f.T == 2
    got = f(2, None, torch.zeros(2, 2, dtype=torch.long))
    assert np.array_equal(got.numpy(), np.stack([grid[4, 1, 2], grid[7, 0, 2]]))
    # a pass over a verify step's rows runs the block's experts for its drafting rows only (draft_rows: the last
    # row of each request), which read the trace at their own positions
    f.begin_step({"num_tokens": 4, "decode": True, "draft": True, "seqs": [meta(1, 4, 3), meta(0, 7, 1)],
                  "draft_layer": 2, "draft_rows": [2, 3]})
    assert f.T == 2
    got = f(2, None, torch.zeros(2, 2, dtype=torch.long))
    assert np.array_equal(got.numpy(), np.stack([grid[6, 1, 2], grid[7, 0, 2]]))
    f.begin_step({"num_tokens": 1, "decode": True, "draft": True, "seqs": [meta(1, 4, 1)], "draft_layer": 5})
    assert f.T == 0


def test_speculative_tokens_equal_with_the_mtp_layer_traced(tiny_checkpoint):
    """A synthetic trace made for the main layers and the MTP layer (mtp_decode.py's default): the drafter's
    decode-like passes route from the trace (prompt passes keep the router), and speculation still gives the tokens
    of plain decoding on the same engine and trace."""
    llm = LLM(tiny_checkpoint("qwen35_mtp"), moe_cache_size=6, speculative="mtp", num_speculative_tokens=2, **COMMON)
    cfg, engine = llm.model_config, llm.engine
    draft = engine.runtime.ctx.lookahead.draft_layers
    layers = list(engine.runtime.store.moe_layers)
    assert draft and set(draft) <= set(layers)
    tr = synth.generate(synth.preset("qwen36", tokens=256, batch=2, num_layers=len(layers),
                                     num_experts=cfg.num_experts, top_k=cfg.top_k), moe_layers=layers)
    forced = []

    class Spy(RouteForcer):  # the MTP layer's calls: (a decode-like pass, its ids replaced)
        def __call__(self, layer, x, ids):
            out = super().__call__(layer, x, ids)
            if layer in draft:
                forced.append((self.T > 0, out is not ids))
            return out

    engine.set_route_tap(Spy(tr, engine.device, max_rows=2 * 3, by_position=True, streams=2))
    runner = llm.llm_engine.runner
    outs = {}
    for k in (0, 2):
        runner.spec_k = k
        forced.clear()
        outs[k] = [o.token_ids for o in llm.generate([[5, 6, 7, 8], [9, 10, 11]], SamplingParams(
            max_tokens=24, temperature=0.0, ignore_eos=True))]
    assert llm.stats()["speculative"]["verify_steps"] > 0
    assert any(f for f, _ in forced) and all(f == r for f, r in forced), forced
    assert outs[2] == outs[0]


def test_speculative_tokens_equal_under_forced_routing_by_position(tiny_checkpoint):
    """With routing forced by position, a verify step's rows route as the plain decode steps of the same tokens,
    so --speculative mtp gives the greedy tokens of decoding without it, drafts accepted or not (the MTP layer
    keeps its own router); the same forcing by step count would route the verify rows differently."""
    cfg_llm = lambda **kw: LLM(tiny_checkpoint("qwen35_mtp"), moe_cache_size=6,  # noqa: E731
                               **COMMON, **kw)
    outs = {}
    for spec in ("none", "mtp"):
        llm = cfg_llm(speculative=spec, num_speculative_tokens=2) if spec == "mtp" else cfg_llm()
        cfg, engine = llm.model_config, llm.engine
        layers = [layer for layer in engine.runtime.store.moe_layers
                  if layer not in engine.runtime.ctx.lookahead.draft_layers]
        tr = synth.generate(synth.preset("qwen36", tokens=256, batch=2, num_layers=len(layers),
                                         num_experts=cfg.num_experts, top_k=cfg.top_k), moe_layers=layers)
        engine.set_route_tap(RouteForcer(tr, engine.device, max_rows=2 * 3, by_position=True, streams=2))
        outs[spec] = [o.token_ids for o in llm.generate([[5, 6, 7, 8], [9, 10, 11]], SamplingParams(
            max_tokens=24, temperature=0.0, ignore_eos=True))]
        if spec == "mtp":
            assert llm.stats()["speculative"]["verify_steps"] > 0
    assert outs["mtp"] == outs["none"]
