"""Which (layer, expert) sits in which cache slot: pure bookkeeping, no tensors, no device.

One LRU over all (layer, expert) pairs of all MoE layers (a hot layer may take more slots than a
cold one). Hits, misses and evictions are counted per layer. Pinned keys (the experts the layer
being computed reads) are never chosen as victims; asking for a slot when every slot is pinned
raises `CacheFull` (callers split a layer's experts into rounds of at most `capacity()` first).

Invariants (`check_integrity`): slot_of and key_of are inverse maps; every slot is either free or
holds exactly one key; pinned keys are resident.
"""
from __future__ import annotations

from collections import OrderedDict
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


class Residency:
    def __init__(self, num_slots: int, layers: list[int]):
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self.slot_of: OrderedDict[Key, int] = OrderedDict()  # least recently used first
        self.key_of: list[Key | None] = [None] * num_slots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest slot first
        self.pins: dict[Key, int] = {}
        self.counts: dict[int, LayerCounts] = {layer: LayerCounts() for layer in layers}

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
        if slot is not None:
            self.slot_of.move_to_end(key)
            self.counts[key[0]].hits += 1
            return slot, True
        self.counts[key[0]].misses += 1
        return self._insert(key), False

    def note_miss(self, key: Key) -> None:
        """A miss served without a slot (computed on CPU): counted, nothing inserted."""
        self.counts[key[0]].misses += 1

    def touch(self, key: Key) -> bool:
        """Mark recently used without counting (prefetch protects predicted residents this way)."""
        if key in self.slot_of:
            self.slot_of.move_to_end(key)
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
        return slot

    def _evict(self) -> int:
        for victim in self.slot_of:  # LRU order
            if victim not in self.pins:
                slot = self.slot_of.pop(victim)
                self.key_of[slot] = None
                self.counts[victim[0]].evictions += 1
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
