"""``agent_memory``'s KV lifecycle fields: validated as the proxy reads a turn (a 400 naming the
field), and carried out after the turn through a real kvindex (in-process, over HTTP) whose
evictions reach a real HTTP memory-API stand-in."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from agentserving.core.clients import NotFound
from agentserving.core.hashing import ChunkHasher
from agentserving.core.schemas import EventBatch, EvictRequest, PodRegistration, ResidencyEvent
from agentserving.kvindex.app import create_app as create_kvindex
from agentserving.kvindex.index.memory import InMemoryIndex, InMemorySessionStore
from agentserving.kvindex.settings import KvindexSettings
from agentserving.proxy.app import create_app as create_proxy
from agentserving.proxy.kvindex_http import AioKvindexClient
from agentserving.proxy.memory_hooks import AgentMemory, after_turn
from agentserving.proxy.settings import ProxySettings
from testkit.servers import MemoryApiPeer, ThreadedServer, free_port

H = ChunkHasher("blake3", 4).hashes(list(range(40)))  # 10 chained hashes


@pytest.fixture
def fleet() -> Iterator[tuple[str, MemoryApiPeer]]:
    """A kvindex (memory backend) and one pod's memory API behind it."""
    peer = MemoryApiPeer()
    kv = ThreadedServer(create_kvindex(KvindexSettings(), InMemoryIndex(),
                                       InMemorySessionStore()))
    yield kv.url, peer
    kv.stop()
    peer.stop()


def test_after_turn_pins_sets_priority_releases_and_closes(fleet) -> None:  # type: ignore[no-untyped-def]
    url, peer = fleet
    done: list[tuple[str, bool]] = []

    def record(op: str, ok: bool) -> None:
        done.append((op, ok))

    async def scenario() -> None:
        kv = AioKvindexClient(url, 5.0)
        try:
            await kv.register(PodRegistration(pod="p", memory_api_url=peer.url, model="m",
                                              chunk_size=4))
            await kv.events(EventBatch(pod="p", seq=1, events=[
                ResidencyEvent(op="stored", tier="cpu", chunk_hashes=H[:6])]))

            # a turn ending in a tool call: write back, raise the priority, pin through the gap
            await after_turn(kv, "agent", AgentMemory(intent="plan", priority=4, pin_ttl_s=30),
                             H[:4], record)
            info = await kv.session("agent")
            assert info.intents == {"plan": H[:4]} and info.priority == 4
            assert info.pinned_until is not None and info.pinned_until > time.time() + 25
            r = await kv.evict(EvictRequest(chunk_hashes=H[:6], priority=1000))
            assert r.protected == H[:4], r  # the pin holds against any priority
            assert peer.calls[-1:] == [("evict", {"chunk_hashes": H[4:6], "locations": None})], r

            # the next turn: the tool came back, the pin goes
            await after_turn(kv, "agent", AgentMemory(release=True), H[:4], record)
            assert (await kv.session("agent")).pinned_until is None
            r = await kv.evict(EvictRequest(chunk_hashes=H[:4], priority=1000))
            assert r.protected == []

            # the final turn: its chunks are written back, then the session closes
            peer.calls.clear()
            await after_turn(kv, "agent", AgentMemory(intent="plan", close_session=True),
                             H[:5], record)
            with pytest.raises(NotFound):
                await kv.session("agent")
            assert peer.calls == [("evict", {"chunk_hashes": sorted(H[:5]), "locations": None})]

            # a verb for a session the kvindex does not know is recorded, never raised
            await after_turn(kv, "nobody", AgentMemory(pin_ttl_s=5), [], record)
        finally:
            await kv.aclose()

        # and an unreachable kvindex fails no turn either
        down = AioKvindexClient(f"http://127.0.0.1:{free_port()}", 0.5)
        try:
            await after_turn(down, "agent", AgentMemory(close_session=True), H[:1], record)
        finally:
            await down.aclose()

    asyncio.run(scenario())
    assert done == [("write", True), ("priority", True), ("pin", True), ("release", True),
                    ("write", True), ("close", True), ("pin", False), ("close", False)]


def test_a_turn_without_chunk_hashes_still_carries_out_its_lifecycle_verbs(fleet) -> None:  # type: ignore[no-untyped-def]
    """An engine that names no chunks for a turn leaves nothing to write back under
    ``intent``; the session's close must happen all the same."""
    url, _peer = fleet
    done: list[tuple[str, bool]] = []

    async def scenario() -> None:
        kv = AioKvindexClient(url, 5.0)
        try:
            await after_turn(kv, "quiet", AgentMemory(intent="plan"), H[:2],
                             lambda op, ok: done.append((op, ok)))
            await after_turn(kv, "quiet", AgentMemory(intent="plan", close_session=True), None,
                             lambda op, ok: done.append((op, ok)))
            with pytest.raises(NotFound):
                await kv.session("quiet")
        finally:
            await kv.aclose()

    asyncio.run(scenario())
    assert done == [("write", True), ("close", True)]


@pytest.mark.parametrize(
    ("memory", "param"),
    [
        ({"pin_ttl_s": 0}, "agent_memory.pin_ttl_s"),
        ({"pin_ttl_s": "30"}, "agent_memory.pin_ttl_s"),
        ({"pin_ttl_s": 86401}, "agent_memory.pin_ttl_s"),
        ({"pin_ttl_s": 30, "release": True}, "agent_memory.release"),
        ({"pin_ttl_s": 30, "close_session": True}, "agent_memory.close_session"),
        ({"close_session": 1}, "agent_memory.close_session"),
        ({"priority": 2000}, "agent_memory.priority"),
        ({"pin": 30}, "agent_memory.pin"),
    ],
)
def test_bad_lifecycle_fields_are_a_400_naming_the_field(memory, param) -> None:  # type: ignore[no-untyped-def]
    with TestClient(create_proxy(ProxySettings())) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": [1],
                                                 "agent_memory": memory})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_lifecycle_fields_are_documented_and_release_with_close_is_one_close() -> None:
    schema = create_proxy(ProxySettings()).openapi()["components"]["schemas"]
    props = schema["AgentMemory"]["properties"]
    assert {"pin_ttl_s", "release", "close_session", "priority"} <= set(props)
    with pytest.raises(ValidationError):
        AgentMemory(pin_ttl_s=1, release=True)
    assert AgentMemory(release=True, close_session=True).close_session
