"""The Anthropic Messages API (``POST /v1/messages``) over the pods' chat completions.

A request becomes the chat request ``/v1/chat/completions`` would get for the same
conversation, so the pods apply the same chat template to the same messages and compute the
same token ids: the same ``chunk_hashes``, the same reuse, whichever API a client speaks.

- ``system`` (a string or text blocks) is the first message; text blocks join with a newline,
  as vLLM joins a chat message's text parts (so every engine sees the same prompt).
- ``tool_use`` blocks are the assistant message's ``tool_calls``; each ``tool_result`` block is
  a ``tool`` message (in block order, before the user's other blocks); ``thinking`` blocks are
  dropped (no pod here reasons). ``image`` and ``document`` blocks are a 400: the models
  behind the proxy take text, as its chat completions schema says.
- ``tools`` are functions; ``tool_choice`` auto / any / tool / none is auto / required / the
  named function / none; ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``.
- Each ``cache_control`` breakpoint (``ephemeral``, ``ttl`` 5m by default, or 1h), on a block
  or at the top (automatic caching), pins the session's KV for its TTL after the turn (the
  longest when there are several), through the proxy's pin (``request_hints``): every tier
  that honours pins keeps it.
- ``usage``: ``cache_read_input_tokens`` are the prompt tokens the pods reused;
  ``cache_creation_input_tokens`` those they computed and kept for a request with a breakpoint
  (the pods keep every full chunk they compute); ``input_tokens`` the rest, so the three add
  up to the prompt, as Anthropic's do.

Accepted and ignored: ``thinking``, ``service_tier``, ``container``, ``mcp_servers`` and
other fields this proxy has no use for, and server tools (``web_search`` and the like), which
are not offered to the model.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool

from agentserving.core.service import ApiError
from agentserving.proxy.agent_api_common import (
    ChatUsage,
    TurnExtensions,
    chat_stream_payloads,
    json_arguments,
    new_id,
    sse,
    type_other_than,
)
from agentserving.proxy.request_hints import CacheControl

DEFAULT_BREAKPOINT_TTL_S = 300.0  # Anthropic's ephemeral cache without a ttl: 5 minutes
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                 "function_call": "tool_use"}
# an HTTP status to the type Anthropic's errors carry for it
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")  # citations and the like: no use here

    cache_control: CacheControl | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


def _as_blocks(value: Any) -> Any:
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[list[TextBlock], BeforeValidator(_as_blocks)] = []
    is_error: StrictBool | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                  Field(discriminator="type")]
Blocks = Annotated[list[Block], BeforeValidator(_as_blocks)]
TextBlocks = Annotated[list[TextBlock], BeforeValidator(_as_blocks)]


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: Blocks


class Tool(BaseModel):
    """A client tool: offered to the model as a function."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ServerTool(BaseModel):
    """A server tool (``web_search``, ``code_execution``...) or one of Anthropic's own client
    tools (``bash``, ``text_editor``): accepted, so an agent's whole tool list is served, and
    not offered to the model (the pods run no such tool)."""

    model_config = ConfigDict(extra="allow")

    type: type_other_than("custom")  # type: ignore[valid-type]
    cache_control: CacheControl | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")

    user_id: str | None = None


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: the conversation, without sampling fields."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: TextBlocks | None = None
    tools: list[Tool | ServerTool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest, TurnExtensions):
    """``POST /v1/messages`` (Anthropic Messages), with the turn extensions of chat
    completions."""

    max_tokens: int = Field(ge=1)
    # at most four, as chat completions' stop (the reference engine's bound)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, max_length=4)
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    stream: StrictBool = False
    metadata: Metadata | None = None
    cache_control: CacheControl | None = Field(
        default=None, description="Automatic caching: a breakpoint at the conversation's end.")


# ---------------------------------------------------------------------- request -> chat
def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(b.text for b in blocks)


def _chat_messages(message: MessageParam) -> list[dict[str, Any]]:
    if message.role == "assistant":
        text = [b for b in message.content if isinstance(b, TextBlock)]
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in message.content if isinstance(b, ToolUseBlock)]
        out: dict[str, Any] = {"role": "assistant", "content": _joined(text)}
        if calls:
            out["tool_calls"] = calls
        return [out]
    messages = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _joined(b.content)}
                for b in message.content if isinstance(b, ToolResultBlock)]
    rest = [b for b in message.content if isinstance(b, TextBlock)]
    if rest or not messages:
        messages.append({"role": "user", "content": _joined(rest)})
    return messages


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages."""
    out = [{"role": "system", "content": _joined(req.system)}] if req.system else []
    for message in req.messages:
        out += _chat_messages(message)
    return out


def _tool_fields(req: CountTokensRequest) -> dict[str, Any]:
    offered = [t for t in req.tools or [] if isinstance(t, Tool)]
    if not offered:
        return {}
    out: dict[str, Any] = {"tools": [
        {"type": "function", "function": {"name": t.name, "description": t.description or "",
                                          "parameters": t.input_schema}} for t in offered]}
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise ApiError(400, "tool_choice.name: required when type is 'tool'",
                               param="tool_choice.name")
            out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
    return out


def breakpoint_ttl_s(req: CountTokensRequest) -> float | None:
    """The longest TTL of the request's ``cache_control`` breakpoints (None: none)."""
    marks: list[CacheControl | None] = [getattr(req, "cache_control", None)]
    marks += [b.cache_control for b in req.system or []]
    marks += [t.cache_control for t in req.tools or []]
    for message in req.messages:
        for block in message.content:
            marks.append(block.cache_control)
            if isinstance(block, ToolResultBlock):
                marks += [part.cache_control for part in block.content]
    ttls = [m.ttl if m.ttl is not None else DEFAULT_BREAKPOINT_TTL_S for m in marks if m]
    return max(ttls) if ttls else None


def tokenize_body(req: CountTokensRequest) -> dict[str, Any]:
    """What a pod's ``/tokenize`` counts: the templated conversation, as a turn's prompt."""
    return {"model": req.model, "messages": chat_messages(req), "add_generation_prompt": True,
            **_tool_fields(req)}


def chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The chat completion request for ``req`` (see the module docstring)."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req),
                            "max_tokens": req.max_tokens, **_tool_fields(req)}
    for name, value in (("temperature", req.temperature), ("top_p", req.top_p),
                        ("top_k", req.top_k), ("stop", req.stop_sequences)):
        if value is not None:
            body[name] = value
    body.update(req.chat_fields())
    if (ttl := breakpoint_ttl_s(req)) is not None:
        body["cache_control"] = {"type": "ephemeral", "ttl": ttl}
    if req.stream:
        body.update(stream=True, stream_options={"include_usage": True,
                                                 "continuous_usage_stats": True})
    return body


# ---------------------------------------------------------------------- chat -> message
def usage(chat: ChatUsage | None, breakpoint_ttl: float | None) -> dict[str, Any]:
    """Anthropic's usage from the pods' counts (module docstring)."""
    chat = chat or ChatUsage()
    computed = max(chat.prompt_tokens - chat.cached_tokens, 0)
    created = computed if breakpoint_ttl is not None else 0
    long_lived = breakpoint_ttl is not None and breakpoint_ttl > DEFAULT_BREAKPOINT_TTL_S
    return {"input_tokens": computed - created, "output_tokens": chat.completion_tokens,
            "cache_read_input_tokens": chat.cached_tokens,
            "cache_creation_input_tokens": created,
            "cache_creation": {"ephemeral_5m_input_tokens": 0 if long_lived else created,
                               "ephemeral_1h_input_tokens": created if long_lived else 0}}


def _stop(finish_reason: str | None, stop_reason: Any, stop_sequences: list[str] | None,
          used_tool: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): vLLM names the stop string it matched in ``stop_reason``."""
    if used_tool:
        return "tool_use", None
    if finish_reason == "stop" and isinstance(stop_reason, str) and stop_sequences \
            and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return _STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def message(payload: dict[str, Any], req: MessagesRequest) -> dict[str, Any]:
    """A chat completion as the Messages API's ``message``."""
    choice = (payload.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id") or new_id("toolu"),
                        "name": fn.get("name", ""),
                        "input": json_arguments(fn.get("arguments", ""))})
    reason, sequence = _stop(choice.get("finish_reason"), choice.get("stop_reason"),
                             req.stop_sequences, any(b["type"] == "tool_use" for b in content))
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "model": req.model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(ChatUsage.of(payload.get("usage")), breakpoint_ttl_s(req))}


def error_body(status_code: int, message: str, code: str | None = None) -> dict[str, Any]:
    """Anthropic's error shape; ``code``, where the proxy or a pod named one
    (``context_length_exceeded``...), rides along as on the OpenAI routes."""
    error = {"type": _ERROR_TYPES.get(status_code, "api_error"), "message": message}
    return {"type": "error", "error": {**error, "code": code} if code else error}


def from_chat_error(status_code: int, payload: Any, fallback: str) -> dict[str, Any]:
    """An OpenAI-shaped error answer (a pod's or the proxy's) in Anthropic's shape."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict):
        return error_body(status_code, fallback)
    code = error.get("code")
    return error_body(status_code, str(error.get("message") or fallback),
                      code if isinstance(code, str) else None)


# ---------------------------------------------------------------------- streaming
class MessageStream:
    """The Messages API's event sequence from a chat completion stream: ``message_start``,
    ``ping``, per content block ``content_block_start`` / ``_delta`` / ``_stop`` (text, or a
    tool call's ``input_json_delta``), ``message_delta`` with the stop reason and the usage,
    ``message_stop``; a failure mid-stream is an ``error`` event."""

    def __init__(self, req: MessagesRequest) -> None:
        self.req = req
        self.breakpoint_ttl = breakpoint_ttl_s(req)
        self.id = new_id("msg")
        self.started = False
        self.block: int = -1  # index of the open content block, -1: none
        self.block_kind: str | None = None
        self.tool_blocks: dict[int, int] = {}  # chat tool call index -> block index
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.usage: ChatUsage | None = None
        self.used_tool = False

    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        first = usage(self.usage, self.breakpoint_ttl)
        first["output_tokens"] = 0
        return [sse("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.req.model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": first}}),
            sse("ping", {"type": "ping"})]

    def _close_block(self) -> list[bytes]:
        if self.block_kind is None:
            return []
        self.block_kind = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.block})]

    def _open_block(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close_block()
        self.block += 1
        self.block_kind = kind
        return out + [sse("content_block_start", {"type": "content_block_start",
                                                  "index": self.block, "content_block": block})]

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                           "delta": delta})

    def feed(self, payload: dict[str, Any]) -> list[bytes]:
        if isinstance(payload.get("error"), dict):
            return [*self._start(), sse("error", from_chat_error(
                502, payload, "the pod failed mid-stream"))]
        self.usage = ChatUsage.of(payload.get("usage")) or self.usage
        out = self._start()
        for choice in payload.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.block_kind != "text":
                    out += self._open_block("text", {"type": "text", "text": ""})
                out.append(self._delta(self.block, {"type": "text_delta",
                                                    "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                out += self._tool_delta(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")
        return out

    def _tool_delta(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        key = int(call.get("index", 0))
        fn = call.get("function") or {}
        if key not in self.tool_blocks:
            self.used_tool = True
            out += self._open_block("tool_use", {"type": "tool_use", "id": call.get("id")
                                                 or new_id("toolu"), "name": fn.get("name", ""),
                                                 "input": {}})
            self.tool_blocks[key] = self.block
        if fn.get("arguments"):
            out.append(self._delta(self.tool_blocks[key], {"type": "input_json_delta",
                                                           "partial_json": fn["arguments"]}))
        return out

    def finish(self) -> list[bytes]:
        reason, sequence = _stop(self.finish_reason, self.stop_reason, self.req.stop_sequences,
                                 self.used_tool)
        return [*self._start(), *self._close_block(),
                sse("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": usage(self.usage, self.breakpoint_ttl)}),
                sse("message_stop", {"type": "message_stop"})]

    async def events(self, chat: AsyncIterator[bytes | str]) -> AsyncIterator[bytes]:
        """The whole event stream for the chat stream ``chat``; an in-band error ends it."""
        async for payload in chat_stream_payloads(chat):
            for event in self.feed(payload):
                yield event
            if isinstance(payload.get("error"), dict):
                return
        for event in self.finish():
            yield event
