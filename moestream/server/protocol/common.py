"""What the OpenAI and Anthropic request models share: limits, the base model, error messages out of a
``pydantic.ValidationError``, and turning request fields into ``SamplingParams``."""
from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from moestream.core import SamplingParams

MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 1000  # per stop string: the detokenizer holds this much text back while matching
MAX_TOKEN_IDS = 1 << 20  # stop_token_ids / prompt ids beyond any vocabulary or context: refused early
MAX_N = 16  # choices (and best_of candidates) per request


def validation_error_message(exc: ValidationError) -> tuple[str, str | None]:
    """``(message, param)`` for a request that failed validation; ``param`` is the first bad field's
    dotted path (``messages.0.content``)."""
    parts: list[str] = []
    param: str | None = None
    for err in exc.errors(include_url=False):
        loc = ".".join(str(x) for x in err.get("loc", ()) if not _is_union_tag(x))
        msg = str(err.get("msg", "invalid value"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if param is None and loc:
            param = loc
        parts.append(f"{loc}: {msg}" if loc else msg)
    return ("; ".join(dict.fromkeys(parts)) or "invalid request"), param


def _is_union_tag(x: Any) -> bool:
    # pydantic puts the union member it tried into the location ("str", "list[TextPart]", "NamedToolChoice",
    # "literal['none','auto']", "function-after[...]"); our field names are lower_snake_case.
    return isinstance(x, str) and (
        x in ("str", "int", "float", "bool", "dict", "list", "none") or x[:1].isupper()
        or any(c in x for c in "[('") or x.startswith("function-")
    )


def unsupported(what: str) -> ValueError:
    return ValueError(f"{what} is not supported by this server")


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


def make_sampling_params(kwargs: dict[str, Any], default_max_tokens: int, defaults: dict[str, Any]) -> SamplingParams:
    merged = {"max_tokens": default_max_tokens, **defaults}
    merged.update({k: v for k, v in kwargs.items() if v is not None})
    return SamplingParams(**merged)


def now() -> int:
    return int(time.time())
