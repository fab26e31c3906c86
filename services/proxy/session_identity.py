"""Which session a request belongs to, from what clients and routers already send.

One order for every API, most explicit first, so a harness that sets a header wins over a
field an SDK fills in for another purpose:

1. ``x-session-id`` (AgentServing's own header),
2. ``X-Dynamo-Session-ID`` (Dynamo's frontend; ``X-Dynamo-Parent-Session-ID`` names a fork's
   parent, as ``x-parent-session-id`` does),
3. ``prompt_cache_key`` (OpenAI chat completions and Responses: the key OpenAI routes its own
   prompt cache by, which Codex sets per conversation),
4. ``metadata.user_id`` (Anthropic Messages; Claude Code puts its session in it),
5. ``user`` (OpenAI's end-user id: the coarsest, one user's sessions share it).

A Responses continuation (``previous_response_id``) without any of them keeps its chain's
session (``openai_responses``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from agentserving.proxy.sessions import kvindex_session_id

SESSION_HEADERS = ("x-session-id", "x-dynamo-session-id")
PARENT_HEADERS = ("x-parent-session-id", "x-dynamo-parent-session-id")


@dataclass(frozen=True)
class BodyIds:
    """The body fields that may name a session, as the request's API spells them."""

    prompt_cache_key: str | None = None
    metadata_user_id: str | None = None
    user: str | None = None


@dataclass(frozen=True)
class SessionIdentity:
    session_id: str | None  # as the kvindex names it (kvindex_session_id)
    parent_session_id: str | None
    source: str | None  # the header or field it came from


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def identify(headers: Mapping[str, str], ids: BodyIds) -> SessionIdentity:
    """The session and fork parent ``headers`` and ``ids`` name (module docstring's order)."""
    candidates = [(h, headers.get(h)) for h in SESSION_HEADERS] + [
        ("prompt_cache_key", ids.prompt_cache_key),
        ("metadata.user_id", ids.metadata_user_id), ("user", ids.user)]
    source, sid = next(((name, v) for name, v in candidates if _text(v)), (None, None))
    parent = next((v for h in PARENT_HEADERS if (v := _text(headers.get(h)))), None)
    return SessionIdentity(kvindex_session_id(sid), kvindex_session_id(parent), source)
