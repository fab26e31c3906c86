"""Redis going away and coming back: the backends fail fast with ``BackendUnavailable`` (so the
HTTP layer answers 503 at once), the circuit breaker keeps them off the socket for a moment, and
the client reconnects by itself once Redis answers again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from agentserving.core.schemas import EventBatch, PodRegistration, ResidencyEvent
from agentserving.kvindex.index.base import BackendUnavailable
from agentserving.kvindex.index.redis import RedisIndex, RedisSessionStore
from testkit.servers import RedisServer, free_port
from testkit.servers import redis_server as running_redis

pytestmark = pytest.mark.anyio

CHUNKS = ["aa01", "aa02", "aa03"]
BREAKER_S = 0.3


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own, since the test stops it."""
    with running_redis() as server:
        yield server


async def fill(index: RedisIndex, pod: str) -> None:
    await index.register_pod(PodRegistration(pod=pod, memory_api_url="http://127.0.0.1:9",
                                             model="m"), 30)
    await index.apply_events(EventBatch(pod=pod, seq=1, events=[
        ResidencyEvent(op="stored", tier="cpu", chunk_hashes=CHUNKS)]))


async def timed_failure(call) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    with pytest.raises(BackendUnavailable, match="redis at redis://127.0.0.1"):
        await call
    return time.monotonic() - start


async def test_outage_fails_fast_then_recovers(own_redis: RedisServer) -> None:
    index = RedisIndex(own_redis.url, breaker_s=BREAKER_S)
    sessions = RedisSessionStore(own_redis.url, breaker_s=BREAKER_S)
    try:
        await fill(index, "p")
        await sessions.put_intent("s", "i", CHUNKS)
        own_redis.stop()

        assert await timed_failure(index.lookup(CHUNKS)) < 1.0
        assert await timed_failure(sessions.get_session("s")) < 1.0
        # The breaker is open now: calls fail without touching the socket.
        start = time.monotonic()
        with pytest.raises(BackendUnavailable, match="circuit open"):
            await index.lookup(CHUNKS)
        with pytest.raises(BackendUnavailable, match="circuit open"):
            await index.ping()
        assert time.monotonic() - start < 0.25  # generous: the machine may be loaded

        # After the breaker's window a call probes again; Redis still down: it fails again.
        await asyncio.sleep(BREAKER_S + 0.05)
        assert await timed_failure(index.apply_events(
            EventBatch(pod="p", seq=2, events=[]))) < 1.0

        own_redis.restart()  # same port; this test server keeps nothing across restarts
        await asyncio.sleep(BREAKER_S + 0.05)
        await index.ping()
        await sessions.ping()
        await fill(index, "p")
        assert [(p.pod, p.prefix_chunks) for p in await index.lookup(CHUNKS)] == [("p", 3)]
        info = await sessions.put_intent("s", "i", CHUNKS[:1])
        assert info.intents == {"i": CHUNKS[:1]}
    finally:
        await index.close()
        await sessions.close()


async def test_pooled_connections_reconnect_after_a_restart(own_redis: RedisServer) -> None:
    """A restart between two calls is invisible: a stale pooled connection is retried once."""
    index = RedisIndex(own_redis.url)
    try:
        await fill(index, "p")
        # Several pooled connections, all of which go stale on the restart.
        await asyncio.gather(*(index.lookup(CHUNKS) for _ in range(4)))
        own_redis.restart()
        results = await asyncio.gather(*(index.list_pods() for _ in range(4)))
        assert results == [[]] * 4  # it answers (and the new server starts empty)
        await fill(index, "q")
        assert [p.pod for p in await index.lookup(CHUNKS)] == ["q"]
    finally:
        await index.close()


async def test_unreachable_at_start_fails_fast() -> None:
    index = RedisIndex(f"redis://127.0.0.1:{free_port()}/0")
    try:
        assert await timed_failure(index.lookup(CHUNKS)) < 1.0
        assert await timed_failure(index.list_pods()) < 0.25  # breaker open
    finally:
        await index.close()


async def test_a_burst_beyond_the_pool_queues_instead_of_failing(own_redis: RedisServer) -> None:
    index = RedisIndex(own_redis.url, max_connections=2)
    try:
        await fill(index, "p")
        results = await asyncio.gather(*(index.lookup(CHUNKS) for _ in range(50)))
        assert all([(p.pod, p.prefix_chunks) for p in r] == [("p", 3)] for r in results)
    finally:
        await index.close()
