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

    def observe(self, cpu_bytes: float, cpu_s: float) -> None:
        """After a decode step: the worker's cumulative expert bytes and busy seconds."""
        self.steps += 1
        if self.steps % self.every:
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
                "cpu_busy_gbs": None if self.cpu_gbs is None else round(self.cpu_gbs, 2)}


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
