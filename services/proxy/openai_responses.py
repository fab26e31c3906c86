"""The OpenAI Responses API (``POST /v1/responses``) over the pods' chat completions.

A request becomes the chat request ``/v1/chat/completions`` would get for the same
conversation: ``instructions`` the system message, message items messages (``developer`` as
``system``, which the chat templates know), ``function_call`` items the assistant's
``tool_calls`` (joined onto the assistant message before them, as a chat answer carries its
text and calls together), each ``function_call_output`` a ``tool`` message; ``reasoning``
items are dropped; ``input_image`` and ``input_file`` parts are a 400 (the models behind the
proxy take text, as its chat completions schema says). Function ``tools`` and
``tool_choice`` are chat's.

``store`` (the default) keeps the response's conversation, its input and output as chat
messages without the instructions, in the response store (the kvindex's Redis, shared by
every proxy replica, bounded and expiring; or the proxy's own memory without a kvindex). A
request with ``previous_response_id`` starts from that conversation, then its own
``instructions`` in front (OpenAI does not carry instructions over), then its input: its
prompt begins with the very tokens the previous turn's did, and it keeps the chain's session,
so it is routed to the pod holding that KV. ``prompt_cache_key`` names the session
(``session_identity``); without any id, a chain's session is its first response's id.

Accepted and ignored: ``reasoning``, ``text``, ``truncation``, ``include``, ``service_tier``
and other fields this proxy has no use for, and built-in and custom tools (``web_search``,
``local_shell``, Codex's freeform ``apply_patch``), which are not offered to the model.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool

from agentserving.core.schemas import RESPONSE_ID_PATTERN
from agentserving.core.service import ApiError
from agentserving.proxy.agent_api_common import (
    ChatUsage,
    TurnExtensions,
    chat_stream_payloads,
    new_id,
    sse,
    type_other_than,
)

# a request whose input holds no message and continues none: schema-valid, nothing to answer
EMPTY_CONVERSATION = "empty_conversation"


def _typed(value: Any) -> Any:
    """An item without ``type`` is a message (the API's "easy input message")."""
    if isinstance(value, dict) and "type" not in value and "role" in value:
        return {**value, "type": "message"}
    return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str = ""
    refusal: str | None = None


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")  # id, status: the client's copy of an output

    type: Literal["message"]
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning"]


Item = Annotated[Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem
                           | ReasoningItem, Field(discriminator="type")],
                 BeforeValidator(_typed)]


class FunctionTool(BaseModel):
    """A function tool: offered to the model as chat's."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class BuiltinTool(BaseModel):
    """A built-in tool (``web_search``, ``local_shell``, ``image_generation``...) or a
    ``custom`` freeform one (Codex's ``apply_patch``): accepted, so an agent's whole tool list
    is served, and not offered to the model (chat completions have no such tool)."""

    model_config = ConfigDict(extra="allow")

    type: type_other_than("function")  # type: ignore[valid-type]


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class ResponsesRequest(TurnExtensions):
    """``POST /v1/responses`` (OpenAI Responses), with the turn extensions of chat
    completions."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool | BuiltinTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: str | None = Field(default=None, pattern=RESPONSE_ID_PATTERN)
    prompt_cache_key: str | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None


# ---------------------------------------------------------------------- request -> chat
def _text(parts: str | list[TextPart]) -> str:
    """One string (parts joined as vLLM joins a chat message's text parts, so every engine
    sees the same prompt)."""
    if isinstance(parts, str):
        return parts
    return "\n".join(p.text or p.refusal or "" for p in parts)


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """The request's input as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text(item.output)})
    return out


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request for ``req`` continuing ``history`` (module docstring)."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    asked = input_messages(req.input)
    if not history and not asked:
        raise ApiError(400, "input: no message to answer (only reasoning items)", param="input",
                       code=EMPTY_CONVERSATION)
    body: dict[str, Any] = {"model": req.model, "messages": [*system, *history, *asked]}
    offered = [t for t in req.tools or [] if isinstance(t, FunctionTool)]
    if offered:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description or "",
            "parameters": t.parameters or {"type": "object", "properties": {}}}}
            for t in offered]
        if req.tool_choice is not None:
            body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else {
                "type": "function", "function": {"name": req.tool_choice.name}}
        if req.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = req.parallel_tool_calls
    for name, value in (("temperature", req.temperature), ("top_p", req.top_p),
                        ("max_tokens", req.max_output_tokens)):
        if value is not None:
            body[name] = value
    body.update(req.chat_fields())
    if req.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


# ---------------------------------------------------------------------- chat -> response
def usage(chat: ChatUsage | None) -> dict[str, Any]:
    """The Responses API's usage from the pods' counts: ``cached_tokens`` they reused,
    ``cache_write_tokens`` they computed (and kept: the pods keep every full chunk)."""
    chat = chat or ChatUsage()
    return {"input_tokens": chat.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": chat.cached_tokens,
                "cache_write_tokens": max(chat.prompt_tokens - chat.cached_tokens, 0)},
            "output_tokens": chat.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat.prompt_tokens + chat.completion_tokens}


def text_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]
            if status == "completed" else []}


def call_item(item_id: str, call_id: str, name: str, arguments: str,
              status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_object(resp_id: str, req: ResponsesRequest, created_at: int,
                    output: list[dict[str, Any]], chat_usage: ChatUsage | None,
                    status: str) -> dict[str, Any]:
    """The Responses API's ``response`` object (``status``: in_progress, completed, or
    incomplete: the answer hit ``max_output_tokens``)."""
    return {
        "id": resp_id, "object": "response", "created_at": created_at, "status": status,
        "model": req.model, "output": output,
        "usage": usage(chat_usage) if status != "in_progress" else None,
        "instructions": req.instructions, "previous_response_id": req.previous_response_id,
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str)
                        else req.tool_choice.model_dump() if req.tool_choice else "auto"),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": req.temperature, "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens, "store": req.store,
        "metadata": req.metadata or {}, "prompt_cache_key": req.prompt_cache_key,
        "user": req.user, "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat completion's answer as output items: its text, then its tool calls."""
    msg = ((payload.get("choices") or [{}])[0]).get("message") or {}
    out = [text_item(new_id("msg"), msg["content"])] if msg.get("content") else []
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        out.append(call_item(new_id("fc"), call.get("id") or new_id("call"),
                             fn.get("name", ""), fn.get("arguments", "")))
    return out


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output as the chat message a continuation's prompt carries (the assistant's text
    and calls, as ``input_messages`` reads the same items sent back)."""
    text = "".join(part.get("text", "") for item in output if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


# ---------------------------------------------------------------------- streaming
class ResponseStream:
    """The Responses API's typed events from a chat completion stream: ``response.created``,
    ``response.in_progress``; per output item ``response.output_item.added``, its text
    (``content_part.added``, ``output_text.delta`` ..., ``output_text.done``,
    ``content_part.done``) or a call's arguments (``function_call_arguments.delta`` ...,
    ``.done``), ``response.output_item.done``; then ``response.completed`` (or
    ``response.incomplete``), sent after ``on_done`` has stored the response. A failure
    mid-stream is an ``error`` event and ``response.failed``."""

    def __init__(self, req: ResponsesRequest, resp_id: str,
                 on_done: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        self.req, self.id, self.on_done = req, resp_id, on_done
        self.created_at = int(time.time())
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.calls: dict[int, int] = {}  # chat tool call index -> output index
        self.finish_reason: str | None = None
        self.usage: ChatUsage | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(kind, data)

    def _response(self, status: str) -> dict[str, Any]:
        return response_object(self.id, self.req, self.created_at, self.output, self.usage,
                               status)

    def start(self) -> list[bytes]:
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.output.index(item)
        out = []
        if item["type"] == "message":
            text = item.pop("_text")
            part = {"type": "output_text", "text": text, "annotations": []}
            out += [self._event("response.output_text.done", item_id=item["id"],
                                output_index=index, content_index=0, text=text, logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"],
                                output_index=index, content_index=0, part=part)]
            item.update(status="completed", content=[part])
        else:
            out.append(self._event("response.function_call_arguments.done",
                                   item_id=item["id"], output_index=index,
                                   arguments=item["arguments"], name=item["name"]))
            item["status"] = "completed"
        return out + [self._event("response.output_item.done", output_index=index,
                                  item=dict(item))]

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.output.append(item)
        self.open = item
        shown = {k: v for k, v in item.items() if not k.startswith("_")}
        return out + [self._event("response.output_item.added",
                                  output_index=len(self.output) - 1, item=shown)]

    def feed(self, payload: dict[str, Any]) -> list[bytes]:
        self.usage = ChatUsage.of(payload.get("usage")) or self.usage
        out: list[bytes] = []
        for choice in payload.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call_delta(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _text_delta(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open is None or self.open["type"] != "message":
            out += self._add({**text_item(new_id("msg"), "", "in_progress"), "_text": ""})
            out.append(self._event("response.content_part.added", item_id=self.open["id"],
                                   output_index=len(self.output) - 1, content_index=0,
                                   part={"type": "output_text", "text": "",
                                         "annotations": []}))
        self.open["_text"] += text
        return out + [self._event("response.output_text.delta", item_id=self.open["id"],
                                  output_index=len(self.output) - 1, content_index=0,
                                  delta=text, logprobs=[])]

    def _call_delta(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        key, fn = int(call.get("index", 0)), call.get("function") or {}
        if key not in self.calls:
            out += self._add(call_item(new_id("fc"), call.get("id") or new_id("call"),
                                       fn.get("name", ""), "", "in_progress"))
            self.calls[key] = len(self.output) - 1
        index = self.calls[key]
        item = self.output[index]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta",
                                   item_id=item["id"], output_index=index,
                                   delta=fn["arguments"]))
        return out

    async def events(self, chat: AsyncIterator[bytes | str]) -> AsyncIterator[bytes]:
        for event in self.start():
            yield event
        async for payload in chat_stream_payloads(chat):
            if isinstance(payload.get("error"), dict):
                error = payload["error"]
                yield self._event("error", code=error.get("code") or "server_error",
                                  message=str(error.get("message") or "the pod failed"),
                                  param=None)
                failed = self._response("failed")
                failed.update(usage=None, error={"code": "server_error",
                                                 "message": str(error.get("message"))})
                yield self._event("response.failed", response=failed)
                return
            for event in self.feed(payload):
                yield event
        for event in self._close():
            yield event
        status = status_of(self.finish_reason)
        final = self._response(status)
        await self.on_done(final)
        yield self._event(f"response.{status}", response=final)
