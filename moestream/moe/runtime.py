"""The one interface the model calls for routed experts, and the registry of placement policies.

    forward(layer, x, topk_ids, topk_w) -> y      begin_step(info) / end_step()      capturable(info)
    stats() -> dict                               step_hit_rate()                    resize(cache_slots)
    routed(layer, x, topk_ids) -> topk_ids        (the model passes each route through it: `tap`)

Adding a policy is one class (moe/policies.py) and one `register` call; models, scheduler and the
engine do not change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .compute import RouteGroups
from .stats import StatsBook
from .store import ExpertStore


@dataclass(frozen=True)
class RuntimeOptions:
    """What a policy needs from the plan (moe/planner.py)."""

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


class ExpertRuntime:
    name = "base"

    def __init__(self, store: ExpertStore, device: torch.device, options: RuntimeOptions):
        self.store, self.device, self.options = store, device, options
        self.book = StatsBook(store.moe_layers)
        self.prefill_mode = False
        self.routers: dict[int, Callable] = {}
        moe = store.moe_layers
        self.next_layer = {a: b for a, b in zip(moe, moe[1:])}
        # sees (and may replace) every layer call's top-k ids: moe/trace.py's recorder or forcer; None: no tap
        self.tap = None

    # ---- the interface -----------------------------------------------------------------
    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError  # every registered policy implements it

    def routed(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The route the layer call computes with: the router's, or the tap's (moe/trace.py); x is the
        layer's input (a recorder applies the next layer's router to it: the prefetcher's prediction)."""
        tap = self.tap
        return topk_ids if tap is None else tap(layer, x, topk_ids)

    def attach_tap(self, tap) -> None:
        self.tap = tap
        if tap is not None:
            tap.bind(self)

    def attach_routers(self, routers: dict[int, Callable]) -> None:
        """layer -> callable(x [T, H]) returning (topk ids, weights, ...): used to predict experts."""
        self.routers = dict(routers)

    def begin_step(self, info: dict | None = None) -> None:
        self.prefill_mode = not (info or {}).get("decode", True)
        self.book.begin_step()
        if self.tap is not None:
            self.tap.begin_step(info or {})

    def end_step(self) -> None:
        self.book.end_step(decode=not self.prefill_mode)
        if self.tap is not None:
            self.tap.end_step()

    def capturable(self, info: dict | None = None) -> bool:
        """True when a decode step touches no host state that depends on the route (no host sync), so
        the engine may record it as a CUDA graph: the pair kernels of fused and offload."""
        return False

    def begin_graph_step(self) -> None:
        """The device-side part of begin_step, recorded inside a captured decode step."""

    def resize(self, cache_slots: int) -> None:
        raise NotImplementedError(f"the {self.name} backend has no expert cache to resize")

    def stats(self) -> dict:
        options = {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v)
                   for k, v in self.options.__dict__.items()}  # JSON-safe: served at /v1/stats
        store = self.store
        hits = self.expert_hits()
        extra = {"expert_hits": {str(k): v for k, v in hits.items()}} if hits is not None else {}
        return {"backend": self.name, **self.book.as_dict(), "options": options, **extra,
                "num_experts": store.num_experts,
                "bytes_per_expert": {str(layer): store.bytes_per_expert(layer) for layer in store.moe_layers}}

    # ---- a CPU decode step's MoE block in one compiled call (models/cpu_decode.py) ----------------------
    def host_layer_table(self, layer: int):
        """(addresses [E, 3] of every expert's gate/up/down, (gate, up, down) ggml type ids, I) when this runtime
        computes every routed expert of `layer` on the CPU from its host bank in a format the kernels read, so
        a CPU decode step may run the whole block in one call; None otherwise (the default)."""
        return None

    def book_host_call(self, layer: int, ids: np.ndarray) -> None:
        """The statistics of a layer call made outside `forward` (ids [T, k], the route it computed)."""
        experts = np.unique(ids)
        s = self.book[layer]
        s.tokens += ids.shape[0]
        s.routed += ids.size
        s.expert_calls += len(experts)
        self._book_host_experts(layer, experts)

    def _book_host_experts(self, layer: int, experts: np.ndarray) -> None:
        pass

    def expert_hits(self) -> dict[int, list[int]] | None:
        """layer -> hits of each expert (decode-path lookups that found it resident); None: not counted."""
        return None

    def step_hit_rate(self) -> float | None:
        """Hit rate of the last decode step (None before the first one)."""
        return self.book.last_step["hit_rate"] if self.book.last_step else None

    def close(self) -> None:
        pass

    # ---- helpers for policies ----------------------------------------------------------
    def _count_pairs(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Host-side counts of a pair-path call (shapes only: no sync; skipped while recording a graph,
        a replay is counted by the engine through count_replay)."""
        if topk_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        s = self.book[layer]
        s.tokens += topk_ids.shape[0]
        s.routed += topk_ids.numel()

    def count_replay(self, num_tokens: int, top_k: int) -> None:
        for layer in self.store.moe_layers:
            s = self.book[layer]
            s.tokens += num_tokens
            s.routed += num_tokens * top_k

    def _count(self, layer: int, topk_ids: torch.Tensor, groups: RouteGroups) -> None:
        s = self.book[layer]
        s.tokens += topk_ids.shape[0]
        s.routed += topk_ids.numel()
        s.expert_calls += len(groups.experts)

    def _predict(self, layer: int, x: torch.Tensor, limit: int) -> list[int]:
        """Experts the router of `layer` picks for x, most-routed first, at most `limit`."""
        router = self.routers.get(layer)
        if router is None or limit <= 0:
            return []
        ids = router(x)[0].flatten()
        experts, counts = torch.unique(ids, return_counts=True)
        order = torch.argsort(counts, descending=True, stable=True)
        return experts[order][:limit].tolist()


RUNTIMES: dict[str, type[ExpertRuntime]] = {}


def register(cls: type[ExpertRuntime]) -> type[ExpertRuntime]:
    RUNTIMES[cls.name] = cls
    return cls


def build_runtime(name: str, store: ExpertStore, device: torch.device,
                  options: RuntimeOptions | None = None) -> ExpertRuntime:
    from . import policies  # noqa: F401  (registers the policies)

    if name not in RUNTIMES:
        raise ValueError(f"unknown MoE backend {name!r}; available: {', '.join(sorted(RUNTIMES))}")
    return RUNTIMES[name](store, device, options or RuntimeOptions())
