"""What the Redis backends leave in Redis: nothing leaks when pods and sessions go, slots are
reused without inheriting residency, and big batches cross the scripts' window boundaries."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis

from agentserving.core.hashing import ChunkHasher
from agentserving.core.schemas import (
    ChunkSnapshot,
    EventBatch,
    PodRegistration,
    ResidencyEvent,
    Tier,
)
from agentserving.kvindex.index.redis import RedisIndex, RedisSessionStore
from testkit.servers import RedisServer

pytestmark = pytest.mark.anyio

CHAIN = ChunkHasher(chunk_size=1).hashes(list(range(2600)))


@pytest.fixture
def raw(redis_server: RedisServer) -> redis.Redis:
    client = redis.Redis(port=redis_server.port, decode_responses=True)
    client.flushdb()
    return client


@pytest.fixture
async def index(redis_server: RedisServer, raw: redis.Redis) -> AsyncIterator[RedisIndex]:
    idx = RedisIndex(redis_server.url, key_prefix="lay:")
    yield idx
    await idx.close()


async def register(index: RedisIndex, pod: str) -> None:
    await index.register_pod(PodRegistration(pod=pod, memory_api_url="http://127.0.0.1:9",
                                             model="m"), 30)


async def store(index: RedisIndex, pod: str, seq: int, tier: Tier, chunks: list[str]) -> None:
    await index.apply_events(EventBatch(pod=pod, seq=seq, events=[
        ResidencyEvent(op="stored", tier=tier, chunk_hashes=chunks)]))


async def test_dropping_every_pod_leaves_no_keys(index: RedisIndex, raw: redis.Redis) -> None:
    for n, pod in enumerate(("a", "b", "c")):
        await register(index, pod)
        await store(index, pod, 1, Tier.CPU, CHAIN[: 100 * (n + 1)])
    await store(index, "a", 2, Tier.DISK, CHAIN[50:80])
    assert raw.hlen("lay:chunks") == 300
    assert raw.hgetall("lay:slots") == {"1": "a", "2": "b", "3": "c"}
    await index.deregister("b")
    assert raw.hlen("lay:chunks") == 300  # a and c still hold them
    assert await index.deregister("a") and await index.deregister("c")
    assert raw.keys("lay:*") == []


async def test_a_freed_slot_is_reused_without_residency(index: RedisIndex,
                                                        raw: redis.Redis) -> None:
    await register(index, "a")
    await register(index, "b")
    await store(index, "a", 1, Tier.DEVICE, CHAIN[:10])
    await store(index, "b", 1, Tier.CPU, CHAIN[:5])
    await index.deregister("a")
    await register(index, "c")
    assert raw.hget("lay:slots", "1") == "c"
    assert await index.holders(CHAIN[:10]) == {"b": {c: 2 for c in CHAIN[:5]}}
    assert [(p.pod, p.prefix_chunks) for p in await index.lookup(CHAIN[:10])] == [("b", 5)]
    # Removing b's last chunks trims the rows to nothing: they are deleted, not left empty.
    await index.apply_events(EventBatch(pod="b", seq=2, events=[
        ResidencyEvent(op="removed", tier="cpu", chunk_hashes=CHAIN[:5])]))
    assert raw.hlen("lay:chunks") == 0


async def test_batches_and_snapshots_larger_than_a_script_window(index: RedisIndex,
                                                                 raw: redis.Redis) -> None:
    await register(index, "a")
    await register(index, "b")
    # 2,600 chunks in one event and one snapshot: the scripts read and write 1,000 at a time.
    await store(index, "a", 1, Tier.CPU, CHAIN)
    await index.replace_chunks("b", ChunkSnapshot(seq=1, chunks={Tier.DISK: CHAIN[:2400],
                                                                 Tier.DEVICE: CHAIN[:1200]}))
    got = {p.pod: (p.prefix_chunks, p.tiers) for p in await index.lookup(CHAIN)}
    assert got == {"a": (2600, {Tier.CPU: 2600}),
                   "b": (2400, {Tier.DEVICE: 1200, Tier.DISK: 1200})}
    assert raw.hlen("lay:pc:a") == 2600 and raw.hlen("lay:pc:b") == 2400
    await index.apply_events(EventBatch(pod="a", seq=2, events=[
        ResidencyEvent(op="cleared", tier=None)]))
    assert raw.exists("lay:pc:a") == 0
    assert (await index.get_pod("a")).chunks == {}
    await index.replace_chunks("b", ChunkSnapshot(seq=2, chunks={}))
    assert raw.hlen("lay:chunks") == 0


async def test_sessions_leave_no_keys(redis_server: RedisServer, raw: redis.Redis) -> None:
    store_ = RedisSessionStore(redis_server.url, key_prefix="lay:")
    try:
        await store_.put_intent("s", "plan", CHAIN[:3])
        await store_.fork("s", "t")
        await store_.put_intent("t", "code", CHAIN[2:5])
        assert raw.hgetall("lay:refs") == {CHAIN[0]: "2", CHAIN[1]: "2", CHAIN[2]: "2",
                                           CHAIN[3]: "1", CHAIN[4]: "1"}
        assert raw.smembers(f"lay:cr:{CHAIN[2]}") == {"s", "t"}
        assert raw.smembers(f"lay:cr:{CHAIN[4]}") == {"t"}
        await store_.pin("t", 30, idle_ttl_s=60)
        assert raw.zscore("lay:sexp", "t") == float(raw.hget("lay:s:t", "exp"))
        assert await store_.close_session("s") and await store_.close_session("t")
        assert raw.keys("lay:*") == []
    finally:
        await store_.close()
