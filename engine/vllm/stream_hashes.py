"""``kv_transfer_params`` (chunk hashes, prompt sources) on vLLM's streamed responses: an
ASGI middleware.

vLLM returns the connector's ``kv_transfer_params`` on blocking responses only; its SSE stream
never carries them, so a streaming client (and the proxy's KV-aware routing) would learn no
chunk hashes, and no turn where its prompt came from. Loaded into vLLM's API server with
``--middleware agentserving.engine.vllm.stream_hashes.ChunkHashesMiddleware``, this rewrites
the stream's events, as the reference engine emits them: the event whose choice finishes and
the closing usage event get ``"kv_transfer_params": {"chunk_hashes": [...], "prompt_sources":
{...}}``.

They come from vLLM's scheduler process, where the connector computed them at
``request_finished`` — before the engine sent the request's last output, so they are there by
the time its final event streams. The middleware asks that process's memory API
(``GET /memory/requests/{id}/kv_transfer_params`` on ``AGENTSERVING_VLLM_MEMORY_URL``) once per
stream. A failed lookup leaves the stream as vLLM wrote it (the proxy then routes that session
without KV awareness for a turn); it never breaks or delays the stream beyond the lookup's
timeout.

Everything that is not a streamed POST to ``/v1/completions`` or ``/v1/chat/completions``
passes through untouched.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx

from agentserving.core.internal_auth import TOKEN_ENV, auth_headers
from agentserving.core.logging import get_logger

log = get_logger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]],
                    Callable[[Message], Awaitable[None]]], Awaitable[None]]

MEMORY_URL_ENV = "AGENTSERVING_VLLM_MEMORY_URL"
STREAM_PATHS = ("/v1/completions", "/v1/chat/completions")


def finishing_event(event: dict[str, Any]) -> bool:
    """Whether a streamed event ends the turn: a finished choice, or the usage event."""
    if event.get("usage") and not event.get("choices"):
        return True
    return any(c.get("finish_reason") for c in event.get("choices") or ())


def candidate_ids(response_id: str) -> list[str]:
    """The connector's keys for a streamed response id: chat streams use it as is, completion
    streams add the choice index (``-0``)."""
    return [response_id, f"{response_id}-0"]


class SseRewriter:
    """Splits an SSE byte stream into events and hands each ``data:`` JSON event to an async
    ``edit`` that may change it; everything else (comments, ``[DONE]``) passes verbatim."""

    def __init__(self, edit: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
        self.edit = edit
        self._buf = b""

    async def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = []
        while b"\n\n" in self._buf:
            event, self._buf = self._buf.split(b"\n\n", 1)
            out.append(await self._rewrite(event) + b"\n\n")
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest

    async def _rewrite(self, event: bytes) -> bytes:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return event
        try:
            payload = json.loads(event[6:])
        except ValueError:
            return event
        if not isinstance(payload, dict):
            return event
        return b"data: " + json.dumps(await self.edit(payload), separators=(",", ":")).encode()


class ChunkHashesMiddleware:
    def __init__(self, app: ASGIApp, memory_url: str | None = None,
                 timeout_s: float = 2.0, token: str | None = None) -> None:
        self.app = app
        self.memory_url = (memory_url or os.environ.get(MEMORY_URL_ENV) or "").rstrip("/")
        self.token = token or os.environ.get(TOKEN_ENV) or None  # the pod's memory API's
        self.timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if (scope.get("type") != "http" or scope.get("method") != "POST"
                or scope.get("path") not in STREAM_PATHS or not self.memory_url):
            await self.app(scope, receive, send)
            return
        state: dict[str, Any] = {"stream": False, "params": None, "asked": False}
        rewriter = SseRewriter(lambda event: self._edit(event, state))

        async def send_rewritten(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                ctype = headers.get(b"content-type", b"")
                state["stream"] = ctype.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and state["stream"]:
                body = await rewriter.feed(message.get("body", b""))
                if not message.get("more_body", False):
                    body += rewriter.flush()
                message = {**message, "body": body}
            await send(message)

        await self.app(scope, receive, send_rewritten)

    async def _edit(self, event: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        if not finishing_event(event) or "kv_transfer_params" in event:
            return event
        if not state["asked"]:
            state["asked"] = True
            state["params"] = await self._lookup(str(event.get("id", "")))
        if state["params"]:
            event["kv_transfer_params"] = dict(state["params"])
        return event

    async def _lookup(self, response_id: str) -> dict[str, Any] | None:
        if not response_id:
            return None
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s,
                                             headers=auth_headers(self.token))
        for rid in candidate_ids(response_id):
            try:
                r = await self._client.get(
                    f"{self.memory_url}/memory/requests/{rid}/kv_transfer_params")
            except httpx.HTTPError as exc:
                log.warning("stream_kv_params_lookup_failed", error=repr(exc))
                return None
            if r.status_code == 200:
                params = r.json().get("kv_transfer_params")
                return params if isinstance(params, dict) else None
        return None
