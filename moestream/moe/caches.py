"""Where the device copies of routed experts live: the cache part of an ExpertRuntime (moe/runtime.py).

BankExperts   none: every expert is in the store's banks on the compute device (fused); its hits are
              counted here (on the device when decode runs the pair kernels)
HostSlots     a host-side `Residency` (victims by --moe-cache-policy) over a device `Pool`; misses copied
              on the copy stream; the grouped decode path computes in rounds that fit the slots and
              prefetches the next layer's predicted experts (offload, hybrid, cpu with its empty cache)
DeviceSlots   `DeviceSlotCache` (moe/device_cache.py) over a pool of its slots plus scratch rows: the pair
              path's lookups, LRU and admission in device tensors, misses staged from the pinned host bank;
              with --moe-prefetch on, `prefetch_rows` admits the next layer's predicted experts (staged by
              the strategy on a side stream while this layer computes)

Every cache answers the same questions for the strategies (moe/strategies.py) and the runtime: its step
hooks, `stats`, `expert_hits`, `check_integrity`, `resize` (`has_slots`), `count_replay`. The grouped path
asks `compute` (partials of experts read where the cache holds them), the pair path `pair_rows` (each
pair's device row), the prefill streamer `resident_rows` and `pool`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..env import prefetch_top
from .compute import DeviceExperts, RouteGroups, WeightRef, host_to_device
from .cpu_moe import layer_table
from .device_cache import (ADMITTED, EVICTIONS, HITS, HOST_PAIRS, MISSES, PREFETCH_HITS, PREFETCHED,
                           DeviceSlotCache)
from .pairs import count_routed, stage_experts
from .residency import Residency
from .runtime import Part
from .transfer import Pool

GPU = DeviceExperts()  # stateless: the grouped computation on the compute device


def pool_partials(copier, layer: int, pool: Pool, rows: dict[int, int], x, topk_w, groups: RouteGroups) -> dict:
    """Partials of the experts in `rows` (expert -> pool row): waits for their copies, computes, and marks the
    rows released once the computation that read them is done (so a later copy cannot overwrite them early)."""
    copier.wait_ready(pool, rows.values())
    out = GPU.compute(x, topk_w, groups, {e: pool.ref(r, layer) for e, r in rows.items()})
    copier.released(pool, rows.values())
    return out


class PairRows(NamedTuple):
    """Where each (token, k) pair of a decode layer call reads its expert: src [P] rows of `arrays` (-1: the
    CPU's pair), and the misses to stage into their rows first (host bank, experts, rows, count) or None."""

    src: torch.Tensor
    arrays: dict
    staged: tuple | None = None

    def stage(self) -> None:
        """Copy the call's missed experts from the pinned host bank into their rows (moe/pairs.py)."""
        if self.staged is not None:
            stage_experts(self.staged[0], self.arrays, *self.staged[1:])

    def fetched_in_pairs(self, x: torch.Tensor, fmt, tokens: int) -> bool:
        """Whether the pair kernels copy this call's misses themselves (moe/qpairs.fetches_in_pairs), in which case
        the caller passes `staged` to them instead of calling stage()."""
        if self.staged is None or fmt is None or not fmt.quantized:
            return False
        from .qpairs import fetches_in_pairs

        return fetches_in_pairs(x, fmt, self.arrays, tokens)


class CacheHooks(Part):
    """The default answers of a cache: no step hooks, no slots, no prefetch, nothing for a CPU decode plan."""

    has_slots = False

    def begin_graph_step(self) -> None:
        """The device-side part of begin_step, recorded inside a captured decode step."""

    def end_graph_step(self) -> None:
        """The device-side part of end_step, recorded inside a captured decode step before the capture ends."""

    def count_replay(self, num_tokens: int, top_k: int) -> None:
        """A replayed decode graph ran (its layer calls counted nothing on the host)."""

    def check_integrity(self) -> None:
        """Raises when the cache's maps disagree."""

    def settle_prefetch(self, layer: int, experts: list[int]) -> None:
        """Counts how the prefetch for `layer` served its call (only a cache that prefetches)."""

    def prefetch_rows(self, layer: int, x: torch.Tensor):
        """The pair path's lookahead prefetch for the layer after `layer` (only DeviceSlots prefetches)."""
        return None

    def host_table(self, layer: int):
        """The CPU decode plan's expert table of `layer` (moe/cpu_moe.layer_table), or None."""
        return None

    def book(self, layer: int, experts: list[int]) -> None:
        """Counts a layer call computed outside `compute` (the CPU decode plan's)."""


class BankExperts(CacheHooks):
    """fused: experts are read from the store's banks on the compute device, every routed expert a hit.
    With the pair path (`on_device`) the hits are counted in device tensors with no host sync: per layer the
    distinct experts of batched calls, and per expert; a batch-1 call's top-k are distinct by construction,
    so its distinct count is the host's (`single`, also counted for replayed graphs in count_replay). A step's calls
    are counted together at its end, in one launch (`count_step`; in a recorded step, inside its graph): one per
    layer call cost 2.4-2.9 µs each on the H100 (0.10-0.12 ms of a 3.6-6.0 ms all-resident Q8_0 step)."""

    def __init__(self, ctx, on_device: bool):
        self.ctx = ctx
        store, layers = ctx.store, ctx.store.moe_layers
        self.on_device = on_device
        self._pending: list[tuple[int, torch.Tensor]] = []  # this step's (layer row, top-k ids) calls, for count_step
        self.layer_index = {layer: i for i, layer in enumerate(layers)}
        if on_device:
            self.distinct = torch.zeros(len(layers), dtype=torch.long, device=ctx.device)
            self.single = [0] * len(layers)
            self.hits_e = torch.zeros(len(layers), store.num_experts, dtype=torch.long, device=ctx.device)
            self._ones = torch.ones(store.num_experts, dtype=torch.long, device=ctx.device)
            self._layer_rows = torch.arange(len(layers), dtype=torch.long, device=ctx.device)
            ctx.book.counters.append(self.counts)
        else:
            self.host_hits = {layer: [0] * store.num_experts for layer in layers}

    def counts(self) -> dict:
        """The pair path's device counts: each distinct routed expert is a hit, an expert call and a GPU expert."""
        self.count_step()
        d = self.distinct.tolist()
        return {layer: {"hits": d[i] + self.single[i], "expert_calls": d[i] + self.single[i],
                        "gpu_experts": d[i] + self.single[i]} for layer, i in self.layer_index.items()}

    def count_replay(self, num_tokens: int, top_k: int) -> None:
        """A replayed batch-1 graph routed top_k distinct experts per layer."""
        if self.on_device and num_tokens == 1:
            self.single = [c + top_k for c in self.single]

    def pair_rows(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, fraction=None) -> PairRows:
        """Every pair reads its expert's row of the device bank; the call's distinct experts are counted."""
        li = self.layer_index[layer]
        if topk_ids.shape[0] == 1 and not (topk_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.single[li] += topk_ids.shape[1]  # distinct by construction (a replay adds them in count_replay)
        self._pending.append((li, topk_ids))
        if len(self._pending) > 4 * len(self.layer_index):  # calls outside steps (a benchmark's loop): bounded
            self.count_step()
        return PairRows(topk_ids.reshape(-1).long(), self.ctx.store.bank(layer))

    def count_step(self) -> None:
        """The pending calls' counts (pair_rows) in one launch per kind of call (batch-1 calls add no distinct
        count: the host's `single` has it): the usual step, every layer once in order, reads a slice of the layer
        rows; any other order one launch a call (no host-to-device copy, so it can be recorded)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        kinds: dict = {}
        for li, ids in pending:
            kinds.setdefault((ids.shape[0] == 1, ids.numel()), []).append((li, ids))
        for (single, _), calls in kinds.items():
            rows = [li for li, _ in calls]
            if rows == list(range(rows[0], rows[0] + len(rows))):
                runs = [(self._layer_rows[rows[0]:rows[0] + len(rows)], calls)]
            else:
                runs = [(self._layer_rows[li:li + 1], [(li, ids)]) for li, ids in calls]
            for lidx, part in runs:
                ids = torch.stack([t.reshape(-1) for _, t in part]).long()
                count_routed(ids, lidx, self.hits_e, self.distinct, add_distinct=not single)

    def end_step(self, decode: bool) -> None:
        self.count_step()

    def end_graph_step(self) -> None:
        self.count_step()

    def book(self, layer: int, experts: list[int]) -> None:
        """Counts a grouped (or compiled CPU) layer call's experts: hits computed on the device."""
        s = self.ctx.book[layer]
        s.hits += len(experts)
        s.gpu_experts += len(experts)
        if self.on_device:  # prefill chunks of a pair-path runtime
            ids = host_to_device(experts, self.hits_e.device)  # (no wait for the prefill chunk's kernels)
            self.hits_e[self.layer_index[layer]].index_add_(0, ids, self._ones[:len(experts)])
        else:
            row = self.host_hits[layer]
            for e in experts:
                row[e] += 1

    def compute(self, layer: int, x, topk_w, groups: RouteGroups, experts: list[int]) -> dict:
        """Partials of `experts` from the device bank."""
        self.book(layer, experts)
        store = self.ctx.store
        bank, fmt = store.bank(layer), store.fmt.for_layer(layer)
        return GPU.compute(x, topk_w, groups, {e: WeightRef(bank, e, fmt) for e in experts})

    def host_table(self, layer: int):
        """On a CPU device the banks are host memory: a CPU decode step may compute the block in one call."""
        if self.ctx.device.type != "cpu":
            return None
        return layer_table(self.ctx.store.bank(layer), self.ctx.store.fmt.for_layer(layer))

    def expert_hits(self) -> dict[int, list[int]]:
        """layer -> hits of each expert (every routed expert is a hit)."""
        if self.on_device:
            self.count_step()
            h = self.hits_e.tolist()
            return {layer: h[i] for layer, i in self.layer_index.items()}
        return self.host_hits

    def stats(self, per_half: int) -> dict:
        """No slot cache to report."""
        return {}


class SlotPool(CacheHooks):
    """What both slot caches share: a device pool of expert rows and the copier that fills it."""

    has_slots = True

    def __init__(self, ctx):
        self.ctx = ctx
        self.copier = ctx.copier
        self.pool = None
        self.rebuild(ctx.options.cache_slots)

    def resize(self, cache_slots: int) -> None:
        """A cold cache of `cache_slots` slots; no copy or kernel may still touch the old pool."""
        if self.copier.sync.cuda:
            torch.cuda.synchronize(self.ctx.device)
        self.rebuild(cache_slots)

    def rebuild(self, slots: int) -> None:
        """Empty bookkeeping and a new pool for `slots` slots."""
        raise NotImplementedError  # HostSlots and DeviceSlots build their own

    def _new_pool(self, rows: int) -> None:
        """A pool of `rows` expert rows on the device."""
        self.pool = None  # the old pool is freed before the new one is made
        self.pool = Pool(self.ctx.store, rows, self.ctx.device)


class HostSlots(SlotPool):
    """The slot cache as host bookkeeping (`Residency`) over a device pool: the grouped decode path."""

    def __init__(self, ctx):
        self.residency = None
        self.prefetched: dict[int, set[int]] = {}  # layer -> experts copied ahead for its next call
        super().__init__(ctx)

    def rebuild(self, slots: int) -> None:
        """A cold Residency of `slots` slots (the counts of the old one kept) and its pool."""
        old = self.residency
        self.residency = Residency(slots, self.ctx.store.moe_layers, self.ctx.options.cache_policy)
        if old is not None:  # statistics survive a resize
            self.residency.counts, self.residency.expert_hits = old.counts, old.expert_hits
        self._new_pool(slots)
        self.ctx.book.residency = self.residency

    # ---- decode on the device, in rounds that fit the cache ----------------------------
    def compute(self, layer: int, x, topk_w, groups: RouteGroups, experts: list[int]) -> dict:
        """Partials of `experts` from the slot cache: resident ones first (so admitting the others cannot
        evict them), at most capacity() experts pinned at a time; the next layer's prefetch is issued after
        the first round's copies (so it queues behind them)."""
        out: dict[int, torch.Tensor] = {}
        first = True
        for rows, fetch in self.residency.rounds(layer, experts):
            self.copier.copy(self.pool, fetch)
            if first:
                self.prefetch_next(layer, x)
            first = False
            out.update(pool_partials(self.copier, layer, self.pool, rows, x, topk_w, groups))
        self.ctx.book[layer].gpu_experts += len(experts)
        return out

    def lookup(self, layer: int, expert: int) -> int | None:
        """The slot of (layer, expert), or None (no LRU update)."""
        return self.residency.lookup((layer, expert))

    def note_misses(self, layer: int, n: int) -> None:
        """n misses of `layer` computed on the CPU: counted, nothing admitted (no policy sees a miss)."""
        self.residency.note_misses(layer, n)

    def resident_rows(self, layer: int, experts: list[int]) -> dict[int, int]:
        """expert -> slot of those of `experts` that are in the slot cache (no LRU update)."""
        found = {e: self.residency.lookup((layer, e)) for e in experts}
        return {e: slot for e, slot in found.items() if slot is not None}

    # ---- decode prefetch -----------------------------------------------------------------
    def prefetch_next(self, layer: int, x: torch.Tensor) -> None:
        """Copy the next layer's predicted experts into free or LRU slots while this layer computes."""
        ctx = self.ctx
        nxt = ctx.lookahead.next_layer.get(layer)
        if nxt is None or not ctx.options.prefetch or self.residency.num_slots == 0:
            return
        predicted = ctx.lookahead.predict(nxt, x, limit=self.residency.num_slots)
        for e in predicted:  # keep predicted residents from being the victims of this prefetch
            self.residency.touch((nxt, e))
        fetch = []
        for e in predicted:
            slot = self.residency.try_prefetch((nxt, e))
            if slot is not None:
                fetch.append((nxt, e, slot))
        self.copier.copy(self.pool, fetch)
        ctx.book[nxt].prefetch_issued += len(fetch)
        self.prefetched[nxt] = {e for _, e, _ in fetch}

    def settle_prefetch(self, layer: int, experts: list[int]) -> None:
        """Counts how the prefetch issued for `layer` served its call (used, or not routed)."""
        done = self.prefetched.pop(layer, set())
        s = self.ctx.book[layer]
        used = done.intersection(experts)
        s.prefetch_hits += sum(1 for e in used if self.residency.lookup((layer, e)) is not None)
        s.prefetch_unused += len(done) - len(used)

    def _drop_prefetched(self) -> None:
        """Prefetches no layer call settled (the step ended first) count as unused."""
        for layer, experts in self.prefetched.items():
            self.ctx.book[layer].prefetch_unused += len(experts)
        self.prefetched = {}

    # ---- step boundaries and reports -----------------------------------------------------------
    def begin_step(self, info: dict, decode: bool) -> None:
        """A step never uses the prefetches of another."""
        self._drop_prefetched()

    def end_step(self, decode: bool) -> None:
        """Drops the step's prefetches; every round's pins must be gone."""
        self._drop_prefetched()
        if self.residency.pins:
            raise RuntimeError(f"expert runtime bug: pins left at end of step: {self.residency.pins}")

    def stats(self, per_half: int) -> dict:
        """The cache's size, occupancy and recency map (per_half: the prefill buffer's rows per half)."""
        return {"cache": {"slots": self.residency.num_slots, "resident": len(self.residency.slot_of),
                          "prefill_slots_per_half": per_half,
                          "resident_map": self.residency.resident_map(self.ctx.store.num_experts)}}

    def check_integrity(self) -> None:
        """Raises when slot_of and key_of disagree or a pin is not resident."""
        self.residency.check_integrity()

    def expert_hits(self) -> dict[int, list[int]] | None:
        """layer -> hits of each expert; None without slots (nothing can hit)."""
        if not self.residency.num_slots:
            return None  # cpu: nothing is cached on the device
        rows = {layer: [0] * self.ctx.store.num_experts for layer in self.ctx.store.moe_layers}
        for (layer, e), n in self.residency.expert_hits.items():
            rows[layer][e] = n
        return rows


class DeviceSlots(SlotPool):
    """The slot cache as device tensors (moe/device_cache.py): hits read their slot, misses are read from the
    pinned host bank by the staging kernel and admitted into LRU victims in the same pass, with no host
    synchronisation, so decode steps can be CUDA graphs. The pool holds `cached` slots and `scratch` rows
    after them, which stage the misses of a call that get no slot."""

    def __init__(self, ctx):
        self.dcache = None
        super().__init__(ctx)
        ctx.book.counters.append(self.counts)

    def rebuild(self, slots: int) -> None:
        """`slots` pool rows: the last `scratch` (one per pair a call may have, at most E) stage misses that get
        no slot; the others are the device cache's slots (at least one)."""
        store = self.ctx.store
        self.slots = slots  # asked for: cached slots + scratch rows
        scratch = min(max(self.ctx.options.max_pairs, 1), store.num_experts)
        cached = max(slots - scratch, 1)
        self.dcache = None
        self._new_pool(cached + scratch)
        self.dcache = DeviceSlotCache(cached, store.moe_layers, store.num_experts, scratch, self.ctx.device,
                                      prefetch=self.ctx.options.prefetch)

    def counts(self) -> dict:
        """The device cache's counters as book fields."""
        out = {}
        for layer, c in self.dcache.counts().items():
            nbytes = self.ctx.store.bytes_per_expert(layer)
            # a prefetched expert crossed PCIe once (PREFETCHED) and is a hit of the call it was predicted for
            out[layer] = {"hits": c[HITS], "misses": c[MISSES], "evictions": c[EVICTIONS], "copies": c[ADMITTED],
                          "bytes_h2d": (c[HOST_PAIRS] + c[PREFETCHED]) * nbytes, "gpu_experts": c[HITS] + c[HOST_PAIRS],
                          "expert_calls": c[HITS] + c[MISSES], "prefetch_issued": c[PREFETCHED],
                          "prefetch_hits": c[PREFETCH_HITS], "prefetch_unused": c[PREFETCHED] - c[PREFETCH_HITS]}
        return out

    def prefetch_rows(self, layer: int, x: torch.Tensor) -> PairRows | None:
        """With --moe-prefetch on: the next MoE layer's experts predicted from this layer's input x (its router
        applied to x) admitted into the device cache -> the PairRows whose `stage()` copies them (the caller
        runs it on a side stream before the next layer computes), or None (no next layer, no router)."""
        ctx = self.ctx
        nxt = ctx.lookahead.next_layer.get(layer)
        router = ctx.lookahead.routers.get(nxt) if nxt is not None else None
        if not ctx.options.prefetch or router is None:
            return None
        ids = router(x)[0]  # [T, k], likeliest first
        top = prefetch_top()
        if 0 < top < ids.shape[1]:
            ids = ids[:, :top]
        experts, rows, count = self.dcache.prefetch(nxt, ids)
        return PairRows(experts, self.pool.arrays, (ctx.store.bank(nxt), experts, rows, count))

    def pair_rows(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, fraction=1.0) -> PairRows:
        """Routes the call through the device cache; fraction < 1 (or a device scalar: hybrid's live share)
        leaves part of the misses to the CPU (their rows -1)."""
        src, experts, rows, count = self.dcache.route(layer, topk_ids, fraction)
        return PairRows(src, self.pool.arrays, (self.ctx.store.bank(layer), experts, rows, count))

    def resident_rows(self, layer: int, experts: list[int]) -> dict[int, int]:
        """expert -> slot of those of `experts` the device cache holds (one read of its table; no LRU update)."""
        rows = self.dcache.resident_rows(layer)
        return {e: rows[e] for e in experts if e in rows}

    def begin_step(self, info: dict, decode: bool) -> None:
        """New stamp and victims for the step (inside the graph when the step is a recorded one)."""
        if not info.get("graph", False):
            self.dcache.begin_step()

    def begin_graph_step(self) -> None:
        """The step's stamp and victims, recorded in the decode graph."""
        self.dcache.begin_step()

    def stats(self, per_half: int) -> dict:
        """As HostSlots.stats, read from the device tensors, and the path taken."""
        # the slots asked for; the pool holds cached_slots + scratch rows staging a step's misses
        return {"cache": {"slots": self.slots, "resident": self.dcache.num_resident(),
                          "prefill_slots_per_half": per_half, "resident_map": self.dcache.resident_map(),
                          "cached_slots": self.dcache.num_slots, "scratch_slots": self.dcache.scratch},
                "decode_kernel": "pairs"}

    def check_integrity(self) -> None:
        """Raises when the table and slot keys are not inverse maps."""
        self.dcache.check_integrity()

    def expert_hits(self) -> dict[int, list[int]]:
        """layer -> hits of each expert (one read of the device counters)."""
        return self.dcache.hits_by_expert()
