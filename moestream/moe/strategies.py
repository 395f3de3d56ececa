"""How a layer call's routed experts are computed: the decode and prefill strategies of an ExpertRuntime.

decode
    pairs     every (token, k) pair reads its expert from the device row the cache gives it (moe/pairs.py,
              moe/qpairs.py): no host sync, so a decode step can be a CUDA graph (fused, offload)
    grouped   the pairs grouped by expert on the host (`RouteGroups`: one host sync per layer call), each
              expert computed where the placement says (`PLACES`): on the device from the cache (fused,
              offload), on CPU threads from the host banks (cpu), or hits on the device and misses split
              between PCIe and the CPU (hybrid)
    bridge    the CPU's pairs posted to one worker thread through pinned host memory (moe/bridge.py) and
              collected by the GPU inside the step: every pair (cpu), or the misses the device cache's
              route leaves to the CPU by hybrid's live fetch share (moe/share.py), the others as `pairs`
prefill
    resident  the grouped computation where the experts are (fused's banks; without a prefill buffer the
              decode path's: slot cache or CPU)
    streamed  what the chunk routes to and the cache does not hold streams through the prefill double buffer
              (moe/transfer.py), outside the LRU; the next layer's predicted experts are loaded ahead

Each strategy has step hooks (`begin_step(info, decode)`, `end_step(decode)`), `close`, `stats`, and for the
CPU decode plan `host_table` / `book_host` (models/cpu_decode.py). `DECODERS`, `PLACES` and `PREFILLS`
name them for the factory (moe/backends.py).
"""
from __future__ import annotations

import time
from collections import deque

import torch

from ..env import hybrid_arms
from .bridge import CpuBridge
from .compute import RouteGroups, WeightRef, accumulate, grouped_bank_ready
from .cpu_moe import layer_table
from .caches import BankExperts, pool_partials
from .device_cache import device_fetch_count
from .pairs import pair_outputs, pair_sum
from .planner import HYBRID_MAX_RESIDENCY
from .runtime import Part
from .share import FETCH, SPLIT, Arms, HeldFetch, LiveShare
from .transfer import PrefillStreamer


def count_call(book, layer: int, topk_ids: torch.Tensor, groups: RouteGroups) -> None:
    """Host counts of a grouped layer call: tokens, pairs and distinct experts."""
    s = book[layer]
    s.tokens += topk_ids.shape[0]
    s.routed += topk_ids.numel()
    s.expert_calls += len(groups.experts)


def count_pairs(book, layer: int, topk_ids: torch.Tensor) -> None:
    """Host counts of a pair-path call (shapes only: no sync; skipped while recording a graph, a replay is
    counted by the engine through count_replay)."""
    if topk_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    s = book[layer]
    s.tokens += topk_ids.shape[0]
    s.routed += topk_ids.numel()


def fetch_count(misses: int, frac: float) -> int:
    """How many of `misses` to fetch over PCIe so both sides finish together: the integer f
    minimising max(f * (1 - frac), (misses - f) * frac); frac = pcie / (pcie + cpu). The one rule of
    the grouped path, the device cache's torch route and its kernel (device_cache.device_fetch_count)."""
    return int(device_fetch_count(torch.tensor(misses), frac))


class Strategy(Part):
    """Defaults of a strategy: not capturable, no step hooks, nothing to report."""

    capturable = False  # a decode step with no host sync (a CUDA graph may record it)
    device_pairs = False  # the device's pairs run the pair kernels
    per_half = 0  # rows per half of the prefill double buffer it streams through (0: none)
    lookahead = None  # a LookaheadCopies (the pair strategies): side-stream copies joined by the step's end

    def join_side_stream(self) -> None:
        """The step's side-stream copies joined to the main stream (end_step; inside a recorded decode graph
        before its capture ends: runtime.end_graph_step)."""
        if self.lookahead is not None:
            self.lookahead.join_all()

    def stats(self) -> dict:
        """Entries of its own for runtime.stats()."""
        return {}

    def host_table(self, layer: int):
        """The CPU decode plan's expert table when this strategy computes every expert on this CPU, else None."""
        return None

    def book_host(self, layer: int, experts: list[int]) -> None:
        """Counts a decode layer call the CPU decode plan made outside `forward`, as `forward` would have."""


# ---- grouped -------------------------------------------------------------------------------------
class HostCompute:
    """Experts computed by CPU threads straight from the host banks (compute.CpuExperts); each is a miss
    of the slot cache (counted, not admitted) and a CPU expert."""

    def __init__(self, ctx, cache, experts):
        self.ctx, self.cache, self.experts = ctx, cache, experts

    def book(self, layer: int, experts: list[int]) -> None:
        """Counts `experts` of `layer` as misses (not admitted) and CPU experts."""
        self.cache.note_misses(layer, len(experts))
        self.ctx.book[layer].cpu_experts += len(experts)

    def submit(self, layer: int, x, topk_w, groups: RouteGroups, experts: list[int], inline: bool = False):
        """A future of {expert: partial}; inline: computed on the calling thread (no worker hand-off)."""
        self.book(layer, experts)
        store = self.ctx.store
        bank, fmt = store.bank(layer), store.fmt.for_layer(layer)
        return self.experts.submit(x, topk_w, groups, {e: WeightRef(bank, e, fmt) for e in experts}, inline=inline)


class OnDevice:
    """Every expert computed on the device from where the cache holds it (fused: the banks; offload: slots)."""

    def __init__(self, ctx, cache, host):
        self.cache = cache

    def begin_step(self) -> None:
        """Nothing per step."""

    def partials(self, layer: int, x, topk_w, groups: RouteGroups) -> dict:
        """{expert: partial} of every routed expert, from the cache."""
        return self.cache.compute(layer, x, topk_w, groups, groups.experts)

    def host_table(self, layer: int):
        """The cache's (fused on a CPU: the banks are host memory)."""
        return self.cache.host_table(layer)

    def book(self, layer: int, experts: list[int]) -> None:
        """As the cache counts a computed call."""
        self.cache.book(layer, experts)


class OnCpu:
    """Every expert computed by CPU threads (cpu); waited for at once, so on a CPU device the calling thread
    computes them (no worker hand-off)."""

    def __init__(self, ctx, cache, host: HostCompute):
        self.ctx, self.cache, self.host = ctx, cache, host

    def begin_step(self) -> None:
        """Nothing per step."""

    def partials(self, layer: int, x, topk_w, groups: RouteGroups) -> dict:
        """{expert: partial} of every routed expert, computed by the CPU threads."""
        return self.host.submit(layer, x, topk_w, groups, groups.experts, inline=x.device.type == "cpu").result()

    def host_table(self, layer: int):
        """On a CPU device with no slots the whole block may be one compiled call over the host banks."""
        if self.ctx.device.type != "cpu" or self.cache.residency.num_slots:
            return None
        return layer_table(self.ctx.store.bank(layer), self.ctx.store.fmt.for_layer(layer))

    def book(self, layer: int, experts: list[int]) -> None:
        """As a CPU computation counts."""
        self.host.book(layer, experts)


class MissSplit:
    """hybrid's grouped path: hits on the device; of the misses, fetch_count(m, fraction) are fetched into
    the slot cache (per `_choose_fetch`) while the CPU computes the others (submitted first)."""

    def __init__(self, ctx, cache, host: HostCompute):
        self.ctx, self.cache, self.host = ctx, cache, host
        self.step = 0
        self.last_seen: dict[tuple[int, int], int] = {}

    def begin_step(self) -> None:
        """Steps are the clock of `last_seen` (recency of a miss)."""
        self.step += 1

    def partials(self, layer: int, x, topk_w, groups: RouteGroups) -> dict:
        """{expert: partial}: hits and fetched misses from the slot cache, the other misses from the CPU."""
        hits = [e for e in groups.experts if self.cache.lookup(layer, e) is not None]
        misses = [e for e in groups.experts if e not in set(hits)]
        fetch = self._choose_fetch(layer, groups, misses)
        on_cpu = [e for e in misses if e not in fetch]
        job = self.host.submit(layer, x, topk_w, groups, on_cpu)  # first, so the CPU works meanwhile
        out = self.cache.compute(layer, x, topk_w, groups, hits + sorted(fetch))
        out.update(job.result())
        for e in groups.experts:
            self.last_seen[(layer, e)] = self.step
        return out

    def _choose_fetch(self, layer: int, groups: RouteGroups, misses: list[int]) -> set[int]:
        """Fetch the misses most tokens route to (a fetched expert serves them all from VRAM), then
        the most recently seen (recurring experts earn a slot), then the lowest id."""
        n = fetch_count(len(misses), self.ctx.options.hybrid_fetch_fraction)
        count = dict(zip(groups.experts, groups.counts))
        ranked = sorted(misses, key=lambda e: (-count[e], -self.last_seen.get((layer, e), 0), e))
        return set(ranked[:n])

    def host_table(self, layer: int):
        """Never: the device computes part of every call."""
        return None

    def book(self, layer: int, experts: list[int]) -> None:
        """Unused (no CPU decode plan for hybrid)."""


PLACES = {"none": OnDevice, "all": OnCpu, "misses": MissSplit}  # Composition.cpu -> placement


class GroupedDecode(Strategy):
    """The layer call's pairs grouped by expert on the host, each expert's partial computed by the placement,
    summed by `accumulate` (each token's pairs in k order on CUDA, ascending experts on CPU)."""

    def __init__(self, ctx, cache, place):
        self.ctx, self.cache, self.place = ctx, cache, place

    def forward(self, layer: int, x, topk_ids, topk_w) -> torch.Tensor:
        """y [T, H]; the route comes to the host once (RouteGroups)."""
        groups = RouteGroups.of(topk_ids)
        count_call(self.ctx.book, layer, topk_ids, groups)
        self.cache.settle_prefetch(layer, groups.experts)
        return accumulate(x, groups, self.place.partials(layer, x, topk_w, groups))

    def begin_step(self, info: dict, decode: bool) -> None:
        """The placement's step clock."""
        self.place.begin_step()

    def host_table(self, layer: int):
        """The placement's: fused and cpu on a CPU device compute every expert there."""
        return self.place.host_table(layer)

    def book_host(self, layer: int, experts: list[int]) -> None:
        """Counted as the placement counts a computed call."""
        self.place.book(layer, experts)


# ---- pairs and bridge ----------------------------------------------------------------------------
class LookaheadCopies:
    """The pair path's lookahead prefetch (--moe-prefetch on, a device cache): after a layer call has staged its
    own misses, the next MoE layer's predicted experts are admitted and copied on a side stream, so the copies
    overlap this layer's expert GEMVs and the next layer's attention; the next layer's call waits for them
    before it routes (`join`). On a CPU device the same admissions and copies run in order. Captured into
    decode graphs as a fork and a join (every fork is joined by the next layer's call or by end_step). Tensors
    the side stream reads are held until its join, so the allocator cannot hand them to the main stream early."""

    def __init__(self, ctx, cache):
        self.ctx, self.cache = ctx, cache
        self.stream = torch.cuda.Stream(ctx.device) if ctx.device.type == "cuda" else None
        self.pending: dict[int, tuple] = {}  # next layer -> what its copies read and wrote

    def issue(self, layer: int, x: torch.Tensor) -> None:
        if not self.ctx.options.prefetch or layer in self.ctx.lookahead.draft_layers:
            return
        if self.stream is None:
            rows = self.cache.prefetch_rows(layer, x)
            if rows is not None:
                rows.stage()
            return
        la = self.ctx.lookahead
        nxt = la.next_layer.get(layer)
        if nxt is None or nxt in la.draft_layers or nxt not in la.routers:
            return  # nothing to copy, or no call of this step would join the side stream
        self.stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(self.stream):
            rows = self.cache.prefetch_rows(layer, x)
            if rows is not None:
                rows.stage()
        self.pending[nxt] = (x, rows)

    def join(self, layer: int) -> None:
        """Before `layer` routes: the copies issued for it are done (stream order)."""
        if self.pending.pop(layer, None) is not None:
            torch.cuda.current_stream(self.ctx.device).wait_stream(self.stream)

    def join_all(self) -> None:
        if self.pending:
            self.pending.clear()
            torch.cuda.current_stream(self.ctx.device).wait_stream(self.stream)


class PairsDecode(Strategy):
    """Every pair reads its expert from the device row the cache gives it (misses staged first; with
    --moe-prefetch on, the next layer's predicted experts copied meanwhile: LookaheadCopies)."""

    capturable = True
    device_pairs = True

    def __init__(self, ctx, cache):
        self.ctx, self.cache = ctx, cache
        self.lookahead = LookaheadCopies(ctx, cache)

    def forward(self, layer: int, x, topk_ids, topk_w) -> torch.Tensor:
        """y [T, H], each token's k pairs summed in k order; no host sync."""
        count_pairs(self.ctx.book, layer, topk_ids)
        return fetched_pairs(self, layer, x, topk_ids, topk_w)

    def end_step(self, decode: bool) -> None:
        """Every side-stream copy joined before the step ends (a recorded step joins them inside its graph)."""
        self.join_side_stream()


def fetched_pairs(strategy, layer: int, x, topk_ids, topk_w) -> torch.Tensor:
    """Every miss staged from the host bank into the device cache, then every pair from its device row (the
    strategy's cache and lookahead copies): offload's decode layer call."""
    strategy.lookahead.join(layer)
    rows = strategy.cache.pair_rows(layer, x, topk_ids)
    return pair_sum(staged_pair_outputs(strategy, layer, rows, x, topk_w), topk_ids.shape[1], x.dtype)


def staged_pair_outputs(strategy, layer: int, rows, x, topk_w) -> torch.Tensor:
    """y [P, H] of a routed call whose misses are not yet in their rows: the pair kernels copy them as the hits compute
    (qpairs.fetches_in_pairs; the lookahead's copies issued after them, not to share PCIe with the call's own), or
    the copy kernel stages them first and the lookahead's copies overlap the pair kernels."""
    fmt = strategy.ctx.store.fmt.for_layer(layer)
    fetch = rows.fetched_in_pairs(x, fmt, x.shape[0])
    if not fetch:
        rows.stage()
        strategy.lookahead.issue(layer, x)
    y = pair_outputs(x, topk_w, rows.src, rows.arrays, fmt, rows.staged if fetch else None)
    if fetch:
        strategy.lookahead.issue(layer, x)
    return y


class BridgeDecode(Strategy):
    """Decode steps whose CPU-computed pairs go through a CpuBridge: one job per decode step for the worker,
    the step waited for (and a failure raised) at its end. `split` (hybrid, over the device cache): of a
    layer call's misses the first fetch_count(m, share) by expert id are fetched into the cache while the CPU
    computes the others, the share following the PCIe and CPU rates measured in running steps (moe/share.py);
    otherwise (cpu) every pair is the CPU's. hybrid's `arms` (moe/share.Arms; MOESTREAM_HYBRID_ARMS=0: off) runs
    some decode steps as offload's (every miss fetched, no worker job) and keeps, per batch size, whichever form
    its measured step times say is faster (every step offload's where the cache holds over planner.HYBRID_MAX_RESIDENCY
    of the experts: share.HeldFetch); `variant` tells recorded CUDA graphs of the two forms apart."""

    capturable = True

    def __init__(self, ctx, cache, split: bool):
        o = ctx.options
        self.ctx, self.cache = ctx, cache
        self.bridge = CpuBridge(ctx.store, ctx.device, o.max_pairs, o.cpu_threads, o.act_dtype, hold=not split)
        self._bridged = False
        layers = list(ctx.store.moe_layers)
        expert_bytes = sum(ctx.store.bytes_per_expert(layer) for layer in layers) / max(len(layers), 1)
        self.share = LiveShare(ctx.device, o.hybrid_fetch_fraction, o.pcie_gbs, expert_bytes) if split else None
        self.device_pairs = split
        self.lookahead = LookaheadCopies(ctx, cache)
        self.arms = Arms() if split and hybrid_arms() else None
        if self.arms is not None and self.residency() > HYBRID_MAX_RESIDENCY:
            self.arms = HeldFetch()  # most experts cached: offload's step (share.HeldFetch says why)
        self.arm = SPLIT
        # each step launched and not yet finished, oldest first: (whether it gave the worker a job, (rows, arm, start)
        # for the arms or None); two while an overlapped step is launched before the last is read
        self._steps: deque = deque()
        self._all_cpu: dict = {}  # (pairs, device) -> an all-True mask: cpu's, made once (no fill kernel a layer)
        ctx.book.counters.append(self.counts)

    def residency(self) -> float:
        """The share of the model's routed experts hybrid's device cache holds (its cached rows, not the scratch)."""
        store = self.ctx.store
        return self.cache.dcache.num_slots / max(1, len(store.moe_layers) * store.num_experts)

    @property
    def variant(self) -> int:
        """The form of this step's layer calls, for the keys of recorded decode graphs (1: every miss fetched)."""
        return int(self.arm == FETCH)

    def forward(self, layer: int, x, topk_ids, topk_w) -> torch.Tensor:
        """y [T, H], GPU and CPU pair outputs summed in k order (as fused sums them); no host sync."""
        return self.forward_beside(layer, x, topk_ids, topk_w, None)[0]

    def forward_beside(self, layer: int, x, topk_ids, topk_w, beside):
        """(y, beside()): the caller's device work (ExpertRuntime.forward_beside) launched after the post, before
        the collect, so the GPU runs it while the worker computes (None: nothing)."""
        count_pairs(self.ctx.book, layer, topk_ids)
        if self.share is None:
            return self._all_on_cpu(layer, x, topk_ids, topk_w, beside)
        if self.arm == FETCH:
            return fetched_pairs(self, layer, x, topk_ids, topk_w), beside() if beside is not None else None
        return self._split(layer, x, topk_ids, topk_w, beside)

    def _all_on_cpu(self, layer: int, x, topk_ids, topk_w, beside=None):
        """cpu: every pair posted to the worker, its rows collected."""
        P, k = topk_ids.numel(), topk_ids.shape[1]
        cpu = self._all_cpu.get((P, x.device))
        if cpu is None:
            cpu = torch.ones(P, dtype=torch.bool, device=x.device)
            # kept when made outside a capture (a step's eager run comes before a graph of its size is recorded); one
            # made inside is filled only when the graph replays
            if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
                self._all_cpu[(P, x.device)] = cpu
        self.bridge.post(layer, x, topk_ids, topk_w, cpu)
        extra = beside() if beside is not None else None
        y = torch.empty(P, x.shape[1], dtype=torch.float32, device=x.device)
        self.bridge.collect(layer, y, cpu)
        return pair_sum(y, k, x.dtype), extra

    def _split(self, layer: int, x, topk_ids, topk_w, beside=None):
        """hybrid: the device cache's route decides; the CPU's pairs are posted before the GPU stages and
        computes its own, so PCIe, GPU and CPU overlap within the layer."""
        self.lookahead.join(layer)
        rows = self.cache.pair_rows(layer, x, topk_ids, self.share.tensor)
        cpu = rows.src < 0
        self.bridge.post(layer, x, topk_ids, topk_w, cpu)  # first: the CPU works while experts are staged
        y = staged_pair_outputs(self, layer, rows, x, topk_w)
        extra = beside() if beside is not None else None
        self.bridge.collect(layer, y, cpu)
        return pair_sum(y, topk_ids.shape[1], x.dtype), extra

    def counts(self) -> dict:
        """The worker's counts as book fields; with no device cache (cpu) its experts are also the misses and
        expert calls (nothing else sees the route)."""
        b = self.bridge
        c, t, k = b.cpu_experts, b.cpu_seconds, b.kernel_seconds
        out = {}
        for layer, i in b.index.items():
            out[layer] = {"cpu_experts": int(c[i]), "cpu_s": float(t[i]), "cpu_kernel_s": float(k[i]),
                          "cpu_wait_s": float(b.wait_seconds[i]), "cpu_handoff_s": float(b.handoff_seconds[i])}
            if self.share is None:
                out[layer].update(misses=int(c[i]), expert_calls=int(c[i]))
        return out

    def overlappable(self, rows: int) -> bool:
        """Whether a decode step of `rows` rows may be launched before the last one is read under `--overlap-schedule
        auto`: while the arms hold the fetch form for that batch size, whose steps are offload's (no worker job), as
        offload's overlap; never while they explore (an arm's time runs from launch to results, which an overlapped
        launch would blur) or hold the split."""
        return self.arms is not None and self.arms.held(rows) == FETCH

    def begin_step(self, info: dict, decode: bool) -> None:
        """A decode step is one job for the worker (prefill steps take the prefill strategy), unless the arms
        run it as offload's. info "overlapped": the step is launched before the last one is read (that one stays
        pending; every step is finished in launch order)."""
        keep = 1 if info.get("overlapped") else 0
        while len(self._steps) > keep:  # a step nobody finished (its launch raised): its job waited for, not timed
            if self._steps.popleft()[0]:
                self.bridge.finish_step()
        self._bridged, self.arm, timed = decode, SPLIT, None
        # an MTP drafter pass calls only its block's layer: the worker starts there, not at layer 0
        first = self.bridge.index.get(info.get("draft_layer"), 0) if info.get("draft") else 0
        if decode and self.arms is not None and not info.get("draft"):  # (an MTP drafter pass: not a step)
            rows = int(info.get("num_tokens", 0))
            self.arm = self.arms.pick(rows)
            self._bridged = self.arm == SPLIT
            timed = (rows, self.arm, time.perf_counter())
        self._steps.append((self._bridged, timed))
        if self._bridged and self.share is not None:  # the arms' tuned share while they hold the split, else the fit's
            fitted = (self.share.value, self.share.fixed)
            tuned = self.arms.share_for(timed[0], fitted) if timed is not None else None  # (arms on)
            frac, fixed = tuned or fitted
            self.share.use(frac, fixed)
            # every miss on the CPU (share 0): the worker's pool held through the step, as the cpu backend's is
            # (a split step, whose CPU share is a few experts a layer beside the PCIe copies, is faster without)
            self.bridge.hold = frac <= 0.0
        if self._bridged:
            self.bridge.begin_step(first, keep)

    def end_step(self, decode: bool) -> None:
        """The step's work is launched: the bridge notes it (finish_step waits for it)."""
        self.join_side_stream()
        if self._bridged:
            self._bridged = False
            self.bridge.end_step()

    def wait_step(self) -> None:
        """A step with a worker job: the caller sleeps until the GPU finished it (CpuBridge.wait_launched). The oldest
        step launched is the one to be read: where it gave the worker no job (hybrid's fetch arm), nothing here waits
        (the bridge's oldest pending step is a newer one, launched after it)."""
        if not self._steps or self._steps[0][0]:
            self.bridge.wait_launched()

    def finish_step(self) -> None:
        """The step's results were waited for: the worker's failure raised; then hybrid's share counts the step,
        and the arms its time from launch to results."""
        bridged, timed = self._steps.popleft() if self._steps else (True, None)
        if bridged and self.bridge.finish_step() and self.share is not None:
            self.share.observe(self.bridge.fit)  # the worker's calls so far, read once per window
        if timed is not None:
            rows, arm, t0 = timed
            self.arms.observe(rows, arm, time.perf_counter() - t0)

    def stats(self) -> dict:
        """hybrid: the live share and the rates it follows; the arms held per batch size."""
        if self.share is None:
            return {}
        return {"hybrid": {**self.share.as_dict(), **({"arms": self.arms.as_dict()} if self.arms else {}),
                           "omp_released": self.bridge.omp_released}}

    def close(self) -> None:
        """Stops the worker thread."""
        self.bridge.close()


DECODERS = {  # Composition.decode -> builder(ctx, composition, cache, host compute)
    "pairs": lambda ctx, comp, cache, host: PairsDecode(ctx, cache),
    "grouped": lambda ctx, comp, cache, host: GroupedDecode(ctx, cache, PLACES[comp.cpu](ctx, cache, host)),
    "bridge": lambda ctx, comp, cache, host: BridgeDecode(ctx, cache, split=comp.cpu == "misses"),
}


# ---- prefill ------------------------------------------------------------------------------------
class StreamedPrefill(Strategy):
    """Prefill chunks read what the cache holds in place and stream the rest through the double buffer, outside
    the LRU (so the decode working set is not flushed); the next layer's predicted experts are loaded into the
    free half while this layer computes (with --moe-prefetch)."""

    def __init__(self, ctx, cache):
        self.ctx, self.cache = ctx, cache
        self.streamer = PrefillStreamer(ctx.store, ctx.copier, ctx.options.prefill_slots, ctx.device)

    @property
    def per_half(self) -> int:
        """Rows of each half of the double buffer."""
        return self.streamer.per_half

    def forward(self, layer: int, x, topk_ids, topk_w) -> torch.Tensor:
        """y [T, H] of a prefill chunk's layer call; the LRU is not touched."""
        groups = RouteGroups.of(topk_ids)
        count_call(self.ctx.book, layer, topk_ids, groups)
        return accumulate(x, groups, self._partials(layer, x, topk_w, groups))

    def _partials(self, layer: int, x, topk_w, groups: RouteGroups) -> dict:
        """Cached experts read in place; the look-ahead load first, the rest in half-sized batches, the next
        batch loaded into the half just computed from (its release event orders the copy)."""
        st, s, copier = self.streamer, self.ctx.book[layer], self.ctx.copier
        cached = self.cache.resident_rows(layer, groups.experts)
        stream = [e for e in groups.experts if e not in cached]
        batches = self._staged_batch(layer, stream)
        rest = [e for e in stream if not batches or e not in batches[0][1]]
        chunks = [rest[i:i + st.per_half] for i in range(0, len(rest), st.per_half)]
        while len(batches) < 2 and chunks:
            batches.append(st.load(layer, chunks.pop(0)))
        out = pool_partials(copier, layer, self.cache.pool, cached, x, topk_w, groups) if cached else {}
        while batches:
            pool, rows = batches.pop(0)
            out.update(pool_partials(copier, layer, pool, rows, x, topk_w, groups))
            if chunks:  # goes into the half just computed from; its release event orders the copy
                batches.append(st.load(layer, chunks.pop(0)))
        s.prefill_resident += len(cached)
        s.prefill_streamed += len(stream)
        s.gpu_experts += len(groups.experts)
        self._stage_next(layer, x)
        return out

    def _staged_batch(self, layer: int, stream: list[int]) -> list:
        """The look-ahead load made for this layer, cut to the experts it streams (counted as used)."""
        staged = self.streamer.take_staged(layer)
        if staged is None:
            return []
        pool, rows = staged
        used = {e: r for e, r in rows.items() if e in set(stream)}
        self.ctx.book[layer].prefill_lookahead_used += len(used)
        return [(pool, used)] if used else []

    def _stage_next(self, layer: int, x: torch.Tensor) -> None:
        """Load the next layer's predicted, uncached experts into the free half."""
        ctx = self.ctx
        nxt = ctx.lookahead.next_layer.get(layer)
        if nxt is None or not ctx.options.prefetch:
            return
        predicted = ctx.lookahead.predict(nxt, x, limit=ctx.store.num_experts)
        resident = self.cache.resident_rows(nxt, predicted)
        predicted = [e for e in predicted if e not in resident][:self.streamer.per_half]
        if predicted:
            pool, rows = self.streamer.load(nxt, predicted)
            self.streamer.staged = (nxt, pool, rows)
            ctx.book[nxt].prefill_lookahead += len(rows)

    def begin_step(self, info: dict, decode: bool) -> None:
        """A look-ahead load never crosses a step."""
        self.streamer.staged = None

    def end_step(self, decode: bool) -> None:
        """A look-ahead load never crosses a step."""
        self.streamer.staged = None


class DeviceBankPrefill(Strategy):
    """fused on the pair path (every expert a row of the device banks): a prefill chunk's layer call with no host
    sync. The route is grouped on the device (moe/grouped.py `grouped_moe` over the bank's rows, pair outputs held
    and summed as the grouped path's: the same values) and counted in the device tensors the pair path counts in
    (`BankExperts.pair_rows`), so the host keeps queueing the chunk's later layers while the GPU computes. The
    grouped path's route (`RouteGroups.of`: `unique_consecutive` and `counts.tolist()`) waited for the GPU at every
    layer: of an all-resident 512-token Q4_K_M prefill on an H100 (2026-12-05), 126 ms wall for 77 ms of kernels.
    A layer whose bank the grouped kernels cannot read (or a CPU device) takes the grouped strategy, `fallback`."""

    def __init__(self, ctx, cache, fallback):
        self.ctx, self.cache, self.fallback = ctx, cache, fallback
        self.rows = torch.arange(ctx.store.num_experts, device=ctx.device)

    def forward(self, layer: int, x, topk_ids, topk_w) -> torch.Tensor:
        store = self.ctx.store
        bank, fmt = store.bank(layer), store.fmt.for_layer(layer)
        if not grouped_bank_ready(x, bank, fmt):
            return self.fallback.forward(layer, x, topk_ids, topk_w)
        count_pairs(self.ctx.book, layer, topk_ids)
        self.cache.pair_rows(layer, x, topk_ids)  # hits, expert calls, GPU experts: the call's distinct experts
        return self.moe(x, topk_ids, topk_w, bank, fmt)

    def moe(self, x, topk_ids, topk_w, bank: dict, fmt) -> torch.Tensor:
        """The layer call's routed experts from the device bank (every expert's row is its id)."""
        from .grouped import grouped_moe

        return grouped_moe(x, topk_ids, topk_w, bank, self.rows, fmt,
                           pair_dtype=torch.promote_types(x.dtype, topk_w.dtype))

    def begin_step(self, info: dict, decode: bool) -> None:
        """The fallback's step hooks."""
        self.fallback.begin_step(info, decode)

    def end_step(self, decode: bool) -> None:
        self.fallback.end_step(decode)


def resident_prefill(ctx, comp, cache, host, decode):
    """The grouped computation where the experts are: the decode strategy itself when it is grouped (one
    placement, one set of step hooks), else a grouped strategy of its own — behind the sync-free device path
    where every expert is a row of the device banks (fused on the pair path)."""
    if isinstance(decode, GroupedDecode):
        return decode
    grouped = DECODERS["grouped"](ctx, comp, cache, host)
    if isinstance(cache, BankExperts) and cache.on_device:
        return DeviceBankPrefill(ctx, cache, grouped)
    return grouped


PREFILLS = {  # Composition.prefill -> builder(ctx, composition, cache, host compute, decode strategy)
    "resident": resident_prefill,
    "streamed": lambda ctx, comp, cache, host, decode: StreamedPrefill(ctx, cache),
}
