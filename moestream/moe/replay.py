"""Replay a routing trace (moe/trace.py) through the expert cache: hit rate, PCIe bytes, predicted tok/s.

The replay drives the engine's own bookkeeping, so its counts are the engine's:
    grouped   `Residency.rounds` per decode layer call (the grouped decode path: host cache, any policy)
    pairs     `DeviceSlotCache._route_torch` on CPU tensors (the CUDA decode path: step-granular LRU
              victims, misses without a victim staged through scratch rows)
With `prefetch` (a recorded trace: it holds the next layer's router top-k on each layer's input) the
replay runs the decode prefetcher of `--moe-prefetch on` too. Prefill steps are skipped: with a prefill buffer (every offload plan) they stream their experts and leave
the cache alone. A layer call counts each distinct routed expert once, as the engine does.

Predicted decode speed (`predict_tok_s`): a step takes the all-hit step time (1 / `full_tok_s`, the tok/s
per request with every expert resident at the trace's batch; 0 when unknown) plus its missed experts'
bytes over PCIe at `pcie_gbs` — no overlap of copies with compute, which is what the offload decode path
does today (misses are staged before the layer's GEMVs); prefetch copies are assumed hidden behind compute
(they count in the PCIe bytes, not in the step time: an upper bound on what prefetch buys).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from .lookahead import CoocPredictor
from .residency import POLICIES, Residency
from .trace import Trace

PATHS = ("grouped", "pairs")


@dataclass
class ReplayResult:
    policy: str
    slots: int
    hits: int
    misses: int
    decode_tokens: int
    decode_steps: int
    bytes_per_expert: int
    prefetch_issued: int = 0  # experts copied ahead by the prefetcher (replays with prefetch)
    prefetch_hits: int = 0  # of them, routed by the layer they were predicted for

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 1.0

    @property
    def bytes_per_token(self) -> float:
        """Demand misses' bytes per token (what a step waits for)."""
        return self.misses * self.bytes_per_expert / max(self.decode_tokens, 1)

    @property
    def pcie_bytes_per_token(self) -> float:
        """All bytes over PCIe per token: demand misses and prefetch copies."""
        return (self.misses + self.prefetch_issued) * self.bytes_per_expert / max(self.decode_tokens, 1)

    def predict_tok_s(self, pcie_gbs: float, full_tok_s: float | None = None) -> float | None:
        """Aggregate decode tok/s: tokens per step / (all-hit step time + a step's miss bytes / PCIe rate);
        full_tok_s: tok/s per request with every expert resident at the trace's batch (1 / step time)."""
        if not pcie_gbs:
            return None
        tokens_per_step = self.decode_tokens / max(self.decode_steps, 1)
        base = 1.0 / full_tok_s if full_tok_s else 0.0
        step_s = base + self.bytes_per_token * tokens_per_step / (pcie_gbs * 1e9)
        return tokens_per_step / step_s if step_s > 0 else None


def layer_calls(trace: Trace):
    """(layer, sorted distinct experts) of every decode layer call, in engine order."""
    layers = trace.header.moe_layers
    for _, ids in trace.steps(decode_only=True):  # ids [T, L, k]
        for i, layer in enumerate(layers):
            yield layer, np.unique(ids[:, i]).tolist()


def replay(trace: Trace, slots: int, policy: str = "lru", path: str = "grouped", scratch: int = 0,
           prefetch: bool = False, lookahead: int = 0, lift: bool = False) -> ReplayResult:
    """Counts of one replay; `scratch` (pairs path): the pool rows that stage misses without a slot, taken from
    `slots` as the engine does (caches.DeviceSlots: max_pairs = max running requests x top-k).
    prefetch (grouped path, a trace with predictions): the decode prefetcher of `--moe-prefetch on`;
    lookahead (grouped path, any trace): instead, prefetch up to that many experts of the next layer predicted
    by a co-occurrence table learned online (moe/lookahead.py; `lift`: its lift ranking)."""
    issued = used = 0
    if path == "pairs":
        hits, misses = _replay_pairs(trace, slots, scratch)
    elif path == "grouped":
        hits, misses, issued, used = _replay_grouped(trace, slots, policy, prefetch, lookahead, lift)
    else:
        raise ValueError(f"unknown replay path {path!r}; available: {', '.join(PATHS)}")
    name = policy if path == "grouped" else "lru-device"
    name += f"+la{lookahead}" if lookahead and path == "grouped" else ""
    return ReplayResult(name, slots, hits, misses, trace.decode_tokens,
                        int(trace.step_decode.sum()), trace.header.bytes_per_expert, issued, used)


def predicted_experts(pred: np.ndarray, limit: int) -> list[int]:
    """The prefetcher's list from a layer call's predicted top-k [T, k]: most-predicted first, ties by id,
    at most `limit` (runtime.Lookahead.predict)."""
    experts, counts = np.unique(pred, return_counts=True)
    return experts[np.argsort(-counts, kind="stable")][:limit].tolist()


def _replay_grouped(trace: Trace, slots: int, policy: str, prefetch: bool, lookahead: int = 0,
                    lift: bool = False) -> tuple[int, int, int, int]:
    """The grouped decode path (strategies.GroupedDecode over caches.HostSlots: compute / prefetch_next /
    settle_prefetch): the prefetch of layer l+1 runs after the first round of layer l's accesses. With
    `lookahead`, the same prefetch from a CoocPredictor's list; the table learns each layer pair after its
    second layer's call (so a step's prediction never knows the step)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown cache policy {policy!r}; available: {', '.join(POLICIES)}")
    if prefetch and lookahead:
        raise ValueError("prefetch (recorded predictions) and lookahead (co-occurrence) are alternatives")
    if prefetch and trace.pred is None:
        raise ValueError("this trace holds no predictions to prefetch with (synthetic traces have none)")
    res = Residency(slots, trace.header.moe_layers, policy)
    layers = trace.header.moe_layers
    nxt = dict(zip(layers, layers[1:]))
    cooc = CoocPredictor(len(layers), trace.header.num_experts, lookahead, lift) if lookahead else None
    issued = used = 0
    for _, ids, pred in trace.steps(decode_only=True, with_pred=True):
        pending: dict[int, set[int]] = {}  # dropped at each step's end, as the engine does
        for i, layer in enumerate(layers):
            experts = np.unique(ids[:, i]).tolist()
            done = pending.pop(layer, set())
            used += sum(1 for e in done.intersection(experts) if res.lookup((layer, e)) is not None)
            for r, _ in enumerate(res.rounds(layer, experts)):
                if r == 0 and (prefetch or cooc) and layer in nxt and slots:
                    if cooc:
                        ahead = cooc.predict(i, ids[:, i], lambda e, n=nxt[layer]: res.lookup((n, e)) is not None)
                    else:
                        ahead = predicted_experts(pred[:, i], slots)
                    for e in ahead:
                        res.touch((nxt[layer], e))
                    got = {e for e in ahead if res.try_prefetch((nxt[layer], e)) is not None}
                    issued += len(got)
                    pending[nxt[layer]] = got
            if cooc and i:
                cooc.learn(i - 1, ids[:, i - 1], ids[:, i])
    hits = sum(c.hits for c in res.counts.values())
    misses = sum(c.misses for c in res.counts.values())
    return hits, misses, issued, used


def _replay_pairs(trace: Trace, slots: int, scratch: int) -> tuple[int, int]:
    import torch

    from .device_cache import HITS, MISSES, DeviceSlotCache

    scratch = min(max(scratch, 1), trace.header.num_experts)  # as caches.DeviceSlots.rebuild
    cache = DeviceSlotCache(max(slots - scratch, 1), trace.header.moe_layers, trace.header.num_experts, scratch,
                            torch.device("cpu"))
    layers = trace.header.moe_layers
    for _, ids in trace.steps(decode_only=True):
        cache.begin_step()
        t = torch.from_numpy(ids.astype(np.int64))
        for i, layer in enumerate(layers):
            cache._route_torch(layer, t[:, i])
    c = cache.counters
    return int(c[HITS].sum()), int(c[MISSES].sum())


def opt_hit_rate(trace: Trace, slots: int) -> float:
    """Belady's bound: the hit rate of evicting the resident expert whose next use is furthest away (it knows
    the future; not an online policy). The layer calls' distinct experts in engine order, no pins: the
    headroom any policy has over LRU on this trace."""
    seq = [(layer, e) for layer, experts in layer_calls(trace) for e in experts]
    n = len(seq)
    nxt, last = [0] * n, {}
    for i in range(n - 1, -1, -1):
        nxt[i] = last.get(seq[i], n + i)  # never again: beyond the end, later ones first
        last[seq[i]] = i
    held: dict = {}
    heap: list = []
    hits = 0
    for i, key in enumerate(seq):
        if key in held:
            hits += 1
        elif len(held) >= slots:
            while True:
                neg, victim = heapq.heappop(heap)
                if held.get(victim) == -neg:
                    del held[victim]
                    break
        held[key] = nxt[i]
        heapq.heappush(heap, (-nxt[i], key))
    return hits / n if n else 1.0


def default_sizes(total: int, top_k: int, num_layers: int) -> list[int]:
    """Cache sizes at 5..90 % residency, at least one layer's top-k."""
    fracs = (0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9)
    return sorted({max(top_k, round(f * total)) for f in fracs})


def _sizes(args, trace: Trace) -> list[int]:
    from ..core import ConfigError

    h = trace.header
    total = len(h.moe_layers) * h.num_experts
    if args.vram_gb is not None:
        if not h.bytes_per_expert:
            raise ConfigError("--vram-gb needs the trace's bytes_per_expert (0 in this trace): use --slots")
        return [max(1, int(args.vram_gb * 1e9 // h.bytes_per_expert))]
    if args.slots is None:
        return default_sizes(total, h.top_k, len(h.moe_layers))
    try:
        sizes = [int(x) for x in args.slots.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--slots takes comma-separated integers, got {args.slots!r}") from None
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--slots must be >= 1, got {args.slots!r}")
    return sizes


def _pcie_gbs(args) -> float | None:
    if args.pcie_gbs is not None:
        return args.pcie_gbs
    import torch

    from .bench import load_profile

    if not torch.cuda.is_available():
        return None
    prof = load_profile(torch.device("cuda"))
    return (prof or {}).get("pcie_pinned_gbs") or None


def _parse_list(text: str | None, what: str, cast, allowed=None) -> list:
    from ..core import ConfigError

    try:
        items = [cast(x.strip()) for x in (text or "").split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what} takes comma-separated values, got {text!r}") from None
    bad = [str(x) for x in items if (allowed is not None and x not in allowed) or (cast is int and x < 1)]
    if bad:
        raise ConfigError(f"unknown {what} {', '.join(bad)}" + (f"; available: {', '.join(allowed)}" if allowed else
                                                               ": each K must be >= 1"))
    return items


def _row(r: ReplayResult, name: str, total: int, tok_s: float | None, extra: str = "") -> str:
    return (f"{name:<11}{r.slots:>7}{100 * r.slots / total:>9.1f}%{100 * r.hit_rate:>9.1f}%"
            f"{r.misses / r.decode_tokens:>12.1f}{r.pcie_bytes_per_token / 1e6:>9.1f}{(f'{tok_s:.1f}' if tok_s else '-'):>9}{extra}")


def _extra(r: ReplayResult, base: ReplayResult | None) -> str:
    """What a prefetching run's copies did: per token issued, the share used, demand misses vs no prefetch."""
    if not (r.prefetch_issued or r.policy.count("+la")):
        return ""
    used = 100 * r.prefetch_hits / max(r.prefetch_issued, 1)
    text = f"   prefetched {r.prefetch_issued / r.decode_tokens:.1f}/tok, {used:.0f}% used"
    if base is not None and base.misses:
        text += f", misses {100 * (r.misses - base.misses) / base.misses:+.1f}% vs {base.policy}"
    return text


def cache_report(args) -> str:
    """`moestream bench cache`: Belady's bound, then one row per (policy [+ prefetch], cache size)."""
    from ..core import ConfigError
    from .trace import read_trace

    trace = read_trace(args.trace)
    h = trace.header
    policies = _parse_list(args.policies, "--policies", str, list(POLICIES))
    ks = _parse_list(getattr(args, "lookahead", None), "--lookahead", int)
    if not trace.decode_tokens:
        raise ConfigError(f"{args.trace} has no decode steps to replay")
    if args.prefetch and trace.pred is None:
        raise ConfigError(f"--prefetch needs a recorded trace (with the prefetcher's predictions); {args.trace} has none")
    sizes, pcie = _sizes(args, trace), _pcie_gbs(args)
    total = len(h.moe_layers) * h.num_experts
    widest = int(trace.step_rows[trace.step_decode].max())
    lines = [f"trace {args.trace}: {h.model}, {len(h.moe_layers)} MoE layers x {h.num_experts} experts, top-{h.top_k}, "
             f"{trace.decode_tokens} decode tokens in {int(trace.step_decode.sum())} steps, "
             f"{h.bytes_per_expert / 2**20:.2f} MiB per expert",
             f"prediction: PCIe {pcie or 0:.1f} GB/s" + (f", {args.full_tok_s:.1f} tok/s all-hit" if args.full_tok_s else
                                                           ", all-hit step time not given (--full-tok-s): PCIe-bound ceiling"),
             f"{'policy':<11}{'slots':>7}{'resident':>10}{'hit rate':>10}{'misses/tok':>12}{'MB/tok':>9}{'tok/s':>9}"]
    if args.opt:
        for slots in sizes:
            lines.append(f"{'opt-bound':<11}{slots:>7}{100 * slots / total:>9.1f}%{100 * opt_hit_rate(trace, slots):>9.1f}%"
                         "   (Belady: knows the future; the ceiling of any eviction policy)")
    runs = [(p, "grouped", False, 0) for p in policies] + ([("lru", "pairs", False, 0)] if args.device_lru else [])
    runs += [(p, "grouped", True, 0) for p in policies] if args.prefetch else []
    runs += [(p, "grouped", False, k) for p in policies for k in ks]
    base: dict = {}
    for policy, path, pf, k in runs:
        for slots in sizes:
            r = replay(trace, slots, policy, path, scratch=args.max_pairs or widest * h.top_k, prefetch=pf,
                       lookahead=k, lift=True)
            if path == "grouped" and not (pf or k):
                base[policy, slots] = r
            tok_s = r.predict_tok_s(pcie or 0.0, args.full_tok_s)
            lines.append(_row(r, r.policy + ("+pf" if pf else ""), total, tok_s,
                              _extra(r, base.get((policy, slots)) if pf or k else None)))
    return "\n".join(lines)
