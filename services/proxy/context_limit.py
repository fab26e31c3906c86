"""Refusing a turn that cannot finish within the model's context, before any pod works on it.

A request whose prompt plus ``max_tokens`` runs past ``max_model_len`` is refused by the
engine, but only after the proxy routed it, a prefill pod may have computed its prompt and a
decode pod pulled the KV: P/D pays two pods' work for a 400. The proxy refuses it first, with
the engine's own verdict, naming the field.

The proxy has no tokenizer, so it refuses only what is certainly impossible:

- ``max_tokens`` (``max_completion_tokens`` on chat) larger than the context alone;
- with a prompt given as token ids (its length is exact), prompt + ``max_tokens`` past the
  context, or, without ``max_tokens``, a prompt that leaves no room for one token.

A text or chat prompt is never refused on its estimated length: the engine, which tokenizes
it, decides. Pure: the caller hands in the request, its prompt size and the context length
(``--max-model-len``, else the largest the pods report in ``GET /v1/models``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentserving.core.service import ApiError
from agentserving.proxy.disagg import PromptSize


def max_tokens_field(endpoint: str, body: Mapping[str, Any]) -> str:
    """The field that bounds the answer: chat's ``max_completion_tokens`` when given (OpenAI's
    newer name), else ``max_tokens``."""
    if endpoint.endswith("/chat/completions") and "max_completion_tokens" in body:
        return "max_completion_tokens"
    return "max_tokens"


def context_error(endpoint: str, body: Mapping[str, Any], size: PromptSize,
                  max_model_len: int | None) -> ApiError | None:
    """The 400 for a request that cannot finish within ``max_model_len`` tokens, or None."""
    if not max_model_len:
        return None
    field = max_tokens_field(endpoint, body)
    limit = body.get(field)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        limit = None  # absent, or malformed: the engine's own validation names it
    prefix = f"This model's maximum context length is {max_model_len} tokens"
    if limit is not None and limit > max_model_len:
        return ApiError(400, f"{field}: {prefix}; {field} asks for {limit} completion tokens "
                        "alone", param=field, code="context_length_exceeded")
    if size.tokens is None:
        return None
    if limit is not None and size.tokens + limit > max_model_len:
        return ApiError(400, f"{field}: {prefix}; the prompt's {size.tokens} tokens plus "
                        f"{field} {limit} make {size.tokens + limit}", param=field,
                        code="context_length_exceeded")
    if limit is None and size.tokens >= max_model_len:
        return ApiError(400, f"prompt: {prefix}; the prompt has {size.tokens}, leaving no "
                        "room for a completion token", param="prompt",
                        code="context_length_exceeded")
    return None
