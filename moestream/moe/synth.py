"""Synthetic routing traces with tunable locality (docs/routing-traces.md#synthetic-traces).

Each of `batch` streams decodes `tokens` tokens; each token picks `top_k` distinct experts in
each MoE layer. Slot j of a token at layer l is drawn, in this order of tries:

    reuse    with probability `reuse`: an expert of the stream's previous token at layer l (one not
             taken yet by this token) — temporal locality, what an LRU cache feeds on
    follow   with probability `follow`: the expert that layer l's fixed random map assigns to this
             token's slot-j expert of layer l-1 — cross-layer correlation (layer 0 never follows)
    popular  otherwise: from layer l's popularity, Zipf with exponent `zipf` over the ranks of the
             stream's current topic (a random order of the experts per layer and topic; 0: uniform)

Before these, with probability `share`, a stream b > 0 copies stream 0's slot-j expert of this token
(requests that route alike: 1 = identical requests, as a benchmark sending one prompt B times at
temperature 0). A try whose expert is already taken by this token falls through to a popularity draw. A stream
switches topic with probability 1/`topic_len` per token (to one of `topics` per-layer orders; a
new stream starts on a random one), so the popular set moves, as it does between a chat, code and a
summary. Presets (`PRESETS`) fix the parameters; `qwen36` is the Qwen3.6-35B-A3B shape (40 MoE layers,
256 experts, top-8, FP8 experts of 3 MiB + scales) with seed 001's LRU curve (see RESULTS.md).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from .trace import Trace, TraceHeader


@dataclass(frozen=True)
class SynthParams:
    num_layers: int = 40
    num_experts: int = 256
    top_k: int = 8
    bytes_per_expert: int = 3 * 2**20 + 3 * 16 * 4 * 4  # FP8 gate/up/down [512 x 2048] + 128x128-block scales
    tokens: int = 2048  # decode tokens per stream
    batch: int = 1  # streams decoded together (one step = one token of each)
    zipf: float = 1.0
    reuse: float = 0.5
    follow: float = 0.0
    topics: int = 4
    topic_len: float = 256.0
    share: float = 0.0  # batch > 1: probability a stream's slot copies stream 0's (1: identical requests)
    seed: int = 0

    def validate(self) -> None:
        from ..core import ConfigError

        if not (1 <= self.top_k <= self.num_experts and self.num_layers >= 1 and self.tokens >= 1 and self.batch >= 1):
            raise ConfigError("synthetic trace: need 1 <= top_k <= num_experts, num_layers >= 1, tokens >= 1, batch >= 1")
        for name in ("reuse", "follow", "share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"synthetic trace: {name} must be in [0, 1], got {getattr(self, name)}")
        if self.reuse + self.follow > 1.0:
            raise ConfigError("synthetic trace: reuse + follow must be <= 1")
        if self.zipf < 0 or self.topics < 1 or self.topic_len < 1:
            raise ConfigError("synthetic trace: zipf >= 0, topics >= 1, topic_len >= 1")


PRESETS: dict[str, SynthParams] = {
    # calibrated (benchmarks/RESULTS.md) so that LRU's replay hit rates give seed 001's bs1 tok/s curve at a
    # 3090's PCIe (25 GB/s assumed, 60 tok/s all-hit): within 3.7 tok/s of it from 5 to 89 % residency
    "qwen36": SynthParams(zipf=1.0, reuse=0.3, follow=0.1, topics=8, topic_len=64.0),
    # long topics with a sharper popularity skew and less token-to-token reuse: where frequency matters most
    "qwen36-skewed": SynthParams(zipf=1.3, reuse=0.2, follow=0.1, topics=4, topic_len=512.0),
    # no locality at all: what random weights give (a cache hits only its residency fraction)
    "uniform": SynthParams(zipf=0.0, reuse=0.0, follow=0.0, topics=1),
}


def preset(name: str, **overrides) -> SynthParams:
    from ..core import ConfigError

    if name not in PRESETS:
        raise ConfigError(f"unknown synthetic preset {name!r}; available: {', '.join(PRESETS)}")
    p = replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
    p.validate()
    return p


def _zipf_cdf(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return np.cumsum(w) / w.sum()


def generate(p: SynthParams, name: str = "synthetic", moe_layers: list[int] | None = None) -> Trace:
    """A decode-only trace of p.tokens steps of p.batch rows each; moe_layers: the model's layer numbers
    (default 0..num_layers-1)."""
    p.validate()
    rng = np.random.default_rng(p.seed)
    L, E, k, B, N = p.num_layers, p.num_experts, p.top_k, p.batch, p.tokens
    order, follow_map = _tables(p, rng)
    cdf = _zipf_cdf(E, p.zipf)
    ids = np.zeros((N, B, L, k), dtype=np.uint16)
    prev = np.full((B, L, k), -1, dtype=np.int64)
    topic = rng.integers(0, p.topics, size=B)
    # the random draws of all tokens at once: which try each slot takes, and its uniform numbers
    u_try = rng.random((N, B, L, k))
    u_pick = rng.random((N, B, L, k))
    u_pop = rng.random((N, B, L, k, 4))  # up to 4 popularity draws per slot before a uniform fallback
    u_share = rng.random((N, B, L, k))
    u_topic = rng.random((N, B))
    new_topic = rng.integers(0, p.topics, size=(N, B))
    for t in range(N):
        for b in range(B):
            if p.topics > 1 and u_topic[t, b] < 1.0 / p.topic_len:
                topic[b] = new_topic[t, b]
            ranks_of_topic = order[topic[b]]
            for layer in range(L):
                taken: list[int] = []
                prev_l = prev[b, layer]
                for j in range(k):
                    u = u_try[t, b, layer, j]
                    e = -1
                    if b and u_share[t, b, layer, j] < p.share:
                        lead = int(ids[t, 0, layer, j])
                        e = lead if lead not in taken else -1
                    elif u < p.reuse and prev_l[0] >= 0:
                        free = [x for x in prev_l if x not in taken]
                        if free:
                            e = int(free[int(u_pick[t, b, layer, j] * len(free))])
                    elif u < p.reuse + p.follow and layer > 0:
                        cand = int(follow_map[layer, ids[t, b, layer - 1, j]])
                        e = cand if cand not in taken else -1
                    if e < 0:
                        e = _popular(ranks_of_topic[layer], cdf, u_pop[t, b, layer, j], taken, rng)
                    taken.append(e)
                ids[t, b, layer] = taken
                prev[b, layer] = taken
    layers = list(moe_layers) if moe_layers is not None else list(range(L))
    if len(layers) != L:
        raise ValueError(f"{len(layers)} moe_layers for num_layers={L}")
    header = TraceHeader(model=name, num_layers=max(layers) + 1, moe_layers=layers, num_experts=E, top_k=k,
                         bytes_per_expert=p.bytes_per_expert, source="synthetic", params=asdict(p))
    flat = ids.reshape(N * B, L, k)
    return Trace(header, flat, np.full(N, B, dtype=np.int64), np.ones(N, dtype=bool))


def _tables(p: SynthParams, rng) -> tuple[np.ndarray, np.ndarray]:
    """The first draws of a trace's generator: the popularity orders [topics, L, E] and the follow maps [L, E]
    (layer l: expert of l-1 -> expert of l)."""
    L, E = p.num_layers, p.num_experts
    order = np.stack([np.stack([rng.permutation(E) for _ in range(L)]) for _ in range(p.topics)])
    return order, np.stack([rng.permutation(E) for _ in range(L)])


def follow_maps(p: SynthParams) -> np.ndarray:
    """The follow maps [L, E] that `generate(p)` uses (what a perfect layer-to-layer predictor would know)."""
    return _tables(p, np.random.default_rng(p.seed))[1]


def _popular(ranks: np.ndarray, cdf: np.ndarray, us: np.ndarray, taken: list[int], rng) -> int:
    for u in us:
        e = int(ranks[min(int(np.searchsorted(cdf, u, side="right")), len(cdf) - 1)])
        if e not in taken:
            return e
    free = [e for e in range(len(ranks)) if e not in taken]
    return int(free[int(rng.integers(len(free)))])
