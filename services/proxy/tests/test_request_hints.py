"""The ecosystem's request fields (``cache_control``, Dynamo's ``nvext``) read onto the
project's verbs: validated as the proxy reads a turn (a 400 naming the field), resolved (a pin
without a TTL sized from the tool-gap prediction), and carried out: the pod is sent the turn's
pin in ``vllm_xargs`` and none of the fields it does not read, the kvindex (in-process, over
HTTP) gets the session's pin and priority after the turn."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

import aiohttp
import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from agentserving.core.hashing import ChunkHasher
from agentserving.core.schemas import PIN_TTL_XARG, parse_ttl
from agentserving.kvindex.app import create_app as create_kvindex
from agentserving.kvindex.index.memory import InMemoryIndex, InMemorySessionStore
from agentserving.kvindex.settings import KvindexSettings
from agentserving.proxy.app import create_app as create_proxy
from agentserving.proxy.memory_hooks import AgentMemory
from agentserving.proxy.metrics import ProxyMetrics
from agentserving.proxy.orchestrator import Orchestrator, Turn
from agentserving.proxy.pods import PodPool
from agentserving.proxy.request_hints import TurnHints, merged_memory, read_hints
from agentserving.proxy.routing import make_policy
from agentserving.proxy.sessions import kvindex_session_id
from agentserving.proxy.settings import ProxySettings
from agentserving.proxy.tool_gaps import pin_ttl_for_gap
from testkit.servers import ThreadedServer, wait_until

H = ChunkHasher("blake3", 4).hashes(list(range(16)))
PIN = {"type": "ephemeral"}


@pytest.mark.parametrize(("ttl", "seconds"), [
    ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0), ("90m", 5400.0), (45, 45), (2.5, 2.5)])
def test_ttls_read_as_anthropic_and_dynamo_spell_them(ttl, seconds) -> None:
    assert parse_ttl(ttl) == seconds


@pytest.mark.parametrize("ttl", ["5", "5 minutes", "m", "5d", "-5m", "0h", "05m", "1.5m",
                                 " 2h", True])
def test_other_ttl_spellings_are_refused(ttl) -> None:
    with pytest.raises(ValueError):
        parse_ttl(ttl)


def test_a_pin_without_ttl_lasts_a_multiple_of_the_predicted_gap_within_floor_and_cap() -> None:
    assert pin_ttl_for_gap(10.0, floor_s=5, cap_s=600, multiple=2) == 20.0
    assert pin_ttl_for_gap(1.0, floor_s=5, cap_s=600, multiple=2) == 5.0
    assert pin_ttl_for_gap(1000.0, floor_s=5, cap_s=600, multiple=2) == 600.0


def test_hints_are_taken_off_the_body_and_the_top_level_pin_wins() -> None:
    body = {"prompt": [1], "cache_control": {"type": "ephemeral", "ttl": "1m"},
            "nvext": {"cache_control": {"type": "ephemeral", "ttl": "1h"},
                      "agent_hints": {"speculative_prefill": True, "osl": 9}}}
    assert read_hints(body) == TurnHints(pin=True, pin_ttl_s=60.0, speculative_prefill=True)
    assert body == {"prompt": [1]}
    assert read_hints({"nvext": {"cache_control": PIN}}) == TurnHints(pin=True)
    # a pin holds for a tool gap, not forever: a longer TTL is cut to a day
    assert read_hints({"cache_control": {"type": "ephemeral", "ttl": "48h"}}).pin_ttl_s == 86400
    assert read_hints({"cache_control": {"type": "ephemeral", "ttl": 1e9}}).pin_ttl_s == 86400


def test_the_agents_own_memory_fields_win_over_the_hints() -> None:
    hint = TurnHints(pin=True, pin_ttl_s=60.0, priority=2)
    assert merged_memory(None, hint) == AgentMemory(pin_ttl_s=60.0, priority=2)
    assert merged_memory(None, TurnHints(pin=True)) == AgentMemory(pin=True)
    assert merged_memory(None, TurnHints()) is None
    own = AgentMemory(priority=5, pin_ttl_s=10)
    assert merged_memory(own, hint) == own
    # a close (or a release) makes the hint's pin moot; the hint's priority still applies
    assert merged_memory(AgentMemory(close_session=True), hint) == \
        AgentMemory(close_session=True, priority=2)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"cache_control": {"type": "persistent"}}, "cache_control.type"),
        ({"cache_control": {"type": "ephemeral", "ttl": "5 minutes"}}, "cache_control.ttl"),
        ({"cache_control": {"type": "ephemeral", "ttl": 0}}, "cache_control.ttl"),
        ({"cache_control": {"type": "ephemeral", "ttl": -1}}, "cache_control.ttl"),
        ({"cache_control": {"type": "ephemeral", "scope": "x"}}, "cache_control.scope"),
        ({"cache_control": "ephemeral"}, "cache_control"),
        ({"nvext": 3}, "nvext"),
        ({"nvext": {"cache_control": {"type": "ephemeral", "ttl": True}}},
         "nvext.cache_control.ttl"),
        ({"nvext": {"agent_hints": {"priority": 5000}}}, "nvext.agent_hints.priority"),
        ({"nvext": {"agent_hints": {"priority": "5"}}}, "nvext.agent_hints.priority"),
        ({"nvext": {"agent_hints": {"osl": -1}}}, "nvext.agent_hints.osl"),
        ({"nvext": {"agent_hints": {"latency_sensitivity": False}}},
         "nvext.agent_hints.latency_sensitivity"),
        ({"nvext": {"agent_hints": {"speculative_prefill": "yes"}}},
         "nvext.agent_hints.speculative_prefill"),
        ({"cache_control": PIN, "vllm_xargs": [1]}, "vllm_xargs"),
        ({"agent_memory": {"pin": "yes"}}, "agent_memory.pin"),
        ({"agent_memory": {"pin": True, "release": True}}, "agent_memory.release"),
        ({"agent_memory": {"intent": "~context"}}, "agent_memory.intent"),
        ({"agent_memory": {"evict_intents": ["~context"]}}, "agent_memory.evict_intents"),
    ],
)
def test_bad_hints_are_a_400_naming_the_field(fields, param) -> None:
    with TestClient(create_proxy(ProxySettings())) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": [1], **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_hints_without_a_verb_and_unknown_nvext_fields_are_accepted() -> None:
    """Dynamo adds hints and nvext fields: they pass validation (here no pod is configured,
    so the turn gets as far as the 503 that says so)."""
    with TestClient(create_proxy(ProxySettings())) as client:
        r = client.post("/v1/completions", json={
            "model": "m", "prompt": [1], "cache_control": {"type": "ephemeral", "ttl": "5m"},
            "nvext": {"agent_hints": {"osl": 64, "strict_priority": 1, "latency_sensitivity": 0.5,
                                      "some_future_hint": {"x": 1}}, "ignore_eos": True},
            "agent_memory": {"pin_ttl_s": 300}})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_pods", r.text
    schema = create_proxy(ProxySettings()).openapi()["components"]["schemas"]
    assert {"cache_control", "nvext"} <= set(schema["CompletionTurn"]["properties"])
    assert {"priority", "osl", "speculative_prefill"} <= set(schema["AgentHints"]["properties"])


class RecordingPod:
    """A pod's OpenAI API as the wire shows it: it records each body and answers with the
    chunk hashes the reference worker would name."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        app = FastAPI()

        @app.post("/v1/completions")
        async def complete(request: Request) -> dict[str, Any]:
            self.bodies.append(await request.json())
            return {"id": "c", "object": "text_completion", "model": "m",
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 16, "completion_tokens": 1, "total_tokens": 17},
                    "kv_transfer_params": {"chunk_hashes": H}}

        self.server = ThreadedServer(app)


def _wired(**settings: Any) -> Iterator[tuple[TestClient, RecordingPod, str]]:
    """A proxy (``settings`` on top of the tests' own) in front of a recording pod and a
    real kvindex."""
    pod = RecordingPod()
    kv = ThreadedServer(create_kvindex(KvindexSettings(), InMemoryIndex(),
                                       InMemorySessionStore()))
    proxy = ProxySettings(kvindex_url=kv.url, prefill_urls=[pod.server.url],
                          stall_detection=False, pin_ttl_floor_s=7, **settings)
    with TestClient(create_proxy(proxy)) as client:
        yield client, pod, kv.url
    kv.stop()
    pod.server.stop()


@pytest.fixture
def wired() -> Iterator[tuple[TestClient, RecordingPod, str]]:
    yield from _wired()


@pytest.fixture
def tool_pinning() -> Iterator[tuple[TestClient, RecordingPod, str]]:
    yield from _wired(tool_pin=True)


def session(kv_url: str, sid: str) -> dict[str, Any] | None:
    r = httpx.get(f"{kv_url}/v1/sessions/{sid}", timeout=5)
    return r.json() if r.status_code == 200 else None


def pinned_session(kv_url: str, sid: str) -> dict[str, Any]:
    """The kvindex's record of ``sid`` once it is pinned."""
    return wait_until(lambda: (s := session(kv_url, sid)) and s["pinned_until"] and s,
                      what="the session pinned", ignoring=(httpx.HTTPError,))


def test_a_session_id_with_a_slash_or_url_characters_reaches_the_kvindex(wired) -> None:
    """The kvindex's ids hold no '/': a client's (a replay's ``source/id``) is written %2F
    there, and '?', '#', '%' and spaces travel inside the id, not as URL syntax."""
    client, _, kv_url = wired
    assert kvindex_session_id("team/agent 1") == "team%2Fagent 1"
    assert kvindex_session_id("a%2Fb") == "a%252Fb" != kvindex_session_id("a/b")
    for sid in ("team/agent 1", "q?x=1#f", "a%2Fb"):
        r = client.post("/v1/completions", headers={"x-session-id": sid},
                        json={"model": "m", "prompt": list(range(16))})
        assert r.status_code == 200, r.text
        stored = quote(kvindex_session_id(sid), safe="")
        info = wait_until(lambda s=stored: session(kv_url, s),
                          what=f"session {sid!r} in the kvindex", ignoring=(httpx.HTTPError,))
        assert info["intents"] == {"~context": H}
    assert session(kv_url, quote("a/b", safe="")) is None


def test_the_hints_reach_the_pod_and_the_kvindex(wired) -> None:
    client, pod, kv_url = wired
    r = client.post("/v1/completions", headers={"x-session-id": "dyn"}, json={
        "model": "m", "prompt": list(range(16)), "vllm_xargs": {"mine": 1},
        "nvext": {"cache_control": {"type": "ephemeral", "ttl": "5m"},
                  "agent_hints": {"priority": 7, "osl": 32}}})
    assert r.status_code == 200, r.text
    sent = pod.bodies[-1]
    assert sent["vllm_xargs"] == {"mine": 1, PIN_TTL_XARG: 300.0}
    assert "nvext" not in sent and "cache_control" not in sent
    info = pinned_session(kv_url, "dyn")
    assert info["pinned_until"] == pytest.approx(time.time() + 300, abs=10)
    assert info["priority"] == 7 and info["intents"] == {"~context": H}

    # Anthropic's spelling without a TTL: the predicted gap (the 2 s default, doubled) is
    # under the floor, so the pin lasts the floor
    r = client.post("/v1/completions", headers={"x-session-id": "anth"}, json={
        "model": "m", "prompt": list(range(16)), "cache_control": PIN})
    assert r.status_code == 200, r.text
    assert pod.bodies[-1]["vllm_xargs"] == {PIN_TTL_XARG: 7.0}
    assert "cache_control" not in pod.bodies[-1]
    info = pinned_session(kv_url, "anth")
    assert info["pinned_until"] == pytest.approx(time.time() + 7, abs=3)

    # a turn asking nothing sends the pod nothing extra, and its session exists all the same
    r = client.post("/v1/completions", headers={"x-session-id": "plain"},
                    json={"model": "m", "prompt": list(range(16))})
    assert r.status_code == 200 and "vllm_xargs" not in pod.bodies[-1]
    wait_until(lambda: session(kv_url, "plain"), what="the session", ignoring=(httpx.HTTPError,))


def with_orchestrator(settings: ProxySettings, use: Callable[[Orchestrator], Any]) -> Any:
    """``use`` applied to an orchestrator with no pods and no kvindex (its pure decisions)."""
    async def run() -> Any:
        async with aiohttp.ClientSession() as http:
            return use(Orchestrator(settings, PodPool([], [], None), None,
                                    make_policy("kv-aware"), http,
                                    ProxyMetrics(CollectorRegistry())))

    return asyncio.run(run())


def test_a_pin_without_ttl_follows_the_learnt_gap_of_the_tool_named() -> None:
    def resolve(orch: Orchestrator) -> list[dict[str, Any]]:
        orch.tool_gaps.observe("pytest", 40.0)
        orch.tool_gaps.observe("grep", 1.0)
        out = []
        for tool in ("pytest", "grep", None):
            turn = Turn(endpoint="/v1/completions", body={"prompt": [1]}, session_id="s",
                        session_key="s", memory=AgentMemory(pin=True), next_tool=tool)
            orch._resolve_pin(turn)
            assert turn.memory is not None and not turn.memory.pin
            out.append({"ttl": turn.memory.pin_ttl_s, **turn.body["vllm_xargs"]})
        return out

    pytest_pin, grep_pin, unnamed = with_orchestrator(ProxySettings(), resolve)
    assert pytest_pin == {"ttl": 80.0, PIN_TTL_XARG: 80.0}  # twice the tool's gap
    assert grep_pin == {"ttl": 5.0, PIN_TTL_XARG: 5.0}  # the floor
    assert 5.0 < unnamed["ttl"] < 80.0  # the mean over all tools, doubled


def test_a_turn_that_ends_in_a_tool_call_pins_its_session_for_the_gap(tool_pinning) -> None:
    """--tool-pin: the agent is back when its tool returns, so the session's KV is pinned for
    the predicted gap (here the floor) on the pod and in the kvindex; a turn that names no
    tool hands back to a person and pins nothing."""
    client, pod, kv_url = tool_pinning
    r = client.post("/v1/completions", headers={"x-session-id": "agent",
                                                "x-agentserving-next-tool": "bash"},
                    json={"model": "m", "prompt": list(range(16))})
    assert r.status_code == 200, r.text
    assert pod.bodies[-1]["vllm_xargs"] == {PIN_TTL_XARG: 7.0}
    info = pinned_session(kv_url, "agent")
    assert info["pinned_until"] == pytest.approx(time.time() + 7, abs=3)

    r = client.post("/v1/completions", headers={"x-session-id": "human"},
                    json={"model": "m", "prompt": list(range(16))})
    assert r.status_code == 200 and "vllm_xargs" not in pod.bodies[-1]
    info = wait_until(lambda: session(kv_url, "human"), what="the session",
                      ignoring=(httpx.HTTPError,))
    assert not info["pinned_until"]


def test_tool_pins_yield_to_the_agents_own_memory_verbs_and_to_the_flag() -> None:
    def resolve(settings: ProxySettings, memory: AgentMemory | None) -> AgentMemory | None:
        turn = Turn(endpoint="/v1/completions", body={"prompt": [1]}, session_id="s",
                    session_key="s", memory=memory, next_tool="bash")
        with_orchestrator(settings, lambda orch: orch._resolve_pin(turn))
        return turn.memory

    pinned = resolve(ProxySettings(tool_pin=True), None)
    assert pinned is not None and pinned.pin_ttl_s == 5.0  # the floor: no gap learnt yet
    assert resolve(ProxySettings(), None) is None  # off by default
    released = resolve(ProxySettings(tool_pin=True), AgentMemory(release=True))
    assert released == AgentMemory(release=True)
