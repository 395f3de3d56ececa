"""hybrid's fetch share, live: the part of each decode layer call's misses fetched over PCIe (the rest is
computed by the CPU worker), set from the rates measured in the running decode steps.

A layer call's misses finish together when f * A / B_pcie = (1 - f) * A / B_cpu, i.e. f = B_pcie /
(B_pcie + B_cpu). B_cpu is what the CPU worker achieves inside the steps (expert bytes it computed over
the seconds it was busy: CpuBridge.cpu_experts / cpu_seconds), which is what an isolated benchmark
misjudged (the worker shares the machine with the launching thread and waits on every layer's request);
B_pcie is the pinned host-to-device rate (`moestream bench bw`, or a short copy measured here).

The share lives in a float32 device scalar that the route kernel reads at every call
(device_cache.route with a tensor fraction), so recorded CUDA graphs follow it with no re-recording.
When the CPU is slow the share goes to 1 and hybrid fetches every miss, as offload does; until the CPU
has computed enough to be measured, the share is lowered a little once per window (a start-up probe);
windows with too little CPU work after that keep the share.

A CPU layer call also has a fixed cost the bandwidth split does not see (waking the worker, grouping the
pairs, the call itself: tens to hundreds of µs), and a layer call's misses are few (a handful of experts at
batch 1), so giving the CPU even one expert can make the call slower than fetching them all. The worker
reports the seconds of its calls that computed exactly one expert; when that exceeds what PCIe needs for
the rest of an average call's misses, the share is set to 1 (hybrid then runs as offload: measured on the
H200, hybrid decoded 60 / 42 / 38 tok/s where offload decoded 100 / 62 / 47 with the bandwidth split alone).
It stays there: with no CPU work there is nothing new to measure.
"""
from __future__ import annotations

import time

import torch

MIN_BUSY_S = 0.002  # CPU seconds a window must hold before its rate is believed
PROBE = 0.05  # share given back to the CPU by a window that measured nothing
MAX_SHARE = 0.98


def split(pcie_gbs: float, cpu_gbs: float) -> float:
    """f = pcie / (pcie + cpu), in [0, MAX_SHARE] (1 - MAX_SHARE keeps the CPU measured)."""
    if pcie_gbs <= 0 and cpu_gbs <= 0:
        return 0.5
    return min(MAX_SHARE, pcie_gbs / (pcie_gbs + max(cpu_gbs, 0.0)))


class LiveShare:
    def __init__(self, device: torch.device, initial: float, pcie_gbs: float, every: int = 8):
        self.value = min(max(initial, 0.0), MAX_SHARE)
        self.tensor = torch.full((), self.value, dtype=torch.float32, device=device)
        self.pcie_gbs = pcie_gbs or measure_pcie_gbs(device)
        self.every, self.steps = every, 0
        self.cpu_gbs: float | None = None
        self._mark = (0.0, 0.0)  # the worker's (bytes, busy seconds) at the last update
        self._calls = (0, 0.0, 0, 0)  # (single-expert calls, their seconds, misses, layer calls) at the last update
        self.one_expert_s: float | None = None  # mean seconds of a CPU call computing one expert
        self.misses_per_call: float | None = None
        self.cpu_unhelpful = False  # the fixed cost of a CPU call exceeds fetching over PCIe: share 1

    def observe(self, cpu_bytes: float, cpu_s: float, single_calls: int = 0, single_s: float = 0.0,
                misses: int = 0, layer_calls: int = 0, expert_bytes: float = 0.0) -> None:
        """After a decode step: the worker's cumulative expert bytes and busy seconds; optionally its
        cumulative single-expert calls and their seconds, the runtime's cumulative misses and layer calls,
        and the bytes of one expert (for the fixed-cost rule in the module doc)."""
        self.steps += 1
        if self.steps % self.every or self.cpu_unhelpful:
            return
        c = self._calls
        if layer_calls > c[3]:
            self.misses_per_call = (misses - c[2]) / (layer_calls - c[3])
        if single_calls > c[0]:
            self.one_expert_s = (single_s - c[1]) / (single_calls - c[0])
        self._calls = (single_calls, single_s, misses, layer_calls)
        if (self.one_expert_s is not None and self.misses_per_call is not None and expert_bytes > 0
                and self.pcie_gbs > 0):
            rest = max(self.misses_per_call - 1.0, 0.0) * expert_bytes / (self.pcie_gbs * 1e9)
            if self.one_expert_s >= rest:
                self.cpu_unhelpful = True
                self._set(1.0)
                return
        db, ds = cpu_bytes - self._mark[0], cpu_s - self._mark[1]
        if ds < MIN_BUSY_S:  # too little CPU work to measure: probe until a first rate, then keep the share
            if self.cpu_gbs is None:
                self._set(max(self.value - PROBE, 0.0))
            return
        self._mark = (cpu_bytes, cpu_s)
        self.cpu_gbs = db / ds / 1e9
        self._set(0.5 * self.value + 0.5 * split(self.pcie_gbs, self.cpu_gbs))  # smoothed over windows

    def _set(self, value: float) -> None:
        self.value = value
        self.tensor.fill_(value)

    def as_dict(self) -> dict:
        return {"fetch_share": round(self.value, 4), "pcie_gbs": round(self.pcie_gbs, 2),
                "cpu_busy_gbs": None if self.cpu_gbs is None else round(self.cpu_gbs, 2),
                "one_expert_call_us": None if self.one_expert_s is None else round(self.one_expert_s * 1e6, 1),
                "misses_per_call": None if self.misses_per_call is None else round(self.misses_per_call, 2),
                "cpu_unhelpful": self.cpu_unhelpful}


def measure_pcie_gbs(device: torch.device, chunk: int = 16 << 20, n: int = 8) -> float:
    """Pinned host-to-device GB/s over n chunks (0 off CUDA): ~3 ms on a PCIe 4/5 card."""
    if device.type != "cuda":
        return 0.0
    src = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(chunk, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(n):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return n * chunk / (time.perf_counter() - t) / 1e9
