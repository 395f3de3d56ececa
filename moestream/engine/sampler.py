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
    return sample_device(logits, params, generators).tolist()


def sample_device(logits: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] fp32 -> [B] token ids on the logits' device, without waiting for them (an overlapped decode
    step samples before the host reads anything): greedy rows the argmax, the others one draw each from their
    tempered, filtered distribution with the request's generator, in row order. A row with nothing finite left to
    draw gives its best token (a draw is still made from a uniform stand-in, so a request's generator advances
    the same way whatever its logits)."""
    out = torch.argmax(logits, dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(filter_logits(logits[i], p), -1)
        ok = torch.isfinite(probs).all() & (probs.sum() > 0.0)
        best = torch.argmax(torch.nan_to_num(logits[i], nan=float("-inf")))
        draw = torch.multinomial(torch.where(ok, probs, torch.ones_like(probs)), 1, generator=generators[i])[0]
        out[i] = torch.where(ok, draw, best)
    return out


def sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from one row; falls back to the best token when nothing finite is left to draw."""
    probs = torch.softmax(filter_logits(logits, p), -1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        return int(torch.argmax(torch.nan_to_num(logits, nan=float("-inf"))))
    return int(torch.multinomial(probs, 1, generator=generator)[0])


# ---- logits processing: penalties, logit_bias, min_tokens, grammar masks -----------------------
class PenaltyState:
    """One request's logits-processing tensors, kept from step to step: its logit_bias as (ids, values), the
    distinct ids of its prompt and output (`ids`) and of its output alone (`out_ids`), and how often the
    output holds each id (`counts`, [V]). Rebuilt every step they cost time in the size of the bias and of
    the prompt (a full-vocabulary bias or a 100k-token prompt: tens of milliseconds), paid by every request
    in the batch; kept, a step adds only its new tokens."""

    def __init__(self):
        self.key = None  # (V, device) the tensors are for
        self.seen = self.counts = self.bias = self.ids = self.out_ids = None
        self.prompt_done, self.outputs = False, 0  # the tokens already counted in

    def update(self, p: SamplingParams, prompt_ids: list[int], output_ids: list[int], V: int, device) -> None:
        """Bring the tensors up to date with the request's tokens (built at the first call)."""
        if self.key != (V, device):
            self._build(p, V, device)
        if not self.prompt_done:
            self._mark(prompt_ids, V, device, count=False)
            self.prompt_done = True
        if len(output_ids) > self.outputs:
            self._mark(output_ids[self.outputs:], V, device, count=True)
            self.outputs = len(output_ids)

    def _build(self, p: SamplingParams, V: int, device) -> None:
        """Empty tensors for a vocabulary of V on `device`, and the bias's (made once: p never changes)."""
        self.key, self.prompt_done, self.outputs = (V, device), False, 0
        self.seen = torch.zeros(V, dtype=torch.bool, device=device)
        self.counts = torch.zeros(V, dtype=torch.float32, device=device)
        self.ids = self.out_ids = torch.zeros(0, dtype=torch.long, device=device)
        ids = [t for t in p.logit_bias if t < V]
        self.bias = (torch.tensor(ids, dtype=torch.long, device=device),
                     torch.tensor([p.logit_bias[t] for t in ids], dtype=torch.float32, device=device))

    def _mark(self, ids: list[int], V: int, device, count: bool) -> None:
        """Count `ids` in: the ones not seen before join `ids` (and, for output tokens, `out_ids`/`counts`)."""
        t = torch.tensor(ids, dtype=torch.long, device=device)
        t = t[t < V]
        new = torch.unique(t[~self.seen[t]])
        self.seen[new] = True
        self.ids = torch.cat([self.ids, new])
        if count:
            fresh = torch.unique(t[self.counts[t] == 0])
            self.out_ids = torch.cat([self.out_ids, fresh])
            self.counts.index_add_(0, t, torch.ones(t.shape[0], dtype=torch.float32, device=device))


def apply_penalties(row: torch.Tensor, p: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                    stop_ids: set[int] | frozenset = frozenset(), state: PenaltyState | None = None) -> torch.Tensor:
    """One row [V] of fp32 logits -> the row after min_tokens, logit_bias and the penalties, in vLLM's
    order. `stop_ids`: the ids that end the request (EOS and stop_token_ids), masked below min_tokens.
    `state`: the request's PenaltyState, so a step costs its new tokens only (a fresh one without)."""
    V = row.shape[-1]
    state = state or PenaltyState()
    state.update(p, prompt_ids, output_ids, V, row.device)
    if p.min_tokens and len(output_ids) < p.min_tokens:
        ids = [t for t in stop_ids if 0 <= t < V]
        if ids:
            row[ids] = float("-inf")
    if state.bias[0].numel():
        row.index_add_(0, state.bias[0], state.bias[1].to(row.dtype))
    if p.repetition_penalty != 1.0 and state.ids.numel():
        vals, rp = row[state.ids], p.repetition_penalty
        row[state.ids] = torch.where(vals > 0, vals / rp, vals * rp)
    if (p.presence_penalty or p.frequency_penalty) and state.out_ids.numel():
        counts = state.counts[state.out_ids].to(row.dtype)
        row[state.out_ids] -= p.frequency_penalty * counts + p.presence_penalty
    return row


def apply_bitmask(row: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits outside `allowed` (a bool [V'] mask, V' may differ from V) -> -inf."""
    V = row.shape[-1]
    if allowed.shape[0] == V:
        return row.masked_fill_(~allowed.to(row.device, non_blocking=True), float("-inf"))
    n = min(V, allowed.shape[0])
    keep = torch.zeros(V, dtype=torch.bool, device=row.device)
    keep[:n] = allowed[:n].to(row.device)
    return row.masked_fill_(~keep, float("-inf"))


def logprobs_of(logits: torch.Tensor, tokens: list[int], tops: list[int]) -> list[tuple]:
    """Rows [B, V] of raw logits, the chosen token of each row and how many alternatives to report ->
    per row (token logprob, [(id, logprob) of the `top` most likely]). log_softmax in fp32."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    k = max(tops, default=0)
    if k:
        vals, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
    out = []
    for i, top in enumerate(tops):
        alts = list(zip(ids[i][:top], vals[i][:top])) if top else []
        out.append((chosen[i], alts))
    return out


# ---- speculative decoding ---------------------------------------------------------------------
def verify_drafts(logits: torch.Tensor, drafts: list[int], p: SamplingParams,
                  generator: torch.Generator | None) -> list[int]:
    """Speculative decoding's acceptance rule for drafts proposed greedily (a one-hot draft distribution q).

    logits [k + 1, V]: the target's logits at the position before each draft and after the last one.
    Returns the accepted drafts followed by one token of the target's own (len 1..k+1). Greedy requests
    accept a draft while it is the target's argmax. Sampled requests accept draft d with probability
    min(1, p(d) / q(d)) = p(d) and, on rejection, draw from the residual max(p - q, 0) (p without d,
    renormalised); after k acceptances the extra token is drawn from p itself: every emitted token then
    has the distribution plain sampling gives it (the standard rule; q one-hot is a special case)."""
    out: list[int] = []
    if p.greedy:
        best = torch.argmax(logits, dim=-1).tolist()
        for i, d in enumerate(drafts):
            if best[i] != d:
                break
            out.append(d)
        return out + [best[len(out)]]
    for i, d in enumerate(drafts):
        probs = torch.softmax(filter_logits(logits[i], p), -1)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            return out + [sample_row(logits[i], p, generator)]  # nothing finite to draw: as plain sampling
        u = float(torch.rand((), generator=generator, device=probs.device))
        if u < float(probs[d]):
            out.append(d)
            continue
        residual = probs.clone()
        residual[d] = 0.0
        if float(residual.sum()) <= 0.0:  # p was all on d (u >= 1 cannot happen): keep d
            return out + [d]
        return out + [int(torch.multinomial(residual / residual.sum(), 1, generator=generator)[0])]
    return out + [sample_row(logits[len(drafts)], p, generator)]
