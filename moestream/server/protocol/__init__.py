"""Request models and response builders of the two HTTP APIs, one module each.

- `openai_api`: /v1/chat/completions and /v1/completions — requests, responses, stream chunks, logprobs.
- `anthropic_api`: /v1/messages and /v1/messages/count_tokens — requests, the message, its SSE stream.
- `common`: what both share — limits, the request base model, `validation_error_message`,
  `make_sampling_params`.

Requests are pydantic v2 models: unknown fields are ignored, and anything we cannot honour raises
``pydantic.ValidationError`` (or ``moestream.core.RequestError``) with a message a user can act on. The
server turns either into HTTP 400 with ``openai_error_body`` / ``anthropic_error_body``;
``validation_error_message`` makes the message and ``param`` out of a ``ValidationError``. Responses are
plain dicts (what ``json.dumps`` sends).

The routes import the module of their API; the names below are the package's public surface.
"""
from __future__ import annotations

from moestream.core import RequestError

from .anthropic_api import (AnthropicMessagesRequest, AnthropicStreamEncoder, CountTokensRequest,
                            anthropic_error_body, anthropic_message_response, anthropic_stop_reason,
                            anthropic_usage, new_message_id, sse_event)
from .common import validation_error_message
from .openai_api import (SSE_DONE, ChatCompletionRequest, ChatMessage, CompletionRequest, chat_completion_chunk,
                         chat_completion_response, chat_logprobs, completion_chunk, completion_logprobs,
                         completion_response, openai_error_body, openai_finish_reason, sse_data, usage_dict)

__all__ = [
    "openai_error_body",
    "anthropic_error_body",
    "validation_error_message",
    "ChatMessage",
    "ChatCompletionRequest",
    "CompletionRequest",
    "AnthropicMessagesRequest",
    "CountTokensRequest",
    "chat_completion_response",
    "chat_completion_chunk",
    "completion_response",
    "completion_chunk",
    "chat_logprobs",
    "completion_logprobs",
    "usage_dict",
    "openai_finish_reason",
    "anthropic_stop_reason",
    "anthropic_message_response",
    "anthropic_usage",
    "new_message_id",
    "AnthropicStreamEncoder",
    "sse_data",
    "sse_event",
    "SSE_DONE",
    "RequestError",
]
