"""Talking to a worker's OpenAI API: one call, retryable failures told apart from answers.

A connection failure, a timeout or a 5xx is ``UpstreamFailed`` (the orchestrator tries another
pod); a 4xx is the worker's verdict on the request and goes back to the caller as it is.

The client is aiohttp: every turn makes two upstream calls (prefill, then decode) carrying the
whole prompt, and aiohttp spends about a quarter of httpx's CPU per call (0.2 vs 0.8 ms for a
5k-token body on this machine), which is most of the proxy's own cost per turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from agentserving.proxy.jsonio import dumps, loads

_JSON = {"content-type": "application/json"}

# What a failing worker or connection raises, before or during a streamed answer.
UPSTREAM_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, asyncio.TimeoutError)


def new_session(timeout_s: float, connect_timeout_s: float) -> aiohttp.ClientSession:
    """One pooled keep-alive client for all upstream calls (create it inside the event loop)."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s),
        connector=aiohttp.TCPConnector(limit=1000, keepalive_timeout=60),
        auto_decompress=False)


class UpstreamFailed(Exception):
    def __init__(self, pod: str, reason: str) -> None:
        super().__init__(f"{pod}: {reason}")
        self.pod = pod
        self.reason = reason


@dataclass
class Reply:
    """A worker's whole answer."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        return loads(self.content)


class StreamReply:
    """A worker's answer whose body is still to be read, line by line."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status_code = resp.status
        self.headers: Mapping[str, str] = resp.headers

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    async def aread(self) -> bytes:
        return await self._resp.read()

    async def aclose(self) -> None:
        self._resp.release()

    async def aiter_lines(self) -> AsyncIterator[str]:
        """Lines without their ``\n`` / ``\r\n``; raises ``UPSTREAM_ERRORS`` if the worker
        goes away mid-stream."""
        buf = b""
        async for data in self._resp.content.iter_any():
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                yield line.removesuffix(b"\r").decode()
        if buf:
            yield buf.removesuffix(b"\r").decode()


async def post_json(client: aiohttp.ClientSession, pod: str, url: str, body: dict[str, Any],
                    headers: Mapping[str, str] | None = None) -> Reply:
    try:
        async with client.post(url, data=dumps(body),
                               headers={**_JSON, **headers} if headers else _JSON) as resp:
            reply = Reply(resp.status, resp.headers, await resp.read())
    except UPSTREAM_ERRORS as exc:
        raise UpstreamFailed(pod, f"{type(exc).__name__}: {exc}") from exc
    if reply.status_code >= 500:
        raise UpstreamFailed(pod, f"HTTP {reply.status_code}: {reply.text[:200]}")
    return reply


async def open_stream(client: aiohttp.ClientSession, pod: str, url: str, body: dict[str, Any],
                      headers: Mapping[str, str] | None = None) -> StreamReply:
    """Send the request and read the status line; the body is read later, line by line."""
    try:
        resp = await client.post(url, data=dumps(body),
                                 headers={**_JSON, **headers} if headers else _JSON)
    except UPSTREAM_ERRORS as exc:
        raise UpstreamFailed(pod, f"{type(exc).__name__}: {exc}") from exc
    if resp.status >= 500:
        try:
            text = (await resp.read()).decode(errors="replace")[:200]
        except UPSTREAM_ERRORS:
            text = ""
        resp.release()
        raise UpstreamFailed(pod, f"HTTP {resp.status}: {text}")
    return StreamReply(resp)


@dataclass
class TurnOutcome:
    """What the proxy learns from a worker's answer, streamed or not."""

    chunk_hashes: list[str] | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    tool_names: list[str] = field(default_factory=list)
    completion_tokens: int | None = None

    def absorb(self, payload: dict[str, Any]) -> None:
        params = payload.get("kv_transfer_params")
        if isinstance(params, dict) and isinstance(params.get("chunk_hashes"), list):
            self.chunk_hashes = params["chunk_hashes"]
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                self.cached_tokens = details["cached_tokens"]
        for choice in payload.get("choices") or []:
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            message = choice.get("message") or choice.get("delta") or {}
            for call in message.get("tool_calls") or []:
                name = (call.get("function") or {}).get("name")
                if name:
                    self.tool_names.append(name)


def patch_cached_tokens(payload: dict[str, Any], cached_tokens: int | None) -> bool:
    """Report the prefill pod's cache hit in the caller's usage (the decode pod pulled it all)."""
    usage = payload.get("usage")
    if cached_tokens is None or not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details") or {}
    details["cached_tokens"] = cached_tokens
    usage["prompt_tokens_details"] = details
    return True


async def relay_sse(resp: StreamReply, outcome: TurnOutcome,
                    cached_override: int | None) -> AsyncIterator[bytes]:
    """Pass SSE lines through, reading (and, for P/D, patching) the events that matter."""
    async for line in resp.aiter_lines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            try:
                payload = loads(line[5:])
            except ValueError:
                payload = None
            if isinstance(payload, dict):
                outcome.absorb(payload)
                if patch_cached_tokens(payload, cached_override):
                    line = "data: " + dumps(payload).decode()
        yield (line + "\n").encode()
