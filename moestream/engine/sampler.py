"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds."""
from __future__ import annotations

import torch

from ..core import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.seed is None or params.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(int(params.seed))
    return g


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row [V] of fp32 logits -> tempered, filtered logits (-inf outside the kept set).

    The row is shifted so its maximum is 0 before dividing: any temperature > 0, however tiny, then
    gives finite-or--inf values with the best token at exactly 0, never inf or nan (1e-40 acts greedy).
    """
    x = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    x = (x - x.max()) / p.temperature
    x = x.masked_fill(torch.isnan(x), float("-inf"))  # (-inf - -inf) on an all -inf row
    if p.top_k > 0 and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, -1).cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop = (cum - torch.softmax(sorted_x, -1)) >= p.top_p
        x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    return x


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] fp32 -> one token id per row."""
    out = torch.argmax(logits, dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        out[i] = sample_row(logits[i], p, generators[i])
    return out.tolist()


def sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from one row; falls back to the best token when nothing finite is left to draw."""
    probs = torch.softmax(filter_logits(logits, p), -1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        return int(torch.argmax(torch.nan_to_num(logits, nan=float("-inf"))))
    return int(torch.multinomial(probs, 1, generator=generator)[0])
