"""The contract of ``Index`` and ``SessionStore`` (see ``index/base.py``), run against every
backend: the in-memory one and Redis (a real redis-server on a free loopback port)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from agentserving.core.hashing import ChunkHasher
from agentserving.core.schemas import (
    DEFAULT_PRIORITY,
    ChunkLocation,
    ChunkSnapshot,
    EventBatch,
    PodRegistration,
    PodRole,
    ResidencyEvent,
    Tier,
)
from agentserving.kvindex.index.base import (
    Index,
    SessionExists,
    SessionLife,
    SessionStore,
    UnknownPod,
    UnknownSession,
    protected_chunks,
)
from agentserving.kvindex.index.factory import new_index
from agentserving.kvindex.index.memory import InMemoryIndex, InMemorySessionStore
from agentserving.kvindex.index.redis import RedisIndex, RedisSessionStore
from testkit.clock import ManualClock

pytestmark = pytest.mark.anyio

CHAIN = ChunkHasher(chunk_size=4).hashes(list(range(40)))  # 10 chained hashes
A, B, C, D = CHAIN[:4]
DEV, CPU, DISK = Tier.DEVICE, Tier.CPU, Tier.DISK


def reg(pod: str, role: PodRole = PodRole.BOTH) -> PodRegistration:
    return PodRegistration(pod=pod, memory_api_url="http://127.0.0.1:9", model="tiny",
                           role=role, chunk_size=4, labels={"zone": "z1"})


def ev(op: str, tier: Tier | None, chunks: Sequence[str] = (), nbytes: int | None = None
       ) -> ResidencyEvent:
    return ResidencyEvent(op=op, tier=tier, chunk_hashes=list(chunks), bytes=nbytes)


async def send(index: Index, pod: str, seq: int, *events: ResidencyEvent):
    return await index.apply_events(EventBatch(pod=pod, seq=seq, events=list(events)))


async def register(index: Index, *pods: str, ttl_s: float = 30.0,
                   role: PodRole = PodRole.BOTH) -> None:
    for pod in pods:
        await index.register_pod(reg(pod, role), ttl_s)


def as_dict(prefixes) -> dict[str, tuple[int, dict[Tier, int]]]:
    return {p.pod: (p.prefix_chunks, p.tiers) for p in prefixes}


# ---------------------------------------------------------------------------- pods and leases


async def test_register_heartbeat_get_list_deregister(index: Index) -> None:
    info = await index.register_pod(reg("p0", PodRole.PREFILL), 30)
    assert (info.pod, info.role, info.seq, info.needs_resync) == ("p0", PodRole.PREFILL, -1, False)
    assert info.labels == {"zone": "z1"} and info.chunk_size == 4
    assert info.lease_expires_at == pytest.approx(info.registered_at + 30)
    assert info.chunks == {} and info.used_bytes == {}
    await register(index, "p1")
    assert [p.pod for p in await index.list_pods()] == ["p0", "p1"]

    await asyncio.sleep(0.01)
    lease = await index.heartbeat("p0", 60)
    assert lease.pod == "p0" and lease.lease_expires_at > info.lease_expires_at + 29
    got = await index.get_pod("p0")
    assert got.last_heartbeat > info.last_heartbeat
    assert got.lease_expires_at == lease.lease_expires_at

    await send(index, "p0", 1, ev("stored", CPU, [A, B]))
    # Re-registering a live pod (its API process restarted) keeps its residency and seq.
    again = await index.register_pod(reg("p0", PodRole.DECODE), 30)
    assert again.role == PodRole.DECODE and again.seq == 1 and again.chunks == {CPU: 2}
    assert again.registered_at == info.registered_at

    assert await index.deregister("p0") is True
    assert [p.pod for p in await index.list_pods()] == ["p1"]
    assert await index.locate(A) == []
    assert await index.deregister("p0") is False
    with pytest.raises(UnknownPod, match="p0"):
        await index.get_pod("p0")
    with pytest.raises(UnknownPod):
        await index.heartbeat("p0", 30)


async def test_unknown_pod_errors(index: Index) -> None:
    with pytest.raises(UnknownPod, match="'ghost'"):
        await send(index, "ghost", 1, ev("stored", CPU, [A]))
    with pytest.raises(UnknownPod):
        await index.replace_chunks("ghost", ChunkSnapshot(seq=1, chunks={CPU: [A]}))
    with pytest.raises(UnknownPod):
        await index.heartbeat("ghost", 1)
    with pytest.raises(UnknownPod):
        await index.get_pod("ghost")
    assert await index.deregister("ghost") is False
    assert await index.expire_leases() == []


async def test_lapsed_lease_is_invisible_at_once_and_expiry_drops_residency(index: Index) -> None:
    await register(index, "short", ttl_s=0.4)
    await register(index, "long")
    for pod in ("short", "long"):
        await send(index, pod, 1, ev("stored", CPU, CHAIN[:3]))
    assert set(as_dict(await index.lookup(CHAIN[:3]))) == {"short", "long"}

    await asyncio.sleep(0.6)
    # Lapsed but not yet reaped: no read sees it, no write reaches it.
    assert [p.pod for p in await index.list_pods()] == ["long"]
    assert await index.locate(A) == [ChunkLocation(pod="long", tier=CPU)]
    assert set(as_dict(await index.lookup(CHAIN[:3]))) == {"long"}
    assert set(await index.holders(CHAIN[:3])) == {"long"}
    with pytest.raises(UnknownPod):
        await index.get_pod("short")
    with pytest.raises(UnknownPod):
        await index.heartbeat("short", 30)
    with pytest.raises(UnknownPod):
        await send(index, "short", 2, ev("stored", CPU, [D]))

    assert await index.expire_leases() == ["short"]
    assert await index.expire_leases() == []
    # Residency went with it: the same name registering again starts empty.
    fresh = await index.register_pod(reg("short"), 30)
    assert fresh.chunks == {} and fresh.seq == -1
    assert set(await index.holders(CHAIN[:3])) == {"long"}
    assert set(as_dict(await index.lookup(CHAIN[:3]))) == {"long"}


async def test_registering_again_after_lapse_starts_fresh(index: Index) -> None:
    await register(index, "p", ttl_s=0.3)
    await send(index, "p", 4, ev("stored", DISK, [A], 10))
    await asyncio.sleep(0.45)
    info = await index.register_pod(reg("p"), 30)  # before the reaper ran
    assert (info.seq, info.chunks, info.used_bytes) == (-1, {}, {})
    assert await index.locate(A) == []
    assert await index.expire_leases() == []


async def test_heartbeat_keeps_a_short_lease_alive(index: Index) -> None:
    await register(index, "p", ttl_s=0.6)
    await send(index, "p", 1, ev("stored", CPU, [A]))
    for _ in range(3):  # 0.75 s in all: longer than one lease
        await asyncio.sleep(0.25)
        await index.heartbeat("p", 0.6)
    assert await index.expire_leases() == []
    assert await index.locate(A) == [ChunkLocation(pod="p", tier=CPU)]


# ---------------------------------------------------------------------------- residency


async def test_events_per_tier_with_byte_accounting(index: Index) -> None:
    await register(index, "p")
    r = await send(index, "p", 1, ev("stored", CPU, [A, B, C], 300), ev("stored", DEV, [A], 100))
    assert (r.applied, r.chunk_events, r.needs_resync) == (True, 4, False)
    info = await index.get_pod("p")
    assert info.chunks == {DEV: 1, CPU: 3} and info.used_bytes == {DEV: 100, CPU: 300}
    assert await index.locate(A) == [ChunkLocation(pod="p", tier=DEV),
                                     ChunkLocation(pod="p", tier=CPU)]

    await send(index, "p", 2, ev("removed", CPU, [A], 100), ev("stored", DISK, [D], 50))
    info = await index.get_pod("p")
    assert info.chunks == {DEV: 1, CPU: 2, DISK: 1}
    assert info.used_bytes == {DEV: 100, CPU: 200, DISK: 50}
    assert await index.locate(A) == [ChunkLocation(pod="p", tier=DEV)]

    # Removing more bytes than accounted clamps at zero; removing an absent chunk is a no-op.
    await send(index, "p", 3, ev("removed", DISK, [D, C], 999))
    info = await index.get_pod("p")
    assert info.chunks == {DEV: 1, CPU: 2} and info.used_bytes == {DEV: 100, CPU: 200}
    assert await index.locate(D) == []

    r = await send(index, "p", 4, ev("cleared", DEV))
    assert r.chunk_events == 1
    info = await index.get_pod("p")
    assert info.chunks == {CPU: 2} and info.used_bytes == {CPU: 200}
    assert await index.locate(A) == []
    assert await index.locate(B) == [ChunkLocation(pod="p", tier=CPU)]

    await send(index, "p", 5, ev("stored", DISK, [A], 7), ev("cleared", None))
    info = await index.get_pod("p")
    assert info.chunks == {} and info.used_bytes == {}
    assert await index.holders(CHAIN) == {}


async def test_events_within_one_batch_apply_in_order(index: Index) -> None:
    await register(index, "p")
    await send(index, "p", 1, ev("stored", CPU, [A, A, B]), ev("removed", CPU, [A]),
               ev("stored", DISK, [A]), ev("stored", DEV, [B]), ev("cleared", CPU),
               ev("stored", CPU, [C]))
    assert await index.holders([A, B, C]) == {"p": {A: 4, B: 1, C: 2}}
    assert (await index.get_pod("p")).chunks == {DEV: 1, CPU: 1, DISK: 1}


async def test_seq_replay_is_ignored_and_a_gap_flags_resync(index: Index) -> None:
    await register(index, "p")
    first = await send(index, "p", 5, ev("stored", CPU, [A]))  # a first batch may start anywhere
    assert first.applied and not first.needs_resync
    replay = await send(index, "p", 5, ev("removed", CPU, [A]))
    assert (replay.applied, replay.chunk_events) == (False, 0)
    older = await send(index, "p", 3, ev("stored", CPU, [B]))
    assert not older.applied
    assert await index.holders([A, B]) == {"p": {A: 2}}
    assert (await index.get_pod("p")).seq == 5

    gap = await send(index, "p", 7, ev("stored", CPU, [B]))
    assert gap.applied and gap.needs_resync  # applied: what it says is still true
    assert (await send(index, "p", 8, ev("stored", CPU, [C]))).needs_resync
    assert (await index.get_pod("p")).needs_resync
    assert await index.holders([A, B, C]) == {"p": {A: 2, B: 2, C: 2}}

    lease = await index.replace_chunks("p", ChunkSnapshot(seq=20, chunks={DISK: [A]}))
    assert (lease.seq, lease.needs_resync) == (20, False)
    after = await send(index, "p", 21, ev("stored", DEV, [A]))
    assert after.applied and not after.needs_resync


async def test_snapshot_replaces_all_residency(index: Index) -> None:
    await register(index, "p", "q")
    await send(index, "p", 1, ev("stored", CPU, [A, B, C], 30), ev("stored", DEV, [A], 10))
    await send(index, "q", 1, ev("stored", CPU, [B]))
    snap = ChunkSnapshot(seq=9, chunks={DISK: [B, D, B], CPU: [D]}, bytes={DISK: 20, CPU: 5})
    lease = await index.replace_chunks("p", snap)
    assert lease.pod == "p" and lease.seq == 9
    info = await index.get_pod("p")
    assert info.chunks == {CPU: 1, DISK: 2} and info.used_bytes == {CPU: 5, DISK: 20}
    assert await index.holders([A, B, C, D]) == {"p": {B: 4, D: 6}, "q": {B: 2}}
    assert await index.locate(A) == [] and await index.locate(C) == []
    await index.replace_chunks("p", ChunkSnapshot(seq=10, chunks={}))
    assert (await index.get_pod("p")).chunks == {}
    assert await index.holders([A, B, C, D]) == {"q": {B: 2}}


async def test_locate_lists_every_pod_and_tier_sorted(index: Index) -> None:
    await register(index, "b", "a")
    await send(index, "b", 1, ev("stored", DISK, [A]), ev("stored", DEV, [A]))
    await send(index, "a", 1, ev("stored", CPU, [A]))
    assert await index.locate(A) == [
        ChunkLocation(pod="a", tier=CPU), ChunkLocation(pod="b", tier=DEV),
        ChunkLocation(pod="b", tier=DISK)]
    assert await index.locate(D) == []


async def test_lookup_longest_prefix_with_tier_breakdown_and_filters(index: Index) -> None:
    await register(index, "a", role=PodRole.PREFILL)
    await register(index, "b", role=PodRole.DECODE)
    await register(index, "c", "d", "e")
    await send(index, "a", 1, ev("stored", DISK, CHAIN[:6]))
    await send(index, "b", 1, ev("stored", CPU, CHAIN[:4]), ev("stored", DEV, CHAIN[:2]))
    await send(index, "c", 1, ev("stored", CPU, CHAIN[1:8]))  # lacks the first chunk
    await send(index, "d", 1, ev("stored", CPU, [CHAIN[0], CHAIN[2]]))  # a hole at 1
    await send(index, "e", 1, ev("stored", CPU, CHAIN))

    got = as_dict(await index.lookup(CHAIN))
    assert got == {"a": (6, {DISK: 6}), "b": (4, {DEV: 2, CPU: 2}), "d": (1, {CPU: 1}),
                   "e": (10, {CPU: 10})}
    assert as_dict(await index.lookup(CHAIN[:3])) == {
        "a": (3, {DISK: 3}), "b": (3, {DEV: 2, CPU: 1}), "d": (1, {CPU: 1}), "e": (3, {CPU: 3})}
    assert as_dict(await index.lookup(CHAIN, pods=["b", "c", "zz"])) == {"b": (4, {DEV: 2, CPU: 2})}
    assert await index.lookup(CHAIN, pods=[]) == []
    assert set(as_dict(await index.lookup(CHAIN, role=PodRole.PREFILL))) == {"a", "d", "e"}
    assert set(as_dict(await index.lookup(CHAIN, role=PodRole.DECODE))) == {"b", "d", "e"}
    assert set(as_dict(await index.lookup(CHAIN, role=PodRole.BOTH))) == {"d", "e"}
    assert set(as_dict(await index.lookup(CHAIN, pods=["a", "b"], role=PodRole.DECODE))) == {"b"}
    assert await index.lookup([]) == []
    assert as_dict(await index.lookup(CHAIN[1:])) == {
        "a": (5, {DISK: 5}), "b": (3, {DEV: 1, CPU: 2}), "c": (7, {CPU: 7}), "e": (9, {CPU: 9})}


async def test_lookup_walks_long_chains(index: Index) -> None:
    chain = ChunkHasher(chunk_size=1).hashes(list(range(3000)))
    await register(index, "p", "q")
    await send(index, "p", 1, ev("stored", CPU, chain[:2500]), ev("stored", DEV, chain[:1000]))
    await send(index, "q", 1, ev("stored", DISK, chain))
    got = as_dict(await index.lookup(chain))
    assert got == {"p": (2500, {DEV: 1000, CPU: 1500}), "q": (3000, {DISK: 3000})}


async def test_holders_maps_live_pods_to_masks(index: Index) -> None:
    await register(index, "p", "q")
    await send(index, "p", 1, ev("stored", CPU, [A, B]), ev("stored", DEV, [A]))
    await send(index, "q", 1, ev("stored", DISK, [B, C]))
    assert await index.holders([A, B, C, D]) == {"p": {A: 3, B: 2}, "q": {B: 4, C: 4}}
    assert await index.holders([D]) == {}
    assert await index.holders([]) == {}


# ---------------------------------------------------------------------------- sessions


async def test_session_intents_put_get_delete(sessions: SessionStore) -> None:
    info = await sessions.put_intent("s1", "plan", [A, B])
    assert (info.session_id, info.parent, info.intents) == ("s1", None, {"plan": [A, B]})
    info = await sessions.put_intent("s1", "code", [C])
    assert info.intents == {"plan": [A, B], "code": [C]}
    assert info.updated_at >= info.created_at
    assert await sessions.get_intent("s1", "plan") == [A, B]
    info = await sessions.put_intent("s1", "plan", [D])  # replaces
    assert info.intents == {"plan": [D], "code": [C]}
    assert (await sessions.get_session("s1")).intents == {"plan": [D], "code": [C]}
    info = await sessions.delete_intent("s1", "plan")
    assert info.intents == {"code": [C]}
    await sessions.put_intent("s1", "empty", [])
    assert await sessions.get_intent("s1", "empty") == []

    with pytest.raises(UnknownSession, match="no intent 'plan'"):
        await sessions.get_intent("s1", "plan")
    with pytest.raises(UnknownSession, match="no intent 'plan'"):
        await sessions.delete_intent("s1", "plan")
    with pytest.raises(UnknownSession, match="unknown session 'nope'"):
        await sessions.get_intent("nope", "plan")
    with pytest.raises(UnknownSession, match="unknown session 'nope'"):
        await sessions.delete_intent("nope", "plan")
    with pytest.raises(UnknownSession, match="nope"):
        await sessions.get_session("nope")

    assert await sessions.close_session("s1") == sorted([C])  # what it referenced, "empty" too
    assert await sessions.close_session("s1") is None
    with pytest.raises(UnknownSession):
        await sessions.get_session("s1")


async def test_fork_is_copy_on_write(sessions: SessionStore) -> None:
    await sessions.put_intent("parent", "plan", [A, B])
    await sessions.put_intent("parent", "tools", [C])
    child = await sessions.fork("parent", "child")
    assert (child.session_id, child.parent) == ("child", "parent")
    assert child.intents == {"plan": [A, B], "tools": [C]}

    await sessions.put_intent("child", "plan", [A, D])
    await sessions.delete_intent("child", "tools")
    assert (await sessions.get_session("parent")).intents == {"plan": [A, B], "tools": [C]}
    assert (await sessions.get_session("child")).intents == {"plan": [A, D]}

    with pytest.raises(SessionExists, match="child"):
        await sessions.fork("parent", "child")
    with pytest.raises(UnknownSession, match="ghost"):
        await sessions.fork("ghost", "other")
    grandchild = await sessions.fork("child", "grandchild")
    assert grandchild.parent == "child" and grandchild.intents == {"plan": [A, D]}


async def referenced_elsewhere(sessions: SessionStore, chunks: list[str],
                               sid: str | None) -> set[str]:
    """What an unforced evict by ``sid`` at the default priority keeps."""
    refs = await sessions.references(chunks, also=sid)
    return protected_chunks(refs, asker=sid, priority=DEFAULT_PRIORITY)


async def test_references_count_other_live_sessions(sessions: SessionStore) -> None:
    everything = [A, B, C, D]
    await sessions.put_intent("s1", "x", [A, B])
    await sessions.put_intent("s1", "y", [B])  # the same chunk in two of one session's intents
    refs = await sessions.references(everything)
    assert refs.refs == {A: ["s1"], B: ["s1"]} and set(refs.sessions) == {"s1"}
    # A session's own references never protect its chunks, however many intents name them.
    assert await referenced_elsewhere(sessions, everything, "s1") == set()
    assert await referenced_elsewhere(sessions, everything, None) == {A, B}
    assert await referenced_elsewhere(sessions, everything, "unknown") == {A, B}

    await sessions.fork("s1", "s2")
    assert (await sessions.references([B, C])).refs == {B: ["s1", "s2"]}
    assert await referenced_elsewhere(sessions, everything, "s1") == {A, B}
    await sessions.put_intent("s2", "x", [C])
    await sessions.put_intent("s2", "y", [])
    assert await referenced_elsewhere(sessions, everything, "s1") == {C}
    assert await referenced_elsewhere(sessions, everything, "s2") == {A, B}

    await sessions.delete_intent("s1", "x")
    assert await referenced_elsewhere(sessions, everything, "s2") == {B}
    assert await sessions.close_session("s2") == [C]
    assert await referenced_elsewhere(sessions, everything, "s1") == set()
    assert await referenced_elsewhere(sessions, everything, None) == {B}
    assert await sessions.close_session("s1") == [B]
    assert await referenced_elsewhere(sessions, everything, None) == set()
    assert await referenced_elsewhere(sessions, [], None) == set()
    assert (await sessions.references([])).refs == {}


@pytest.fixture
async def clocked(store: str):  # type: ignore[no-untyped-def]
    clock = ManualClock(1_700_000_000.0)
    sessions = (InMemorySessionStore(clock=clock) if store == "memory"
                else RedisSessionStore(store, clock=clock))
    yield sessions, clock
    await sessions.close()


async def test_lifecycle_pin_priority_and_idle_expiry(clocked) -> None:  # type: ignore[no-untyped-def]
    sessions, clock = clocked
    t0 = clock.now
    info = await sessions.put_intent("s", "x", [A], idle_ttl_s=60)
    assert (info.expires_at, info.pinned_until, info.priority) == (t0 + 60, None, 0)
    info = await sessions.pin("s", 100, idle_ttl_s=60)  # the pin outlasts the idle TTL
    assert (info.pinned_until, info.expires_at) == (t0 + 100, t0 + 100)
    info = await sessions.set_priority("s", 7, idle_ttl_s=60)
    assert info.priority == 7 and info.pinned_until == t0 + 100
    life = (await sessions.references([A], also="s")).sessions["s"]
    assert life == SessionLife(expires_at=t0 + 100, pinned_until=t0 + 100, priority=7)

    clock.now = t0 + 99
    assert (await sessions.get_session("s")).pinned_until == t0 + 100
    clock.now = t0 + 100  # the pin lapses, and the session with it (no write since)
    with pytest.raises(UnknownSession):
        await sessions.get_session("s")
    with pytest.raises(UnknownSession):
        await sessions.pin("s", 5)
    refs = await sessions.references([A])
    assert refs.refs == {A: ["s"]} and not refs.sessions["s"].live(refs.now)  # not yet reaped
    assert protected_chunks(refs, asker=None, priority=None) == set()
    assert await sessions.expire_sessions() == ["s"]
    assert (await sessions.references([A])).refs == {}
    assert await sessions.expire_sessions() == []

    # a write to an expired, unreaped session starts it afresh; a fork inherits the priority
    await sessions.put_intent("p", "x", [A, B], idle_ttl_s=10)
    await sessions.set_priority("p", 3, idle_ttl_s=10)
    clock.now += 11
    info = await sessions.put_intent("p", "y", [C], idle_ttl_s=10)
    assert info.intents == {"y": [C]} and info.priority == 0 and info.created_at == clock.now
    await sessions.set_priority("p", 3)  # no idle TTL: never expires
    child = await sessions.fork("p", "c", idle_ttl_s=10)
    assert (child.priority, child.pinned_until, child.expires_at) == (3, None, clock.now + 10)
    assert (await sessions.get_session("p")).expires_at is None
    info = await sessions.pin("c", 5, idle_ttl_s=10)
    assert (await sessions.release("c", idle_ttl_s=10)).pinned_until is None
    clock.now += 10
    assert await sessions.close_session("c") is None  # expired: nothing to close
    assert await sessions.close_session("p") == [C]


async def test_ping_answers(index: Index, sessions: SessionStore) -> None:
    assert await index.ping() is None
    assert await sessions.ping() is None


# ---------------------------------------------------------------------------- factory


def test_factory_builds_each_backend_and_names_a_bad_store() -> None:
    index, sessions = new_index("memory")
    assert isinstance(index, InMemoryIndex) and isinstance(sessions, InMemorySessionStore)
    index, sessions = new_index("redis://127.0.0.1:1/0", key_prefix="t:")
    assert isinstance(index, RedisIndex) and isinstance(sessions, RedisSessionStore)
    assert isinstance(index, Index) and isinstance(sessions, SessionStore)
    with pytest.raises(ValueError, match="'postgres://db'"):
        new_index("postgres://db")
    with pytest.raises(ValueError, match="''"):
        new_index("")
