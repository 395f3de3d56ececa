"""Placement policies: compose residency, transfer and compute behind the ExpertRuntime interface.

fused    every expert resident on the compute device (store banks live there)
offload  device slot cache (one cache over all layers, victims by --moe-cache-policy; the pair path's device
         cache: LRU); misses copied from host banks on the copy stream; decode prefetches layer l+1's predicted experts; prefill streams through a double buffer
cpu      routed experts computed by CPU threads from host banks; on a GPU, prefill chunks still
         stream through the device double buffer (a prefill chunk is compute-bound)
hybrid   hits on the device; misses split between PCIe fetch and CPU compute in proportion to the
         measured bandwidths; every routed expert computed exactly once
"""
from __future__ import annotations

import torch

from .cpu_moe import layer_table
from .compute import CpuExperts, DeviceExperts, RouteGroups, WeightRef, accumulate
from .device_cache import ADMITTED, EVICTIONS, HITS, HOST_PAIRS, MISSES, DeviceSlotCache, device_fetch_count
from .bridge import CpuBridge
from .pairs import pair_moe, pair_outputs, pair_sum, stage_experts, triton_ready
from .qpairs import supports as qpair_supports
from .residency import Residency
from .runtime import ExpertRuntime, register
from .share import LiveShare
from .transfer import Copier, Pool, PrefillStreamer, Sync


def pairs_wanted(options, store, device) -> bool:
    """Use the pair kernels for decode? auto: on CUDA with Triton, for dense experts and every compressed
    format with a quantized pair kernel (moe/qpairs.py); pairs: also on CPU (the torch references, for
    tests); grouped: never."""
    if options.decode_kernel == "grouped":
        return False
    if store.fmt.quantized and device.type == "cuda" and not all(
            qpair_supports(store.fmt.for_layer(layer)) for layer in store.moe_layers):
        return False  # a format with no Triton pair kernel keeps the grouped path on CUDA
    if device.type == "cuda":
        return triton_ready(device)
    return options.decode_kernel == "pairs"


@register
class FusedRuntime(ExpertRuntime):
    name = "fused"

    def __init__(self, store, device, options):
        super().__init__(store, device, options)
        self.gpu = DeviceExperts()
        self.pairs = pairs_wanted(options, store, device)
        if self.pairs:
            self.distinct = torch.zeros(len(store.moe_layers), dtype=torch.long, device=device)
            self.layer_index = {layer: i for i, layer in enumerate(store.moe_layers)}
            # one token's top-k experts are distinct: a batch-1 step's count needs no kernel (counted here)
            self.single = [0] * len(store.moe_layers)
            self.book.device_counts = self._device_counts
            self.hits_e = torch.zeros(len(store.moe_layers), store.num_experts, dtype=torch.long, device=device)
            self._ones = torch.ones(store.num_experts, dtype=torch.long, device=device)
        else:
            self.host_hits = {layer: [0] * store.num_experts for layer in store.moe_layers}

    def host_layer_table(self, layer):
        if self.pairs or self.device.type != "cpu" or self.tap is not None:
            return None
        return layer_table(self.store.bank(layer), self.store.fmt.for_layer(layer))

    def _book_host_experts(self, layer, experts):
        s = self.book[layer]
        s.hits += len(experts)
        s.gpu_experts += len(experts)
        row = self.host_hits[layer]
        for e in experts.tolist():
            row[e] += 1

    def expert_hits(self):
        if self.pairs:
            h = self.hits_e.tolist()
            return {layer: h[i] for layer, i in self.layer_index.items()}
        return self.host_hits

    def capturable(self, info=None):
        return self.pairs

    def _device_counts(self) -> dict:
        d = self.distinct.tolist()
        return {layer: {"hits": d[i] + self.single[i], "expert_calls": d[i] + self.single[i],
                        "gpu_experts": d[i] + self.single[i]} for layer, i in self.layer_index.items()}

    def count_replay(self, num_tokens: int, top_k: int) -> None:
        super().count_replay(num_tokens, top_k)
        if self.pairs and num_tokens == 1:
            self.single = [c + top_k for c in self.single]

    def forward(self, layer, x, topk_ids, topk_w):
        if self.pairs and not self.prefill_mode:
            self._count_pairs(layer, topk_ids)
            li = self.layer_index[layer]
            if topk_ids.shape[0] == 1:  # distinct by construction (a replay adds them in count_replay)
                if not (topk_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
                    self.single[li] += topk_ids.shape[1]
                self.hits_e[li].index_add_(0, topk_ids.reshape(-1).long(), self._ones[:topk_ids.shape[1]])
            else:
                routed = torch.zeros(self.store.num_experts, dtype=torch.bool, device=x.device)
                routed.index_fill_(0, topk_ids.reshape(-1), True)
                self.distinct[li] += routed.sum()
                self.hits_e[li] += routed
            return pair_moe(x, topk_w, topk_ids.reshape(-1).long(), self.store.bank(layer),
                            self.store.fmt.for_layer(layer))
        groups = RouteGroups.of(topk_ids)
        self._count(layer, topk_ids, groups)
        s = self.book[layer]
        s.hits += len(groups.experts)
        s.gpu_experts += len(groups.experts)
        if self.pairs:  # prefill chunks of a pair-path runtime
            ids = torch.tensor(groups.experts, dtype=torch.long, device=self.hits_e.device)
            self.hits_e[self.layer_index[layer]].index_add_(0, ids, self._ones[:len(groups.experts)])
        else:
            row = self.host_hits[layer]
            for e in groups.experts:
                row[e] += 1
        bank = self.store.bank(layer)
        fmt = self.store.fmt.for_layer(layer)
        refs = {e: WeightRef(bank, e, fmt) for e in groups.experts}
        return accumulate(x, groups, self.gpu.compute(x, topk_w, groups, refs))


class CachedRuntime(ExpertRuntime):
    """Shared machinery of the policies that keep master copies in host banks."""

    uses_cpu = False

    def __init__(self, store, device, options):
        super().__init__(store, device, options)
        self.sync = Sync(device)
        self.copier = Copier(store, self.sync, self.book)
        self.gpu = DeviceExperts()
        self.cpu = CpuExperts(options.cpu_threads) if self.uses_cpu else None
        self._build_cache(options.cache_slots)
        self.streamer = (PrefillStreamer(store, self.copier, options.prefill_slots, device)
                         if options.prefill_slots > 0 else None)
        self.prefetched: dict[int, set[int]] = {}

    def _build_cache(self, slots: int, pool_rows: int | None = None) -> None:
        old = getattr(self, "residency", None)
        self.residency = Residency(slots, self.store.moe_layers, self.options.cache_policy)
        if old is not None:  # statistics survive a resize
            self.residency.counts, self.residency.expert_hits = old.counts, old.expert_hits
        self.pool = None  # the old pool is freed before the new one is made
        self.pool = Pool(self.store, slots if pool_rows is None else pool_rows, self.device)
        self.book.residency = self.residency

    def forward(self, layer, x, topk_ids, topk_w):
        groups = RouteGroups.of(topk_ids)
        self._count(layer, topk_ids, groups)
        if self.prefill_mode and self.streamer is not None:
            partials = self._prefill(layer, x, topk_w, groups)
        else:
            self._settle_prefetch(layer, groups.experts)
            partials = self._decode(layer, x, topk_w, groups)
        return accumulate(x, groups, partials)

    def _decode(self, layer, x, topk_w, groups: RouteGroups) -> dict:
        raise NotImplementedError  # each subclass below implements it

    # ---- decode on the device, in rounds that fit the cache ----------------------------
    def _device_rounds(self, layer, x, topk_w, groups, experts: list[int], after_first_copy=None) -> dict:
        """Compute `experts` from the slot cache: resident ones first (so admitting the others
        cannot evict them), at most capacity() experts pinned at a time."""
        out: dict[int, torch.Tensor] = {}
        first = True
        for rows, fetch in self.residency.rounds(layer, experts):
            self.copier.copy(self.pool, fetch)
            if first and after_first_copy is not None:
                after_first_copy()  # prefetch copies queue behind the demand copies
            first = False
            out.update(self._compute_rows(layer, self.pool, rows, x, topk_w, groups))
        self.book[layer].gpu_experts += len(experts)
        return out

    def _compute_rows(self, layer: int, pool: Pool, rows: dict[int, int], x, topk_w, groups) -> dict:
        self.copier.wait_ready(pool, rows.values())
        out = self.gpu.compute(x, topk_w, groups, {e: pool.ref(r, layer) for e, r in rows.items()})
        self.copier.released(pool, rows.values())
        return out

    # ---- decode prefetch -----------------------------------------------------------------
    def _prefetch_next(self, layer: int, x: torch.Tensor) -> None:
        nxt = self.next_layer.get(layer)
        if nxt is None or not self.options.prefetch or self.residency.num_slots == 0:
            return
        predicted = self._predict(nxt, x, limit=self.residency.num_slots)
        for e in predicted:  # keep predicted residents from being the victims of this prefetch
            self.residency.touch((nxt, e))
        fetch = []
        for e in predicted:
            slot = self.residency.try_prefetch((nxt, e))
            if slot is not None:
                fetch.append((nxt, e, slot))
        self.copier.copy(self.pool, fetch)
        self.book[nxt].prefetch_issued += len(fetch)
        self.prefetched[nxt] = {e for _, e, _ in fetch}

    def _settle_prefetch(self, layer: int, experts: list[int]) -> None:
        done = self.prefetched.pop(layer, set())
        s = self.book[layer]
        used = done.intersection(experts)
        s.prefetch_hits += sum(1 for e in used if self.residency.lookup((layer, e)) is not None)
        s.prefetch_unused += len(done) - len(used)

    # ---- prefill: stream what the chunk routes to, outside the LRU --------------------------
    def _prefill(self, layer, x, topk_w, groups: RouteGroups) -> dict:
        st, s = self.streamer, self.book[layer]
        cached = self._resident_rows(layer, groups.experts)
        stream = [e for e in groups.experts if e not in cached]
        batches = self._staged_batch(layer, stream)
        rest = [e for e in stream if not batches or e not in batches[0][1]]
        chunks = [rest[i:i + st.per_half] for i in range(0, len(rest), st.per_half)]
        while len(batches) < 2 and chunks:
            batches.append(st.load(layer, chunks.pop(0)))
        out = self._compute_rows(layer, self.pool, cached, x, topk_w, groups) if cached else {}
        while batches:
            pool, rows = batches.pop(0)
            out.update(self._compute_rows(layer, pool, rows, x, topk_w, groups))
            if chunks:  # goes into the half just computed from; its release event orders the copy
                batches.append(st.load(layer, chunks.pop(0)))
        s.prefill_resident += len(cached)
        s.prefill_streamed += len(stream)
        s.gpu_experts += len(groups.experts)
        self._stage_next(layer, x)
        return out

    def _resident_rows(self, layer: int, experts: list[int]) -> dict[int, int]:
        """expert -> slot of those of `experts` that are in the slot cache (no LRU update)."""
        found = {e: self.residency.lookup((layer, e)) for e in experts}
        return {e: slot for e, slot in found.items() if slot is not None}

    def _staged_batch(self, layer: int, stream: list[int]) -> list:
        staged = self.streamer.take_staged(layer)
        if staged is None:
            return []
        pool, rows = staged
        s = self.book[layer]
        used = {e: r for e, r in rows.items() if e in set(stream)}
        s.prefill_lookahead_used += len(used)
        return [(pool, used)] if used else []

    def _stage_next(self, layer: int, x: torch.Tensor) -> None:
        nxt = self.next_layer.get(layer)
        if nxt is None or not self.options.prefetch:
            return
        predicted = self._predict(nxt, x, limit=self.store.num_experts)
        resident = self._resident_rows(nxt, predicted)
        predicted = [e for e in predicted if e not in resident][:self.streamer.per_half]
        if predicted:
            pool, rows = self.streamer.load(nxt, predicted)
            self.streamer.staged = (nxt, pool, rows)
            self.book[nxt].prefill_lookahead += len(rows)

    # ---- step boundaries ---------------------------------------------------------------------
    def begin_step(self, info=None):
        super().begin_step(info)
        self._drop_lookahead()

    def end_step(self):
        self._drop_lookahead()
        if self.residency.pins:
            raise RuntimeError(f"expert runtime bug: pins left at end of step: {self.residency.pins}")
        super().end_step()

    def _drop_lookahead(self) -> None:
        for layer, experts in self.prefetched.items():
            self.book[layer].prefetch_unused += len(experts)
        self.prefetched = {}
        if self.streamer is not None:
            self.streamer.staged = None

    def resize(self, cache_slots: int) -> None:
        """New slot cache (cold) between steps; host banks and the prefill buffer are kept."""
        if self.sync.cuda:
            torch.cuda.synchronize(self.device)  # no copy or kernel may still touch the old pool
        self.options = type(self.options)(**{**self.options.__dict__, "cache_slots": cache_slots})
        self._build_cache(cache_slots)
        self.epoch = getattr(self, "epoch", 0) + 1  # recorded decode graphs point at the old pool

    def stats(self):
        self.copier.fold(block=True)
        out = super().stats()
        out["cache"] = {"slots": self.residency.num_slots, "resident": len(self.residency.slot_of),
                        "prefill_slots_per_half": self.streamer.per_half if self.streamer else 0,
                        "resident_map": self.residency.resident_map(self.store.num_experts)}
        return out

    def check_integrity(self) -> None:
        self.residency.check_integrity()

    def expert_hits(self):
        if not self.residency.num_slots:
            return None  # cpu: nothing is cached on the device
        rows = {layer: [0] * self.store.num_experts for layer in self.store.moe_layers}
        for (layer, e), n in self.residency.expert_hits.items():
            rows[layer][e] = n
        return rows

    def close(self):
        if self.cpu is not None:
            self.cpu.close()

    # ---- CPU compute -----------------------------------------------------------------------
    def _submit_cpu(self, layer, x, topk_w, groups, experts: list[int], inline: bool = False):
        for e in experts:
            self.residency.note_miss((layer, e))
        self.book[layer].cpu_experts += len(experts)
        bank = self.store.bank(layer)
        fmt = self.store.fmt.for_layer(layer)
        return self.cpu.submit(x, topk_w, groups, {e: WeightRef(bank, e, fmt) for e in experts}, inline=inline)


class DeviceCachedRuntime(CachedRuntime):
    """Decode through the pair kernels and the device-side slot cache (moe/device_cache.py) where they
    apply (dense or compressed experts with a pair kernel, every host bank pinned, a prefill buffer):
    hits read their slot, misses are read from the pinned host bank by the kernel and admitted into LRU
    victims in the same pass, with no host synchronisation, so decode steps can be CUDA graphs. Otherwise
    the grouped path: host LRU, copies on the copy stream, then compute."""

    def __init__(self, store, device, options):
        pinned = device.type != "cuda" or all(t.is_pinned() for per in store.banks.values() for t in per.values())
        # the device-side cache is an LRU: other policies keep the host cache (grouped path)
        self.pairs = (pairs_wanted(options, store, device) and pinned and options.prefill_slots > 0
                      and options.cache_slots > 0 and options.cache_policy == "lru")
        self.dcache = None
        super().__init__(store, device, options)

    def _build_cache(self, slots):
        if not self.pairs:
            return super()._build_cache(slots)
        # the last `scratch` rows of the pool stage misses that get no slot (moe/device_cache.py)
        scratch = min(max(self.options.max_pairs, 1), self.store.num_experts)
        cached = max(slots - scratch, 1)
        self.dcache = None
        super()._build_cache(cached, cached + scratch)
        self.dcache = DeviceSlotCache(cached, self.store.moe_layers, self.store.num_experts, scratch, self.device)
        self.book.residency = None
        self.book.device_counts = self._device_counts

    def _device_counts(self) -> dict:
        out = {}
        cpu = self.bridge.cpu_experts if getattr(self, "bridge", None) is not None else None
        for layer, c in self.dcache.counts().items():
            nbytes = self.store.bytes_per_expert(layer)
            out[layer] = {"hits": c[HITS], "misses": c[MISSES], "evictions": c[EVICTIONS], "copies": c[ADMITTED],
                          "bytes_h2d": c[HOST_PAIRS] * nbytes, "gpu_experts": c[HITS] + c[HOST_PAIRS],
                          "expert_calls": c[HITS] + c[MISSES]}
            if cpu is not None:
                i = self.dcache.layer_index[layer]
                out[layer].update(cpu_experts=cpu[i], cpu_s=self.bridge.cpu_seconds[i],
                                  cpu_kernel_s=self.bridge.kernel_seconds[i])
        return out

    def capturable(self, info=None):
        return self.pairs

    def expert_hits(self):
        return self.dcache.hits_by_expert() if self.pairs else super().expert_hits()

    def begin_graph_step(self):
        if self.pairs:
            self.dcache.begin_step()

    def begin_step(self, info=None):
        super().begin_step(info)
        if self.pairs and not (info or {}).get("graph", False):
            self.dcache.begin_step()

    def _resident_rows(self, layer, experts):
        if not self.pairs:
            return super()._resident_rows(layer, experts)
        rows = self.dcache.resident_rows(layer)
        return {e: rows[e] for e in experts if e in rows}

    def stats(self):
        out = super().stats()
        if self.pairs:  # the slots asked for; the pool holds cached_slots + scratch rows staging a step's misses
            out["cache"]["slots"] = self.options.cache_slots
            out["cache"]["cached_slots"] = self.dcache.num_slots
            out["cache"]["scratch_slots"] = self.dcache.scratch
            out["cache"]["resident"] = self.dcache.num_resident()
            out["cache"]["resident_map"] = self.dcache.resident_map()
            out["decode_kernel"] = "pairs"
        return out

    def check_integrity(self):
        if self.pairs:
            self.dcache.check_integrity()
        super().check_integrity()


@register
class OffloadRuntime(DeviceCachedRuntime):
    name = "offload"

    def forward(self, layer, x, topk_ids, topk_w):
        if not self.pairs or self.prefill_mode:
            return super().forward(layer, x, topk_ids, topk_w)
        self._count_pairs(layer, topk_ids)
        src, experts, rows, count = self.dcache.route(layer, topk_ids)
        stage_experts(self.store.bank(layer), self.pool.arrays, experts, rows, count)
        return pair_moe(x, topk_w, src, self.pool.arrays, self.store.fmt.for_layer(layer))

    def _decode(self, layer, x, topk_w, groups):
        return self._device_rounds(layer, x, topk_w, groups, groups.experts,
                                   after_first_copy=lambda: self._prefetch_next(layer, x))


class BridgedSteps:
    """Decode steps whose CPU-computed pairs go through a CpuBridge (moe/bridge.py): one job per decode step
    for the worker, the step waited for (and a failure raised) at its end. Mixed into cpu and hybrid."""

    bridge = None
    _bridged = False

    def _make_bridge(self, wanted: bool) -> None:
        self.bridge = (CpuBridge(self.store, self.device, self.options.max_pairs, self.options.cpu_threads,
                                 self.options.act_dtype) if wanted else None)
        self._bridged = False

    def begin_step(self, info=None):
        super().begin_step(info)
        self._bridged = self.bridge is not None and not self.prefill_mode
        if self._bridged:
            self.bridge.begin_step()

    def end_step(self):
        try:
            if self._bridged:
                self._bridged = False
                self.bridge.end_step()
        finally:
            super().end_step()

    def close(self):
        if self.bridge is not None:
            self.bridge.close()
        super().close()


def bridge_wanted(options, store, device) -> bool:
    """CPU pairs through the bridge: wherever the pair kernels run (CUDA + Triton, dense or compressed
    experts; or forced on CPU for tests) and the plan says how many pairs a decode layer call may have."""
    return pairs_wanted(options, store, device) and options.max_pairs > 0


@register
class CpuRuntime(BridgedSteps, CachedRuntime):
    name = "cpu"
    uses_cpu = True

    def __init__(self, store, device, options):
        super().__init__(store, device, options)
        self._make_bridge(bridge_wanted(options, store, device))
        if self.bridge is not None:
            self.book.device_counts = self._device_counts

    def _device_counts(self) -> dict:
        c, t, k = self.bridge.cpu_experts, self.bridge.cpu_seconds, self.bridge.kernel_seconds
        return {layer: {"misses": c[i], "cpu_experts": c[i], "cpu_s": t[i], "cpu_kernel_s": k[i], "expert_calls": c[i]}
                for layer, i in self.bridge.index.items()}

    def capturable(self, info=None):
        return self.bridge is not None

    def host_layer_table(self, layer):
        if self.bridge is not None or self.device.type != "cpu" or self.tap is not None or self.residency.num_slots:
            return None
        return layer_table(self.store.bank(layer), self.store.fmt.for_layer(layer))

    def _book_host_experts(self, layer, experts):
        for e in experts.tolist():
            self.residency.note_miss((layer, e))
        self.book[layer].cpu_experts += len(experts)

    def forward(self, layer, x, topk_ids, topk_w):
        if self.bridge is None or self.prefill_mode:
            return super().forward(layer, x, topk_ids, topk_w)
        self._count_pairs(layer, topk_ids)
        P, k = topk_ids.numel(), topk_ids.shape[1]
        cpu = torch.ones(P, dtype=torch.bool, device=x.device)
        self.bridge.post(layer, x, topk_ids, topk_w, cpu)
        y = torch.empty(P, x.shape[1], dtype=torch.float32, device=x.device)
        self.bridge.collect(layer, y, cpu)
        return pair_sum(y, k, x.dtype)

    def _decode(self, layer, x, topk_w, groups):
        # waited for at once: on a CPU device the calling thread computes them (no worker hand-off)
        return self._submit_cpu(layer, x, topk_w, groups, groups.experts, inline=x.device.type == "cpu").result()


def fetch_count(misses: int, frac: float) -> int:
    """How many of `misses` to fetch over PCIe so both sides finish together: the integer f
    minimising max(f * (1 - frac), (misses - f) * frac); frac = pcie / (pcie + cpu). The one rule of
    the grouped path, the device cache's torch route and its kernel (device_cache.device_fetch_count)."""
    return int(device_fetch_count(torch.tensor(misses), frac))


@register
class HybridRuntime(BridgedSteps, DeviceCachedRuntime):
    """Grouped path: hits on the device, misses split between fetch and CPU per `_choose_fetch`. Pair path
    (with the device cache): of a layer call's misses the first fetch_count(m, share) by expert id are
    fetched into the cache while the CPU computes the others (moe/bridge.py); the step stays a graph, and
    the share follows the PCIe and CPU rates measured in running steps (moe/share.py)."""

    name = "hybrid"
    uses_cpu = True

    def __init__(self, store, device, options):
        super().__init__(store, device, options)
        self._make_bridge(self.pairs and bridge_wanted(options, store, device))
        self.pairs = self.bridge is not None
        if not self.pairs and self.dcache is not None:  # no bridge after all: the grouped path's host LRU
            self.dcache = None
            self.book.device_counts = None
            CachedRuntime._build_cache(self, options.cache_slots)
        # pair path: the fetch share follows the rates measured in running steps (moe/share.py)
        self.share = LiveShare(device, options.hybrid_fetch_fraction, options.pcie_gbs) if self.pairs else None
        self.step = 0
        self.last_seen: dict[tuple[int, int], int] = {}

    def forward(self, layer, x, topk_ids, topk_w):
        if not self.pairs or self.prefill_mode:
            return super().forward(layer, x, topk_ids, topk_w)
        self._count_pairs(layer, topk_ids)
        src, experts, rows, count = self.dcache.route(layer, topk_ids, self.share.tensor)
        cpu = src < 0
        self.bridge.post(layer, x, topk_ids, topk_w, cpu)  # first: the CPU works while experts are staged
        stage_experts(self.store.bank(layer), self.pool.arrays, experts, rows, count)
        y = pair_outputs(x, topk_w, src, self.pool.arrays, self.store.fmt.for_layer(layer))
        self.bridge.collect(layer, y, cpu)
        return pair_sum(y, topk_ids.shape[1], x.dtype)

    def begin_step(self, info=None):
        super().begin_step(info)
        self.step += 1

    def end_step(self):
        decode = self.share is not None and not self.prefill_mode
        super().end_step()
        if decode and (self.share.steps + 1) % self.share.every:
            self.share.observe(0.0, 0.0)  # counts the step; the rates are read once per window
        elif decode:
            b = self.bridge
            cpu_bytes = sum(b.cpu_experts[i] * self.store.bytes_per_expert(layer) for layer, i in b.index.items())
            layers = list(self.store.moe_layers)
            layer_calls = (self.share.steps + 1) * len(layers)  # decode steps so far, this one included
            expert_bytes = sum(self.store.bytes_per_expert(layer) for layer in layers) / max(len(layers), 1)
            self.share.observe(cpu_bytes, sum(b.cpu_seconds), b.single_calls, b.single_seconds,
                               self.book.total().misses, layer_calls, expert_bytes)

    def stats(self):
        out = super().stats()
        if self.share is not None:
            out["hybrid"] = self.share.as_dict()
        return out

    def _decode(self, layer, x, topk_w, groups):
        hits = [e for e in groups.experts if self.residency.lookup((layer, e)) is not None]
        misses = [e for e in groups.experts if e not in set(hits)]
        fetch = self._choose_fetch(layer, groups, misses)
        on_cpu = [e for e in misses if e not in fetch]
        job = self._submit_cpu(layer, x, topk_w, groups, on_cpu)  # first, so the CPU works meanwhile
        out = self._device_rounds(layer, x, topk_w, groups, hits + sorted(fetch),
                                  after_first_copy=lambda: self._prefetch_next(layer, x))
        out.update(job.result())
        for e in groups.experts:
            self.last_seen[(layer, e)] = self.step
        return out

    def _choose_fetch(self, layer, groups, misses: list[int]) -> set[int]:
        """Fetch the misses most tokens route to (a fetched expert serves them all from VRAM), then
        the most recently seen (recurring experts earn a slot), then the lowest id."""
        n = fetch_count(len(misses), self.options.hybrid_fetch_fraction)
        count = dict(zip(groups.experts, groups.counts))
        ranked = sorted(misses, key=lambda e: (-count[e], -self.last_seen.get((layer, e), 0), e))
        return set(ranked[:n])
