"""A small OpenAI-compatible completions server, for tests and benches (needs fastapi).

It speaks the streaming format the worker and proxy speak (SSE ``data:`` chunks, a usage chunk
with ``prompt_tokens_details.cached_tokens``, ``kv_transfer_params.chunk_hashes``, ``[DONE]``),
honours ``forced_output_token_ids`` (with ``return_token_ids`` it streams each token's id, as
vLLM does), keeps an unbounded prefix cache of ``chunk``-token chunks (prompt and output, as a
real engine would) and logs every request so tests can compare runs. Failures, and outputs
that stray from the forced ids, can be injected per (session, nth request).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeState:
    chunk: int = 16
    token_delay_s: float = 0.002
    cache: bool = True
    fail: set[tuple[str, int]] = field(default_factory=set)  # (session, nth request) -> 500
    stray: set[tuple[str, int]] = field(default_factory=set)  # -> first output id changed
    token_ids: bool = True  # stream the ids when a request asks (return_token_ids)
    requests: list[dict[str, Any]] = field(default_factory=list)
    seen: set[bytes] = field(default_factory=set)
    per_session: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        """Forget requests and the cache (a fresh server), keeping the settings."""
        with self.lock:
            self.requests.clear()
            self.per_session.clear()
            self.seen.clear()

    def chain(self, tokens: list[int]) -> list[bytes]:
        out, prev = [], b""
        for i in range(len(tokens) // self.chunk):
            part = json.dumps(tokens[i * self.chunk:(i + 1) * self.chunk]).encode()
            prev = hashlib.sha256(prev + part).digest()
            out.append(prev)
        return out


def make_fake_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):  # type: ignore[no-untyped-def]
        body = await request.json()
        sid = request.headers.get("x-session-id", "")
        with state.lock:
            nth = state.per_session.get(sid, 0)
            state.per_session[sid] = nth + 1
            state.requests.append({"session": sid, "nth": nth, "body": body,
                                   "parent": request.headers.get("x-parent-session-id"),
                                   "tool": request.headers.get("x-agentserving-next-tool"),
                                   "auth": request.headers.get("authorization")})
        if (sid, nth) in state.fail:
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error",
                                           "param": None, "code": None}}, status_code=500)
        prompt: list[int] = body["prompt"]
        forced: list[int] = body["forced_output_token_ids"]
        assert body["max_tokens"] == len(forced)
        chain = state.chain(prompt)
        with state.lock:
            hit = 0
            limit = (len(prompt) - 1) // state.chunk
            while state.cache and hit < min(len(chain), limit) and chain[hit] in state.seen:
                hit += 1
            state.seen.update(state.chain(prompt + forced[:-1]))
        cached = hit * state.chunk
        emitted = list(forced)
        if (sid, nth) in state.stray:
            emitted[0] += 1
        ids = state.token_ids and bool(body.get("return_token_ids"))

        async def stream():  # type: ignore[no-untyped-def]
            for i, tok in enumerate(emitted):
                await asyncio.sleep(state.token_delay_s)
                finish = "length" if i == len(forced) - 1 else None
                choice = {"index": 0, "text": f" t{tok}", "finish_reason": finish}
                if ids:
                    choice["token_ids"] = [tok]
                yield "data: " + json.dumps({"object": "text_completion",
                                             "choices": [choice]}) + "\n\n"
            yield "data: " + json.dumps({
                "object": "text_completion", "choices": [],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(forced),
                          "total_tokens": len(prompt) + len(forced),
                          "prompt_tokens_details": {"cached_tokens": cached}},
                "kv_transfer_params": {"chunk_hashes": [c.hex() for c in chain]}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers={
            "x-agentserving-prefill-pod": "fake-prefill-0",
            "x-agentserving-decode-pod": "fake-decode-0"})

    return app
