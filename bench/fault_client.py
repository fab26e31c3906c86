"""The fault bench's client: replays the workload through the proxy as an agent harness
would, and writes down every attempt of every turn.

Sessions run concurrently, each turn after the previous one answered plus the think time. A
failed turn is sent again (after 0.25-1 s) until it is answered or ``turn_deadline_s`` has
passed, the way an agent harness retries an error it is told is retriable; each attempt is
kept (``fault_plan.Attempt``), so the bench can tell a turn the proxy saved from one the
client had to save, and a clean error from a silent cut. ``hooks`` see every turn sent and
every token that arrives: that is where the bench triggers its faults, mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from agentserving.core.openai_protocol import sse_data
from agentserving.replay.trace import ResolvedTurn
from bench.fault_plan import Attempt, TurnResult, Workload, attempt_kind, request_body

H_SESSION = "x-session-id"
H_RETRIED = "x-agentserving-retried"  # services/proxy/orchestrator.py
H_DECODE = "x-agentserving-decode-pod"
H_PREFILL = "x-agentserving-prefill-pod"


@dataclass
class Hooks:
    """Called on the event loop: keep them quick (start a task for anything slow)."""

    on_send: Callable[[int, int], None] = lambda s, t: None
    on_token: Callable[[int, int, Attempt], None] = lambda s, t, a: None
    on_result: Callable[[TurnResult], None] = lambda r: None


async def attempt(client: httpx.AsyncClient, url: str, body: dict[str, Any], session: str,
                  on_token: Callable[[Attempt], None], timeout_s: float) -> Attempt:
    """One streamed try of a turn, read to its end or its failure."""
    a = Attempt(started=time.monotonic(), ended=0.0)
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers={H_SESSION: session}, timeout=timeout_s) as resp:
            a.status = resp.status_code
            a.decode_pod = resp.headers.get(H_DECODE)
            a.prefill_pod = resp.headers.get(H_PREFILL)
            retried = resp.headers.get(H_RETRIED)
            a.proxy_retried = [p for p in (retried or "").split(",") if p]
            if resp.status_code != 200:
                _error_from(a, (await resp.aread()).decode(errors="replace"))
            else:
                async for line in resp.aiter_lines():
                    if (data := sse_data(line)) is None:
                        continue
                    if data == "[DONE]":
                        a.done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        _error_from(a, data)
                        continue  # read on to the end: a [DONE] may follow it
                    usage = obj.get("usage") or {}
                    tiers = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens_by_tier")
                    if isinstance(tiers, dict):
                        a.cached_by_tier = {str(k): int(v) for k, v in tiers.items()}
                    for choice in obj.get("choices") or []:
                        ids = choice.get("token_ids") or []
                        if ids:
                            a.tokens.extend(int(t) for t in ids)
                            on_token(a)
                        if choice.get("finish_reason") is not None:
                            a.finished = True
    except httpx.HTTPError as exc:
        a.transport_error = f"{type(exc).__name__}: {exc}"[:300]
    a.ended = time.monotonic()
    return a


def _error_from(a: Attempt, text: str) -> None:
    try:
        err = json.loads(text).get("error")
    except ValueError:
        err = None
    if isinstance(err, dict):
        a.error_type, a.error_code = err.get("type"), err.get("code")
        a.error_message = str(err.get("message"))[:300]
    else:
        a.error_message = text[:300] or "(empty error body)"


async def run_session(client: httpx.AsyncClient, url: str, k: int, turns: list[ResolvedTurn],
                      w: Workload, model: str, hooks: Hooks, t0: float,
                      turn_deadline_s: float, attempt_timeout_s: float) -> list[TurnResult]:
    await asyncio.sleep(max(0.0, t0 + k * w.stagger_s - time.monotonic()))
    out = []
    for turn in turns:
        body = request_body(turn, model, w.output_tokens)
        result = TurnResult(k, turn.index, [])
        deadline = time.monotonic() + turn_deadline_s
        backoff = 0.25
        while True:
            hooks.on_send(k, turn.index)
            a = await attempt(client, url, body, f"fault-s{k}",
                              lambda a, _t=turn.index: hooks.on_token(k, _t, a),
                              attempt_timeout_s)
            result.attempts.append(a)
            if attempt_kind(a) == "ok" or time.monotonic() + backoff > deadline:
                break
            await asyncio.sleep(backoff)
            backoff = min(1.0, backoff * 2)
        out.append(result)
        hooks.on_result(result)
        if result.final is None:
            break  # the session's context is not where the next turn expects it: stop there
        await asyncio.sleep(w.think_s)
    return out


async def replay(url: str, sessions: list[list[ResolvedTurn]], w: Workload, model: str,
                 hooks: Hooks | None = None, turn_deadline_s: float = 60.0,
                 attempt_timeout_s: float = 30.0) -> list[TurnResult]:
    """Every session's turns through ``url``; results in session, turn order."""
    hooks = hooks or Hooks()
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        per = await asyncio.gather(*(run_session(client, url, k, turns, w, model, hooks, t0,
                                                 turn_deadline_s, attempt_timeout_s)
                                     for k, turns in enumerate(sessions)))
    return [r for rs in per for r in rs]
