"""Talking to a worker's OpenAI API: one call, retryable failures told apart from answers.

A connection failure, a timeout or a 5xx is ``UpstreamFailed`` (the orchestrator tries another
pod); a 4xx is the worker's verdict on the request and goes back to the caller as it is.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx


class UpstreamFailed(Exception):
    def __init__(self, pod: str, reason: str) -> None:
        super().__init__(f"{pod}: {reason}")
        self.pod = pod
        self.reason = reason


async def post_json(client: httpx.AsyncClient, pod: str, url: str, body: dict[str, Any]
                    ) -> httpx.Response:
    try:
        resp = await client.post(url, json=body)
    except httpx.HTTPError as exc:
        raise UpstreamFailed(pod, f"{type(exc).__name__}: {exc}") from exc
    if resp.status_code >= 500:
        raise UpstreamFailed(pod, f"HTTP {resp.status_code}: {resp.text[:200]}")
    return resp


async def open_stream(client: httpx.AsyncClient, pod: str, url: str, body: dict[str, Any]
                      ) -> httpx.Response:
    """Send the request and read the status line; the body is read later, line by line."""
    try:
        resp = await client.send(client.build_request("POST", url, json=body), stream=True)
    except httpx.HTTPError as exc:
        raise UpstreamFailed(pod, f"{type(exc).__name__}: {exc}") from exc
    if resp.status_code >= 500:
        text = (await resp.aread()).decode(errors="replace")[:200]
        await resp.aclose()
        raise UpstreamFailed(pod, f"HTTP {resp.status_code}: {text}")
    return resp


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


async def relay_sse(resp: httpx.Response, outcome: TurnOutcome,
                    cached_override: int | None) -> AsyncIterator[bytes]:
    """Pass SSE lines through, reading (and, for P/D, patching) the events that matter."""
    async for line in resp.aiter_lines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            try:
                payload = json.loads(line[5:])
            except json.JSONDecodeError:
                payload = None
            if isinstance(payload, dict):
                outcome.absorb(payload)
                if patch_cached_tokens(payload, cached_override):
                    line = "data: " + json.dumps(payload, separators=(",", ":"))
        yield (line + "\n").encode()
