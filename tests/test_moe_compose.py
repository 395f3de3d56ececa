"""moe/backends.py: the one factory's decision rules, and the parts it builds for each composition (what each
composition computes is tests/test_moe_backends.py's: every backend gives fused's tokens)."""
from __future__ import annotations

import pytest
import torch

from moestream.moe import BACKENDS, RuntimeOptions, build_runtime
from moestream.moe.backends import Composition
from moestream.moe.caches import BankExperts, DeviceSlots, HostSlots
from moestream.moe.formats import dense_format
from moestream.moe.store import ExpertStore
from moestream.moe.strategies import (BridgeDecode, DeviceBankPrefill, GroupedDecode, MissSplit, OnCpu, OnDevice,
                                      PairsDecode, StreamedPrefill)

CPU = torch.device("cpu")
PAIRS = {"decode_kernel": "pairs"}
SLOTS = {"cache_slots": 4, "prefill_slots": 2}


def _store(layers=(0, 1), E=6, H=16, I=8):
    g = torch.Generator().manual_seed(0)
    st = ExpertStore(list(layers), E, H, I, dense_format(torch.float32), "cpu")
    for layer in layers:
        st.put_stacked(layer, "gate_up", torch.randn(E, 2 * I, H, generator=g) * 0.3, "gu")
        st.put_stacked(layer, "down", torch.randn(E, H, I, generator=g) * 0.3, "dn")
    return st


# backend, RuntimeOptions fields, (cache, decode, prefill, cpu)
CASES = [
    ("fused", {}, ("none", "grouped", "resident", "none")),  # CPU, auto: the grouped path
    ("fused", PAIRS, ("none", "pairs", "resident", "none")),
    ("fused", {"decode_kernel": "grouped"}, ("none", "grouped", "resident", "none")),
    ("offload", {"cache_slots": 4}, ("host", "grouped", "resident", "none")),
    ("offload", SLOTS, ("host", "grouped", "streamed", "none")),
    ("offload", {**SLOTS, **PAIRS}, ("device", "pairs", "streamed", "none")),
    # the device cache needs a prefill buffer, slots and LRU: otherwise the host cache's grouped path
    ("offload", {"cache_slots": 4, **PAIRS}, ("host", "grouped", "resident", "none")),
    ("offload", {"prefill_slots": 2, **PAIRS}, ("host", "grouped", "streamed", "none")),
    ("offload", {**SLOTS, **PAIRS, "cache_policy": "wlfu"}, ("host", "grouped", "streamed", "none")),
    ("cpu", {}, ("host", "grouped", "resident", "all")),
    ("cpu", PAIRS, ("host", "grouped", "resident", "all")),  # no max_pairs: no bridge
    ("cpu", {**PAIRS, "max_pairs": 8}, ("host", "bridge", "resident", "all")),
    ("cpu", {**PAIRS, "max_pairs": 8, "prefill_slots": 2}, ("host", "bridge", "streamed", "all")),
    ("hybrid", {**SLOTS, **PAIRS, "max_pairs": 8}, ("device", "bridge", "streamed", "misses")),
    ("hybrid", {**SLOTS, **PAIRS}, ("host", "grouped", "streamed", "misses")),  # no bridge: the host cache
    ("hybrid", {**SLOTS, "max_pairs": 8}, ("host", "grouped", "streamed", "misses")),
    ("hybrid", {"cache_slots": 4, **PAIRS, "max_pairs": 8}, ("host", "grouped", "resident", "misses")),
]
CACHE_TYPES = {"none": BankExperts, "host": HostSlots, "device": DeviceSlots}
DECODE_TYPES = {"pairs": PairsDecode, "grouped": GroupedDecode, "bridge": BridgeDecode}
PLACE_TYPES = {"none": OnDevice, "all": OnCpu, "misses": MissSplit}


@pytest.mark.parametrize("backend,kw,want", CASES)
def test_the_factory_composes_each_backend(backend, kw, want):
    store = _store()
    options = RuntimeOptions(**kw)
    comp = BACKENDS[backend](options, store, CPU)
    assert comp == Composition(*want)
    rt = build_runtime(backend, store, CPU, options)
    try:
        assert rt.name == backend and rt.composition == comp
        assert type(rt.cache) is CACHE_TYPES[comp.cache] and type(rt.decode) is DECODE_TYPES[comp.decode]
        if comp.prefill == "streamed":
            assert type(rt.prefill) is StreamedPrefill
        elif (comp.cache, comp.decode) == ("none", "pairs"):  # fused on the pair path: the device route, which
            # falls back to a grouped strategy of its own (not the decode one) where its kernels cannot run
            assert type(rt.prefill) is DeviceBankPrefill and type(rt.prefill.fallback) is GroupedDecode
            assert rt.prefill.fallback is not rt.decode and rt.prefill.cache is rt.cache
        else:  # resident: the grouped computation, the decode strategy itself when that is grouped
            assert type(rt.prefill) is GroupedDecode and (rt.prefill is rt.decode) == (comp.decode == "grouped")
        for strategy in (rt.decode, rt.prefill, getattr(rt.prefill, "fallback", None)):
            if isinstance(strategy, GroupedDecode):
                assert type(strategy.place) is PLACE_TYPES[comp.cpu]
        assert rt.capturable() == (comp.decode != "grouped")
        assert (rt.bridge is not None) == (comp.decode == "bridge")
        assert rt.pairs == (comp.decode == "pairs" or comp.cache == "device")  # the device's pairs: pair kernels
        assert (rt.cpu is not None) == (comp.cpu != "none")
        # counts kept off the host: the pair path's (fused), the device cache's and the bridge worker's
        off_host = (comp.cache, comp.decode) == ("none", "pairs") or comp.cache == "device" or comp.decode == "bridge"
        assert bool(rt.book.counters) == off_host
    finally:
        rt.close()


def test_the_hybrid_bridge_counts_what_its_cache_does_not():
    """cpu's bridge reports its experts as misses and expert calls (nothing else sees the route); hybrid's
    device cache counts those, the bridge only the CPU's work: every field has one source."""
    store = _store()
    fields = {}
    for backend, kw in (("cpu", {**PAIRS, "max_pairs": 8}), ("hybrid", {**SLOTS, **PAIRS, "max_pairs": 8})):
        rt = build_runtime(backend, store, CPU, RuntimeOptions(**kw))
        try:
            fields[backend] = [sorted(c()[0]) for c in rt.book.counters]
        finally:
            rt.close()
    assert fields["cpu"] == [["cpu_experts", "cpu_handoff_s", "cpu_kernel_s", "cpu_s", "cpu_wait_s", "expert_calls",
                              "misses"]]
    cache, bridge = fields["hybrid"]
    assert bridge == ["cpu_experts", "cpu_handoff_s", "cpu_kernel_s", "cpu_s", "cpu_wait_s"] and not set(cache) & set(bridge)
    assert {"hits", "misses", "expert_calls"} <= set(cache)


def test_resize_needs_a_slot_cache_and_unknown_backends_are_refused():
    store = _store()
    rt = build_runtime("fused", store, CPU)
    with pytest.raises(NotImplementedError, match="fused backend has no expert cache"):
        rt.resize(4)
    rt = build_runtime("offload", store, CPU, RuntimeOptions(**SLOTS, **PAIRS))
    rt.resize(5)
    assert rt.epoch == 1 and rt.options.cache_slots == 5 and rt.stats()["cache"]["slots"] == 5
    with pytest.raises(ValueError, match="unknown MoE backend 'nope'; available: cpu, fused, hybrid, offload"):
        build_runtime("nope", store, CPU)


def test_host_to_device_on_the_cpu_is_the_list():
    import torch

    from moestream.moe.compute import RouteGroups, host_to_device

    t = host_to_device([3, -1, 2], torch.device("cpu"))
    assert t.dtype == torch.long and t.tolist() == [3, -1, 2]
    g = RouteGroups.of(torch.tensor([[2, 0], [2, 1]]))
    assert g.experts == [0, 1, 2] and g.counts == [1, 1, 2] and g.counts_t.tolist() == g.counts  # the route's own


def test_copier_moves_runs_of_experts_as_the_rows_they_are():
    """Copier.copy takes consecutive experts into consecutive rows as one copy per array (a prefill half), and
    rows sized for a larger per-layer type get this layer's bytes at their front, whatever the order."""
    import torch

    from moestream.moe import ExpertStore
    from moestream.moe.formats import layered_gguf_format
    from moestream.moe.stats import StatsBook
    from moestream.moe.transfer import Copier, Pool, Sync, _runs

    assert _runs([(0, 3, 0), (0, 4, 1), (0, 5, 2), (0, 9, 3), (0, 10, 4), (0, 2, 5)]) == \
        [(0, 3, 0, 3), (0, 9, 3, 2), (0, 2, 5, 1)]
    H = I = 256
    fmt = layered_gguf_format({0: {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"},
                               1: {"gate": "Q4_K", "up": "Q4_K", "down": "Q4_K"}}, H, I)
    st = ExpertStore([0, 1], 12, H, I, fmt, "cpu")
    g = torch.Generator().manual_seed(0)
    for per_layer in st.banks.values():
        for bank in per_layer.values():
            bank.copy_(torch.randint(0, 256, bank.shape, generator=g, dtype=torch.uint8))
    pool = Pool(st, 8, torch.device("cpu"))
    copier = Copier(st, Sync(torch.device("cpu")), StatsBook([0, 1]))
    for layer in (0, 1):
        items = [(layer, 4, 0), (layer, 5, 1), (layer, 6, 2), (layer, 7, 3), (layer, 11, 4), (layer, 1, 7)]
        copier.copy(pool, items)
        for _, e, row in items:
            for name, dst in pool.arrays.items():
                src = st.banks[name][layer][e]
                assert torch.equal(dst[row, :src.shape[0]], src), (layer, e, row, name)
        assert copier.stats[layer].copies == len(items)
