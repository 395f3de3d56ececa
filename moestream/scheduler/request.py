"""A request as the scheduler tracks it (pages, slot, progress) and the engine samples it (generator,
grammar matcher, reasoning block, forced tokens, drafts)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ..core import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)
    state_slot: int = -1
    num_computed: int = 0  # tokens whose K/V and linear state are in the caches
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    detok: object = None  # IncrementalDetokenizer the engine attaches when it has a tokenizer (add_request)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    stalls: int = 0  # times in a row it preempted itself while running alone at this many tokens (stall_at)
    stall_at: int = -1
    # prefix cache: the tree nodes this request holds (its first len(nodes) pages), the prompt tokens it
    # found cached when first admitted, a snapshot to resume from in its next step, its rolling snapshot,
    # and (node, n): the first n positions of that cached page to copy into its own next page (copy-on-write)
    nodes: list = field(default_factory=list)
    cached_tokens: int | None = None
    pending_load: int = -1
    roll_node: object = None
    pending_copy: tuple | None = None
    branch_at: int = 0  # linear-state models: tokens of its prompt found in cached pages (a snapshot goes there)
    matcher: object = None  # grammar.Matcher of a constrained request
    thinking: bool = False  # inside <think>...</think> (the grammar waits, the thinking budget counts)
    thinking_tokens: int = 0
    forced: list[int] = field(default_factory=list)  # tokens emitted next instead of sampled ones
    # prompt_lps[k]: (logprob, top alternatives) of prompt token k (k >= 1; None for token 0)
    prompt_lps: list = field(default_factory=list)
    output_lps: list = field(default_factory=list)  # (logprob, top alternatives) per generated token
    parent: str | None = None  # n > 1: the sibling whose prefill this request copies instead of computing
    drafts: list[int] = field(default_factory=list)  # --speculative: tokens proposed after the newest one
    penalties: object = None  # engine.sampler.PenaltyState of a request with logit_bias or penalties
    # overlapped decode (LLMEngine): the last output id is PENDING, a token a launched step samples on the device and
    # the next step reads there; Scheduler.resolve puts the real one in its place (and _release drops it)
    pending: bool = False

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, i: int) -> int:
        """all_ids[i], without building all_ids."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        # Decoding means only the newest sampled token is not yet in the caches.
        return self.num_computed < self.num_tokens - 1

    @property
    def can_draft(self) -> bool:
        """Speculative drafts only for requests sampled from the plain (tempered, top-k/p, min-p)
        distribution; logits processing, grammars, logprobs, forced tokens and a thinking budget decode one
        token a step."""
        p = self.params
        return not (p.needs_processing or self.matcher is not None or p.logprobs is not None or self.forced
                    or (self.thinking and p.max_thinking_tokens is not None))


PENDING = -1  # the placeholder of a pending token (Request.pending)


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request: Request
    new_token: int | None
    text_delta: str
    finished: bool
    logprobs: tuple | None = None  # (logprob of new_token, [(id, logprob)...]) when the request asked
    prompt_logprobs: list | None = None  # the prompt's, with the first generated token
    error: str | None = None  # the request failed in this step and finished with "error" (why)
    refused: bool = False  # the error is the request's (a grammar that cannot be used here), not the engine's
