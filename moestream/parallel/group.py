"""This process's rank of a tensor-parallel group: the collectives of the sharded model, the command
channel from rank 0, and the hooks `Engine` calls to build a rank's share of the model.

Two process groups: `group` carries activations (NCCL on GPU, gloo on CPU); `ctrl`, always gloo,
carries rank 0's commands (the step to run, as a pickled object on the host, so step metadata never
waits on a GPU stream). A worker waits on `ctrl` while the server is idle, hence its long timeout.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

STORE_TIMEOUT = timedelta(minutes=5)
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # one forward step; NCCL's watchdog ends a hung rank after it
IDLE_TIMEOUT = timedelta(days=365)  # a worker waiting for the next command


@dataclass
class TPRank:
    rank: int
    size: int
    backend: str  # "nccl" | "gloo"
    group: Any
    ctrl: Any

    # ---- collectives of the sharded model ------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank 0's columns first."""
        t = t.contiguous()
        if self.backend == "nccl":
            out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
            dist.all_gather_into_tensor(out, t, group=self.group)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(t) for _ in range(self.size)]
            dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=-1)

    # ---- rank 0's commands -----------------------------------------------------------------
    def broadcast(self, obj=None):
        """Rank 0 sends obj; every other rank returns what rank 0 sent."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    def all_gather_object(self, obj) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    # ---- hooks Engine calls (engine/engine.py) --------------------------------------------------
    def local_config(self, cfg):
        from .shard import local_config

        return local_config(cfg, self.size)

    def local_hardware(self, hw):
        """Ranks share the host: each plans with its part of host memory (and, on CPU, of the budget)."""
        n = self.size
        out = dataclasses.replace(hw, host_total_bytes=hw.host_total_bytes // n,
                                  host_available_bytes=hw.host_available_bytes // n)
        return dataclasses.replace(out, free_bytes=hw.free_bytes // n) if hw.device == "cpu" else out

    def expert_store(self, moe_layers, num_experts, hidden, inter, fmt, device):
        from .experts import ShardedExpertStore

        return ShardedExpertStore(moe_layers, num_experts, hidden, inter, fmt, device, self.rank, self.size)

    def shard(self, model):
        from .shard import shard_model

        return shard_model(model, self)


def join(rank: int, size: int, store, backend: str) -> TPRank:
    """Join the group whose rendezvous is `store` (a TCPStore rank 0 serves on localhost)."""
    kw = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT, **kw)
    ctrl = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TPRank(rank, size, backend, dist.group.WORLD, ctrl)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
