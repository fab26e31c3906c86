"""The Anthropic Messages and OpenAI Responses front doors, driven by the real anthropic and
openai SDKs over real HTTP: a proxy and a kvindex in front of a pod that records the chat
request each translation makes (``chat_pod``). What the pods make of those requests is
``e2e/vllm/test_agent_apis_on_vllm.py``'s."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from agentserving.core.schemas import PIN_TTL_XARG
from agentserving.kvindex.app import create_app as create_kvindex
from agentserving.kvindex.index.memory import InMemoryIndex, InMemorySessionStore
from agentserving.kvindex.settings import KvindexSettings
from agentserving.proxy.app import create_app as create_proxy
from agentserving.proxy.session_identity import BodyIds, identify
from agentserving.proxy.settings import ProxySettings
from testkit.servers import ThreadedServer

from .chat_pod import ANSWER, ChatPod, prompt_tokens

SYSTEM = "You are a terse assistant."
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


class Stack:
    def __init__(self, **settings: Any) -> None:
        self.pod = ChatPod()
        self.kv = ThreadedServer(create_kvindex(KvindexSettings(), InMemoryIndex(),
                                                InMemorySessionStore()))
        proxy = ProxySettings(kvindex_url=self.kv.url if settings.pop("kvindex", True) else None,
                              prefill_urls=[self.pod.server.url], stall_detection=False,
                              **settings)
        self.proxy = ThreadedServer(create_proxy(proxy))
        self.anthropic = anthropic.Anthropic(base_url=self.proxy.url, api_key="unused",
                                             max_retries=0)
        self.openai = openai.OpenAI(base_url=self.proxy.url + "/v1", api_key="unused",
                                    max_retries=0)

    def stop(self) -> None:
        for server in (self.proxy, self.kv, self.pod.server):
            server.stop()

    def session(self, sid: str) -> dict[str, Any]:
        r = httpx.get(f"{self.kv.url}/v1/sessions/{sid}")
        r.raise_for_status()
        return r.json()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack()
    yield s
    s.stop()


def _raw_events(r: httpx.Response) -> list[dict[str, Any]]:
    """An SSE answer's events as (name, data) checked against each other."""
    out = []
    for block in r.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"], block
        out.append(data)
    return out


# ---------------------------------------------------------------------- Anthropic Messages
def test_a_tool_round_trip_through_the_anthropic_sdk(stack: Stack) -> None:
    """A forced tool call comes back as a tool_use block; its result, sent back as a
    tool_result, reaches the pod as chat's tool message after the assistant's tool call."""
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral",
                                                                 "ttl": "1h"}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    first = stack.anthropic.messages.create(
        model="m", max_tokens=32, system=system, messages=messages, tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        metadata={"user_id": "claude-session-1"})
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if b.type == "tool_use")
    assert call.name == "get_weather" and call.input == {"city": "Paris"}
    sent = stack.pod.bodies[-1]
    assert sent["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert sent["vllm_xargs"][PIN_TTL_XARG] == 3600.0  # the 1h breakpoint's pin
    assert stack.session("claude-session-1")["pinned_until"] > time.time() + 3000

    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [
                     {"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"},
                     {"type": "text", "text": "Summarise."}]}]
    second = stack.anthropic.messages.create(model="m", max_tokens=32, system=system,
                                             messages=messages, tools=[WEATHER],
                                             metadata={"user_id": "claude-session-1"})
    assert second.stop_reason == "end_turn" and second.content[0].text == ANSWER
    chat = stack.pod.bodies[-1]["messages"]
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "tool", "user"]
    assert chat[2]["tool_calls"][0]["id"] == call.id
    assert json.loads(chat[2]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert chat[3] == {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}
    # the pods' reuse, in Anthropic's terms: what the first turn's prompt held is read back
    assert second.usage.cache_read_input_tokens == prompt_tokens(chat[:2]) > 0
    total = (second.usage.input_tokens + second.usage.cache_read_input_tokens
             + second.usage.cache_creation_input_tokens)
    assert total == prompt_tokens(chat)
    assert second.usage.cache_creation.ephemeral_1h_input_tokens \
        == second.usage.cache_creation_input_tokens > 0
    metrics = httpx.get(stack.proxy.url + "/metrics").text
    assert 'proxy_api_turns_total{api="messages",session_source="metadata.user_id"} 2.0' \
        in metrics


def test_agent_memory_and_teacher_forcing_ride_along(stack: Stack) -> None:
    """The turn extensions of chat completions work on both APIs: agent_memory's pin reaches
    the pod and the kvindex, forced tokens reach the pod."""
    stack.anthropic.messages.create(model="m", max_tokens=4, messages=[
        {"role": "user", "content": "Hi"}], metadata={"user_id": "with-memory"},
        extra_body={"agent_memory": {"pin_ttl_s": 120}, "forced_output_token_ids": [5, 6]})
    sent = stack.pod.bodies[-1]
    assert sent["vllm_xargs"][PIN_TTL_XARG] == 120.0 and "agent_memory" not in sent
    assert sent["forced_output_token_ids"] == [5, 6]
    assert stack.session("with-memory")["pinned_until"] > time.time() + 60
    stack.openai.responses.create(model="m", input="Hi", store=False,
                                  extra_body={"forced_output_token_ids": [7]})
    assert stack.pod.bodies[-1]["forced_output_token_ids"] == [7]


def test_the_answer_validates_against_the_sdk_models(stack: Stack) -> None:
    r = httpx.post(stack.proxy.url + "/v1/messages", json={
        "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
        headers={"x-session-id": "s-raw"})
    assert r.status_code == 200, r.text
    message = Message.model_validate(r.json())
    assert message.content[0].text == ANSWER and message.usage.cache_creation_input_tokens == 0
    assert r.headers["x-agentserving-session-source"] == "x-session-id"
    assert r.headers["x-agentserving-routing"]


@pytest.mark.parametrize("forced", [False, True], ids=["text", "tool_use"])
def test_messages_stream_as_anthropic_events(stack: Stack, forced: bool) -> None:
    kwargs: dict[str, Any] = dict(model="m", max_tokens=32, messages=[
        {"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER])
    if forced:
        kwargs["tool_choice"] = {"type": "any"}
    with stack.anthropic.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    if forced:
        assert final.stop_reason == "tool_use" and text == ""
        assert final.content[0].type == "tool_use" and final.content[0].input == {"city": "Paris"}
    else:
        assert text == ANSWER and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 5
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens \
        == prompt_tokens(stack.pod.bodies[-1]["messages"])
    r = httpx.post(stack.proxy.url + "/v1/messages", json={**kwargs, "stream": True})
    raw = _raw_events(r)
    assert raw[1] == {"type": "ping"}  # documented, though not in the SDK's event union
    events = [TypeAdapter(RawMessageStreamEvent).validate_python(e) for e in raw
              if e["type"] != "ping"]
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1


def test_tools_the_pods_cannot_run_are_accepted_and_not_offered(stack: Stack) -> None:
    """Agents send their whole tool list (Codex: web_search, a freeform apply_patch; Claude
    Code may add server tools): served, with the function tools alone offered."""
    stack.anthropic.messages.create(model="m", max_tokens=4, messages=[
        {"role": "user", "content": "Hi"}], tools=[
        WEATHER, {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}])
    assert [t["function"]["name"] for t in stack.pod.bodies[-1]["tools"]] == ["get_weather"]
    stack.openai.responses.create(model="m", input="Hi", store=False, tools=[
        {"type": "web_search"}, {"type": "custom", "name": "apply_patch", "format": {
            "type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}])
    assert "tools" not in stack.pod.bodies[-1]


def test_count_tokens_counts_the_templated_conversation(stack: Stack) -> None:
    counted = stack.anthropic.messages.count_tokens(
        model="m", system=SYSTEM, messages=[{"role": "user", "content": "Hi there"}])
    assert counted.input_tokens == prompt_tokens([{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": "Hi there"}])
    assert stack.pod.bodies[-1]["add_generation_prompt"] is True


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]}, "messages[0].content[0].tool_use_id"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]},
     "messages[0].role"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "system": [{"type": "text", "text": "s", "cache_control": {"type": "persistent"}}]},
     "system[0].cache_control.type"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "no_schema"}]}, "tools[0].input_schema"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]},
     "messages[0].content[0]"),
])
def test_a_malformed_message_is_a_400_in_anthropics_shape(stack: Stack, body, param) -> None:
    r = httpx.post(stack.proxy.url + "/v1/messages", json=body)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(param + ":"), error
    if "max_tokens" in body:  # (the SDK itself refuses a call without it)
        with pytest.raises(anthropic.BadRequestError):  # the SDK reads the shape as its own
            stack.anthropic.messages.create(**body)


# ---------------------------------------------------------------------- OpenAI Responses
def test_previous_response_id_continues_the_stored_conversation(stack: Stack) -> None:
    """Three turns chained by previous_response_id: each prompt starts with the previous
    one's messages and answer, the chain keeps one session, and the reuse grows."""
    client = stack.openai
    first = client.responses.create(model="m", instructions=SYSTEM, input="What is 2+2?")
    assert first.output_text == ANSWER and first.status == "completed"
    prompts = [stack.pod.bodies[-1]["messages"]]
    cached = [first.usage.input_tokens_details.cached_tokens]
    previous = first
    for question in ("And 3+3?", "And 4+4?"):
        previous = client.responses.create(model="m", instructions=SYSTEM, input=question,
                                           previous_response_id=previous.id)
        prompts.append(stack.pod.bodies[-1]["messages"])
        cached.append(previous.usage.input_tokens_details.cached_tokens)
    assert prompts[2][:len(prompts[1])] == prompts[1]
    assert prompts[1][:len(prompts[0])] == prompts[0]
    assert prompts[1][len(prompts[0])] == {"role": "assistant", "content": ANSWER}
    assert cached[0] < cached[1] < cached[2]
    assert stack.session(first.id)["session_id"] == first.id  # the chain's session
    # stored, as it was returned; deleted, a continuation from it is a 404
    assert client.responses.retrieve(previous.id).output_text == previous.output_text
    assert client.responses.delete(previous.id) is None
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="m", input="More?", previous_response_id=previous.id)
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(previous.id)


def test_responses_stream_typed_events_and_function_calls(stack: Stack) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["input_schema"]}
    with stack.openai.responses.stream(model="m", input="Weather?", tools=[tool],
                                       tool_choice="required") as stream:
        final = stream.get_final_response()
    call = final.output[0]
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    follow = stack.openai.responses.create(model="m", previous_response_id=final.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    chat = stack.pod.bodies[-1]["messages"]
    assert chat[-2]["tool_calls"][0]["id"] == call.call_id
    assert chat[-1] == {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"}
    assert follow.output_text == ANSWER
    r = httpx.post(stack.proxy.url + "/v1/responses", json={
        "model": "m", "input": "Hi", "stream": True, "store": False})
    events = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in _raw_events(r)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    done = Response.model_validate(events[-1].response.model_dump())
    assert done.usage.output_tokens == 5
    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing
        stack.openai.responses.retrieve(done.id)


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m"}, "input"),
    ({"model": "m", "input": [{"type": "function_call_output", "output": "x"}]},
     "input[0].call_id"),
    ({"model": "m", "input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"model": "m", "input": "x", "temperature": 3}, "temperature"),
])
def test_a_malformed_response_request_is_a_400_naming_the_field(stack: Stack, body,
                                                                 param) -> None:
    r = httpx.post(stack.proxy.url + "/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_stored_responses_without_a_kvindex_live_in_the_proxy() -> None:
    s = Stack(kvindex=False, max_stored_responses=1)
    try:
        a = s.openai.responses.create(model="m", input="one")
        b = s.openai.responses.create(model="m", input="two", previous_response_id=a.id)
        assert s.pod.bodies[-1]["messages"][:2] == [{"role": "user", "content": "one"},
                                                     {"role": "assistant", "content": ANSWER}]
        with pytest.raises(openai.NotFoundError):  # the bound: one kept, the oldest out
            s.openai.responses.retrieve(a.id)
        assert s.openai.responses.retrieve(b.id).id == b.id
    finally:
        s.stop()


# ---------------------------------------------------------------------- both, and chat
def test_one_conversation_is_one_chat_request_whichever_api(stack: Stack) -> None:
    """The same conversation through chat completions, messages and responses reaches the
    pod as the same messages (so the same template, tokens and chunk hashes)."""
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye"}]
    stack.openai.chat.completions.create(model="m", messages=chat, max_tokens=4)
    sent = [stack.pod.bodies[-1]["messages"]]
    stack.anthropic.messages.create(model="m", max_tokens=4, system=SYSTEM, messages=chat[1:])
    sent.append(stack.pod.bodies[-1]["messages"])
    stack.openai.responses.create(model="m", instructions=SYSTEM, input=chat[1:], store=False)
    sent.append(stack.pod.bodies[-1]["messages"])
    assert sent[0] == sent[1] == sent[2] == chat


def test_session_identity_follows_one_documented_order() -> None:
    headers = {"x-dynamo-session-id": "dyn", "x-dynamo-parent-session-id": "parent"}
    ids = BodyIds(prompt_cache_key="pck", metadata_user_id="meta", user="u/1")
    assert identify({"x-session-id": "own", **headers}, ids).session_id == "own"
    who = identify(headers, ids)
    assert (who.session_id, who.parent_session_id, who.source) == (
        "dyn", "parent", "x-dynamo-session-id")
    assert identify({}, ids).source == "prompt_cache_key"
    assert identify({}, BodyIds(metadata_user_id="meta", user="u")).session_id == "meta"
    assert identify({}, BodyIds(user="u/1")).session_id == "u%2F1"
    assert identify({}, BodyIds()).session_id is None


def test_x_api_key_authenticates_as_a_bearer_key(tmp_path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "sk-team-key-1", "tenant": "team"}]}))
    s = Stack(api_keys_file=keys)
    try:
        client = anthropic.Anthropic(base_url=s.proxy.url, api_key="sk-team-key-1", max_retries=0)
        ok = client.messages.create(model="m", max_tokens=4,
                                    messages=[{"role": "user", "content": "Hi"}])
        assert ok.content[0].text == ANSWER
        assert s.pod.bodies[-1]["cache_salt"]  # the tenant's salt reached the pod
        bad = anthropic.Anthropic(base_url=s.proxy.url, api_key="sk-wrong-key-1", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as err:
            bad.messages.create(model="m", max_tokens=4,
                                messages=[{"role": "user", "content": "Hi"}])
        assert err.value.body["error"]["type"] == "authentication_error"
    finally:
        s.stop()


def test_a_response_store_that_is_down_degrades_and_loses_nothing_silently() -> None:
    """With the kvindex down a new response is still answered (and says it was not stored),
    and a continuation is a 503 to retry, never a 404 that would read as a deleted chain."""
    s = Stack(kvindex_timeout_s=0.3)
    try:
        first = s.openai.responses.create(model="m", input="one")
        s.kv.stop()
        raw = s.openai.responses.with_raw_response.create(model="m", input="two")
        assert raw.parse().output_text == ANSWER
        assert raw.headers["x-agentserving-degraded"].startswith("response-store: not stored")
        with pytest.raises(openai.InternalServerError) as err:
            s.openai.responses.create(model="m", input="three", previous_response_id=first.id)
        assert err.value.status_code == 503
        assert err.value.body["code"] == "response_store_unavailable"
    finally:
        s.stop()
