"""Lookahead prediction of the next MoE layer's experts from this layer's routing, for the trace replay.

`CoocPredictor` keeps, per pair of consecutive MoE layers (i, i+1), a table of how many tokens routed
expert e at layer i and expert e' at layer i+1, learned online as the trace is replayed (a prediction for
step t uses only steps before t). At layer i's call it predicts layer i+1's experts as the `k` experts
with the most co-occurrences with this call's experts, skipping those resident already (a copy of a
resident expert buys nothing). With `lift`, the score is the co-occurrences beyond independence,
count(e, e') - count(e) x count(e') / tokens, so experts that follow everything (the popular ones, resident
anyway) rank below those that follow these experts in particular.

This is a replay-only model of "prefetch issued one layer ahead" (`bench cache --lookahead K`): it needs
no hidden state, so it runs on synthetic traces too; the engine's own prefetcher (`--moe-prefetch on`)
predicts from the hidden state instead and is replayed from a recorded trace's predictions.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np


class CoocPredictor:
    def __init__(self, num_layers: int, num_experts: int, k: int, lift: bool = False):
        if k < 1:
            raise ValueError(f"lookahead needs k >= 1, got {k}")
        self.k = k
        self.lift = lift
        self.counts = np.zeros((max(num_layers - 1, 0), num_experts, num_experts), dtype=np.float32)
        self.src = np.zeros((max(num_layers - 1, 0), num_experts), dtype=np.float32)  # tokens routing e at i
        self.dst = np.zeros((max(num_layers - 1, 0), num_experts), dtype=np.float32)  # ... e' at i+1
        self.tokens = np.zeros(max(num_layers - 1, 0), dtype=np.float32)

    def learn(self, i: int, ids_i: np.ndarray, ids_next: np.ndarray) -> None:
        """Rows [T, k] of layers i and i+1 of one step: every row's (e, e') pairs count once."""
        table = self.counts[i]
        for a, b in zip(ids_i.astype(np.int64), ids_next.astype(np.int64)):
            a, b = np.unique(a), np.unique(b)
            table[a[:, None], b[None, :]] += 1.0
            self.src[i, a] += 1.0
            self.dst[i, b] += 1.0
            self.tokens[i] += 1.0

    def predict(self, i: int, ids_i: np.ndarray, resident: Callable[[int], bool]) -> list[int]:
        """Up to k experts of layer i+1, most likely first, none resident, none never seen after these."""
        src = np.unique(ids_i.astype(np.int64))
        score = self.counts[i][src].sum(axis=0)
        if self.lift and self.tokens[i]:
            score = score - self.src[i, src].sum() * self.dst[i] / self.tokens[i]
        out = []
        for e in np.argsort(-score, kind="stable").tolist():
            if score[e] <= 0 or len(out) == self.k:
                break
            if not resident(e):
                out.append(e)
        return out
