"""Residency (the slot LRU) against a reference dict model, pins, and exact counts on scripted traces."""
from __future__ import annotations

import random
from collections import OrderedDict

import pytest
import torch

from moestream.moe.compute import moe_reference
from moestream.moe.formats import dense_format
from moestream.moe.device_cache import device_fetch_count, live_share
from moestream.moe.strategies import fetch_count
from moestream.moe.residency import CacheFull, Residency
from moestream.moe.runtime import RuntimeOptions, build_runtime
from moestream.moe.store import ExpertStore


class DictLRU:
    """The obvious model: an ordered dict of resident keys, least recently used first."""

    def __init__(self, cap):
        self.cap, self.d = cap, OrderedDict()
        self.hits = self.misses = self.evictions = 0

    def access(self, key, pinned=()):
        if key in self.d:
            self.d.move_to_end(key)
            self.hits += 1
            return
        self.misses += 1
        if len(self.d) == self.cap:
            victim = next(k for k in self.d if k not in pinned)
            del self.d[victim]
            self.evictions += 1
        self.d[key] = True


@pytest.mark.parametrize("seed", range(6))
def test_matches_dict_model_on_random_traces(seed):
    rng = random.Random(seed)
    cap, layers, experts = rng.randint(2, 9), [0, 1, 3], 6
    res, ref = Residency(cap, layers), DictLRU(cap)
    pinned: set = set()
    for _ in range(600):
        key = (rng.choice(layers), rng.randrange(experts))
        if rng.random() < 0.1 and key in res.slot_of and key not in pinned and len(pinned) < cap - 1:
            res.pin(key)
            pinned.add(key)
        elif rng.random() < 0.1 and pinned:
            k = pinned.pop()
            res.unpin(k)
        ref.access(key, pinned)
        slot, hit = res.access(key)
        assert res.key_of[slot] == key
        assert list(res.slot_of) == list(ref.d)  # same residents in the same LRU order
        res.check_integrity()
    c = res.counts
    assert sum(v.hits for v in c.values()) == ref.hits
    assert sum(v.misses for v in c.values()) == ref.misses
    assert sum(v.evictions for v in c.values()) == ref.evictions


def test_pinned_never_evicted_and_full_pins_raise():
    res = Residency(4, [0, 1])
    for e in range(2):
        res.access((0, e))
        res.pin((0, e))
    rng = random.Random(0)
    for _ in range(300):
        res.access((1, rng.randrange(8)))
        assert res.lookup((0, 0)) is not None and res.lookup((0, 1)) is not None
    assert res.capacity() == 2
    res.access((1, 100)); res.pin((1, 100))
    res.access((1, 101)); res.pin((1, 101))
    assert res.capacity() == 0
    with pytest.raises(CacheFull):
        res.access((1, 102))
    assert res.try_prefetch((1, 103)) is None  # prefetch is best effort, never raises
    res.check_integrity()


def test_scripted_trace_exact_counts():
    # capacity 3, one LRU over two layers
    res = Residency(3, [0, 1])
    trace = [(0, 1), (0, 2), (1, 1),  # 3 misses fill the cache
             (0, 1),                  # hit; LRU order now (0,2) (1,1) (0,1)
             (1, 3),                  # miss, evicts (0,2)
             (0, 2),                  # miss, evicts (1,1)
             (0, 1),                  # hit
             (1, 1),                  # miss, evicts (1,3)
             (1, 1), (0, 2)]          # hits
    hits = [res.access(k)[1] for k in trace]
    assert hits == [False, False, False, True, False, False, True, False, True, True]
    c = res.counts
    assert (c[0].hits, c[0].misses, c[0].evictions) == (3, 3, 1)
    assert (c[1].hits, c[1].misses, c[1].evictions) == (1, 3, 2)
    assert set(res.slot_of) == {(0, 1), (0, 2), (1, 1)}


def _store(layers=(0, 1), E=6, H=16, I=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    st = ExpertStore(list(layers), E, H, I, dense_format(torch.float32), "cpu")
    for layer in layers:
        st.put_stacked(layer, "gate_up", torch.randn(E, 2 * I, H, generator=g) * 0.3, "gu")
        st.put_stacked(layer, "down", torch.randn(E, H, I, generator=g) * 0.3, "dn")
    return st


def test_runtime_scripted_trace_counts_and_values():
    """An offload runtime with 3 slots, top-1 routing, prefetch off: exact hits/misses per layer, and
    outputs equal to the reference every step."""
    st = _store()
    rt = build_runtime("offload", st, torch.device("cpu"), RuntimeOptions(cache_slots=3, prefetch=False))
    x = torch.randn(1, 16)
    w = torch.ones(1, 1)
    steps = [(0, 1), (1, 1), (0, 2), (1, 1), (0, 1), (1, 4), (0, 1)]  # (layer, expert) per call
    for layer, e in steps:
        rt.begin_step({"decode": True})
        ids = torch.tensor([[e]])
        y = rt.forward(layer, x, ids, w)
        rt.end_step()
        assert torch.equal(y, moe_reference(x, ids, w, *st.weights(layer)))
    s = rt.stats()["layers"]
    # (0,1) m, (1,1) m, (0,2) m [full], (1,1) h, (0,1) h, (1,4) m evicts (0,2), (0,1) h
    assert (s["0"]["hits"], s["0"]["misses"], s["0"]["evictions"]) == (2, 2, 1)
    assert (s["1"]["hits"], s["1"]["misses"]) == (1, 2)
    assert rt.stats()["total"]["bytes_h2d"] == 4 * st.bytes_per_expert()
    rt.check_integrity()


def test_runtime_rounds_when_a_layer_needs_more_experts_than_slots():
    """A batch routing to 6 distinct experts through 2 slots: computed in rounds, same values."""
    st = _store()
    for name in ("offload", "hybrid"):
        rt = build_runtime(name, st, torch.device("cpu"), RuntimeOptions(cache_slots=2))
        x = torch.randn(6, 16)
        ids = torch.tensor([[0, 1], [2, 3], [4, 5], [0, 5], [1, 2], [3, 4]])
        w = torch.rand(6, 2)
        rt.begin_step({"decode": True})
        y = rt.forward(0, x, ids, w)
        rt.end_step()
        assert torch.allclose(y, moe_reference(x, ids, w, *st.weights(0)), atol=1e-6)
        t = rt.stats()["total"]
        assert t["gpu_experts"] + t["cpu_experts"] == t["expert_calls"] == 6
        rt.close()


@pytest.mark.parametrize("misses", range(0, 12))
@pytest.mark.parametrize("frac", [0.0, 0.2, 0.5, 0.77, 1.0])
def test_fetch_count_balances(misses, frac):
    f = fetch_count(misses, frac)
    assert 0 <= f <= misses and abs(f - frac * misses) <= 1


@pytest.mark.parametrize("fixed", [0.0, 0.3, 1.0, 2.5])
@pytest.mark.parametrize("frac", [0.2, 0.5, 0.77])
def test_fetch_count_with_a_cpu_call_cost_is_the_fastest_split(frac, fixed):
    """hybrid's live share [frac, fixed]: f takes the least time of every split, the CPU's fixed cost paid only
    when it gets a miss; with no fixed cost it is the bandwidth split of fetch_count."""
    share = live_share(frac, fixed)
    fr, fx = float(share[0]), float(share[1])

    def time(n, f):
        return max(f * (1 - fr), (n - f) * fr + fx if f < n else 0.0)

    for n in range(0, 13):
        f = int(device_fetch_count(torch.tensor(n), share))
        assert 0 <= f <= n
        assert time(n, f) <= min(time(n, g) for g in range(n + 1)) + 1e-12, (n, f)
        if fixed == 0.0:
            assert f == fetch_count(n, frac)
    if fixed >= 1.0:  # one miss: a CPU call costs more than fetching it
        assert int(device_fetch_count(torch.tensor(1), share)) == 1


def test_resident_map_marks_residents_by_recency():
    res = Residency(3, [0, 1])
    for key in [(0, 1), (1, 3), (0, 2), (1, 0)]:  # (0, 1) is evicted by the fourth
        res.access(key)
    res.access((1, 3))  # now the most recently used
    got = res.resident_map(4)
    assert set(got) == {"0", "1"} and all(len(row) == 4 for row in got.values())
    resident = {(int(layer), e) for layer, row in got.items() for e, c in enumerate(row) if c != "0"}
    assert resident == set(res.slot_of)
    assert got["0"][2] == "1" and got["1"][0] == "5" and got["1"][3] == "9"  # LRU order: (0,2), (1,0), (1,3)


@pytest.mark.parametrize("policy", ["lfu", "lrfu", "wlfu"])
def test_policy_heaps_stay_bounded_when_nothing_is_evicted(policy):
    """Hits push heap entries; a cache that never evicts must still drop the stale ones."""
    res = Residency(16, [0], policy)
    for e in range(16):
        res.access((0, e))
    for i in range(20000):
        assert res.access((0, i % 16))[1]
    assert len(res.policy.heap) <= 4 * 16 + 64


@pytest.mark.parametrize("policy", ["lfu", "lrfu", "wlfu"])
def test_policies_keep_invariants_with_pins(policy):
    rng = random.Random(1)
    res = Residency(6, [0, 1], policy)
    for _ in range(3000):
        layer = rng.choice([0, 1])
        experts = rng.sample(range(10), rng.randint(1, 8))
        for rows, fetch in res.rounds(layer, experts):
            assert all(res.key_of[slot] == (layer, e) for e, slot in rows.items())
            assert len(rows) <= 6
        res.check_integrity()
        assert not res.pins
    c = res.counts
    assert sum(v.hits for v in c.values()) > 0 and sum(v.evictions for v in c.values()) > 0
