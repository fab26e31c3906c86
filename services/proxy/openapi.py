"""What the proxy's OpenAPI says it takes and answers.

The proxy reads a turn's body raw and passes it on (a worker, the reference one or vLLM,
validates it), so FastAPI sees no body model; these routes document the workers' request
models, which the reference worker enforces, plus AgentServing's ``agent_memory`` and the
ecosystem's ``cache_control`` and ``nvext`` (``request_hints``) that the proxy takes off before
forwarding; less ``kv_transfer_params``, the P/D hand-off's, which only the proxy sets (a
client's is a 400). Token ids and lengths are bounded by the model behind the
proxy, which its schema cannot know: a worker answers 400 with code
``token_id_out_of_vocabulary`` or ``context_length_exceeded`` there. The proxy answers
``context_length_exceeded`` itself, before routing, where it is certain without a tokenizer
(``context_limit``): ``max_tokens`` past the context alone, or a token-id prompt plus
``max_tokens`` past it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from agentserving.core.openai_protocol import ChatCompletionRequest, CompletionRequest
from agentserving.core.service import error_responses
from agentserving.proxy.memory_hooks import AgentMemory
from agentserving.proxy.request_hints import CacheControl, NvExt


class _WithMemory(BaseModel):
    agent_memory: AgentMemory | None = None
    cache_control: CacheControl | None = Field(
        default=None, description="Anthropic's spelling of a pin: keep this session's KV for "
        "ttl after the turn (no ttl: the proxy's predicted tool gap).")
    nvext: NvExt | None = Field(default=None, description="Dynamo's request extension: "
                                "cache_control and agent_hints are read, the rest ignored.")


class ChatTurn(ChatCompletionRequest, _WithMemory):
    """A chat turn: the workers' chat request and the agent's memory hooks."""


class CompletionTurn(CompletionRequest, _WithMemory):
    """A completion turn: the workers' completion request and the agent's memory hooks."""


def turn_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting ``model`` as a route's JSON body."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


TURN_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The worker's answer; with `stream`, server-sent events ending in "
                         "`data: [DONE]`.", "content": {"application/json": {},
                                                        "text/event-stream": {}}},
    **error_responses(400, 401, 404, 413, 503),
    502: {"description": "Every worker tried failed this turn.",
          **{k: v for k, v in error_responses(503)[503].items() if k != "description"}},
}


def document_turn_bodies(app: FastAPI) -> None:
    """Add the turn models to the app's OpenAPI components (the routes refer to them)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        _, defs = models_json_schema([(ChatTurn, "validation"), (CompletionTurn, "validation")],
                                     ref_template="#/components/schemas/{model}")
        for turn in (ChatTurn, CompletionTurn):  # the proxy sets the hand-off, never a client
            defs["$defs"][turn.__name__]["properties"].pop("kv_transfer_params", None)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(
            defs.get("$defs", {}))
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
