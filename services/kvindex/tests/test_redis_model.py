"""Property tests: on random operation sequences the Redis backends answer exactly as the
in-memory ones (the reference model), operation by operation and in the state they leave."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentserving.core.schemas import (
    ChunkSnapshot,
    EventBatch,
    PodRegistration,
    PodRole,
    ResidencyEvent,
    Tier,
)
from agentserving.core.testing import RedisServer
from agentserving.kvindex.index.base import UnknownPod
from agentserving.kvindex.index.memory import InMemoryIndex, InMemorySessionStore
from agentserving.kvindex.index.redis import RedisIndex, RedisSessionStore

POOL = [f"{i:02x}" * 4 for i in range(6)]  # six chunk hashes, the chain in this order
PODS = ["p0", "p1"]
SIDS = ["s0", "s1", "s2", "s3"]
SETTINGS = settings(max_examples=80, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

chunks = st.lists(st.sampled_from(POOL), max_size=5)
tiers = st.sampled_from(list(Tier))
events = st.one_of(
    st.builds(lambda op, t, c, b: ResidencyEvent(op=op, tier=t, chunk_hashes=c, bytes=b),
              st.sampled_from(["stored", "removed"]), tiers, chunks,
              st.one_of(st.none(), st.integers(0, 100))),
    st.builds(lambda t: ResidencyEvent(op="cleared", tier=t), st.one_of(st.none(), tiers)),
)
index_ops = st.lists(st.one_of(
    st.tuples(st.just("register"), st.sampled_from(PODS), st.sampled_from(list(PodRole))),
    # seq None: the pod's next seq (the common case); a number: a replay, a gap or a restart
    *[st.tuples(st.just("events"), st.sampled_from(PODS),
                st.one_of(st.none(), st.none(), st.integers(0, 6)),
                st.lists(events, min_size=1, max_size=3))] * 3,
    st.tuples(st.just("snapshot"), st.sampled_from(PODS), st.integers(0, 8),
              st.dictionaries(tiers, chunks, max_size=3),
              st.dictionaries(tiers, st.integers(0, 50), max_size=3)),
    st.tuples(st.just("deregister"), st.sampled_from(PODS)),
), max_size=25)
session_ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.sampled_from(SIDS), st.sampled_from(["x", "y"]), chunks),
    st.tuples(st.just("delete_intent"), st.sampled_from(SIDS), st.sampled_from(["x", "y"])),
    st.tuples(st.just("delete"), st.sampled_from(SIDS)),
    st.tuples(st.just("fork"), st.sampled_from(SIDS), st.sampled_from(SIDS)),
), max_size=25)


def dump(got: Any) -> Any:
    """A result without its time-dependent fields (the two backends read the clock apart)."""
    if hasattr(got, "model_dump"):
        return got.model_dump(exclude={"registered_at", "last_heartbeat", "lease_expires_at",
                                       "created_at", "updated_at"})
    return got


async def outcome(call: Any) -> Any:
    """What a call answered, or its error's type (which is part of the contract)."""
    try:
        return dump(await call)
    except Exception as exc:  # noqa: BLE001
        return ("error", type(exc).__name__)


async def index_state(index: Any) -> Any:
    lookups = {}
    for start in range(len(POOL)):
        for role in (None, *PodRole):
            found = await index.lookup(POOL[start:], role=role)
            lookups[(start, role)] = sorted((p.pod, p.prefix_chunks, sorted(p.tiers.items()))
                                            for p in found)
        found = await index.lookup(POOL[start:], pods=PODS[:2])
        lookups[(start, "filtered")] = sorted((p.pod, p.prefix_chunks) for p in found)
    return {
        "pods": [dump(p) for p in await index.list_pods()],
        "get": [await outcome(index.get_pod(p)) for p in PODS],
        "holders": await index.holders(POOL),
        "locate": [await index.locate(c) for c in POOL],
        "lookups": lookups,
    }


async def next_seq(model: InMemoryIndex, pod: str) -> int:
    try:
        return max(0, (await model.get_pod(pod)).seq + 1)
    except UnknownPod:
        return 0


async def run_index_ops(roles: list[PodRole], ops: list[tuple], url: str) -> None:
    model = InMemoryIndex()
    real = RedisIndex(url, key_prefix=f"prop-{uuid.uuid4().hex[:8]}:")
    try:
        # Every pod starts registered, so most operations reach one; "register" ops re-register.
        for op in [("register", pod, role) for pod, role in zip(PODS, roles, strict=True)] + ops:
            if op[0] == "events" and op[2] is None:
                op = (*op[:2], await next_seq(model, op[1]), op[3])
            results = []
            for backend in (model, real):
                if op[0] == "register":
                    reg = PodRegistration(pod=op[1], memory_api_url="http://127.0.0.1:9",
                                          model="m", role=op[2])
                    call = backend.register_pod(reg, 60)
                elif op[0] == "events":
                    call = backend.apply_events(EventBatch(pod=op[1], seq=op[2], events=op[3]))
                elif op[0] == "snapshot":
                    snap = ChunkSnapshot(seq=op[2], chunks=op[3], bytes=op[4])
                    call = backend.replace_chunks(op[1], snap)
                else:
                    call = backend.deregister(op[1])
                results.append(await outcome(call))
            assert results[0] == results[1], op
        assert await index_state(model) == await index_state(real)
    finally:
        await real.flush_prefix()
        await real.close()


async def run_session_ops(ops: list[tuple], url: str) -> None:
    model = InMemorySessionStore()
    real = RedisSessionStore(url, key_prefix=f"prop-{uuid.uuid4().hex[:8]}:")
    try:
        for op in ops:
            results = []
            for store in (model, real):
                if op[0] == "put":
                    call = store.put_intent(op[1], op[2], op[3])
                elif op[0] == "delete_intent":
                    call = store.delete_intent(op[1], op[2])
                elif op[0] == "delete":
                    call = store.delete_session(op[1])
                else:
                    call = store.fork(op[1], op[2])
                results.append(await outcome(call))
            assert results[0] == results[1], op
        for store_sid in (None, *SIDS):
            assert (await model.referenced_elsewhere(POOL, store_sid)
                    == await real.referenced_elsewhere(POOL, store_sid)), store_sid
        for sid in SIDS:
            assert await outcome(model.get_session(sid)) == await outcome(real.get_session(sid))
    finally:
        await real.flush_prefix()
        await real.close()


@SETTINGS
@given(roles=st.lists(st.sampled_from(list(PodRole)), min_size=2, max_size=2), ops=index_ops)
def test_redis_index_matches_the_in_memory_model(redis_server: RedisServer, roles, ops) -> None:
    asyncio.run(run_index_ops(roles, ops, redis_server.url))


@SETTINGS
@given(ops=session_ops)
def test_redis_sessions_match_the_in_memory_model(redis_server: RedisServer, ops) -> None:
    asyncio.run(run_session_ops(ops, redis_server.url))
