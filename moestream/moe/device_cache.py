"""The expert slot cache kept in device tensors: lookups, LRU recency and admission without the host.

`residency.Residency` is the host-side LRU the grouped decode path uses; it needs each layer's route on
the host (one synchronisation per layer). This cache answers the same questions with tensor ops on
the compute device, so a decode step has no host synchronisation and can be a CUDA graph:

    table [L*E (+1)]    slot of (layer i, expert e) at i*E + e, or -1
    slot_key [S (+1)]   key held by each slot, or -1
    last_use [S (+1)]   step stamp of the last step that read (or filled) the slot
    victims [V]         at each step start: the V least recently used slots, in LRU order

A layer call (`route`) reads the slots of its pairs, stamps the hits, and admits its distinct misses
into the next unused victims. A victim is skipped when the expert it holds is routed by the same layer
call (it is being read); a miss that gets no victim goes to one of `scratch` rows after the slots
(rows S .. S+scratch-1 of the pool), used for this call only. `route` returns every pair's pool row and
the compact list of (expert, row) the caller stages from the host bank before computing. The trailing (+1) element of table, slot_key and last_use is a scratch
target for masked scatters. Counters per layer: hits, misses (distinct experts per call), admitted,
evictions (counted against the admitting layer) and host pairs (pairs read over PCIe).

Invariant (`check_integrity`, reads everything back): table and slot_key are inverse maps.
"""
from __future__ import annotations

import torch

HITS, MISSES, ADMITTED, EVICTIONS, HOST_PAIRS = range(5)


class DeviceSlotCache:
    def __init__(self, num_slots: int, moe_layers: list[int], num_experts: int, max_pairs: int,
                 device: torch.device):
        """num_slots cached rows; the pool needs num_slots + max_pairs rows (the scratch rows)."""
        self.num_slots, self.E, self.device = num_slots, num_experts, device
        self.layer_index = {layer: i for i, layer in enumerate(moe_layers)}
        L = len(moe_layers)
        self.table = torch.full((L * num_experts + 1,), -1, dtype=torch.long, device=device)
        self.slot_key = torch.full((num_slots + 1,), -1, dtype=torch.long, device=device)
        self.last_use = torch.full((num_slots + 1,), -1, dtype=torch.long, device=device)
        # a step admits at most one victim per distinct routed expert per layer call
        self.num_victims = max(0, min(num_slots, max_pairs * L))
        self.scratch = max_pairs
        self.victims = torch.zeros(self.num_victims, dtype=torch.long, device=device)
        self.vptr = torch.zeros((), dtype=torch.long, device=device)
        self.stamp = torch.zeros((), dtype=torch.long, device=device)
        self.counters = torch.zeros((5, L), dtype=torch.long, device=device)
        self._arange = torch.arange(num_experts, device=device)

    # ---- per step ------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.stamp += 1
        if self.num_victims:
            order = torch.argsort(self.last_use[:self.num_slots], stable=True)  # never used (-1) first
            self.victims.copy_(order[:self.num_victims])
        self.vptr.zero_()

    # ---- per layer call ------------------------------------------------------------------
    def route(self, layer: int, topk_ids: torch.Tensor):
        """topk_ids [T, k] -> (src [P] pool row of every pair, stage_experts [M], stage_rows [M], count):
        experts[:count] must be copied from the host bank into rows[:count] before computing."""
        i, E, S = self.layer_index[layer], self.E, self.num_slots
        flat = topk_ids.reshape(-1).long()
        table = self.table[i * E:(i + 1) * E]
        slot = table[flat]
        hit = slot >= 0
        routed = torch.zeros(E, dtype=torch.bool, device=self.device).index_fill_(0, flat, True)
        resident = table >= 0
        miss_e = routed & ~resident
        n_miss = miss_e.sum()
        self.counters[HITS, i] += (routed & resident).sum()
        self.counters[MISSES, i] += n_miss
        self.counters[HOST_PAIRS, i] += n_miss
        self.last_use.scatter_(0, torch.where(hit, slot, S), self.stamp.expand(flat.shape[0]))
        rows_e = table.clone()
        if self.num_victims:
            V = self.num_victims
            rank = torch.cumsum(miss_e.long(), 0) - 1 + self.vptr
            victim = self.victims[rank.clamp(0, V - 1)]
            old = self.slot_key[victim]
            old_here = (old >= i * E) & (old < (i + 1) * E)
            busy = old_here & routed[(old - i * E).clamp(0, E - 1)]
            ok = miss_e & (rank < V) & ~busy
            self.vptr += n_miss
            self.counters[ADMITTED, i] += ok.sum()
            self.counters[EVICTIONS, i] += (ok & (old >= 0)).sum()
            dummy_t, keys = self.table.shape[0] - 1, i * E + self._arange
            self.table.scatter_(0, torch.where(ok & (old >= 0), old, dummy_t), -1)
            self.table.scatter_(0, torch.where(ok, keys, dummy_t), victim)
            self.slot_key.scatter_(0, torch.where(ok, victim, S), keys)
            self.last_use.scatter_(0, torch.where(ok, victim, S), self.stamp.expand(E))
            rows_e = torch.where(ok, victim, rows_e)
        else:
            ok = torch.zeros_like(miss_e)
        # misses without a victim: scratch rows S, S+1, ... (at most one per pair of this call)
        spill = miss_e & ~ok
        rows_e = torch.where(spill, S + torch.cumsum(spill.long(), 0) - 1, rows_e)
        M = min(self.scratch, E)
        order = torch.argsort((~miss_e).to(torch.int8), stable=True)[:M]  # missed experts first
        return rows_e[flat], order, rows_e[order], n_miss

    # ---- host-side views (each reads device memory: not for the decode path) ---------------
    def resident_rows(self, layer: int) -> dict[int, int]:
        i, E = self.layer_index[layer], self.E
        row = self.table[i * E:(i + 1) * E].tolist()
        return {e: s for e, s in enumerate(row) if s >= 0}

    def counts(self) -> dict[int, list[int]]:
        """layer -> [hits, misses, admitted, evictions, host_pairs]."""
        c = self.counters.t().tolist()
        return {layer: c[i] for layer, i in self.layer_index.items()}

    def num_resident(self) -> int:
        return int((self.slot_key[:self.num_slots] >= 0).sum())

    def check_integrity(self) -> None:
        table, keys = self.table[:-1].tolist(), self.slot_key[:-1].tolist()
        for key, slot in enumerate(table):
            if slot >= 0 and keys[slot] != key:
                raise AssertionError(f"table says key {key} is in slot {slot}, which holds {keys[slot]}")
        for slot, key in enumerate(keys):
            if key >= 0 and table[key] != slot:
                raise AssertionError(f"slot {slot} holds key {key}, whose table entry is {table[key]}")
