"""Which (layer, expert) sits in which cache slot: pure bookkeeping, no tensors, no device.

One cache over all (layer, expert) pairs of all MoE layers (a hot layer may take more slots than a
cold one). Hits, misses and evictions are counted per layer, hits also per expert. Pinned keys (the
experts the layer being computed reads) are never chosen as victims; asking for a slot when every slot
is pinned raises `CacheFull` (callers split a layer's experts into rounds of at most `capacity()`
first: `rounds`, which the grouped decode path and the trace replay (moe/replay.py) both use).

The victim is chosen by a policy (`POLICIES`, `--moe-cache-policy`):
    lru   the least recently used unpinned key
    lfu   the unpinned key with the fewest accesses (hits and misses, remembered for keys that left the
          cache too), least recently used among equals; every `age_every` accesses all counts are halved
          (ageing), so an expert that stops being routed loses its place within a few halvings
    lrfu  the unpinned key with the lowest sum over its accesses of 2^-(accesses since / half-life)
    wlfu  keys among the last half-cache of recently used ones are kept; the others go lfu's way
Measured on synthetic traces (benchmarks/RESULTS.md): none beats lru by much; lfu loses (a new expert
is the next victim before the next token can reuse it).

Invariants (`check_integrity`): slot_of and key_of are inverse maps; every slot is either free or
holds exactly one key; pinned keys are resident.
"""
from __future__ import annotations

import heapq
import math
from collections import Counter, OrderedDict
from dataclasses import dataclass

Key = tuple[int, int]  # (layer, expert)


def recency_digit(rank: int, n: int) -> str:
    """"1".."9" for the rank-th least recently used of n resident experts: "1" the least, "9" the most."""
    return "9" if n <= 1 else str(1 + (8 * rank) // (n - 1))


class CacheFull(RuntimeError):
    """Every slot is pinned; the caller asked for more experts at once than the cache holds."""


@dataclass
class LayerCounts:
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # counted against the layer of the evicted expert
    prefetched: int = 0  # admitted by prefetch rather than by a demand miss


class LruPolicy:
    """Victim: the least recently used unpinned key (the order of Residency.slot_of)."""

    name = "lru"

    def __init__(self, num_slots: int):
        pass

    def used(self, key: Key, count: bool = True) -> None:
        pass

    def admitted(self, key: Key) -> None:
        pass

    def removed(self, key: Key) -> None:
        pass

    def victim(self, res: "Residency") -> Key | None:
        return next((k for k in res.slot_of if k not in res.pins), None)


class LfuPolicy:
    """Victim: the unpinned key with the lowest (access count, last use). Counts cover every key seen,
    resident or not, and are halved every `age_every` counted accesses. A heap of (count, tick, key)
    entries; an entry is current while it matches the key's count and tick (others are skipped)."""

    name = "lfu"
    AGE_SLOTS = 16  # age_every = AGE_SLOTS x num_slots counted accesses (at least AGE_MIN)
    AGE_MIN = 4096

    def __init__(self, num_slots: int):
        self.freq: Counter = Counter()
        self.tick: dict[Key, int] = {}
        self.clock = 0
        self.heap: list[tuple[int, int, Key]] = []
        self.age_every = max(self.AGE_SLOTS * num_slots, self.AGE_MIN)
        self.since_age = 0
        self.resident: set[Key] = set()

    def used(self, key: Key, count: bool = True) -> None:
        self.clock += 1
        if count:
            self.freq[key] += 1
            self.since_age += 1
        self.tick[key] = self.clock
        if key in self.resident:
            self._reused(key)
        if self.since_age >= self.age_every:
            self._age()

    def _reused(self, key: Key) -> None:
        """A resident key was used: its heap entry is renewed with its new count and tick."""
        self._push((self.freq[key], self.clock, key))

    def admitted(self, key: Key) -> None:
        self.resident.add(key)
        self._push((self.freq[key], self.tick.get(key, 0), key))

    def removed(self, key: Key) -> None:
        self.resident.discard(key)

    def _age(self) -> None:
        self.since_age = 0
        self.freq = Counter({k: v >> 1 for k, v in self.freq.items() if v >> 1})
        self._rebuild()

    def _rebuild(self) -> None:
        self.heap = [(self.freq[k], self.tick.get(k, 0), k) for k in self.resident]
        heapq.heapify(self.heap)

    def _current(self, entry) -> bool:
        f, t, key = entry
        return key in self.resident and f == self.freq[key] and t == self.tick.get(key, 0)

    def _push(self, entry) -> None:
        heapq.heappush(self.heap, entry)
        if len(self.heap) > 4 * len(self.resident) + 64:
            self._rebuild()  # drop the stale entries (a cache that rarely evicts would grow it without end)

    def victim(self, res: "Residency") -> Key | None:
        held = []
        found = None
        while self.heap:
            f, t, key = entry = heapq.heappop(self.heap)
            if not self._current(entry):
                continue  # stale
            if key in res.pins:
                held.append((f, t, key))
                continue
            found = key
            break
        for entry in held:
            heapq.heappush(self.heap, entry)
        return found


class LrfuPolicy(LfuPolicy):
    """Victim: the unpinned key with the lowest combined recency-frequency value, sum over its accesses of
    2^-(accesses since then / half_life): one access long ago weighs little, many recent ones much. Kept as
    log2 of the value scaled to now (a logaddexp per access), so no value ever needs decaying; ties (never
    accessed) go least recently admitted first."""

    name = "lrfu"
    HALF_LIFE_SLOTS = 1.0  # half-life in counted accesses, as a multiple of the slots

    def __init__(self, num_slots: int):
        super().__init__(num_slots)
        self.half_life = max(self.HALF_LIFE_SLOTS * num_slots, 1.0)
        self.score: dict[Key, float] = {}

    def used(self, key: Key, count: bool = True) -> None:
        self.clock += 1
        if count:
            now = self.clock / self.half_life
            old = self.score.get(key)
            self.score[key] = now if old is None else max(old, now) + math.log2(1 + 2.0 ** -abs(old - now))
        self.tick[key] = self.clock
        if key in self.resident:
            self._push((self.score.get(key, -math.inf), self.clock, key))

    def admitted(self, key: Key) -> None:
        self.resident.add(key)
        self._push((self.score.get(key, -math.inf), self.tick.get(key, 0), key))

    def _rebuild(self) -> None:
        self.heap = [(self.score.get(k, -math.inf), self.tick.get(k, 0), k) for k in self.resident]
        heapq.heapify(self.heap)

    def _current(self, entry) -> bool:
        f, t, key = entry
        return key in self.resident and f == self.score.get(key, -math.inf) and t == self.tick.get(key, 0)


class WindowLfuPolicy(LfuPolicy):
    """A window of the most recently used keys (an LRU of WINDOW x slots keys) is never the victim; the
    rest are evicted least frequently used first (LfuPolicy's aged counts). A key enters the window on
    every use and falls into the frequency part when WINDOW x slots more recent keys push it out."""

    name = "wlfu"
    WINDOW = 0.5

    def __init__(self, num_slots: int):
        super().__init__(num_slots)
        self.window_size = max(int(self.WINDOW * num_slots), 1)
        self.window: OrderedDict[Key, None] = OrderedDict()
        self.main: set[Key] = set()

    def _reused(self, key: Key) -> None:
        """A resident key was used (LfuPolicy.used counts it): it moves to the window's recent end."""
        self._to_window(key)

    def admitted(self, key: Key) -> None:
        self.resident.add(key)
        self._to_window(key)

    def removed(self, key: Key) -> None:
        self.resident.discard(key)
        self.window.pop(key, None)
        self.main.discard(key)

    def _to_window(self, key: Key) -> None:
        self.main.discard(key)
        self.window[key] = None
        self.window.move_to_end(key)
        while len(self.window) > self.window_size:
            old, _ = self.window.popitem(last=False)
            self.main.add(old)
            self._push((self.freq[old], self.tick.get(old, 0), old))

    def _rebuild(self) -> None:
        self.heap = [(self.freq[k], self.tick.get(k, 0), k) for k in self.main]
        heapq.heapify(self.heap)

    def _current(self, entry) -> bool:
        return entry[2] in self.main and super()._current(entry)

    def victim(self, res: "Residency") -> Key | None:
        key = super().victim(res)
        if key is None:  # nothing outside the window (or all of it pinned): the window's LRU
            key = next((k for k in self.window if k not in res.pins), None)
        return key


POLICIES = {p.name: p for p in (LruPolicy, LfuPolicy, LrfuPolicy, WindowLfuPolicy)}


class Residency:
    def __init__(self, num_slots: int, layers: list[int], policy: str = "lru"):
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; available: {', '.join(POLICIES)}")
        self.policy = POLICIES[policy](num_slots)
        self.num_slots = num_slots
        self.slot_of: OrderedDict[Key, int] = OrderedDict()  # least recently used first
        self.key_of: list[Key | None] = [None] * num_slots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest slot first
        self.pins: dict[Key, int] = {}
        self.counts: dict[int, LayerCounts] = {layer: LayerCounts() for layer in layers}
        self.expert_hits: Counter = Counter()  # (layer, expert) -> hits

    # ---- queries (no side effects) -----------------------------------------------------
    def lookup(self, key: Key) -> int | None:
        return self.slot_of.get(key)

    def capacity(self) -> int:
        """Slots that a new key could still take now (free or holding an unpinned key)."""
        return self.num_slots - len(self.pins)

    def resident(self, layer: int | None = None) -> set[Key]:
        return {k for k in self.slot_of if layer is None or k[0] == layer}

    def resident_map(self, num_experts: int) -> dict[str, str]:
        """Per layer, one character per expert (for /v1/stats): "0" not in a slot, "1".."9" resident, by
        recency of use among the resident experts ("1" the least recently used, "9" the most)."""
        rows = {layer: ["0"] * num_experts for layer in self.counts}
        n = len(self.slot_of)
        for rank, (layer, expert) in enumerate(self.slot_of):  # least recently used first
            rows[layer][expert] = recency_digit(rank, n)
        return {str(layer): "".join(row) for layer, row in rows.items()}

    # ---- accesses ----------------------------------------------------------------------
    def access(self, key: Key) -> tuple[int, bool]:
        """Demand access: (slot, hit). A miss takes a free slot or evicts the LRU unpinned key."""
        slot = self.slot_of.get(key)
        self.policy.used(key)
        if slot is not None:
            self.slot_of.move_to_end(key)
            self.counts[key[0]].hits += 1
            self.expert_hits[key] += 1
            return slot, True
        self.counts[key[0]].misses += 1
        return self._insert(key), False

    def rounds(self, layer: int, experts: list[int]):
        """A layer call's demand accesses, in rounds that fit the cache: yields (rows {expert: slot},
        fetch [(layer, expert, slot)] of the misses) per round, its keys pinned until the next round.
        Resident experts come first, so admitting the others cannot evict them."""
        todo = sorted(experts, key=lambda e: self.lookup((layer, e)) is None)
        while todo:
            batch, todo = todo[:self.capacity()], todo[self.capacity():]
            rows, fetch = {}, []
            for e in batch:
                slot, hit = self.access((layer, e))
                self.pin((layer, e))
                rows[e] = slot
                if not hit:
                    fetch.append((layer, e, slot))
            try:
                yield rows, fetch
            finally:
                for e in batch:
                    self.unpin((layer, e))

    def note_misses(self, layer: int, n: int) -> None:
        """n misses of `layer` served without a slot (computed on CPU): counted, nothing inserted."""
        self.counts[layer].misses += n

    def touch(self, key: Key) -> bool:
        """Mark recently used without counting (prefetch protects predicted residents this way)."""
        if key in self.slot_of:
            self.slot_of.move_to_end(key)
            self.policy.used(key, count=False)
            return True
        return False

    def try_prefetch(self, key: Key) -> int | None:
        """Admit a predicted key if a slot can be had; None when resident already or all pinned."""
        if key in self.slot_of or self.capacity() == 0:
            return None
        self.counts[key[0]].prefetched += 1
        return self._insert(key)

    # ---- pins --------------------------------------------------------------------------
    def pin(self, key: Key) -> None:
        if key not in self.slot_of:
            raise KeyError(f"cannot pin {key}: not resident")
        self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, key: Key) -> None:
        n = self.pins[key] - 1
        if n:
            self.pins[key] = n
        else:
            del self.pins[key]

    # ---- internals ---------------------------------------------------------------------
    def _insert(self, key: Key) -> int:
        slot = self.free.pop() if self.free else self._evict()
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self.policy.admitted(key)
        return slot

    def _evict(self) -> int:
        victim = self.policy.victim(self)
        if victim is not None:
            slot = self.slot_of.pop(victim)
            self.key_of[slot] = None
            self.counts[victim[0]].evictions += 1
            self.policy.removed(victim)
            return slot
        raise CacheFull(f"all {self.num_slots} expert slots are pinned by the layer being computed")

    def check_integrity(self) -> None:
        if len(self.slot_of) + len(self.free) != self.num_slots:
            raise AssertionError("resident + free != num_slots")
        for key, slot in self.slot_of.items():
            if self.key_of[slot] != key:
                raise AssertionError(f"slot {slot} holds {self.key_of[slot]}, expected {key}")
        for slot in self.free:
            if self.key_of[slot] is not None:
                raise AssertionError(f"free slot {slot} still names {self.key_of[slot]}")
        if len(set(self.free)) != len(self.free):
            raise AssertionError("a slot is free twice")
        for key in self.pins:
            if key not in self.slot_of:
                raise AssertionError(f"pinned {key} is not resident")
