"""Routed-expert computation: `(x, route, weights) -> y`, on the compute device and on CPU threads.

Shapes: x [T, H]; topk_ids, topk_w [T, k]; one expert's arrays gate_up [2I, H], down [H, I] (a
quantized format computes from its compressed rows through `ExpertFormat.expert_mlp`, dequantizing
tile by tile where the rows are). Decode on CUDA uses moe/pairs.py instead (no host sync).

Every placement computes per-expert partial outputs `{expert: [n_e, H]}` wherever the expert's weights
are (slot pool, prefill buffer, device bank or host bank) and `accumulate` sums them into y in
ascending expert order on the compute device. Same ops on bit-identical weights in the same order is
why every backend gives exactly fused's tokens on one device.

"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .formats import ExpertFormat, expert_mlp


@dataclass(frozen=True)
class WeightRef:
    """Expert weights at row `index` of every array in `bank` (name -> [N, ...] tensor), stored in
    `fmt` (None: dense gate_up/down); `partial_outputs` computes through `fmt.expert_mlp`."""

    bank: dict
    index: int
    fmt: ExpertFormat | None = None

    def arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense gate_up, down of the expert."""
        return self.bank["gate_up"][self.index], self.bank["down"][self.index]


@dataclass
class RouteGroups:
    """The (token, k) pairs of one layer call sorted by expert. experts/counts are host lists."""

    experts: list[int]
    counts: list[int]
    rows: torch.Tensor  # [T*k] token row of each pair, grouped by expert
    pos: torch.Tensor  # [T*k] k position of each pair
    starts: list[int]

    @classmethod
    def of(cls, topk_ids: torch.Tensor) -> "RouteGroups":
        flat = topk_ids.flatten()
        order = torch.argsort(flat, stable=True)
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        k = topk_ids.shape[1]
        counts_l = counts.tolist()  # the one host sync of a layer call
        starts = [0]
        for c in counts_l[:-1]:
            starts.append(starts[-1] + c)
        return cls(experts.tolist(), counts_l, order // k, order % k, starts)

    def members(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.starts[i]
        return self.rows[s:s + self.counts[i]], self.pos[s:s + self.counts[i]]

    def index(self) -> dict[int, int]:
        return {e: i for i, e in enumerate(self.experts)}

    def to(self, device: torch.device) -> "RouteGroups":
        return RouteGroups(self.experts, self.counts, self.rows.to(device), self.pos.to(device), self.starts)


def partial_outputs(x: torch.Tensor, topk_w: torch.Tensor, groups: RouteGroups,
                    refs: dict[int, WeightRef]) -> dict[int, torch.Tensor]:
    """w * mlp_e(x rows routed to e) for each expert in refs (the torch grouped loop)."""
    where = groups.index()
    out = {}
    for e, ref in refs.items():
        rows, pos = groups.members(where[e])
        if ref.fmt is not None:  # the format's own SwiGLU: quantized rows are decoded tile by tile
            y = ref.fmt.expert_mlp(x[rows], {name: a[ref.index] for name, a in ref.bank.items()})
        else:
            y = expert_mlp(x[rows], *ref.arrays())
        out[e] = y * topk_w[rows, pos, None]
    return out


def accumulate(x: torch.Tensor, groups: RouteGroups, partials: dict[int, torch.Tensor]) -> torch.Tensor:
    """y [T, H]: partials summed in ascending expert order. Invariant: each routed expert exactly once."""
    if sorted(partials) != groups.experts:
        raise RuntimeError(f"expert runtime bug: computed experts {sorted(partials)} != routed {groups.experts}")
    out = torch.zeros_like(x)
    for i, e in enumerate(groups.experts):
        out.index_add_(0, groups.members(i)[0], partials[e].to(device=out.device, dtype=out.dtype))
    return out


def moe_reference(x, topk_ids, topk_w, gate_up, down) -> torch.Tensor:
    """The oracle: all experts from one stacked bank."""
    groups = RouteGroups.of(topk_ids)
    bank = {"gate_up": gate_up, "down": down}
    refs = {e: WeightRef(bank, e) for e in groups.experts}
    return accumulate(x, groups, partial_outputs(x, topk_w, groups, refs))


class DeviceExperts:
    """Grouped computation on the compute device over the slots (or bank rows) a step uses."""

    def compute(self, x, topk_w, groups: RouteGroups, refs: dict[int, WeightRef]) -> dict[int, torch.Tensor]:
        return partial_outputs(x, topk_w, groups, refs)


def physical_cores() -> int:
    """Physical cores this process may run on (SMT siblings counted once)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
    seen = set()
    for c in cpus:
        path = f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list"
        try:
            with open(path) as f:
                seen.add(f.read().strip())
        except OSError:
            seen.add(str(c))
    return max(1, len(seen))


class CpuExperts:
    """Experts computed by CPU threads straight from the host banks (no copies of the weights).

    One worker thread runs the torch ops (which release the GIL), so the caller keeps issuing
    device work while the CPU computes; torch's intra-op pool gives the `threads` cores. A C++/ISA
    kernel can replace `_run` without changing callers.
    """

    def __init__(self, threads: int):
        self.threads = threads or physical_cores()
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)  # process-wide: torch has one intra-op pool
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moestream-cpu-experts")

    def submit(self, x: torch.Tensor, topk_w: torch.Tensor, groups: RouteGroups,
               refs: dict[int, WeightRef]) -> Future:
        """x/topk_w on any device; returns a future of {expert: partial on CPU}."""
        if not refs:
            done: Future = Future()
            done.set_result({})
            return done
        x_h, w_h, g_h = x.to("cpu"), topk_w.to("cpu"), groups.to(torch.device("cpu"))
        return self._pool.submit(self._run, x_h, w_h, g_h, refs)

    @staticmethod
    def _run(x, topk_w, groups, refs):
        with torch.inference_mode():
            return partial_outputs(x, topk_w, groups, refs)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
