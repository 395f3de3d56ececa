"""Candidate expert-cache policies, replayed on routing traces next to the engine's and Belady's bound.

The candidates here are replay-only (not selectable with --moe-cache-policy): they plug into
`Residency` through the same policy interface (used / admitted / removed / victim) and are registered
in this process only. A candidate that beat lru by >= 10 points on the calibrated presets would move
into moestream/moe/residency.py; none has (benchmarks/RESULTS.md, issue 18).

    wscore   a window of the W x slots most recently used keys is never the victim; the others go in
             order of an exponentially decayed use count (half-life H x slots accesses): wlfu with
             lrfu's decayed counts instead of halved ones
    s3fifo   S3-FIFO: new keys enter a small FIFO (10 % of the slots); one used again while there moves to
             the main FIFO, the others are evicted and remembered in a ghost FIFO (a key coming back
             from it enters the main FIFO); the main FIFO gives each key up to 3 second chances
    arc      ARC: recency list T1 and frequency list T2 with ghosts B1 / B2; the target size of T1 adapts
             on ghost hits
    lquota   per-layer LRU partitions: layer l's share is proportional to its working set (its distinct
             experts among its last 512 accesses, ~64 calls of top-8); the victim is the LRU key of the
             layer most over its share

    PYTHONPATH=. python benchmarks/cache_policy_sweep.py --trace-dir /tmp/traces \
        --presets qwen36,qwen36-skewed,uniform --residency 0.1,0.3,0.6
(writes each preset's trace with `bench trace --tokens 1024` defaults if it is missing); with
--follow-ceiling, the share of lru's misses that any prefetch predicted from the previous layer's routing
could at most cover (the generator's cross-layer `follow` draws).
"""
from __future__ import annotations

import argparse
import heapq
import math
from collections import OrderedDict
from pathlib import Path

from moestream.moe import residency
from moestream.moe.replay import opt_hit_rate, replay


class WindowScorePolicy:
    name = "wscore"
    W = 0.5
    H = 8.0

    def __init__(self, num_slots: int):
        self.half_life = max(self.H * num_slots, 1.0)
        self.window_size = max(int(self.W * num_slots), 1)
        self.clock = 0
        self.score: dict = {}  # key -> log2 of its decayed count, scaled to clock 0 (never needs decaying)
        self.window: OrderedDict = OrderedDict()
        self.main: dict = {}  # key -> the score its heap entry was pushed with
        self.heap: list = []

    def used(self, key, count: bool = True) -> None:
        self.clock += 1
        if count:
            now, old = self.clock / self.half_life, self.score.get(key)
            self.score[key] = now if old is None else max(old, now) + math.log2(1 + 2.0 ** -abs(old - now))
        if key in self.window or key in self.main:
            self._to_window(key)

    def admitted(self, key) -> None:
        self._to_window(key)

    def removed(self, key) -> None:
        self.window.pop(key, None)
        self.main.pop(key, None)

    def _to_window(self, key) -> None:
        self.main.pop(key, None)
        self.window[key] = None
        self.window.move_to_end(key)
        while len(self.window) > self.window_size:
            old, _ = self.window.popitem(last=False)
            self.main[old] = s = self.score.get(old, -math.inf)
            heapq.heappush(self.heap, (s, old))
        if len(self.heap) > 4 * len(self.main) + 64:
            self.heap = [(s, k) for k, s in self.main.items()]
            heapq.heapify(self.heap)

    def victim(self, res):
        held, found = [], None
        while self.heap:
            s, key = heapq.heappop(self.heap)
            if self.main.get(key) != s:
                continue  # stale entry
            if key in res.pins:
                held.append((s, key))
                continue
            found = key
            break
        for entry in held:
            heapq.heappush(self.heap, entry)
        return found if found is not None else next((k for k in self.window if k not in res.pins), None)


class S3FifoPolicy:
    name = "s3fifo"
    SMALL = 0.1

    def __init__(self, num_slots: int):
        self.n = max(num_slots, 1)
        self.small_size = max(int(self.SMALL * num_slots), 1)
        self.small: OrderedDict = OrderedDict()
        self.main: OrderedDict = OrderedDict()
        self.ghost: OrderedDict = OrderedDict()
        self.freq: dict = {}

    def used(self, key, count: bool = True) -> None:
        if key in self.freq:
            self.freq[key] = min(self.freq[key] + 1, 3)

    def admitted(self, key) -> None:
        self.freq[key] = 0
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None

    def removed(self, key) -> None:
        self.freq.pop(key, None)
        self.main.pop(key, None)
        if key in self.small:
            del self.small[key]
            self.ghost[key] = None
            while len(self.ghost) > self.n:
                self.ghost.popitem(last=False)

    def victim(self, res):
        for _ in range(8 * self.n + 16):  # every key has at most 3 chances; pinned ones go round
            q = self.small if self.small and (len(self.small) >= self.small_size or not self.main) else self.main
            key = next(iter(q))
            if key in res.pins:
                q.move_to_end(key)
            elif q is self.small and self.freq[key] > 0:
                del self.small[key]
                self.main[key] = None
                self.freq[key] = 0
            elif q is self.main and self.freq[key] > 0:
                self.freq[key] -= 1
                self.main.move_to_end(key)
            else:
                return key
        return next((k for k in res.slot_of if k not in res.pins), None)


class ArcPolicy:
    name = "arc"

    def __init__(self, num_slots: int):
        self.c, self.p = num_slots, 0.0
        self.t1: OrderedDict = OrderedDict()
        self.t2: OrderedDict = OrderedDict()
        self.b1: OrderedDict = OrderedDict()
        self.b2: OrderedDict = OrderedDict()

    def used(self, key, count: bool = True) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)
        elif key in self.b1:
            self.p = min(self.c, self.p + max(len(self.b2) / max(len(self.b1), 1), 1))
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / max(len(self.b2), 1), 1))

    def admitted(self, key) -> None:
        ghost = key in self.b1 or key in self.b2
        self.b1.pop(key, None)
        self.b2.pop(key, None)
        (self.t2 if ghost else self.t1)[key] = None
        while len(self.b1) + len(self.t1) > self.c and self.b1:
            self.b1.popitem(last=False)
        while len(self.b1) + len(self.b2) + len(self.t1) + len(self.t2) > 2 * self.c and self.b2:
            self.b2.popitem(last=False)

    def removed(self, key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None

    def victim(self, res):
        first = self.t1 if self.t1 and (len(self.t1) > self.p or not self.t2) else self.t2
        for q in (first, self.t2 if first is self.t1 else self.t1):
            key = next((k for k in q if k not in res.pins), None)
            if key is not None:
                return key
        return None


class LayerQuotaPolicy:
    name = "lquota"
    WINDOW = 512  # a layer's working set: its distinct experts among its last WINDOW accesses

    def __init__(self, num_slots: int):
        self.held: dict = {}  # layer -> resident keys, least recently used first
        self.last: dict = {}  # layer -> {expert: its last access tick}, oldest first
        self.tick: dict = {}  # layer -> accesses so far

    def used(self, key, count: bool = True) -> None:
        layer, expert = key
        t = self.tick[layer] = self.tick.get(layer, 0) + 1
        last = self.last.setdefault(layer, OrderedDict())
        last[expert] = t
        last.move_to_end(expert)
        while last and next(iter(last.values())) <= t - self.WINDOW:
            last.popitem(last=False)
        held = self.held.setdefault(layer, OrderedDict())
        if key in held:
            held.move_to_end(key)

    def admitted(self, key) -> None:
        self.held.setdefault(key[0], OrderedDict())[key] = None

    def removed(self, key) -> None:
        self.held[key[0]].pop(key, None)

    def victim(self, res):
        ws = {layer: max(len(self.last.get(layer, ())), 1) for layer in self.held}
        total = sum(ws.values())
        over = sorted(self.held, key=lambda l: len(self.held[l]) - res.num_slots * ws[l] / total, reverse=True)
        for layer in over:
            key = next((k for k in self.held[layer] if k not in res.pins), None)
            if key is not None:
                return key
        return None


CANDIDATES = (WindowScorePolicy, S3FifoPolicy, ArcPolicy, LayerQuotaPolicy)


def follow_ceiling(trace, slots: int, policy: str = "lru") -> float:
    """The share of a policy's misses (batch-1 synthetic trace) whose expert is the generator's follow-map image
    of one of the previous layer's experts in the same token: the most a prefetch predicted from the previous
    layer's routing alone could cover on this trace, even knowing the map and prefetching all top-k images."""
    from moestream.moe import synth
    from moestream.moe.residency import Residency

    h = trace.header
    fmap = synth.follow_maps(synth.SynthParams(**h.params))
    res = Residency(slots, h.moe_layers, policy)
    misses = covered = 0
    for _, ids in trace.steps(decode_only=True):
        for i, layer in enumerate(h.moe_layers):
            images = set(fmap[i][ids[:, i - 1].ravel()].tolist()) if i else set()
            for _, fetch in res.rounds(layer, sorted(set(ids[:, i].ravel().tolist()))):
                misses += len(fetch)
                covered += sum(e in images for _, e, _ in fetch)
    return covered / max(misses, 1)


def trace_for(preset: str, directory: Path):
    from moestream.moe import synth
    from moestream.moe.trace import read_trace, write_trace

    path = directory / f"{preset}.trace"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        write_trace(path, synth.generate(synth.preset(preset, tokens=1024), name=f"synthetic:{preset}"))
    return read_trace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace-dir", default="/tmp/moestream-traces")
    ap.add_argument("--presets", default="qwen36,qwen36-skewed,uniform")
    ap.add_argument("--residency", default="0.1,0.3,0.6")
    ap.add_argument("--policies", default="lru,lfu,lrfu,wlfu,wscore,s3fifo,arc,lquota")
    ap.add_argument("--follow-ceiling", action="store_true",
                    help="instead: the share of lru's misses a perfect previous-layer predictor could cover")
    args = ap.parse_args()
    if args.follow_ceiling:
        for preset in args.presets.split(","):
            trace = trace_for(preset, Path(args.trace_dir))
            total = len(trace.header.moe_layers) * trace.header.num_experts
            shares = [100 * follow_ceiling(trace, round(float(f) * total)) for f in args.residency.split(",")]
            print(f"| {preset} | " + " | ".join(f"{x:.1f}%" for x in shares) + " |", flush=True)
        return
    for c in CANDIDATES:
        residency.POLICIES.setdefault(c.name, c)
    policies = args.policies.split(",")
    print("| trace | residency | " + " | ".join(policies) + " | Belady |")
    print("|---" * (len(policies) + 3) + "|")
    for preset in args.presets.split(","):
        trace = trace_for(preset, Path(args.trace_dir))
        total = len(trace.header.moe_layers) * trace.header.num_experts
        for frac in (float(x) for x in args.residency.split(",")):
            slots = round(frac * total)
            rates = [100 * replay(trace, slots, p).hit_rate for p in policies]
            best = max(rates)
            cells = [f"**{r:.1f}%**" if r == best else f"{r:.1f}%" for r in rates]
            print(f"| {preset} | {100 * frac:.0f}% | " + " | ".join(cells) + f" | {100 * opt_hit_rate(trace, slots):.1f}% |",
                  flush=True)


if __name__ == "__main__":
    main()
