"""Moving expert weights host -> device: slot pools, a copy stream with events, the prefill double buffer.

On CUDA, copies run on their own stream. Each pool row has a `ready` event (recorded after the last
copy into it; compute waits on it before reading) and a `release` event (recorded on the compute
stream after the last computation that read it; the copy stream waits on it before overwriting).
So compute waits only for the rows it reads, and a copy never races a kernel still reading the row
it replaces, although the bookkeeping (residency) runs ahead of the GPU.
On CPU there are no streams: copies are synchronous and every event is None; the code path is the
same, so tests on CPU exercise the real bookkeeping, copies and counts.
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from .compute import WeightRef
from .stats import StatsBook
from .store import ExpertStore


class Sync:
    """Copy stream and events on CUDA; no-ops on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device=device) if self.cuda else None

    def copy_scope(self):
        return torch.cuda.stream(self.copy_stream) if self.cuda else nullcontext()

    def event(self, on_copy: bool, timing: bool = False):
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(self.copy_stream if on_copy else torch.cuda.current_stream(self.device))
        return ev

    def compute_waits(self, events) -> None:
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            for ev in {id(e): e for e in events if e is not None}.values():
                stream.wait_event(ev)

    def copy_waits(self, events) -> None:
        if self.cuda:
            for ev in {id(e): e for e in events if e is not None}.values():
                self.copy_stream.wait_event(ev)


class Pool:
    """`n` rows of expert arrays on the device: the slot cache, or one half of the prefill buffer."""

    def __init__(self, store: ExpertStore, n: int, device: torch.device):
        specs = store.fmt.arrays(store.hidden, store.inter)
        self.n, self.fmt = n, store.fmt
        # same per-array specs as the host banks: quantized formats copy and keep compressed rows
        self.arrays = {name: torch.empty((n, *shape), dtype=dtype, device=device)
                       for name, (shape, dtype) in specs.items()}
        self.ready: list = [None] * n
        self.release: list = [None] * n

    def ref(self, row: int, layer: int) -> WeightRef:
        """The expert of `layer` held in `row` (per-layer GGUF types decode with that layer's format)."""
        return WeightRef(self.arrays, row, self.fmt.for_layer(layer))

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self.arrays.values())


def _runs(items: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """(layer, expert, row) items as (layer, first expert, first row, n) runs of consecutive experts into
    consecutive rows (a prefill half loads a layer's experts in ascending order: mostly one run)."""
    runs: list[list[int]] = []
    for lay, e, row in items:
        last = runs[-1] if runs else None
        if last is not None and last[0] == lay and last[1] + last[3] == e and last[2] + last[3] == row:
            last[3] += 1
        else:
            runs.append([lay, e, row, 1])
    return [tuple(r) for r in runs]


class Copier:
    """Issues expert copies into pools on the copy stream and records bytes and time per layer."""

    def __init__(self, store: ExpertStore, sync: Sync, stats: StatsBook):
        self.store, self.sync, self.stats = store, sync, stats
        self._timed: list[tuple[int, object, object]] = []  # (layer, start event, end event) not yet read

    def copy(self, pool: Pool, items: list[tuple[int, int, int]]) -> None:
        """items: (layer, expert, pool row). One call copies one layer's experts."""
        if not items:
            return
        layer = items[0][0]
        with self.sync.copy_scope():
            self.sync.copy_waits(pool.release[row] for _, _, row in items)
            t0, start = time.perf_counter(), self.sync.event(True, timing=True)
            for lay, e, row, n in _runs(items):
                for name, dst in pool.arrays.items():
                    src = self.store.banks[name][lay][e:e + n]
                    if dst.shape[1:] == src.shape[1:]:  # n experts in a row, n rows in a row: one copy
                        dst[row:row + n].copy_(src, non_blocking=True)
                        continue
                    for i in range(n):  # rows sized for a larger per-layer type take this layer's bytes at their front
                        dst[row + i, :src.shape[1]].copy_(src[i], non_blocking=True)
            end = self.sync.event(True, timing=True)
        for _, _, row in items:
            pool.ready[row] = end
        s = self.stats[layer]
        s.bytes_h2d += len(items) * self.store.bytes_per_expert(layer)
        s.copies += len(items)
        if end is None:
            s.copy_s += time.perf_counter() - t0
        else:
            self._timed.append((layer, start, end))
            self.fold(block=False)

    def fold(self, block: bool) -> None:
        """Add finished CUDA copy times to the stats (block: wait for all of them)."""
        keep = []
        for layer, start, end in self._timed:
            if block or end.query():
                end.synchronize()
                self.stats[layer].copy_s += start.elapsed_time(end) / 1e3
            else:
                keep.append((layer, start, end))
        self._timed = keep

    def wait_ready(self, pool: Pool, rows) -> None:
        self.sync.compute_waits(pool.ready[r] for r in rows)

    def released(self, pool: Pool, rows) -> None:
        ev = self.sync.event(False)
        for r in rows:
            pool.release[r] = ev


class PrefillStreamer:
    """Two halves of `per_half` rows, outside the LRU: prefill chunks stream the experts they route
    to (and that are not already cached) through them, so the decode working set is not flushed.

    Loads alternate halves strictly; a caller loads batch i+2 only after computing batch i, so a
    half is never refilled before its previous batch was computed (the release events order it on
    the GPU). `staged` is a look-ahead load of the next layer's predicted experts.
    """

    def __init__(self, store: ExpertStore, copier: Copier, per_half: int, device: torch.device):
        self.per_half = per_half
        self.halves = [Pool(store, per_half, device), Pool(store, per_half, device)]
        self.copier = copier
        self.turn = 0
        self.staged: tuple[int, Pool, dict[int, int]] | None = None

    def load(self, layer: int, experts: list[int]) -> tuple[Pool, dict[int, int]]:
        if len(experts) > self.per_half:
            raise ValueError(f"{len(experts)} experts exceed the prefill half of {self.per_half} rows")
        pool = self.halves[self.turn]
        self.turn ^= 1
        rows = {e: i for i, e in enumerate(experts)}
        self.copier.copy(pool, [(layer, e, i) for e, i in rows.items()])
        return pool, rows

    def take_staged(self, layer: int) -> tuple[Pool, dict[int, int]] | None:
        staged, self.staged = self.staged, None
        if staged is None or staged[0] != layer:
            return None
        return staged[1], staged[2]

    def nbytes(self) -> int:
        return sum(h.nbytes() for h in self.halves)
