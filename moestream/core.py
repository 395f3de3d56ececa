"""Shared vocabulary of the engine: sampling parameters, requests, finish reasons.

Everything here is plain data; no torch device work happens in this module.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # the client went away or the request was cancelled


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
    # Prompt tokens whose KV (and linear state) came from the prefix cache instead of being computed.
    cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
