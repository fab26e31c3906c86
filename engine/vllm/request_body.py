"""Rewriting an OpenAI request's JSON body before vLLM's API server reads it: an ASGI base.

vLLM's OpenAI server parses the body into its own request models, where fields it does not
know are dropped with a warning. The project's request extensions (a tenant's ``cache_salt``
for LMCache, teacher forcing) have to become fields vLLM does know before that happens, so
each is a middleware (``vllm serve --middleware``) that reads the whole body once, hands the
decoded object to ``rewrite`` and passes the result on with its ``content-length`` fixed. A
rewrite may also refuse the request with a 400 in OpenAI's error shape (``BodyRejected``):
vLLM would otherwise accept it and fail later, in the engine process.

Only POSTs to the two generation routes are read; everything else passes untouched, and a
body that is not JSON goes to vLLM as it came (vLLM answers it with its own 400).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class BodyRejected(ValueError):
    """A body the engine must not start on; the message names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return v.decode("latin-1") or None
    return None


class JsonBodyMiddleware:
    """Subclasses implement ``rewrite``: the new body, or None to leave it as it was."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    def rewrite(self, body: Any, scope: Scope) -> Any | None:
        raise NotImplementedError

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope.get("type") != "http" or scope.get("method") != "POST"
                or scope.get("path") not in GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, replay([message]), send)  # disconnect: pass it on
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        try:
            new = self.rewrite(json.loads(raw), scope)
        except ValueError as exc:  # BodyRejected, or not JSON (vLLM answers that itself)
            if isinstance(exc, BodyRejected):
                await reject(send, exc)
                return
            new = None
        if new is not None:
            raw = json.dumps(new).encode()
            scope = {**scope, "headers": [
                (k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"
            ] + [(b"content-length", str(len(raw)).encode())]}
        await self.app(scope, replay([{"type": "http.request", "body": raw,
                                       "more_body": False}], receive), send)


async def reject(send: Send, exc: BodyRejected) -> None:
    """A 400 as vLLM's own errors look (OpenAI's shape), naming the field."""
    payload = json.dumps({"error": {"message": str(exc), "type": "BadRequestError",
                                    "param": exc.param, "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def replay(messages: list[Message], then: Receive | None = None) -> Receive:
    """A ``receive`` that hands out ``messages`` first, then defers to ``then``."""
    pending = list(messages)

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}

    return receive
