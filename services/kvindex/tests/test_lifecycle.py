"""The KV lifecycle verbs through the kvindex's REST API, on both backends: pins with a TTL,
release, eviction priorities, idle expiry (with its reaper) and close, whose eviction reaches
the pods' memory APIs (real HTTP servers recording what they are sent).

Time is a clock the test moves, injected into the session store (the stores read it for every
timestamp and expiry); one test runs the reaper on the real clock with sub-second TTLs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from fastapi.testclient import TestClient

from agentserving.core.hashing import ChunkHasher
from agentserving.kvindex.app import create_app
from agentserving.kvindex.index.memory import InMemoryIndex, InMemorySessionStore
from agentserving.kvindex.index.redis import RedisIndex, RedisSessionStore
from agentserving.kvindex.settings import KvindexSettings
from testkit.clock import ManualClock

CHAIN = ChunkHasher(chunk_size=4).hashes(list(range(40)))  # 10 chained hashes


def kvindex(store: str, clock: ManualClock | None = None, **settings: object) -> TestClient:
    """A kvindex app on ``store`` whose session store reads ``clock`` (the index keeps real
    time: pod leases are not under test)."""
    conf = KvindexSettings(**{"lease_ttl_s": 60, "reap_interval_s": 3600, **settings})
    kw = {} if clock is None else {"clock": clock}
    if store == "memory":
        index, sessions = InMemoryIndex(), InMemorySessionStore(**kw)
    else:
        index, sessions = RedisIndex(store), RedisSessionStore(store, **kw)
    return TestClient(create_app(conf, index, sessions))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(time.time())


@pytest.fixture
def client(store: str, clock: ManualClock) -> Iterator[TestClient]:
    with kvindex(store, clock, session_idle_ttl_s=600) as c:
        yield c


def ok(r):  # type: ignore[no-untyped-def]
    assert r.is_success, f"{r.request.method} {r.request.url}: {r.status_code} {r.text}"
    return r.json()


def pod_holding(client: TestClient, pod: str, url: str, chunks: list[str]) -> None:
    ok(client.post("/v1/pods", json={"pod": pod, "memory_api_url": url, "model": "m",
                                     "chunk_size": 4}))
    ok(client.post("/v1/events", json={"pod": pod, "seq": 1, "events": [
        {"op": "stored", "tier": "cpu", "chunk_hashes": chunks},
        {"op": "stored", "tier": "disk", "chunk_hashes": chunks}]}))


def put(client: TestClient, sid: str, intent: str, chunks: list[str]) -> dict:
    return ok(client.put(f"/v1/sessions/{sid}/intents/{intent}", json={"chunk_hashes": chunks}))


def evicted(peer) -> list[str]:  # type: ignore[no-untyped-def]
    """Every chunk the peer was asked to evict since the last call, in order."""
    out = [c for op, body in peer.calls if op == "evict" for c in body["chunk_hashes"]]
    peer.calls.clear()
    return out


def test_a_pin_survives_an_evict_that_removes_everything_else(client, clock, memory_api):
    peer = memory_api()
    pod_holding(client, "p", peer.url, CHAIN[:8])
    put(client, "pinned", "plan", CHAIN[:3])
    put(client, "plain", "plan", CHAIN[3:5])
    put(client, "high", "plan", CHAIN[5:6])
    info = ok(client.post("/v1/sessions/pinned/pin", json={"ttl_s": 30}))
    assert info["pinned_until"] == pytest.approx(clock.now + 30)
    assert ok(client.put("/v1/sessions/high/priority", json={"priority": 5}))["priority"] == 5

    # an evict at priority 3: the pin and the priority-5 session keep theirs, the rest goes
    r = ok(client.post("/v1/evict", json={"chunk_hashes": CHAIN[:8], "priority": 3}))
    assert r["protected"] == CHAIN[:3] + CHAIN[5:6]
    assert evicted(peer) == CHAIN[3:5] + CHAIN[6:8]
    # above every priority: only the pin holds
    r = ok(client.post("/v1/evict", json={"chunk_hashes": CHAIN[:8], "priority": 1000}))
    assert r["protected"] == CHAIN[:3] and evicted(peer) == CHAIN[3:8]
    # a session's priority is its evicts' default: "high" may push out "plain", not "pinned"
    r = ok(client.post("/v1/evict", json={"chunk_hashes": CHAIN[:8], "session_id": "high"}))
    assert r["protected"] == CHAIN[:3] and evicted(peer) == CHAIN[3:8]
    r = ok(client.post("/v1/evict", json={"chunk_hashes": CHAIN[:8], "session_id": "plain"}))
    assert r["protected"] == CHAIN[:3] + CHAIN[5:6]
    evicted(peer)
    # its own pin never stops a session evicting its own chunks; force overrides any pin
    r = ok(client.post("/v1/evict", json={"chunk_hashes": CHAIN[:3], "session_id": "pinned",
                                          "priority": 1000}))
    assert r["protected"] == [] and evicted(peer) == CHAIN[:3]
    r = ok(client.post("/v1/evict", json={"chunk_hashes": CHAIN[:3], "priority": 1000,
                                          "force": True}))
    assert r["protected"] == [] and evicted(peer) == CHAIN[:3]

    # the pin lapses by itself
    clock.now += 31
    assert ok(client.get("/v1/sessions/pinned"))["pinned_until"] is None
    r = ok(client.post("/v1/evict", json={"chunk_hashes": CHAIN[:3], "priority": 1000}))
    assert r["protected"] == [] and evicted(peer) == CHAIN[:3]
    # ... or is released
    ok(client.post("/v1/sessions/pinned/pin", json={"ttl_s": 30}))
    r = ok(client.post("/v1/evict", json={"chunk_hashes": CHAIN[:3], "priority": 1000}))
    assert r["protected"] == CHAIN[:3]
    assert ok(client.post("/v1/sessions/pinned/release"))["pinned_until"] is None
    r = ok(client.post("/v1/evict", json={"chunk_hashes": CHAIN[:3], "priority": 1000}))
    assert r["protected"] == [] and evicted(peer) == CHAIN[:3]
    # without a priority or a session, every live reference still protects (as before pins)
    assert ok(client.post("/v1/evict", json={"chunk_hashes": CHAIN[:8]}))["protected"] == \
        CHAIN[:6]


def test_idle_sessions_expire_and_stop_protecting(store, clock, memory_api):
    peer = memory_api()
    with kvindex(store, clock, session_idle_ttl_s=60) as client:
        pod_holding(client, "p", peer.url, CHAIN[:4])
        t0 = clock.now
        assert put(client, "idle", "plan", CHAIN[:2])["expires_at"] == pytest.approx(t0 + 60)
        put(client, "busy", "plan", CHAIN[2:4])
        clock.now = t0 + 50
        put(client, "busy", "code", [])  # a write restarts the idle TTL
        ok(client.post("/v1/sessions/busy/pin", json={"ttl_s": 100}))  # and a pin extends it
        assert ok(client.get("/v1/sessions/busy"))["expires_at"] == pytest.approx(t0 + 150)
        assert ok(client.post("/v1/evict", json={"chunk_hashes": CHAIN[:4]}))["protected"] == \
            CHAIN[:4]

        clock.now = t0 + 61  # "idle" lapsed: invisible at once, though not yet reaped
        assert client.get("/v1/sessions/idle").status_code == 404
        assert client.get("/v1/sessions/idle/intents/plan").status_code == 404
        r = ok(client.post("/v1/evict", json={"chunk_hashes": CHAIN[:4]}))
        assert r["protected"] == CHAIN[2:4] and evicted(peer) == CHAIN[:2]
        # a write to it starts a new session: the old intents are gone
        assert put(client, "idle", "code", CHAIN[3:4])["intents"] == {"code": CHAIN[3:4]}

        clock.now = t0 + 149  # "busy" lives on its pin, past its idle TTL
        assert ok(client.get("/v1/sessions/busy"))["pinned_until"] == pytest.approx(t0 + 150)
        clock.now = t0 + 150
        assert client.get("/v1/sessions/busy").status_code == 404
        assert client.delete("/v1/sessions/busy").status_code == 404
        assert ok(client.post("/v1/evict", json={"chunk_hashes": CHAIN[:4]}))["protected"] == []


def test_the_reaper_drops_expired_sessions(store):
    """Real time, sub-second TTLs: the reaper in the app's lifespan drops what expired."""
    with kvindex(store, session_idle_ttl_s=0.3, reap_interval_s=0.05) as client:
        put(client, "short", "plan", CHAIN[:2])
        put(client, "kept", "plan", CHAIN[2:3])
        ok(client.post("/v1/sessions/kept/pin", json={"ttl_s": 5}))
        sessions = client.app.state.kv.sessions
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            if store == "memory":
                left = set(sessions._inner._sessions)
            else:
                left = {k.split(":", 2)[2] for k in
                        redis.Redis.from_url(store, decode_responses=True).keys("as:s:*")}
            if left == {"kept"}:
                break
            time.sleep(0.05)
        assert left == {"kept"}
        assert client.get("/v1/sessions/short").status_code == 404
        assert ok(client.get("/v1/sessions/kept"))["intents"] == {"plan": CHAIN[2:3]}


def test_close_reclaims_the_sessions_chunks_on_every_pod_and_tier(client, clock, memory_api):
    a, b = memory_api(), memory_api()
    pod_holding(client, "a", a.url, CHAIN[:6])
    pod_holding(client, "b", b.url, CHAIN[2:8])
    ok(client.post("/v1/events", json={"pod": "b", "seq": 2, "events": [
        {"op": "stored", "tier": "device", "chunk_hashes": CHAIN[6:8]}]}))
    put(client, "gone", "x", CHAIN[6:7])
    clock.now += 601  # "gone" expires idle: it protects nothing
    put(client, "s", "plan", CHAIN[:4])
    put(client, "s", "code", CHAIN[6:8] + CHAIN[9:10])  # CHAIN[9] no pod holds
    ok(client.post("/v1/sessions/s/fork", json={"child": "kid"}))
    put(client, "kid", "code", [])  # the child keeps only the plan
    put(client, "other", "x", CHAIN[3:4])
    ok(client.put("/v1/sessions/other/priority", json={"priority": -5}))  # low, still live
    ok(client.post("/v1/sessions/s/pin", json={"ttl_s": 30}))  # closing drops its own pin
    assert [op for op, _ in a.calls + b.calls] == ["pin", "pin"]  # the holders' tiers pin too
    a.calls.clear()
    b.calls.clear()

    closed = ok(client.delete("/v1/sessions/s"))
    mine = sorted(CHAIN[:4] + CHAIN[6:8] + CHAIN[9:10])
    assert closed["session_id"] == "s" and closed["chunk_hashes"] == mine
    # the child (and "other", whatever its priority) still use the plan's chunks
    assert closed["evict"]["protected"] == [c for c in mine if c in CHAIN[:4]]
    assert closed["evict"]["missing"] == CHAIN[9:10]
    res = closed["evict"]["results"]
    assert set(res) == {"b"} and res["b"]["ok"] and res["b"]["num_chunks"] == 2
    # every tier: the memory API gets no locations (device copies go with the rest)
    assert b.calls == [("evict", {"chunk_hashes": [c for c in mine if c in CHAIN[6:8]],
                                  "locations": None})]
    assert a.calls == []
    b.calls.clear()
    assert client.get("/v1/sessions/s").status_code == 404
    assert client.delete("/v1/sessions/s").status_code == 404

    # the last session out takes the shared chunks with it
    closed = ok(client.delete("/v1/sessions/other"))
    assert closed["evict"]["protected"] == CHAIN[3:4] and a.calls == b.calls == []
    closed = ok(client.delete("/v1/sessions/kid"))
    assert closed["chunk_hashes"] == sorted(CHAIN[:4]) and closed["evict"]["protected"] == []
    assert sorted(evicted(a)) == sorted(CHAIN[:4])
    assert sorted(evicted(b)) == sorted(CHAIN[2:4])


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"),
    [
        ("POST", "/v1/sessions/s/pin", {"ttl_s": 0}, 400, "ttl_s"),
        ("POST", "/v1/sessions/s/pin", {"ttl_s": "5"}, 400, "ttl_s"),
        ("POST", "/v1/sessions/s/pin", {"ttl_s": 86401}, 400, "ttl_s"),
        ("POST", "/v1/sessions/s/pin", {}, 400, "ttl_s"),
        ("POST", "/v1/sessions/s/pin", {"ttl_s": 1, "until": 2}, 400, "until"),
        ("POST", "/v1/sessions/ghost/pin", {"ttl_s": 1}, 404, "session_id"),
        ("POST", "/v1/sessions/ghost/release", None, 404, "session_id"),
        ("PUT", "/v1/sessions/s/priority", {"priority": 1001}, 400, "priority"),
        ("PUT", "/v1/sessions/s/priority", {"priority": True}, 400, "priority"),
        ("PUT", "/v1/sessions/s/priority", {"priority": 1.5}, 400, "priority"),
        ("PUT", "/v1/sessions/ghost/priority", {"priority": 1}, 404, "session_id"),
        ("POST", "/v1/evict", {"chunk_hashes": ["ab"], "priority": "1"}, 400, "priority"),
        ("DELETE", "/v1/sessions/ghost", None, 404, "session_id"),
    ],
)
def test_bad_lifecycle_input_names_the_field(client, method, path, body, status, param):
    put(client, "s", "plan", CHAIN[:1])
    r = client.request(method, path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err


def test_openapi_documents_the_lifecycle(client):
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    for path, method, codes in (("/v1/sessions/{session_id}/pin", "post", {"200", "400", "404"}),
                                ("/v1/sessions/{session_id}/release", "post", {"200", "404"}),
                                ("/v1/sessions/{session_id}/priority", "put",
                                 {"200", "400", "404"}),
                                ("/v1/sessions/{session_id}", "delete", {"200", "404"})):
        assert codes <= set(paths[path][method]["responses"]), (path, method)
    schemas = spec["components"]["schemas"]
    ttl = schemas["PinRequest"]["properties"]["ttl_s"]
    assert ttl["exclusiveMinimum"] == 0 and ttl["maximum"] == 86400
    prio = schemas["PriorityRequest"]["properties"]["priority"]
    assert (prio["minimum"], prio["maximum"]) == (-1000, 1000)
    assert {"priority", "pinned_until", "expires_at"} <= set(schemas["SessionInfo"]["properties"])
    assert paths["/v1/sessions/{session_id}"]["delete"]["responses"]["200"]["content"][
        "application/json"]["schema"]["$ref"].endswith("/SessionClosed")


def pins_sent(peer) -> list[tuple[str, list[str], float | None]]:  # type: ignore[no-untyped-def]
    """The pin and unpin calls the peer got since the last call: (op, chunks, ttl_s)."""
    out = [(op, body["chunk_hashes"], body.get("ttl_s")) for op, body in peer.calls
           if op in ("pin", "unpin")]
    peer.calls.clear()
    return out


def test_a_pin_reaches_the_pods_tiers_and_a_release_spares_another_pinned_session(
        client, memory_api):
    holder, last = memory_api(), memory_api()
    pod_holding(client, "holder", holder.url, CHAIN[:6])
    ok(client.post("/v1/pods", json={"pod": "last", "memory_api_url": last.url, "model": "m",
                                     "chunk_size": 4}))
    put(client, "a", "plan", CHAIN[:4])
    put(client, "b", "plan", CHAIN[:2])  # a shared system prompt
    # the proxy's routing record names the pod of a's last turn, which has not reported yet
    ok(client.put("/v1/sessions/a/route", json={"turns": 1, "chunk_hashes": CHAIN[:4],
                                                "last_pod": "last"}))
    ok(client.post("/v1/sessions/a/pin", json={"ttl_s": 30}))
    assert pins_sent(holder) == [("pin", CHAIN[:4], 30)]
    assert pins_sent(last) == [("pin", CHAIN[:4], 30)]
    ok(client.post("/v1/sessions/b/pin", json={"ttl_s": 60}))
    assert pins_sent(holder) == [("pin", CHAIN[:2], 60)]
    # a's release gives back the pods' pins on a's own chunks, never on b's pinned ones
    ok(client.post("/v1/sessions/a/release"))
    assert pins_sent(holder) == [("unpin", CHAIN[2:4], None)]
    assert pins_sent(last) == [("unpin", CHAIN[2:4], None)]
    metrics = client.get("/metrics").text
    assert 'kvindex_fanout_calls_total{ok="true",op="pin"} 3.0' in metrics


def test_shutdown_never_hangs_on_a_stuck_store(monkeypatch):
    """A store whose close never returns (a connection stuck in a command) costs the shutdown
    the step's bound, not the process's exit."""
    import asyncio

    from agentserving.kvindex import app as kvindex_app

    class StuckSessions(InMemorySessionStore):
        async def close(self) -> None:
            await asyncio.Event().wait()

    monkeypatch.setattr(kvindex_app, "SHUTDOWN_STEP_S", 0.2)
    conf = KvindexSettings(lease_ttl_s=60, reap_interval_s=3600)
    started = time.monotonic()
    with TestClient(create_app(conf, InMemoryIndex(), StuckSessions())) as client:
        ok(client.get("/healthz"))
    assert time.monotonic() - started < 10
