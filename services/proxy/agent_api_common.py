"""What the Anthropic Messages and OpenAI Responses front doors share: naming a bad field by
where it sits in the client's JSON, reading a chat answer's usage, and the SSE framing both
APIs use (``event:`` and ``data:`` lines) over the chat stream the pods answer."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, Field, ValidationError, WithJsonSchema

from agentserving.core.openai_protocol import ForcedTokenIds
from agentserving.core.service import ApiError, field_path
from agentserving.proxy.memory_hooks import AgentMemory
from agentserving.proxy.request_hints import NvExt

M = TypeVar("M", bound=BaseModel)


def input_path(raw: Any, loc: Sequence[Any]) -> str:
    """A validation error's place in the client's own JSON (``messages[0].content[1].id``):
    pydantic's location also names the union members it tried (``list[...]``, a block's
    ``type`` tag), which are dropped by following the input; a last step the input lacks is
    kept where it can be a missing field (in an object)."""
    kept: list[Any] = []
    node = raw
    for i, part in enumerate(loc):
        if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(node, dict) and isinstance(part, str) and part in node:
            node = node[part]
        elif i < len(loc) - 1 or not isinstance(node, dict):
            continue
        kept.append(part)
    return field_path(kept)


def validated(model: type[M], raw: Any) -> M:
    """``raw`` as ``model``, or a 400 naming the field (``ApiError``; each API renders it in
    its own error shape)."""
    if not isinstance(raw, dict):
        raise ApiError(400, "body must be a JSON object", param="body")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        # of the union members tried, the one that got furthest says what is wrong
        err = max(exc.errors(), key=lambda e: len(e["loc"]))
        param = input_path(raw, err["loc"]) or "body"
        raise ApiError(400, f"{param}: {err['msg']}", param=param) from exc


def type_other_than(*offered: str) -> Any:
    """The ``type`` of a tool the pods' chat API cannot offer a model (a provider's built-in
    or server tool: web search, a shell, a freeform tool): any string but the ``offered``
    types, whose own models say what they need."""

    def not_offered(value: str) -> str:
        if value in offered:
            raise ValueError(f"a {value} tool needs its own fields")
        return value

    return Annotated[str, AfterValidator(not_offered),
                     WithJsonSchema({"type": "string", "not": {"enum": list(offered)}})]


class TurnExtensions(BaseModel):
    """What a turn may carry besides its API's own fields, as on chat completions:
    AgentServing's ``agent_memory``, Dynamo's ``nvext`` and teacher forcing."""

    agent_memory: AgentMemory | None = None
    nvext: NvExt | None = None
    forced_output_token_ids: ForcedTokenIds = Field(
        default=None, min_length=1, description="Teacher forcing: the pod emits these tokens "
        "(a replayed trace computes the same tokens on every configuration).")

    def chat_fields(self) -> dict[str, Any]:
        """The extensions given, as the chat body carries them."""
        out: dict[str, Any] = {}
        for name in ("agent_memory", "nvext"):
            if (value := getattr(self, name)) is not None:
                out[name] = value.model_dump(exclude_none=True)
        if self.forced_output_token_ids is not None:
            out["forced_output_token_ids"] = self.forced_output_token_ids
        return out


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class ChatUsage:
    """A chat answer's token counts, as the pods measured them (cached: reused, not
    computed)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def of(cls, usage: Any) -> ChatUsage | None:
        if not isinstance(usage, dict):
            return None
        details = usage.get("prompt_tokens_details") or {}
        return cls(int(usage.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0),
                   int(usage.get("completion_tokens") or 0))


def json_arguments(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as an object (what the Messages API's ``input`` is); text that
    is no JSON object is kept whole under ``_raw`` rather than lost."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"_raw": arguments}


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def chat_stream_payloads(body: AsyncIterator[bytes | str]
                               ) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a chat completion stream (its chunks, a usage chunk, an in-band
    error), ending at ``[DONE]`` or the stream's end."""
    pending = ""
    async for part in body:
        pending += part.decode() if isinstance(part, bytes) else part
        *lines, pending = pending.split("\n")
        for line in lines:
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            try:
                payload = json.loads(data)
            except ValueError:
                continue
            if isinstance(payload, dict):
                yield payload
