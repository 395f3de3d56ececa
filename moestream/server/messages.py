"""The messages between the front end and the engine process, one dataclass each. They travel pickled
through two one-way pipes (`engine_client.EngineClient` sends the first four and reads the rest,
`engine_proc.EngineLoop` the other way round).

    front end -> engine   Add | Abort | StatsQuery | Shutdown
    engine -> front end   Ready | StartupError (once, at start-up), then Outputs (one per step, the step's
                          Delta of each request), Failed (a request the engine could not serve), Stats
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core import SamplingParams


# ---- front end -> engine ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Add:
    """Start a request. `parent`: the engine id of an n > 1 sibling whose prefill this one copies."""
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    keep_markup: bool = True  # keep the reasoning / tool-call tags in the text (the parsers read them)
    parent: str | None = None


@dataclass(frozen=True)
class Abort:
    """Stop a request now and free its pages and slot."""
    rid: str


@dataclass(frozen=True)
class StatsQuery:
    """Ask for the engine's stats; the answer is the `Stats` with the same `sid`."""
    sid: int


@dataclass(frozen=True)
class Rebuild:
    """Resize the KV pool (tokens) and the expert slot cache (slots, or "auto") between two steps; None keeps
    a size (POST /v1/admin/cache). Answered by `Reply(sid)`."""
    sid: int
    kv_tokens: int | None = None
    moe_slots: int | str | None = None


@dataclass(frozen=True)
class Shutdown:
    """Leave the loop and exit."""


# ---- engine -> front end ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The model is loaded; `info`: max_seq_len, kv_tokens, vocab_size, device, ... (`EngineLoop.info`)."""
    info: dict


@dataclass(frozen=True)
class StartupError:
    """The engine could not start; one line for the user."""
    message: str


@dataclass
class Delta:
    """What one request produced in one step (the front end's generator yields these)."""
    text: str
    tokens: int  # generated tokens this delta stands for
    finish_reason: str | None = None
    stop: str | None = None  # the stop string that ended the request, if one did
    logprobs: list | None = None  # [[token, logprob, [[id, logprob], ...]], ...] when asked for
    prompt_logprobs: list | None = None  # [None, (logprob, alternatives), ...] with the first delta
    cached_tokens: int = 0  # prompt tokens the engine took from its prefix cache


@dataclass(frozen=True)
class Outputs:
    """One step's output: (request id, its delta) per request that produced a token."""
    items: list[tuple[str, Delta]]


@dataclass(frozen=True)
class Failed:
    """A request the engine could not serve; `status` is the HTTP status to answer with."""
    rid: str
    message: str
    status: int = 500


@dataclass(frozen=True)
class Stats:
    """The answer to `StatsQuery(sid)`: `EngineLoop.stats()`."""
    sid: int
    data: dict


@dataclass(frozen=True)
class Reply:
    """The answer to `Rebuild(sid)`: the report (data), or the reason it was refused (error, HTTP status)."""
    sid: int
    data: dict | None = None
    error: str | None = None
    status: int = 200
