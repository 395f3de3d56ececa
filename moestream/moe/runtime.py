"""The one interface the model calls for routed experts, and the registry of placement policies.

    forward(layer, x, topk_ids, topk_w) -> y     begin_step(info) / end_step()     stats()

Adding a policy is one class here (or in its own module) and one registry entry.
"""
from __future__ import annotations

from typing import Callable

import torch

from .compute import moe_reference
from .store import ExpertStore


class ExpertRuntime:
    name = "base"

    def __init__(self, store: ExpertStore, device: torch.device):
        self.store = store
        self.device = device
        self.layers: dict[int, dict[str, int]] = {layer: {"tokens": 0, "routed": 0} for layer in store.moe_layers}

    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def begin_step(self, info: dict | None = None) -> None:
        pass

    def end_step(self) -> None:
        pass

    def _count(self, layer: int, topk_ids: torch.Tensor) -> None:
        c = self.layers[layer]
        c["tokens"] += topk_ids.shape[0]
        c["routed"] += topk_ids.numel()

    def stats(self) -> dict:
        total = {"tokens": 0, "routed": 0}
        for c in self.layers.values():
            for k in total:
                total[k] += c[k]
        return {"backend": self.name, "total": total, "layers": {str(k): dict(v) for k, v in self.layers.items()}}


class FusedRuntime(ExpertRuntime):
    """Every expert resident on the compute device."""

    name = "fused"

    def forward(self, layer, x, topk_ids, topk_w):
        self._count(layer, topk_ids)
        gate_up, down = self.store.weights(layer)
        return moe_reference(x, topk_ids, topk_w, gate_up, down)


RUNTIMES: dict[str, Callable[..., ExpertRuntime]] = {"fused": FusedRuntime}


def build_runtime(name: str, store: ExpertStore, device: torch.device, **kwargs) -> ExpertRuntime:
    if name not in RUNTIMES:
        raise ValueError(f"unknown MoE backend {name!r}; available: {', '.join(sorted(RUNTIMES))}")
    return RUNTIMES[name](store, device, **kwargs)
