"""A pod's chat completions API as the wire shows it, for the proxy's API translations: it
records each body and answers as vLLM does (a tool call where ``tool_choice`` forces one, else
text; usage with the prompt tokens a previous request's prompt already held as cached; streamed
chunks ending in a usage chunk and ``[DONE]``), plus ``/tokenize`` over messages."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from testkit.servers import ThreadedServer

ANSWER = "Paris is the capital."
ARGUMENTS = '{"city": "Paris"}'


def prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """A stand-in token count: one per 4 characters of the messages' JSON."""
    return len(json.dumps(messages)) // 4


class ChatPod:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self._seen: list[list[dict[str, Any]]] = []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            body = await request.json()
            self.bodies.append(body)
            messages = body["messages"]
            cached = max((prompt_tokens(m) for m in self._seen
                          if messages[:len(m)] == m), default=0)
            self._seen.append(messages)
            usage = {"prompt_tokens": prompt_tokens(messages), "completion_tokens": 5,
                     "total_tokens": prompt_tokens(messages) + 5,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            choice = body.get("tool_choice")
            call = isinstance(choice, dict) or choice == "required"
            name = choice["function"]["name"] if isinstance(choice, dict) else \
                (body.get("tools") or [{"function": {"name": "x"}}])[0]["function"]["name"]
            if body.get("stream"):
                return StreamingResponse(self._chunks(call, name, usage),
                                         media_type="text/event-stream")
            message: dict[str, Any] = {"role": "assistant", "content": None if call else ANSWER}
            if call:
                message["tool_calls"] = [{"id": "chatcmpl-tool-1", "type": "function",
                                          "function": {"name": name, "arguments": ARGUMENTS}}]
            return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000,
                    "model": body["model"], "usage": usage,
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop",
                                 "stop_reason": None}],
                    "kv_transfer_params": {"chunk_hashes": ["a1b2c3"]}}

        @app.post("/tokenize")
        async def tokenize(request: Request) -> dict[str, Any]:
            body = await request.json()
            self.bodies.append(body)
            n = prompt_tokens(body["messages"])
            return {"count": n, "max_model_len": 4096, "tokens": list(range(n))}

        self.server = ThreadedServer(app)

    @staticmethod
    async def _chunks(call: bool, name: str, usage: dict[str, Any]):  # type: ignore[no-untyped-def]
        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            return "data: " + json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk",
                                          "created": 1700000000, "model": "m", "choices": [
                                              {"index": 0, "delta": delta,
                                               "finish_reason": finish}]}) + "\n\n"

        yield chunk({"role": "assistant", "content": ""})
        if call:
            yield chunk({"tool_calls": [{"index": 0, "id": "chatcmpl-tool-1", "type": "function",
                                         "function": {"name": name, "arguments": ""}}]})
            for piece in ('{"city": ', '"Paris"}'):
                yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        else:
            for word in ANSWER.split(" "):
                yield chunk({"content": word + " " if not word.endswith(".") else word})
        yield chunk({}, "tool_calls" if call else "stop")
        yield "data: " + json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk",
                                     "created": 1700000000, "model": "m", "choices": [],
                                     "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"
