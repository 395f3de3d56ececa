"""Shared vocabulary of the engine: sampling parameters, requests, finish reasons.

Everything here is plain data; no torch device work happens in this module.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field


def die_with_parent() -> None:
    """Linux: the kernel sends this process SIGTERM when the process (thread) that spawned it dies, even by
    SIGKILL (the server's engine process, tensor-parallel ranks); elsewhere nothing."""
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class MoestreamError(Exception):
    """An error a user can hit and fix; the message says what to do."""


class ConfigError(MoestreamError):
    """A malformed or unsupported model/engine configuration."""


class CheckpointError(MoestreamError):
    """A missing, unexpected or mis-shaped tensor, or an unreadable model file."""


class RequestError(MoestreamError):
    """A request that cannot be served as asked (too long, bad parameters)."""


# torch.Generator.manual_seed takes exactly this range (int64 min .. uint64 max); outside it raises.
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI allows


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """How to pick tokens. The names follow vLLM / the OpenAI API.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    `validate` refuses every value the sampler cannot take (a seed torch cannot hold, nan, inf), so a
    request that passed it cannot fail inside the engine's step.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # OpenAI penalties over the generated tokens: logit -= frequency * count + presence * (count > 0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF/vLLM over prompt + generated tokens: positive logits divided by it, negative ones multiplied
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated
    # log-probabilities (of the model's distribution, before penalties and temperature): None = off,
    # N >= 0 = the sampled token's plus the N most likely ones; prompt_logprobs the same for the prompt
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # a compiled llguidance grammar (moestream.tokenizer.grammar.compile_grammar); None = unconstrained
    grammar: str | None = None
    # reasoning models: at most this many tokens inside <think>...</think>, then </think> is forced
    max_thinking_tokens: int | None = None
    # the prompt already opened a reasoning block (the grammar waits for its end; the budget counts from 0)
    reasoning_open: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        self.validate()

    def validate(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (0.0 <= self.temperature <= MAX_TEMPERATURE):  # also false for nan
            raise RequestError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise RequestError(f"top_k must be an integer >= -1 (-1 or 0: off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise RequestError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop sequences must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be token ids >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise RequestError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                               f"got {self.repetition_penalty!r}")
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()):
            raise RequestError("logit_bias maps token ids >= 0 to values in [-100, 100]")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise RequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if self.max_thinking_tokens is not None and (not _is_int(self.max_thinking_tokens)
                                                     or self.max_thinking_tokens < 0):
            raise RequestError(f"max_thinking_tokens must be an integer >= 0, got {self.max_thinking_tokens!r}")

    @property
    def needs_processing(self) -> bool:
        """Whether the logits of this request change before sampling (penalties, bias, min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # the client went away or the request was cancelled
    ERROR = "error"  # its own work (grammar, detokenizer, sampler) failed mid-step; the rest of the batch went on


_req_ids = itertools.count()


def next_request_id() -> str:
    return f"req-{next(_req_ids)}"


@dataclass
class RequestOutput:
    """One finished (or streaming) request, as the offline API returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    # Time to first token and decode speed for this request, in seconds / tokens per second.
    ttft_s: float | None = None
    # with SamplingParams.logprobs: (logprob, [(id, logprob) of the top alternatives]) per generated token;
    # with prompt_logprobs: the same per prompt token (None for the first)
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    # Prompt tokens whose KV (and linear state) came from the prefix cache instead of being computed.
    cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
