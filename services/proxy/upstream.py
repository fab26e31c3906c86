"""Talking to a worker's OpenAI API: one call, retryable failures told apart from answers.

A connection failure, a timeout or a 5xx is ``UpstreamFailed`` (the orchestrator tries another
pod); a 4xx is the worker's verdict on the request and goes back to the caller as it is.

The client is aiohttp: every turn makes two upstream calls (prefill, then decode) carrying the
whole prompt, and aiohttp spends about a quarter of httpx's CPU per call (0.2 vs 0.8 ms for a
5k-token body on this machine), which is most of the proxy's own cost per turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from agentserving.core.schemas import PROMPT_SOURCES_PARAM as SOURCES_KEY
from agentserving.proxy.jsonio import dumps, loads

_JSON = {"content-type": "application/json"}

# What a failing worker or connection raises, before or during a streamed answer.
UPSTREAM_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, asyncio.TimeoutError)

# Does the pod still answer (``liveness``)? Asked when a call has been silent past its deadline.
Liveness = Callable[[], Awaitable[bool]]
T = TypeVar("T")


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


class Stalled(UpstreamFailed):
    """The pod took the request and went silent past a deadline (``kind``: first_token or
    inter_token): retried elsewhere as a failed pod is, and kept out of rotation."""

    def __init__(self, pod: str, kind: str, deadline_s: float) -> None:
        super().__init__(pod, f"stalled: no {kind.replace('_', ' ')} within {deadline_s:.3g}s")
        self.kind = kind
        self.deadline_s = deadline_s


class InterTokenStall(asyncio.TimeoutError):
    """A stream's next line did not come within its inter-token deadline and its pod did not
    answer a probe (one of ``UPSTREAM_ERRORS``: a stream that stalls ends as one whose pod
    died)."""

    def __init__(self, pod: str, deadline_s: float) -> None:
        super().__init__(f"{pod}: stalled: no token within {deadline_s:.3g}s")
        self.pod = pod
        self.deadline_s = deadline_s


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


class PodSilent(Exception):
    """A call's answer did not come within its deadline and the pod did not answer a probe."""

    def __init__(self, waited_s: float) -> None:
        super().__init__(f"silent for {waited_s:.3g}s")
        self.waited_s = waited_s


async def unless_silent(call: Awaitable[T], silence_s: float, alive: Liveness | None) -> T:
    """``call``'s result. Each time ``silence_s`` passes without it, ``alive`` is asked: while
    the pod answers, the call gets another ``silence_s``; when it does not (or there is no
    ``alive``), ``PodSilent``. The call is cancelled unless it finished."""
    task = asyncio.ensure_future(call)
    t0 = time.perf_counter()
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=silence_s)
            if done:
                return task.result()
            answered = alive is not None and await alive()
            if task.done():  # the answer came while the probe was out
                return task.result()
            if not answered:
                raise PodSilent(time.perf_counter() - t0)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class StreamReply:
    """A worker's answer whose body is still to be read, line by line. With an inter-token
    deadline, a line that does not come in time while the pod answers no probe (``alive``)
    raises ``InterTokenStall``; ``on_gap`` is told each gap between two ``data:`` lines (the
    latencies the adaptive deadlines follow)."""

    def __init__(self, resp: aiohttp.ClientResponse, pod: str = "",
                 inter_token_s: float | None = None,
                 on_gap: Callable[[float], None] | None = None,
                 alive: Liveness | None = None) -> None:
        self._resp = resp
        self.status_code = resp.status
        self.headers: Mapping[str, str] = resp.headers
        self.pod = pod
        self.inter_token_s = inter_token_s
        self.on_gap = on_gap
        self.alive = alive
        self.first_token_s: float | None = None  # from the request to the first data line
        self._early: list[str] = []  # lines read before the body was handed on
        self._lines: AsyncIterator[str] | None = None

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    async def aread(self) -> bytes:
        return await self._resp.read()

    async def aclose(self) -> None:
        self._resp.release()

    def abort(self) -> None:
        """Drop the connection: the pod may still be writing (or stopped mid-answer)."""
        self._resp.close()

    async def first_event(self) -> None:
        """Read up to the first ``data:`` line (the first token), keeping what was read for
        ``aiter_lines``. The caller bounds it with the first-token deadline."""
        lines = self._raw_lines()
        self._lines = lines
        async for line in lines:
            self._early.append(line)
            if line.startswith("data:"):
                return

    async def aiter_lines(self) -> AsyncIterator[str]:
        """Lines without their ``\n`` / ``\r\n``; raises ``UPSTREAM_ERRORS`` if the worker
        goes away mid-stream (the client's own timeout included), ``InterTokenStall`` if it
        goes silent past the deadline and answers no probe."""
        for line in self._early:
            yield line
        self._early = []
        lines = self._lines if self._lines is not None else self._raw_lines()
        last = time.perf_counter()
        while True:
            try:
                if self.inter_token_s is None:
                    line = await anext(lines)
                else:
                    line = await unless_silent(anext(lines), self.inter_token_s, self.alive)
            except StopAsyncIteration:
                return
            except PodSilent as silent:
                raise InterTokenStall(self.pod, silent.waited_s) from None
            if line.startswith("data:"):
                now = time.perf_counter()
                if self.on_gap is not None and line[5:].strip() != "[DONE]":
                    self.on_gap(now - last)
                last = now
            yield line

    async def _raw_lines(self) -> AsyncIterator[str]:
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
    return StreamReply(resp, pod)


async def post_watched(client: aiohttp.ClientSession, pod: str, url: str, body: dict[str, Any],
                       headers: Mapping[str, str] | None, silence_s: float,
                       alive: Liveness | None) -> Reply:
    """``post_json``, or ``Stalled`` when the answer has not come within ``silence_s`` and
    the pod answers no probe (``unless_silent``). A blocking answer shows no token before its
    last, so however long it takes, only the pod's silence to a probe moves it."""
    try:  # post_json turns the client's own timeouts into UpstreamFailed: this one is ours
        return await unless_silent(post_json(client, pod, url, body, headers), silence_s, alive)
    except PodSilent as silent:
        raise Stalled(pod, "first_token", silent.waited_s) from None


async def open_watched_stream(client: aiohttp.ClientSession, pod: str, url: str,
                              body: dict[str, Any], headers: Mapping[str, str] | None,
                              first_token_s: float, inter_token_s: float,
                              on_gap: Callable[[float], None] | None = None,
                              alive: Liveness | None = None) -> StreamReply:
    """``open_stream`` that also reads up to the first token, ``Stalled`` when it has not come
    within ``first_token_s`` and the pod answers no probe; its later lines are watched the
    same way with ``inter_token_s``. Nothing has reached the caller when it returns, so any
    failure up to the first token -- a pod that dies, one that stalls -- can still move the
    turn to another pod unseen."""
    t0 = time.perf_counter()
    opened: list[StreamReply] = []

    async def first_token() -> StreamReply:
        reply = await open_stream(client, pod, url, body, headers)
        opened.append(reply)
        if reply.is_success:
            try:
                await reply.first_event()
            except UPSTREAM_ERRORS as exc:
                raise UpstreamFailed(pod, f"before the first token: "
                                     f"{type(exc).__name__}: {exc}") from exc
        return reply

    try:
        reply = await unless_silent(first_token(), first_token_s, alive)
    except BaseException as exc:
        for r in opened:
            r.abort()
        if isinstance(exc, PodSilent):
            raise Stalled(pod, "first_token", exc.waited_s) from None
        raise
    reply.first_token_s = time.perf_counter() - t0
    reply.inter_token_s, reply.on_gap, reply.alive = inter_token_s, on_gap, alive
    return reply


@dataclass
class TurnOutcome:
    """What the proxy learns from a worker's answer, streamed or not."""

    chunk_hashes: list[str] | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    prompt_sources: dict[str, Any] | None = None  # the pod's (engine.vllm.prompt_sources)
    finish_reason: str | None = None
    tool_names: list[str] = field(default_factory=list)
    completion_tokens: int | None = None

    def absorb(self, payload: dict[str, Any]) -> None:
        params = payload.get("kv_transfer_params")
        if isinstance(params, dict) and isinstance(params.get("chunk_hashes"), list):
            self.chunk_hashes = params["chunk_hashes"]
        if isinstance(params, dict) and isinstance(params.get(SOURCES_KEY), dict):
            self.prompt_sources = params[SOURCES_KEY]
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


@dataclass(frozen=True)
class PrefillReport:
    """What a P/D turn's caller hears of its prompt: it was read and computed on the prefill
    pod, so its cache hit and prompt sources are that pod's (the decode pod pulled it all)."""

    cached_tokens: int | None = None
    prompt_sources: dict[str, Any] | None = None

    def patch(self, payload: dict[str, Any]) -> bool:
        """Put the prefill pod's figures in an answer's usage and ``kv_transfer_params``,
        where the decode pod reported its own; True when anything changed."""
        changed = False
        usage = payload.get("usage")
        if self.cached_tokens is not None and isinstance(usage, dict):
            details = usage.get("prompt_tokens_details") or {}
            details["cached_tokens"] = self.cached_tokens
            usage["prompt_tokens_details"] = details
            changed = True
        params = payload.get("kv_transfer_params")
        if self.prompt_sources is not None and isinstance(params, dict) \
                and SOURCES_KEY in params:
            params[SOURCES_KEY] = self.prompt_sources
            changed = True
        return changed


async def relay_sse(resp: StreamReply, outcome: TurnOutcome,
                    prefill: PrefillReport | None) -> AsyncIterator[bytes]:
    """Pass SSE lines through, reading (and, for P/D, patching) the events that matter."""
    async for line in resp.aiter_lines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            try:
                payload = loads(line[5:])
            except ValueError:
                payload = None
            if isinstance(payload, dict):
                outcome.absorb(payload)
                if prefill is not None and prefill.patch(payload):
                    line = "data: " + dumps(payload).decode()
        yield (line + "\n").encode()
