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
from agentserving.kvindex.index.base import UnknownPod, eviction_priority, protected_chunks
from agentserving.kvindex.index.memory import InMemoryIndex, InMemorySessionStore
from agentserving.kvindex.index.redis import RedisIndex, RedisSessionStore
from testkit.clock import ManualClock
from testkit.servers import RedisServer

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
    st.tuples(st.just("close"), st.sampled_from(SIDS)),
    st.tuples(st.just("fork"), st.sampled_from(SIDS), st.sampled_from(SIDS)),
    # the lifecycle, on a clock both backends share: expiry and pins compare exactly
    st.tuples(st.just("pin"), st.sampled_from(SIDS), st.sampled_from([0.5, 3.0, 25.0])),
    st.tuples(st.just("release"), st.sampled_from(SIDS)),
    st.tuples(st.just("priority"), st.sampled_from(SIDS), st.integers(-2, 2)),
    st.tuples(st.just("tick"), st.sampled_from([1.0, 4.0, 11.0])),
    st.tuples(st.just("expire")),
), max_size=25)
IDLE_TTL_S = st.sampled_from([None, 10.0])


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


async def protection(store: Any) -> dict:
    """What every unforced evict would keep: by each asker, at each priority."""
    out = {}
    for sid in (None, *SIDS):
        refs = await store.references(POOL, also=sid)
        asker = refs.sessions.get(sid) if sid else None
        for priority in (None, -1, 0, 1, 3):
            out[(sid, priority)] = sorted(protected_chunks(refs, asker=sid, priority=priority))
        out[(sid, "default")] = eviction_priority(None, asker, refs.now)
        out[(sid, "refs")] = refs.refs
    return out


async def run_session_ops(ops: list[tuple], url: str, idle_ttl_s: float | None) -> None:
    clock = ManualClock(1_700_000_000.0)
    model = InMemorySessionStore(clock=clock)
    real = RedisSessionStore(url, key_prefix=f"prop-{uuid.uuid4().hex[:8]}:", clock=clock)
    try:
        for op in ops:
            if op[0] == "tick":
                clock.now += op[1]
                continue
            results = []
            for store in (model, real):
                if op[0] == "put":
                    call = store.put_intent(op[1], op[2], op[3], idle_ttl_s)
                elif op[0] == "delete_intent":
                    call = store.delete_intent(op[1], op[2], idle_ttl_s)
                elif op[0] == "close":
                    call = store.close_session(op[1])
                elif op[0] == "fork":
                    call = store.fork(op[1], op[2], idle_ttl_s)
                elif op[0] == "pin":
                    call = store.pin(op[1], op[2], idle_ttl_s)
                elif op[0] == "release":
                    call = store.release(op[1], idle_ttl_s)
                elif op[0] == "priority":
                    call = store.set_priority(op[1], op[2], idle_ttl_s)
                else:
                    call = store.expire_sessions()
                results.append(await outcome(call))
            assert results[0] == results[1], op
            assert await protection(model) == await protection(real), op
        for sid in SIDS:
            assert await outcome(model.get_session(sid)) == await outcome(real.get_session(sid))
        assert await model.expire_sessions() == await real.expire_sessions()
    finally:
        await real.flush_prefix()
        await real.close()


@SETTINGS
@given(roles=st.lists(st.sampled_from(list(PodRole)), min_size=2, max_size=2), ops=index_ops)
def test_redis_index_matches_the_in_memory_model(redis_server: RedisServer, roles, ops) -> None:
    asyncio.run(run_index_ops(roles, ops, redis_server.url))


@SETTINGS
@given(ops=session_ops, idle_ttl_s=IDLE_TTL_S)
def test_redis_sessions_match_the_in_memory_model(redis_server: RedisServer, ops,
                                                  idle_ttl_s) -> None:
    asyncio.run(run_session_ops(ops, redis_server.url, idle_ttl_s))
