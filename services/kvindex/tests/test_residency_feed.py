"""The residency change feed (list + watch), on both backends: the feed's own contract, and a
follower that lists once and replays the changes answering every lookup as the kvindex does,
through every kind of change (registrations, event batches of each op, snapshots, a
deregistration, a lapsed lease)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from fastapi.testclient import TestClient

from agentserving.core.hashing import ChunkHasher
from agentserving.core.schemas import (
    ChangeKind,
    LookupRequest,
    PodRole,
    ResidencyChange,
    ResidencyChanges,
    ResidencyListing,
)
from agentserving.kvindex.app import create_app
from agentserving.kvindex.index.changes import ChangeFeed, CursorExpired
from agentserving.kvindex.index.factory import new_feed, new_index
from agentserving.kvindex.settings import KvindexSettings
from agentserving.proxy.residency_replica import ResidencyView

from .test_lifecycle import ok

CHAINS = [ChunkHasher(chunk_size=4).hashes(list(range(s, s + 48))) for s in (0, 1000, 2000)]


def change(pod: str) -> ResidencyChange:
    return ResidencyChange(kind=ChangeKind.GONE, pod=pod)


@pytest.fixture
async def feed(store: str):  # type: ignore[no-untyped-def]
    made: ChangeFeed = new_feed(store, max_changes=5)
    try:
        yield made
    finally:
        await made.close()


@pytest.mark.anyio
async def test_a_cursor_reads_what_follows_it_in_order(feed: ChangeFeed) -> None:
    start = await feed.head()
    assert await feed.read(start, 10, 0) == ([], start)
    await feed.append([change("a"), change("b")])
    await feed.append([change("c")])
    got, cursor = await feed.read(start, 2, 0)
    assert [c.pod for c in got] == ["a", "b"]
    got, cursor = await feed.read(cursor, 10, 0)
    assert [c.pod for c in got] == ["c"] and cursor == await feed.head()
    assert await feed.read(cursor, 10, 0) == ([], cursor)


@pytest.mark.anyio
async def test_a_waiting_read_wakes_at_the_first_change(feed: ChangeFeed) -> None:
    cursor = await feed.head()
    reader = asyncio.create_task(feed.read(cursor, 10, 0.8))
    await asyncio.sleep(0.1)
    assert not reader.done()
    await feed.append([change("late")])
    got, _ = await asyncio.wait_for(reader, 2)
    assert [c.pod for c in got] == ["late"]
    # with nothing new, it gives up after its wait and hands back the same cursor
    head = await feed.head()
    t0 = time.monotonic()
    assert await feed.read(head, 10, 0.3) == ([], head)
    assert time.monotonic() - t0 >= 0.25


@pytest.mark.anyio
async def test_a_cursor_behind_the_kept_tail_or_never_issued_expires(feed: ChangeFeed,
                                                                     store: str) -> None:
    old = await feed.head()
    # max_changes=5; a Redis stream trims approximately, a whole node (100 entries) at a time
    await feed.append([change(f"p{i}") for i in range(250)])
    with pytest.raises(CursorExpired):
        await feed.read(old, 10, 0)
    head = await feed.head()
    got, _ = await feed.read(head, 10, 0)
    assert got == []
    foreign = "beefbeef:1" if store == "memory" else "99999999999999-0"
    with pytest.raises(CursorExpired):
        await feed.read(foreign, 10, 0)
    for other in ("not a cursor", "0-0" if store == "memory" else "beefbeef:0"):
        with pytest.raises(CursorExpired):  # another kind of feed's cursor is none of ours
            await feed.read(other, 10, 0)


# ------------------------------------------------------------------ through the kvindex's REST


def app_on(store: str, **settings: object) -> TestClient:
    conf = KvindexSettings(store=store, **{"lease_ttl_s": 60, "reap_interval_s": 3600,
                                           **settings})
    index, sessions = new_index(store)
    return TestClient(create_app(conf, index, sessions, new_feed(store, conf.change_feed_max)))


def register(kv: TestClient, pod: str, role: str = "prefill") -> None:
    ok(kv.post("/v1/pods", json={"pod": pod, "memory_api_url": "http://127.0.0.1:9",
                                 "model": "m", "chunk_size": 4, "role": role}))


class Follower:
    """A ResidencyView kept up to date over REST, as the proxy's replica keeps its own."""

    def __init__(self, kv: TestClient) -> None:
        self.kv = kv
        self.view = ResidencyView()
        listing = ResidencyListing.model_validate(ok(kv.get("/v1/residency")))
        self.view.load(listing)
        self.cursor = listing.cursor

    def catch_up(self) -> None:
        while True:
            got = ResidencyChanges.model_validate(ok(self.kv.get(
                "/v1/residency/changes", params={"after": self.cursor, "limit": 7})))
            assert all(self.view.apply(c) for c in got.changes)
            self.cursor = got.cursor
            if not got.changes:
                return

    def agrees(self, rng: random.Random) -> None:
        self.catch_up()
        for chain in CHAINS:
            for req in (LookupRequest(chunk_hashes=chain),
                        LookupRequest(chunk_hashes=chain[:rng.randint(1, len(chain))],
                                      role=PodRole.PREFILL),
                        LookupRequest(chunk_hashes=chain, pods=["p0", "p2", "gone"])):
                want = ok(self.kv.post("/v1/lookup", json=req.model_dump(exclude_none=True)))
                assert self.view.lookup(req).model_dump(mode="json") == want


def test_a_follower_answers_every_lookup_as_the_kvindex(store: str) -> None:
    rng = random.Random(7)
    with app_on(store) as kv:
        register(kv, "p0")
        register(kv, "p1", role="decode")
        early = Follower(kv)  # lists now, then replays everything below
        seqs = {"p0": 0, "p1": 0, "p2": 0}
        for step in range(60):
            if step == 10:
                register(kv, "p2", role="both")
            pod = rng.choice(["p0", "p1"] + (["p2"] if step >= 10 else []))
            chain = rng.choice(CHAINS)
            lo = rng.randrange(len(chain))
            part = chain[lo:lo + rng.randint(1, 8)]
            op = rng.choices(["stored", "removed", "cleared", "snapshot"], [6, 3, 1, 1])[0]
            seqs[pod] += 1
            if op == "snapshot":
                ok(kv.put(f"/v1/pods/{pod}/chunks", json={"seq": seqs[pod], "chunks": {
                    "cpu": chain[:lo + 1], "disk": part}}))
            else:
                event = {"op": op, "tier": rng.choice(["device", "cpu", "disk"])}
                if op != "cleared":
                    event["chunk_hashes"] = part
                ok(kv.post("/v1/events", json={"pod": pod, "seq": seqs[pod],
                                               "events": [event]}))
            if step % 15 == 14:
                early.agrees(rng)
        late = Follower(kv)  # a listing taken mid-stream, then caught up the same way
        assert kv.delete("/v1/pods/p1").status_code == 204
        register(kv, "p1", role="decode")  # back, holding nothing
        early.agrees(rng)
        late.agrees(rng)
        assert "p1" in early.view.chunks and not early.view.chunks["p1"]


def test_a_lapsed_lease_leaves_the_followers_view() -> None:
    with app_on("memory", lease_ttl_s=0.2, reap_interval_s=0.05) as kv:
        register(kv, "p0")
        ok(kv.post("/v1/events", json={"pod": "p0", "seq": 1, "events": [
            {"op": "stored", "tier": "cpu", "chunk_hashes": CHAINS[0][:3]}]}))
        follower = Follower(kv)
        assert follower.view.chunks["p0"]
        time.sleep(0.6)
        follower.catch_up()
        assert "p0" not in follower.view.chunks


def test_bad_cursors_are_named_400_and_old_ones_410() -> None:
    with app_on("memory", change_feed_max=3) as kv:
        register(kv, "p0")
        start = ok(kv.get("/v1/residency"))["cursor"]
        for seq in range(1, 6):
            ok(kv.post("/v1/events", json={"pod": "p0", "seq": seq, "events": [
                {"op": "stored", "tier": "cpu", "chunk_hashes": CHAINS[0][seq:seq + 1]}]}))
        r = kv.get("/v1/residency/changes", params={"after": start})
        assert r.status_code == 410 and r.json()["error"]["param"] == "after", r.text
        assert "list" in r.json()["error"]["message"]
        r = kv.get("/v1/residency/changes", params={"after": "nonsense"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "after", r.text
        r = kv.get("/v1/residency/changes", params={"after": start, "wait_s": 99})
        assert r.status_code == 400 and "wait_s" in r.json()["error"]["param"], r.text
