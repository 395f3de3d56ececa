"""Expert-runtime statistics, per MoE layer and in total.

hits / misses     decode-path experts found in / missing from the slot cache (one count per distinct
                  expert per layer call; a fused runtime counts every expert as a hit)
evictions         slots taken from another expert (counted against the evicted expert's layer)
bytes_h2d, copies host -> device (slot pool or prefill buffer) bytes and expert copies; copy_s their time
gpu_experts       expert computations from device memory; cpu_experts: from host banks on CPU
cpu_s             seconds the CPU expert worker of a decode step spent computing (moe/bridge.py); of which
cpu_kernel_s      inside cpu_moe.run (argument checks and the compiled layer call; the rest: the worker's Python)
cpu_wait_s        seconds the worker waited for the GPU's requests (the GPU's own work between its layer calls and the
                  post's way to host memory; a step's first layer also waits for the step to reach it)
cpu_handoff_s     seconds from seeing a request to the layer call and from its end to the answer (the compiled worker)
expert_calls      distinct experts routed per layer call, summed: == gpu_experts + cpu_experts always
prefetch_*        issued (copies started), hits (routed and resident thanks to a prefetch),
                  unused (prefetched and not routed by the layer it was predicted for)
prefill_*         prefill chunks: experts used from the slot cache (resident) or streamed through the
                  double buffer (streamed, of which lookahead_used were loaded ahead by prediction
                  out of lookahead issued); they do not touch hits/misses or the LRU order
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class LayerStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_h2d: int = 0
    copies: int = 0
    copy_s: float = 0.0
    gpu_experts: int = 0
    cpu_experts: int = 0
    cpu_s: float = 0.0
    cpu_kernel_s: float = 0.0
    cpu_wait_s: float = 0.0
    cpu_handoff_s: float = 0.0
    expert_calls: int = 0
    routed: int = 0  # (token, expert) pairs
    tokens: int = 0
    prefetch_issued: int = 0
    prefetch_hits: int = 0
    prefetch_unused: int = 0
    prefill_resident: int = 0
    prefill_streamed: int = 0
    prefill_lookahead: int = 0  # experts of layer l+1 streamed ahead while layer l computed
    prefill_lookahead_used: int = 0

    def add(self, other: "LayerStats") -> None:
        for name in _FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))


_FIELDS = tuple(f.name for f in fields(LayerStats))


def hit_rate(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None


class StatsBook:
    """Counters plus a short history of decode steps for the per-batch log line."""

    def __init__(self, layers: list[int]):
        self.layers = {layer: LayerStats() for layer in layers}
        self._step_start = (0, 0)
        self.last_step: dict | None = None  # hits/misses of the last finished decode step
        self.window: list[tuple[int, int]] = []  # (hits, misses) of the last decode steps
        self.residency = None  # when set, hits/misses/evictions are read from its counters
        # counts kept off the host (device tensors: the pair path's counters and moe/device_cache.py; the CPU
        # bridge's worker): callables -> {layer: {field: count}}, added to the host counts of the same fields
        # whenever the book is read (each part of a runtime that keeps such counts adds its own)
        self.counters: list = []
        self._steps = 0  # decode steps seen (device counters are read every SAMPLE_EVERY of them)

    def _sync(self) -> None:
        if self.residency is None:
            return
        for layer, c in self.residency.counts.items():
            s = self.layers[layer]
            s.hits, s.misses, s.evictions = c.hits, c.misses, c.evictions

    def __getitem__(self, layer: int) -> LayerStats:
        return self.layers[layer]

    def merged(self) -> dict[int, LayerStats]:
        """Per layer: host counts plus the ones kept off the host (`counters`)."""
        self._sync()
        if not self.counters:
            return self.layers
        out = {layer: LayerStats(**asdict(s)) for layer, s in self.layers.items()}
        for counts in self.counters:
            for layer, extra in counts().items():
                s = out[layer]
                for name, v in extra.items():
                    setattr(s, name, getattr(s, name) + v)
        return out

    def total(self) -> LayerStats:
        t = LayerStats()
        for s in self.merged().values():
            t.add(s)
        return t

    SAMPLE_EVERY = 8  # decode steps between reads of device-side counters (each read waits for the GPU)

    def _hits_misses(self) -> tuple[int, int]:
        """Hits and misses over all layers (what a step's hit rate needs; cheaper than total() on the host)."""
        if self.counters:
            t = self.total()
            return t.hits, t.misses
        self._sync()
        return sum(s.hits for s in self.layers.values()), sum(s.misses for s in self.layers.values())

    def begin_step(self) -> None:
        if self.counters:
            return  # sampled in end_step
        self._step_start = self._hits_misses()

    def end_step(self, decode: bool) -> None:
        if self.counters:
            if not decode:
                return
            self._steps += 1
            if self._steps % self.SAMPLE_EVERY:
                return
        hits, misses = self._hits_misses()
        h, m = hits - self._step_start[0], misses - self._step_start[1]
        if self.counters:
            self._step_start = (hits, misses)
        if decode and h + m:
            self.last_step = {"hits": h, "misses": m, "hit_rate": h / (h + m)}
            self.window = (self.window + [(h, m)])[-64:]

    def recent_hit_rate(self) -> float | None:
        return hit_rate(sum(h for h, _ in self.window), sum(m for _, m in self.window))

    def as_dict(self) -> dict:
        layers = self.merged()
        t = LayerStats()
        for v in layers.values():
            t.add(v)
        return {"total": asdict(t), "layers": {str(k): asdict(v) for k, v in layers.items()},
                "hit_rate": hit_rate(t.hits, t.misses), "recent_hit_rate": self.recent_hit_rate(),
                "last_step": self.last_step}
