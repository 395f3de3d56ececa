"""The one interface the model calls for routed experts, composed from swappable parts.

    forward(layer, x, topk_ids, topk_w) -> y      begin_step(info) / end_step()      capturable(info)
    stats() -> dict                               step_hit_rate()                    resize(cache_slots)
    routed(layer, x, topk_ids) -> topk_ids        (the model passes each route through it: `tap`)

An `ExpertRuntime` is three parts over one `Context` (store, device, options, statistics book, look-ahead):

    cache     where the device copies of experts live (moe/caches.py): none (fused: the store's device banks),
              host (a host-side `Residency` over a device pool, copies on the copy stream) or device
              (`DeviceSlotCache`: lookups, LRU and admission in device tensors)
    decode    how a decode layer call is computed (moe/strategies.py): pairs (the pair kernels, no host
              sync), grouped (pairs grouped by expert on the host, computed on the device and/or CPU threads)
              or bridge (the CPU's pairs answered through moe/bridge.py inside a graph-capturable step)
    prefill   how a prefill chunk is computed: resident (the grouped computation where the experts are) or
              streamed (through the prefill double buffer, outside the cache)

The backend names (`--moe-backend` fused / offload / cpu / hybrid) are compositions of these, picked in
one factory (moe/backends.py, `build_runtime`). A new placement or kernel is a new part there; models,
scheduler and the engine do not change.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .stats import StatsBook
from .store import ExpertStore


@dataclass(frozen=True)
class RuntimeOptions:
    """What a runtime needs from the plan (moe/planner.py)."""

    cache_slots: int = 0  # device expert slots (offload, hybrid)
    prefill_slots: int = 0  # rows per half of the prefill double buffer (0: prefill uses the decode path)
    cpu_threads: int = 0  # 0: one per physical core
    # predict layer l+1's experts with its router applied to layer l's input; off as EngineConfig.moe_prefetch
    prefetch: bool = False
    hybrid_fetch_fraction: float = 0.5  # share of a step's misses fetched over PCIe (rest: CPU)
    decode_kernel: str = "auto"  # pairs (moe/pairs.py, no host sync) | grouped (moe/compute.py) | auto
    max_pairs: int = 0  # most (token, expert) pairs of one decode layer call (max batch * top_k)
    act_dtype: torch.dtype | None = None  # the model's activations (None: the dense experts' dtype)
    pcie_gbs: float = 0.0  # pinned host-to-device GB/s from `bench bw` (0: hybrid measures it)
    cache_policy: str = "lru"  # victim choice of the slot cache (moe/residency.py POLICIES)


class Lookahead:
    """The next MoE layer of each layer, and the experts its router picks for this layer's input: what the
    decode prefetch, the prefill look-ahead and the routing recorder predict."""

    def __init__(self, moe_layers: list[int]):
        self.routers: dict[int, Callable] = {}
        self.next_layer = {a: b for a, b in zip(moe_layers, moe_layers[1:])}
        self.draft_layers: frozenset[int] = frozenset()  # MTP blocks' layers: not called in a main decode step

    def predict(self, layer: int, x: torch.Tensor, limit: int) -> list[int]:
        """Experts the router of `layer` picks for x, most-routed first, at most `limit`."""
        router = self.routers.get(layer)
        if router is None or limit <= 0:
            return []
        ids = router(x)[0].flatten()
        experts, counts = torch.unique(ids, return_counts=True)
        order = torch.argsort(counts, descending=True, stable=True)
        return experts[order][:limit].tolist()


class Part:
    """A swappable part of a runtime (cache or strategy): step hooks and close, none by default."""

    def begin_step(self, info: dict, decode: bool) -> None:
        """A step starts (info: the engine's; decode: not a prefill step)."""

    def end_step(self, decode: bool) -> None:
        """A step's work is issued."""

    def wait_step(self) -> None:
        """The caller is about to wait for the last issued step's results: a part whose CPU threads work during
        the step may make the caller wait by sleeping rather than spinning."""

    def finish_step(self) -> None:
        """The caller waited for the last issued step's results (raises what that step's own work raised)."""

    def close(self) -> None:
        """The runtime is done: threads and buffers go."""


@dataclass
class Context:
    """What every part of one runtime shares. `options` is replaced when the cache is resized."""

    store: ExpertStore
    device: torch.device
    options: RuntimeOptions
    book: StatsBook
    lookahead: Lookahead
    copier: object = None  # transfer.Copier of the runtimes with a device pool (None: fused)


class ExpertRuntime:
    """A cache, a decode strategy and a prefill strategy behind the model's interface (module doc). The
    parts' step hooks run in the order cache, prefill, decode at a step's start and the reverse at its end;
    a failure of the decode strategy's end (the CPU bridge) still ends the others and the book."""

    def __init__(self, name: str, ctx: Context, cache, decode, prefill, cpu=None, composition=None):
        self.name, self.ctx = name, ctx
        self.cache, self.decode, self.prefill = cache, decode, prefill
        self.cpu = cpu  # compute.CpuExperts of cpu and hybrid (closed last)
        self.composition = composition  # what the factory chose (backends.Composition)
        self.prefill_mode = False
        self.epoch = 0  # bumped by resize: recorded decode graphs point at the old pools
        # sees (and may replace) every layer call's top-k ids: moe/trace.py's recorder or forcer; None: no tap
        self.tap = None
        parts = []
        for part in (cache, prefill, decode):
            if all(part is not p for p in parts):
                parts.append(part)
        self._parts = parts

    # ---- what the parts share -------------------------------------------------------------
    store = property(lambda self: self.ctx.store)
    device = property(lambda self: self.ctx.device)
    options = property(lambda self: self.ctx.options)
    book = property(lambda self: self.ctx.book)
    copier = property(lambda self: self.ctx.copier)
    routers = property(lambda self: self.ctx.lookahead.routers)
    next_layer = property(lambda self: self.ctx.lookahead.next_layer)
    # the slot cache's host residency and device pool (None where the cache has none)
    residency = property(lambda self: getattr(self.cache, "residency", None))
    pool = property(lambda self: getattr(self.cache, "pool", None))
    bridge = property(lambda self: getattr(self.decode, "bridge", None))

    @property
    def pairs(self) -> bool:
        """Whether decode computes the device's pairs with the pair kernels (moe/pairs.py)."""
        return self.decode.device_pairs

    # ---- the interface -----------------------------------------------------------------
    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """y [T, H]: the layer's routed experts for x [T, H] and the route [T, k], by this step's strategy."""
        strategy = self.prefill if self.prefill_mode else self.decode
        return strategy.forward(layer, x, topk_ids, topk_w)

    def forward_beside(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor,
                       beside: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward's y, beside()): device work of the caller's that does not need y (a block's shared expert),
        issued where it hides best — between the CPU bridge's post and collect, while the worker computes the
        layer's experts (cpu, hybrid decode); after the routed experts elsewhere, as before."""
        run = None if self.prefill_mode else getattr(self.decode, "forward_beside", None)
        if run is not None:
            return run(layer, x, topk_ids, topk_w, beside)
        return self.forward(layer, x, topk_ids, topk_w), beside()

    def routed(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The route the layer call computes with: the router's, or the tap's (moe/trace.py); x is the
        layer's input (a recorder applies the next layer's router to it: the prefetcher's prediction)."""
        tap = self.tap
        return topk_ids if tap is None else tap(layer, x, topk_ids)

    def attach_tap(self, tap) -> None:
        """Route tap (moe/trace.py) for the following layer calls; None removes it."""
        self.tap = tap
        if tap is not None:
            tap.bind(self)

    def attach_routers(self, routers: dict[int, Callable], draft_layers=()) -> None:
        """layer -> callable(x [T, H]) returning (topk ids, weights, ...): used to predict experts; draft_layers:
        the MTP blocks' layers, which a main decode step does not call (nothing is copied ahead for them)."""
        self.ctx.lookahead.routers = dict(routers)
        self.ctx.lookahead.draft_layers = frozenset(draft_layers)

    def begin_step(self, info: dict | None = None) -> None:
        """A step starts: info {"decode", "graph", "num_tokens", "draft", "seqs"} from the engine (decode: no prompt
        rows; draft: an MTP drafter pass; seqs: the batch's SeqMeta rows, for a route tap that follows positions)."""
        self.prefill_mode = not (info or {}).get("decode", True)
        self.book.begin_step()
        if self.tap is not None:
            self.tap.begin_step(info or {})
        for part in self._parts:
            part.begin_step(info or {}, not self.prefill_mode)

    def end_step(self) -> None:
        """A step's work is issued: the decode strategy ends first, the other parts, the book and the tap in
        any case. Nothing here waits for the GPU: finish_step does, after the caller waited for the results."""
        decode = not self.prefill_mode
        last, *rest = reversed(self._parts)
        try:
            last.end_step(decode)
        finally:
            for part in rest:
                part.end_step(decode)
            self.book.end_step(decode=decode)
            if self.tap is not None:
                self.tap.end_step()

    def wait_step(self) -> None:
        """Before the caller waits for the last issued step's results (Part.wait_step)."""
        for part in self._parts:
            part.wait_step()

    def finish_step(self) -> None:
        """The caller has the last issued step's results (it waited for the GPU): the parts that work beside it
        (the bridge's CPU worker) are waited for and raise that step's failure."""
        for part in self._parts:
            part.finish_step()

    def capturable(self, info: dict | None = None) -> bool:
        """True when a decode step touches no host state that depends on the route (no host sync), so
        the engine may record it as a CUDA graph: the pairs and bridge strategies."""
        return self.decode.capturable

    def overlappable(self, rows: int) -> bool:
        """Whether the decode strategy lets a step of `rows` rows overlap the one before under `--overlap-schedule
        auto` where its steps may otherwise be stepwise (BridgeDecode.overlappable: hybrid holding its fetch form)."""
        ok = getattr(self.decode, "overlappable", None)
        return bool(ok and ok(rows))

    def graph_variant(self) -> int:
        """Which form the decode strategy gives this step's layer calls (0 but for hybrid's fetch-every-miss
        arm): part of a recorded decode graph's key."""
        return getattr(self.decode, "variant", 0)

    def begin_graph_step(self) -> None:
        """The device-side part of begin_step, recorded inside a captured decode step."""
        self.cache.begin_graph_step()

    def end_graph_step(self) -> None:
        """The device-side part of end_step, recorded inside a captured decode step before the capture ends: the
        cache's step counts, the decode strategy's side-stream work joined to the main stream (a capture with an
        unjoined fork is invalid; end_step itself runs after the replay, outside the graph)."""
        self.cache.end_graph_step()
        self.decode.join_side_stream()

    def resize(self, cache_slots: int) -> None:
        """New slot cache (cold) between steps; host banks and the prefill buffer are kept."""
        if not self.cache.has_slots:
            raise NotImplementedError(f"the {self.name} backend has no expert cache to resize")
        self.ctx.options = dataclasses.replace(self.options, cache_slots=cache_slots)
        self.cache.resize(cache_slots)
        self.epoch += 1

    def stats(self) -> dict:
        """/v1/stats' expert part: counters per layer and in total, options, per-expert hits, the cache's state."""
        if self.copier is not None:
            self.copier.fold(block=True)
        options = {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v)
                   for k, v in self.options.__dict__.items()}  # JSON-safe: served at /v1/stats
        store = self.store
        hits = self.expert_hits()
        extra = {"expert_hits": {str(k): v for k, v in hits.items()}} if hits is not None else {}
        out = {"backend": self.name, **self.book.as_dict(), "options": options, **extra,
               "num_experts": store.num_experts,
               "bytes_per_expert": {str(layer): store.bytes_per_expert(layer) for layer in store.moe_layers}}
        out.update(self.cache.stats(self.prefill.per_half))
        out.update(self.decode.stats())
        return out

    def check_integrity(self) -> None:
        """Raises when the cache's maps disagree (reads everything back: tests, not the serving path)."""
        self.cache.check_integrity()

    # ---- a CPU decode step's MoE block in one compiled call (models/cpu_decode.py) ----------------------
    def host_layer_table(self, layer: int):
        """(addresses [E, 3] of every expert's gate/up/down, (gate, up, down) ggml type ids, I) when this runtime
        computes every routed expert of `layer` on the CPU from its host bank in a format the kernels read, so
        a CPU decode step may run the whole block in one call; None otherwise (and with a routing tap)."""
        return None if self.tap is not None else self.decode.host_table(layer)

    def book_host_call(self, layer: int, ids: np.ndarray) -> None:
        """The statistics of a layer call made outside `forward` (ids [T, k], the route it computed)."""
        self.book_host_calls([layer], ids[None])

    def book_host_calls(self, layers: list[int], ids: np.ndarray) -> None:
        """book_host_call for several layers' calls at once (ids [len(layers), T, k]; a CPU decode step books every
        layer's route after its one compiled call): the distinct experts of each layer, ascending (np.unique's
        order), from one host list (a few routes: cheaper than numpy calls per layer)."""
        n, T, k = ids.shape
        book, decode = self.book, self.decode
        for layer, route in zip(layers, ids.reshape(n, T * k).tolist()):
            experts = sorted(set(route))
            s = book[layer]
            s.tokens += T
            s.routed += T * k
            s.expert_calls += len(experts)
            decode.book_host(layer, experts)

    def expert_hits(self) -> dict[int, list[int]] | None:
        """layer -> hits of each expert (decode-path lookups that found it resident); None: not counted."""
        return self.cache.expert_hits()

    def step_hit_rate(self) -> float | None:
        """Hit rate of the last decode step (None before the first one)."""
        return self.book.last_step["hit_rate"] if self.book.last_step else None

    def count_replay(self, num_tokens: int, top_k: int) -> None:
        """The host counts of a replayed decode graph (its layer calls counted nothing on the host)."""
        for layer in self.store.moe_layers:
            s = self.book[layer]
            s.tokens += num_tokens
            s.routed += num_tokens * top_k
        self.cache.count_replay(num_tokens, top_k)

    def close(self) -> None:
        """Stops the bridge's worker and the CPU experts' thread."""
        for part in reversed(self._parts):
            part.close()
        if self.cpu is not None:
            self.cpu.close()


BACKENDS: dict[str, Callable] = {}  # --moe-backend name -> its composition rule (moe/backends.py)


def register(name: str):
    """Decorator: `fn(options, store, device) -> backends.Composition` becomes the backend `name`."""
    def add(fn: Callable) -> Callable:
        """Records fn under `name`."""
        BACKENDS[name] = fn
        return fn
    return add


def build_runtime(name: str, store: ExpertStore, device: torch.device,
                  options: RuntimeOptions | None = None) -> ExpertRuntime:
    """The one factory: the backend's rule picks the parts (moe/backends.py), which are built over one Context."""
    from . import backends

    if name not in BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r}; available: {', '.join(sorted(BACKENDS))}")
    options = options or RuntimeOptions()
    return backends.build(name, BACKENDS[name](options, store, device), store, device, options)
