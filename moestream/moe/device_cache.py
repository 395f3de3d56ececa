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
evictions (counted against the admitting layer) and host pairs (pairs read over PCIe); hits per key
(`expert_hits`).

Lookahead prefetch (`prefetch`): before layer i+1's call, the experts predicted for it (its router applied to
layer i's input) are admitted into victims by the same rules, except that a victim read in this step (its
last_use is the step's stamp: layer i's pairs may be reading it right now) or holding an expert predicted with
it is passed over, and a prediction that gets no victim is dropped (no scratch row: those belong to the call in
flight). The caller copies them on a side stream while layer i computes. Counters PREFETCHED (experts copied
ahead) and PREFETCH_HITS (routed by the call they were predicted for: `pf_stamp`, the step that prefetched each
key).

On CUDA (Triton installed, MOESTREAM_TRITON not 0) `route` is one Triton kernel with one program
(`route_triton`), instead of ~60 small torch ops per layer call; `_route_torch` is the reference and
the CPU path, and the kernel equals it bit for bit in every output and state tensor except the
trailing scatter targets (tests/test_device_cache_triton.py, also under TRITON_INTERPRET=1).

Invariant (`check_integrity`, reads everything back): table and slot_key are inverse maps.
"""
from __future__ import annotations

import torch

from ..env import triton_enabled
from .residency import recency_digit

try:  # optional: absent on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

HITS, MISSES, ADMITTED, EVICTIONS, HOST_PAIRS, PREFETCHED, PREFETCH_HITS = range(7)
# hybrid: a miss of an expert the CPU computed within this many steps is fetched before first-time misses, so an
# expert that comes back is cached on its second miss (and one seen once does not displace a resident)
SECOND_TOUCH = 64
NEVER = -(1 << 40)


class DeviceSlotCache:
    def __init__(self, num_slots: int, moe_layers: list[int], num_experts: int, max_pairs: int,
                 device: torch.device, prefetch: bool = False):
        """num_slots cached rows; the pool needs num_slots + max_pairs rows (the scratch rows); prefetch: victims
        for a lookahead prefetch of up to max_pairs experts per layer call too."""
        self.num_slots, self.E, self.device = num_slots, num_experts, device
        self.layer_index = {layer: i for i, layer in enumerate(moe_layers)}
        L = len(moe_layers)
        self.table = torch.full((L * num_experts + 1,), -1, dtype=torch.long, device=device)
        self.slot_key = torch.full((num_slots + 1,), -1, dtype=torch.long, device=device)
        self.last_use = torch.full((num_slots + 1,), -1, dtype=torch.long, device=device)
        # a step admits at most one victim per distinct routed expert per layer call
        self.num_victims = max(0, min(num_slots, max_pairs * L * (2 if prefetch else 1)))
        self.scratch = max_pairs
        self.victims = torch.zeros(self.num_victims, dtype=torch.long, device=device)
        self.vptr = torch.zeros((), dtype=torch.long, device=device)
        self.stamp = torch.zeros((), dtype=torch.long, device=device)
        self.counters = torch.zeros((7, L), dtype=torch.long, device=device)
        self.expert_hits = torch.zeros(L * num_experts, dtype=torch.long, device=device)  # hits of key i*E + e
        # hybrid: the step at which each key was last left to the CPU (its misses then fetch first: SECOND_TOUCH)
        self.last_cpu = torch.full((L * num_experts,), NEVER, dtype=torch.long, device=device)
        self.pf_stamp = torch.full((L * num_experts,), NEVER, dtype=torch.long, device=device)  # step of its prefetch
        self._arange = torch.arange(num_experts, device=device)
        self._work = torch.zeros(2 * num_experts, dtype=torch.long, device=device)  # route_triton's scratch

    # ---- per step ------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.stamp += 1
        if self.num_victims:
            order = torch.argsort(self.last_use[:self.num_slots], stable=True)  # never used (-1) first
            self.victims.copy_(order[:self.num_victims])
        self.vptr.zero_()

    # ---- per layer call ------------------------------------------------------------------
    def route(self, layer: int, topk_ids: torch.Tensor, fetch_fraction: float | torch.Tensor = 1.0):
        """topk_ids [T, k] -> (src [P] pool row of every pair, stage_experts [M], stage_rows [M], count):
        experts[:count] must be copied from the host bank into rows[:count] before computing.

        fetch_fraction < 1 (hybrid): of a call's m misses only the first f = fetch_count(m, fraction) by
        expert id are fetched (admitted or staged); the others are left to the CPU: src = -1 for their
        pairs, no row, no victim, listed after the fetched ones (count = f). A float32 device tensor
        [frac, fixed] as fetch_fraction (live_share) is read on the device at every call (a recorded graph
        follows changes to it: hybrid's live share, strategies.BridgeDecode)."""
        if topk_ids.device.type == "cuda" and triton is not None and triton_enabled():
            return route_triton(self, layer, topk_ids, fetch_fraction)
        return self._route_torch(layer, topk_ids, fetch_fraction)

    def _route_torch(self, layer: int, topk_ids: torch.Tensor, fetch_fraction: float | torch.Tensor = 1.0):
        """The reference of `route` (any device)."""
        i, E, S = self.layer_index[layer], self.E, self.num_slots
        flat = topk_ids.reshape(-1).long()
        table = self.table[i * E:(i + 1) * E]
        slot = table[flat]
        hit = slot >= 0
        routed = torch.zeros(E, dtype=torch.bool, device=self.device).index_fill_(0, flat, True)
        resident = table >= 0
        miss_e = routed & ~resident
        n_miss = miss_e.sum()
        cm = torch.cumsum(miss_e.long(), 0)
        local = cm - 1  # a miss's fetch rank: by id, or (hybrid) second-touch misses first
        if _partial(fetch_fraction):
            n_fetch = device_fetch_count(n_miss, fetch_fraction)
            last_cpu = self.last_cpu[i * E:(i + 1) * E]
            again = miss_e & (last_cpu >= self.stamp - SECOND_TOUCH)
            first = miss_e & ~again
            local = torch.where(again, torch.cumsum(again.long(), 0) - 1, again.sum() + torch.cumsum(first.long(), 0) - 1)
            cpu_e = miss_e & (local >= n_fetch)
            last_cpu.copy_(torch.where(cpu_e, self.stamp, last_cpu))
            miss_e = miss_e & ~cpu_e
        else:
            n_fetch, cpu_e = n_miss, None
        self.counters[HITS, i] += (routed & resident).sum()
        self.counters[PREFETCH_HITS, i] += (routed & resident & (self.pf_stamp[i * E:(i + 1) * E] == self.stamp)).sum()
        self.expert_hits[i * E:(i + 1) * E] += routed & resident
        self.counters[MISSES, i] += n_miss
        self.counters[HOST_PAIRS, i] += n_fetch
        self.last_use.scatter_(0, torch.where(hit, slot, S), self.stamp.expand(flat.shape[0]))
        rows_e = table.clone()
        if self.num_victims:
            ok, victim = self._admit_torch(i, miss_e, local, n_fetch, routed)
            rows_e = torch.where(ok, victim, rows_e)
        else:
            ok = torch.zeros_like(miss_e)
        # misses without a victim: scratch rows S, S+1, ... (at most one per pair of this call)
        spill = miss_e & ~ok
        rows_e = torch.where(spill, S + torch.cumsum(spill.long(), 0) - 1, rows_e)
        if cpu_e is not None:
            rows_e = torch.where(cpu_e, -1, rows_e)
            miss_e = miss_e | cpu_e
        M = min(self.scratch, E)
        # missed experts first, by fetch rank (the fetched ones, then the CPU's), then the rest by id
        pos = torch.where(miss_e, local, n_miss + self._arange - cm)
        order = torch.argsort(pos)[:M]
        return rows_e[flat], order, rows_e[order], n_fetch

    def _admit_torch(self, i: int, fetch: torch.Tensor, local: torch.Tensor, n_fetch, routed: torch.Tensor,
                     skip_read: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's experts in `fetch` take the step's victims in rank order (local: each one's rank; vptr advances
        by n_fetch), unless a victim holds an expert `routed` by this call, or (skip_read: a prefetch) was read in
        this step, or the victims ran out -> (admitted mask, each expert's victim). Evicted keys leave the table;
        counters ADMITTED and EVICTIONS."""
        E, S, V = self.E, self.num_slots, self.num_victims
        rank = local + self.vptr
        victim = self.victims[rank.clamp(0, V - 1)]
        old = self.slot_key[victim]
        old_here = (old >= i * E) & (old < (i + 1) * E)
        busy = old_here & routed[(old - i * E).clamp(0, E - 1)]
        if skip_read:
            busy = busy | (self.last_use[victim] == self.stamp)
        ok = fetch & (rank < V) & ~busy
        self.vptr += n_fetch
        self.counters[ADMITTED, i] += ok.sum()
        self.counters[EVICTIONS, i] += (ok & (old >= 0)).sum()
        dummy_t, keys = self.table.shape[0] - 1, i * E + self._arange
        self.table.scatter_(0, torch.where(ok & (old >= 0), old, dummy_t), -1)
        self.table.scatter_(0, torch.where(ok, keys, dummy_t), victim)
        self.slot_key.scatter_(0, torch.where(ok, victim, S), keys)
        self.last_use.scatter_(0, torch.where(ok, victim, S), self.stamp.expand(E))
        return ok, victim

    def prefetch(self, layer: int, predicted: torch.Tensor):
        """Admit the experts `predicted` [T, k] for `layer`'s coming call that are not resident (see the module
        doc) -> (experts [Q], rows [Q], count): experts[:count] must be copied from the host bank into
        rows[:count] before that call computes. Q = predicted.numel()."""
        if predicted.device.type == "cuda" and triton is not None and triton_enabled():
            return prefetch_triton(self, layer, predicted)
        return self._prefetch_torch(layer, predicted)

    def _prefetch_torch(self, layer: int, predicted: torch.Tensor):
        """The reference of `prefetch` (any device)."""
        i, E, V = self.layer_index[layer], self.E, self.num_victims
        flat = predicted.reshape(-1).long()
        Q = flat.shape[0]
        table = self.table[i * E:(i + 1) * E]
        routed = torch.zeros(E, dtype=torch.bool, device=self.device).index_fill_(0, flat, True)
        miss_e = routed & (table < 0)
        n_miss = miss_e.sum()
        cm = torch.cumsum(miss_e.long(), 0)
        ok = torch.zeros_like(miss_e)
        victim = torch.zeros(E, dtype=torch.long, device=self.device)
        if V:
            ok, victim = self._admit_torch(i, miss_e, cm - 1, n_miss, routed, skip_read=True)
            self.counters[PREFETCHED, i] += ok.sum()
            pf = self.pf_stamp[i * E:(i + 1) * E]
            pf.copy_(torch.where(ok, self.stamp, pf))
        count = ok.sum()
        pos = torch.where(ok, torch.cumsum(ok.long(), 0) - 1, count + self._arange - torch.cumsum(ok.long(), 0))
        order = torch.argsort(pos)
        experts = order[:Q] if Q <= E else torch.cat([order, order.new_zeros(Q - E)])
        rows = victim[experts]
        return experts, rows, count

    # ---- host-side views (each reads device memory: not for the decode path) ---------------
    def resident_rows(self, layer: int) -> dict[int, int]:
        i, E = self.layer_index[layer], self.E
        row = self.table[i * E:(i + 1) * E].tolist()
        return {e: s for e, s in enumerate(row) if s >= 0}

    def counts(self) -> dict[int, list[int]]:
        """layer -> [hits, misses, admitted, evictions, host_pairs, prefetched, prefetch_hits]."""
        c = self.counters.t().tolist()
        return {layer: c[i] for layer, i in self.layer_index.items()}

    def hits_by_expert(self) -> dict[int, list[int]]:
        """layer -> hits of each expert (one read of the device counters)."""
        h = self.expert_hits.view(len(self.layer_index), self.E).tolist()
        return {layer: h[i] for layer, i in self.layer_index.items()}

    def num_resident(self) -> int:
        return int((self.slot_key[:self.num_slots] >= 0).sum())

    def resident_map(self) -> dict[str, str]:
        """As `Residency.resident_map`: per layer, one character per expert, "0" not in a slot, "1".."9"
        resident by recency of use (the slots' last_use stamps); one read of the device tensors."""
        table, last_use = self.table[:-1].tolist(), self.last_use.tolist()
        held = sorted((last_use[slot], key) for key, slot in enumerate(table) if slot >= 0)
        digits = ["0"] * len(table)
        for rank, (_, key) in enumerate(held):
            digits[key] = recency_digit(rank, len(held))
        E = self.E
        return {str(layer): "".join(digits[i * E:(i + 1) * E]) for layer, i in self.layer_index.items()}

    def check_integrity(self) -> None:
        table, keys = self.table[:-1].tolist(), self.slot_key[:-1].tolist()
        for key, slot in enumerate(table):
            if slot >= 0 and keys[slot] != key:
                raise AssertionError(f"table says key {key} is in slot {slot}, which holds {keys[slot]}")
        for slot, key in enumerate(keys):
            if key >= 0 and table[key] != slot:
                raise AssertionError(f"slot {slot} holds key {key}, whose table entry is {table[key]}")


# ---- the single-kernel route (CUDA; CPU tensors under TRITON_INTERPRET=1) ----------------------
def device_fetch_count(n_miss: torch.Tensor, fraction: float | torch.Tensor) -> torch.Tensor:
    """The hybrid fetch count of n_miss misses (a tensor scalar, on any device), as the kernel computes it
    (strategies.fetch_count is its host form). `fraction`: a float frac, or hybrid's live share, a float32
    tensor [frac, fixed] on n_miss's device (moe/share.py). Times are in units of (one expert over PCIe + one
    on the CPU): fetching f takes f (1 - frac), the CPU's n - f take (n - f) frac + fixed (its call's fixed
    cost; no call when f = n). f is the integer minimising the slower side: of floor(n frac + fixed) and the next
    one the first with the least time, or n when that is no slower (a tie goes to PCIe: no CPU call); float64
    of the float32-rounded values."""
    if isinstance(fraction, torch.Tensor):
        frac, fixed = fraction[0].double(), fraction[1].double()
    else:
        frac, fixed = _f32(fraction), 0.0
    n = n_miss.double()
    cost = lambda f: torch.maximum(f * (1 - frac), torch.where(f < n, (n - f) * frac + fixed, 0.0))  # noqa: E731
    lo = torch.clamp(torch.floor(n * frac + fixed), max=n)
    hi = torch.minimum(lo + 1, n)
    f = torch.where(cost(lo) <= cost(hi), lo, hi)
    return torch.where(cost(f) < cost(n), f, n).long()


def live_share(frac: float, fixed: float = 0.0, device: torch.device | str = "cpu") -> torch.Tensor:
    """hybrid's live share as the route reads it: float32 [frac, fixed] (see device_fetch_count)."""
    return torch.tensor([frac, fixed], dtype=torch.float32, device=device)


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def _partial(fraction: float | torch.Tensor) -> bool:
    """Does a route leave some misses to the CPU? (always, for a live fraction tensor)"""
    return isinstance(fraction, torch.Tensor) or fraction < 1.0


def route_triton(cache: DeviceSlotCache, layer: int, topk_ids: torch.Tensor,
                 fetch_fraction: float | torch.Tensor = 1.0):
    """`DeviceSlotCache.route` as one Triton launch: fresh static-shape outputs, no host reads."""
    if triton is None:
        raise RuntimeError("route_triton needs triton")
    i, E, S, V = cache.layer_index[layer], cache.E, cache.num_slots, cache.num_victims
    flat = topk_ids.reshape(-1)
    P, M, dev = flat.shape[0], min(cache.scratch, E), cache.device
    src = torch.empty(P, dtype=torch.long, device=dev)
    order = torch.empty(M, dtype=torch.long, device=dev)
    rows = torch.empty(M, dtype=torch.long, device=dev)
    count = torch.empty((), dtype=torch.long, device=dev)
    block_e = max(16, triton.next_power_of_2(E))
    live = isinstance(fetch_fraction, torch.Tensor)
    frac_ptr = fetch_fraction if live else count  # any tensor: unused unless FRAC_PTR
    _route_kernel[(1,)](flat, cache.table, cache.slot_key, cache.last_use, cache.victims if V else cache.slot_key,
                        cache.vptr, cache.stamp, cache.counters, cache.expert_hits, cache.last_cpu, cache.pf_stamp,
                        cache._work,
                        cache._work[E:],
                        src, order, rows, count, P, E, S, V, cache.counters.shape[1], M, i,
                        0.0 if live else _f32(fetch_fraction), frac_ptr,
                        HAS_V=V > 0, PARTIAL=_partial(fetch_fraction), FRAC_PTR=live,
                        BLOCK_P=max(16, triton.next_power_of_2(P)), BLOCK_E=block_e,
                        num_warps=4 if block_e <= 256 else 8)
    return src, order, rows, count


def prefetch_triton(cache: DeviceSlotCache, layer: int, predicted: torch.Tensor):
    """`DeviceSlotCache.prefetch` as one Triton launch (no host reads)."""
    if triton is None:
        raise RuntimeError("prefetch_triton needs triton")
    i, E, S, V = cache.layer_index[layer], cache.E, cache.num_slots, cache.num_victims
    flat = predicted.reshape(-1)
    Q, dev = flat.shape[0], cache.device
    experts = torch.zeros(Q, dtype=torch.long, device=dev)
    rows = torch.zeros(Q, dtype=torch.long, device=dev)
    count = torch.zeros((), dtype=torch.long, device=dev)
    if not V:
        return experts, rows, count
    block_e = max(16, triton.next_power_of_2(E))
    _prefetch_kernel[(1,)](flat, cache.table, cache.slot_key, cache.last_use, cache.victims, cache.vptr, cache.stamp,
                           cache.counters, cache.pf_stamp, cache._work, experts, rows, count, Q, E, S, V,
                           cache.counters.shape[1], i, BLOCK_Q=max(16, triton.next_power_of_2(Q)), BLOCK_E=block_e,
                           num_warps=4 if block_e <= 256 else 8)
    return experts, rows, count


if triton is not None:
    _SECOND_TOUCH = tl.constexpr(SECOND_TOUCH)  # a Triton kernel reads globals only as constexpr

    @triton.jit
    def _fetch_share(n_miss, frac, frac_ptr, FRAC_PTR: tl.constexpr):
        """device_fetch_count(n_miss, frac) in the kernel, in float64; FRAC_PTR: the live share [frac, fixed]
        read from device memory (a replayed graph follows it), else frac with no fixed cost."""
        nf = n_miss.to(tl.float64)
        if FRAC_PTR:
            fr = nf * 0.0 + tl.load(frac_ptr).to(tl.float64)
            fx = nf * 0.0 + tl.load(frac_ptr + 1).to(tl.float64)
        else:
            fr = nf * 0.0 + frac  # frac in float64 (an exact widening of the float32 the host passes)
            fx = nf * 0.0
        lo = tl.minimum(tl.floor(nf * fr + fx), nf)
        hi = tl.minimum(lo + 1, nf)
        c_lo = tl.maximum(lo * (1 - fr), tl.where(lo < nf, (nf - lo) * fr + fx, 0.0))
        c_hi = tl.maximum(hi * (1 - fr), tl.where(hi < nf, (nf - hi) * fr + fx, 0.0))
        f = tl.where(c_lo <= c_hi, lo, hi)
        c_f = tl.minimum(c_lo, c_hi)
        return tl.where(c_f < nf * (1 - fr), f, nf).to(tl.int64)

    @triton.jit
    def _second_touch(miss, n_fetch, last_cpu_e, em, st, BLOCK_E: tl.constexpr):
        """hybrid's fetch rank of each miss, misses left to the CPU within _SECOND_TOUCH steps (last_cpu) first,
        each group by id -> (rank, fetched mask: rank < n_fetch); the misses left to the CPU now are recorded."""
        lc = tl.load(last_cpu_e, mask=em, other=-1)
        again = miss & (lc >= st - _SECOND_TOUCH)
        first = miss & ~again
        r = tl.where(again, tl.cumsum(again.to(tl.int64), 0) - 1,
                     tl.sum(again.to(tl.int64), 0) + tl.cumsum(first.to(tl.int64), 0) - 1)
        fetch = miss & (r < n_fetch)
        tl.store(last_cpu_e, tl.zeros([BLOCK_E], dtype=tl.int64) + st, mask=miss & ~fetch)
        return r, fetch

    @triton.jit
    def _routed(routed_buf, flat, fm, e, em, BLOCK_F: tl.constexpr, BLOCK_E: tl.constexpr):
        """routed[e]: is expert e among the ids `flat` (mask fm)? A scatter of ones into the scratch row
        routed_buf (left there: _admit reads it by a data-dependent index)."""
        tl.store(routed_buf + e, tl.zeros([BLOCK_E], dtype=tl.int64), mask=em)
        tl.debug_barrier()
        tl.store(routed_buf + flat, tl.full([BLOCK_F], 1, tl.int64), mask=fm)
        tl.debug_barrier()
        return tl.load(routed_buf + e, mask=em, other=0) != 0

    @triton.jit
    def _admit(e, em, base, fetch, r, n_fetch, rows_e, table, slot_key, last_use, victims, vptr, routed_buf,
               counters, st, E, V, L, li, BLOCK_E: tl.constexpr, SKIP_READ: tl.constexpr = False):
        """The fetched misses take the step's LRU victims in rank order (r: each miss's fetch rank, plus the
        old vptr, read-and-advanced by one atomic), unless a victim is routed by this very call, or (SKIP_READ:
        a prefetch) was read in this step, or the victims ran out: -> (admitted mask, each expert's row with the
        admitted ones' new slots). Evicted keys leave the table; counters ADMITTED and EVICTIONS; debug_barrier
        orders every read of table / slot_key before the admission writes."""
        rank = r + tl.atomic_add(vptr, n_fetch)  # the old vptr
        victim = tl.load(victims + tl.minimum(tl.maximum(rank, 0), V - 1), mask=em, other=0)
        old = tl.load(slot_key + victim, mask=em, other=-1)
        here = (old >= base) & (old < base + E)
        busy = tl.load(routed_buf + tl.minimum(tl.maximum(old - base, 0), E - 1), mask=em & here, other=0) != 0
        if SKIP_READ:
            busy = busy | (tl.load(last_use + victim, mask=em, other=-1) == st)
        ok = fetch & (rank < V) & ~busy
        evict = ok & (old >= 0)
        tl.atomic_add(counters + 2 * L + li, tl.sum(ok.to(tl.int64), 0))  # ADMITTED
        tl.atomic_add(counters + 3 * L + li, tl.sum(evict.to(tl.int64), 0))  # EVICTIONS
        tl.debug_barrier()
        tl.store(table + old, tl.full([BLOCK_E], -1, tl.int64), mask=evict)
        tl.store(table + base + e, victim, mask=ok)
        tl.store(slot_key + victim, base + e, mask=ok)
        tl.store(last_use + victim, tl.zeros([BLOCK_E], dtype=tl.int64) + st, mask=ok)
        return ok, tl.where(ok, victim, rows_e)

    @triton.jit(do_not_specialize=["li"])  # one compile for every layer index
    def _route_kernel(ids, table, slot_key, last_use, victims, vptr, stamp, counters, expert_hits, last_cpu, pf_stamp,
                      routed_buf,
                      rows_buf, src_out, order_out, rows_out, count_out, P, E, S, V, L, M, li, frac, frac_ptr,
                      HAS_V: tl.constexpr, PARTIAL: tl.constexpr, FRAC_PTR: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_E: tl.constexpr):
        """One layer call of the slot cache in one program: pairs p < P on one axis, experts e < E on the other.

        routed[e] is a scatter of ones into a scratch row (routed_buf); misses are routed non-residents.
        Inclusive cumsums over e give each miss its victim rank (+ vptr, read-and-advanced by one atomic),
        its scratch row if it gets no victim, and its place in `order` (misses first, then the rest, by
        id), so `order`/`rows` are written by scatter. Gathers by a data-dependent index (routed[old],
        rows_e[flat]) go through global scratch rows; debug_barrier orders each store before its loads
        and every read of table/slot_key before the admission writes."""
        p = tl.arange(0, BLOCK_P)
        pm = p < P
        e = tl.arange(0, BLOCK_E)
        em = e < E
        base = li.to(tl.int64) * E
        flat = tl.load(ids + p, mask=pm, other=0).to(tl.int64)
        slot = tl.load(table + base + flat, mask=pm, other=-1)
        before = tl.load(table + base + e, mask=em, other=-1)  # rows_e starts as the table read here
        st = tl.load(stamp)
        routed = _routed(routed_buf, flat, pm, e, em, BLOCK_P, BLOCK_E)
        hit = pm & (slot >= 0)
        tl.store(last_use + slot, tl.zeros([BLOCK_P], dtype=tl.int64) + st, mask=hit)
        resident = before >= 0
        miss = routed & ~resident
        cm = tl.cumsum(miss.to(tl.int64), 0)  # inclusive: a miss's rank among misses is cm - 1
        n_miss = tl.sum(miss.to(tl.int64), 0)
        tl.atomic_add(counters + 0 * L + li, tl.sum((routed & resident).to(tl.int64), 0))  # HITS
        pf = tl.load(pf_stamp + base + e, mask=em, other=-1) == st
        tl.atomic_add(counters + 6 * L + li, tl.sum((routed & resident & pf).to(tl.int64), 0))  # PREFETCH_HITS
        eh = tl.load(expert_hits + base + e, mask=em, other=0)  # one program: no other writer
        tl.store(expert_hits + base + e, eh + (routed & resident).to(tl.int64), mask=em)
        tl.atomic_add(counters + 1 * L + li, n_miss)  # MISSES
        n_fetch = n_miss
        fetch = miss
        r = cm - 1  # a miss's fetch rank
        if PARTIAL:  # hybrid: fetch_count(n_miss, frac) misses are fetched, second-touch ones first, the rest CPU's
            n_fetch = _fetch_share(n_miss, frac, frac_ptr, FRAC_PTR)
            r, fetch = _second_touch(miss, n_fetch, last_cpu + base + e, em, st, BLOCK_E)
        tl.atomic_add(counters + 4 * L + li, n_fetch)  # HOST_PAIRS
        rows_e = before
        ok = e < 0
        if HAS_V:
            ok, rows_e = _admit(e, em, base, fetch, r, n_fetch, rows_e, table, slot_key, last_use, victims, vptr,
                                routed_buf, counters, st, E, V, L, li, BLOCK_E)
        spill = fetch & ~ok
        rows_e = tl.where(spill, S + tl.cumsum(spill.to(tl.int64), 0) - 1, rows_e)
        if PARTIAL:
            rows_e = tl.where(miss & ~fetch, -1, rows_e)
        tl.store(rows_buf + e, rows_e, mask=em)
        tl.debug_barrier()
        tl.store(src_out + p, tl.load(rows_buf + flat, mask=pm, other=0), mask=pm)
        pos = tl.where(miss, r, n_miss + e - cm)  # a permutation of 0..E-1: misses first (by fetch rank)
        tl.store(order_out + pos, e.to(tl.int64), mask=em & (pos < M))
        tl.store(rows_out + pos, rows_e, mask=em & (pos < M))
        tl.store(count_out, n_fetch)

    @triton.jit(do_not_specialize=["li"])
    def _prefetch_kernel(ids, table, slot_key, last_use, victims, vptr, stamp, counters, pf_stamp, routed_buf,
                         experts_out, rows_out, count_out, Q, E, S, V, L, li, BLOCK_Q: tl.constexpr,
                         BLOCK_E: tl.constexpr):
        """`DeviceSlotCache._prefetch_torch` in one program (the route kernel's scheme): predicted non-residents
        take victims in id order, passing over victims read in this step or holding a predicted expert."""
        q = tl.arange(0, BLOCK_Q)
        qm = q < Q
        e = tl.arange(0, BLOCK_E)
        em = e < E
        base = li.to(tl.int64) * E
        flat = tl.load(ids + q, mask=qm, other=0).to(tl.int64)
        before = tl.load(table + base + e, mask=em, other=-1)
        st = tl.load(stamp)
        routed = _routed(routed_buf, flat, qm, e, em, BLOCK_Q, BLOCK_E)
        miss = routed & (before < 0)
        cm = tl.cumsum(miss.to(tl.int64), 0)
        n_miss = tl.sum(miss.to(tl.int64), 0)
        ok, rows_e = _admit(e, em, base, miss, cm - 1, n_miss, before, table, slot_key, last_use, victims, vptr,
                            routed_buf, counters, st, E, V, L, li, BLOCK_E, SKIP_READ=True)
        n_ok = tl.sum(ok.to(tl.int64), 0)
        tl.atomic_add(counters + 5 * L + li, n_ok)  # PREFETCHED
        tl.store(pf_stamp + base + e, tl.zeros([BLOCK_E], dtype=tl.int64) + st, mask=ok)
        pos = tl.cumsum(ok.to(tl.int64), 0) - 1
        tl.store(experts_out + pos, e.to(tl.int64), mask=ok & (pos < Q))
        tl.store(rows_out + pos, rows_e, mask=ok & (pos < Q))
        tl.store(count_out, tl.minimum(n_ok, Q))
