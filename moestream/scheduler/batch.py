"""The two halves of a step, as plain data: what the scheduler decided (`ScheduledBatch`) and what the
engine's model runner computed from it (`StepResult`).

The scheduler never builds tensors: it names requests, token counts and cache slots and pages; the runner
(engine/runner.py) turns that into a `ForwardBatch`, runs it and samples.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request


@dataclass
class ScheduledSeq:
    """One request's part of a step: n new tokens after its first `cached` ones (its K/V and linear state
    are in the caches up to there)."""

    req: Request
    n: int
    cached: int
    prefill: bool  # more than the newest token was still to compute (Request.in_prefill when scheduled)
    verify: bool = False  # speculative verify: the newest token and n - 1 drafts (Request.drafts)
    samples: bool = False  # the chunk reaches the newest token (not a verify): one token is sampled after it
    # prefix-cache snapshots inside a prefill chunk: (e, slot) = the state after the first e new tokens
    snapshots: tuple = ()

    @property
    def end(self) -> int:
        return self.cached + self.n


@dataclass
class ScheduledBatch:
    """One step as the scheduler planned it; the cache copies are in the order the ForwardBatch runs them."""

    seqs: list[ScheduledSeq]
    # n > 1: (child, parent) = the child copies its parent's prompt K/V and linear state (its pages and slot
    # are taken) after the pass that ends the parent's prefill, and samples its first token from the
    # parent's logits row
    forks: list[tuple[Request, Request]] = field(default_factory=list)
    state_resets: list[int] = field(default_factory=list)  # slots of requests admitted since the last step
    host_copies: list = field(default_factory=list)  # the prefix cache's host-tier ops (PrefixCache.host_ops)
    kv_copies: list = field(default_factory=list)  # copy-on-write (src page, dst page, n)
    state_loads: list = field(default_factory=list)  # (snapshot slot, request slot) before the pass
    state_saves: list = field(default_factory=list)  # (request slot, snapshot slot) after the pass
    # (request slot, snapshot slot) once the step's tokens are appended: the rolling snapshot of a verify
    # step that kept its state at a page boundary (Scheduler.postprocess decides it)
    after_copies: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.n for s in self.seqs)

    @property
    def prompt(self) -> bool:
        """Some sequence computes prompt tokens (a 1-token prompt tail after a cache hit looks like decode)."""
        return any(s.cached < len(s.req.prompt_ids) for s in self.seqs)


@dataclass
class StepResult:
    """What the model runner computed for a ScheduledBatch, in the scheduler's order."""

    # verify steps: the drafts the target kept plus one token of its own, per verified request
    verified: list[tuple[Request, list[int]]] = field(default_factory=list)
    # one token (and its logprobs when asked for, else None) per request whose chunk reached its newest
    # token, then per adopted child (ScheduledBatch.forks)
    sampled: list[tuple[Request, int, tuple | None]] = field(default_factory=list)
    # (request, why, refused): requests whose own work in this step raised (their grammar, their sampling); they
    # appear in neither list above and finish with "error", the others of the step go on; refused: the request's
    # own input is at fault (a grammar with no way forward: HTTP 400), not the engine
    failed: list[tuple[Request, str, bool]] = field(default_factory=list)
