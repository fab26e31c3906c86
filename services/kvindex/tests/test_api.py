"""The kvindex REST API through its public HTTP interface (in-memory backends)."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from agentserving.core.hashing import ChunkHasher
from agentserving.kvindex.app import create_app
from agentserving.kvindex.index.memory import InMemoryIndex, InMemorySessionStore
from agentserving.kvindex.settings import KvindexSettings

CHAIN = ChunkHasher(chunk_size=4).hashes(list(range(40)))  # 10 chained hashes


@pytest.fixture
def client():
    settings = KvindexSettings(lease_ttl_s=30, reap_interval_s=0.05, max_batch_chunks=64,
                               max_body_bytes=64 * 1024)
    app = create_app(settings, InMemoryIndex(), InMemorySessionStore())
    with TestClient(app) as c:
        yield c


def register(client, pod, role="both", url="http://127.0.0.1:9"):
    r = client.post("/v1/pods", json={"pod": pod, "memory_api_url": url, "role": role,
                                      "model": "tiny", "chunk_size": 4})
    assert r.status_code == 200, r.text
    return r.json()


def send(client, pod, seq, events):
    r = client.post("/v1/events", json={"pod": pod, "seq": seq, "events": events})
    assert r.status_code == 200, r.text
    return r.json()


def test_register_list_heartbeat_deregister(client):
    info = register(client, "p0", role="prefill")
    assert info["pod"] == "p0" and info["role"] == "prefill" and info["seq"] == -1
    assert [p["pod"] for p in client.get("/v1/pods").json()["pods"]] == ["p0"]
    lease = client.post("/v1/pods/p0/heartbeat").json()
    assert lease["lease_expires_at"] >= info["lease_expires_at"]
    send(client, "p0", 1, [{"op": "stored", "tier": "cpu", "chunk_hashes": CHAIN[:3]}])
    assert client.delete("/v1/pods/p0").status_code == 204
    assert client.get("/v1/pods").json()["pods"] == []
    assert client.get(f"/v1/chunks/{CHAIN[0]}").json()["locations"] == []
    assert client.delete("/v1/pods/p0").status_code == 404
    assert client.post("/v1/pods/p0/heartbeat").status_code == 404


def test_lookup_longest_prefix_with_tiers_and_best_pod(client):
    for pod in ("a", "b", "c"):
        register(client, pod, role="decode" if pod == "c" else "prefill")
    send(client, "a", 1, [{"op": "stored", "tier": "disk", "chunk_hashes": CHAIN[:6]}])
    send(client, "b", 1, [{"op": "stored", "tier": "cpu", "chunk_hashes": CHAIN[:4]},
                          {"op": "stored", "tier": "device", "chunk_hashes": CHAIN[:2]}])
    send(client, "c", 1, [{"op": "stored", "tier": "cpu", "chunk_hashes": CHAIN[1:8]}])
    body = client.post("/v1/lookup", json={"chunk_hashes": CHAIN}).json()
    by_pod = {p["pod"]: p for p in body["pods"]}
    assert set(by_pod) == {"a", "b"}  # c lacks the first chunk: no prefix at all
    assert by_pod["a"]["prefix_chunks"] == 6 and by_pod["a"]["tiers"] == {"disk": 6}
    assert by_pod["b"]["prefix_chunks"] == 4 and by_pod["b"]["tiers"] == {"device": 2, "cpu": 2}
    # a: 6 * 0.5 = 3.0 ; b: 2 * 1 + 2 * 0.8 = 3.6 -> b is best despite the shorter prefix
    assert body["best_pod"] == "b" and body["num_chunks"] == len(CHAIN)
    only_a = client.post("/v1/lookup", json={"chunk_hashes": CHAIN, "pods": ["a"]}).json()
    assert only_a["best_pod"] == "a"
    decode = client.post("/v1/lookup", json={"chunk_hashes": CHAIN, "role": "decode"}).json()
    assert decode["pods"] == [] and decode["best_pod"] is None


def test_events_idempotent_gap_and_snapshot(client):
    register(client, "p")
    first = send(client, "p", 5, [{"op": "stored", "tier": "cpu", "chunk_hashes": CHAIN[:2],
                                   "bytes": 2048}])
    assert first["applied"] and first["chunk_events"] == 2 and not first["needs_resync"]
    replay = send(client, "p", 5, [{"op": "removed", "tier": "cpu", "chunk_hashes": CHAIN[:2]}])
    assert not replay["applied"]
    locs = client.get(f"/v1/chunks/{CHAIN[0]}").json()["locations"]
    assert locs == [{"pod": "p", "tier": "cpu"}]  # the replayed removal did nothing
    gap = send(client, "p", 9, [{"op": "stored", "tier": "disk", "chunk_hashes": CHAIN[:1]}])
    assert gap["applied"] and gap["needs_resync"]
    assert client.post("/v1/pods/p/heartbeat").json()["needs_resync"]
    pod = client.get("/v1/pods/p").json()
    assert pod["chunks"] == {"cpu": 2, "disk": 1} and pod["used_bytes"] == {"cpu": 2048}
    snap = client.put("/v1/pods/p/chunks", json={"seq": 12, "chunks": {"disk": CHAIN[:3]}})
    assert snap.status_code == 200 and not snap.json()["needs_resync"]
    assert client.get("/v1/pods/p").json()["chunks"] == {"disk": 3}
    cleared = send(client, "p", 13, [{"op": "cleared"}])
    assert cleared["applied"] and client.get("/v1/pods/p").json()["chunks"] == {}


def test_lease_expiry_drops_pod_and_residency():
    settings = KvindexSettings(lease_ttl_s=0.2, reap_interval_s=0.05)
    index = InMemoryIndex()
    with TestClient(create_app(settings, index, InMemorySessionStore())) as client:
        register(client, "short")
        send(client, "short", 1, [{"op": "stored", "tier": "cpu", "chunk_hashes": CHAIN[:3]}])
        assert client.post("/v1/lookup", json={"chunk_hashes": CHAIN}).json()["best_pod"] == "short"
        time.sleep(0.3)
        # invisible at once, before and after the reaper runs
        assert client.post("/v1/lookup", json={"chunk_hashes": CHAIN}).json()["pods"] == []
        assert client.get("/v1/pods").json()["pods"] == []
        deadline = time.monotonic() + 2
        while index._chunks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert index._chunks == {} and index._pods == {}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/events", {"pod": "p", "seq": 1, "events": [
            {"op": "stored", "tier": "cpu", "chunk_hashes": ["xyz"]}]}, 400,
         "events[0].chunk_hashes[0]"),
        ("/v1/events", {"pod": "p", "seq": 1, "events": [
            {"op": "stored", "tier": "hbm", "chunk_hashes": []}]}, 400, "events[0].tier"),
        ("/v1/events", {"pod": "p", "seq": 1, "events": [
            {"op": "stored", "chunk_hashes": []}]}, 400, "events[0]"),
        ("/v1/events", {"pod": "nobody", "seq": 1, "events": []}, 404, "pod"),
        ("/v1/events", {"pod": "p", "seq": 1, "events": [
            {"op": "stored", "tier": "cpu", "chunk_hashes": ["ab"] * 65}]}, 413, "events"),
        ("/v1/lookup", {"chunk_hashes": "ab"}, 400, "chunk_hashes"),
        ("/v1/lookup", {"chunk_hashes": ["ab"], "extra": 1}, 400, "extra"),
        ("/v1/pods", {"pod": "bad name!", "memory_api_url": "http://x", "model": "m"}, 400,
         "pod"),
        ("/v1/pods", {"pod": "p2", "memory_api_url": "ftp://x", "model": "m"}, 400,
         "memory_api_url"),
        ("/v1/evict", {"chunk_hashes": ["ab"], "locations": ["tape"]}, 400, "locations"),
        ("/v1/prefetch", {"chunk_hashes": ["ab"], "pod": "ghost"}, 404, "pod"),
        ("/v1/sessions/s/fork", {"child": "c"}, 404, "session_id"),
    ],
)
def test_bad_input_names_the_field(client, path, body, status, param):
    register(client, "p")
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"]


def test_malformed_json_and_oversized_body(client):
    json_type = {"content-type": "application/json"}
    r = client.post("/v1/lookup", content=b"{not json", headers=json_type)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    big = b"[" + b'"ab",' * 20000 + b'"ab"]'
    r = client.post("/v1/lookup", content=b'{"chunk_hashes": ' + big + b"}", headers=json_type)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"
    assert client.get("/v1/chunks/NOTHEX").status_code == 400


def test_sessions_fork_and_protected_evict(client):
    assert client.put("/v1/sessions/s1/intents/plan",
                      json={"chunk_hashes": CHAIN[:3]}).status_code == 200
    client.put("/v1/sessions/s1/intents/code", json={"chunk_hashes": CHAIN[3:5]})
    info = client.get("/v1/sessions/s1").json()
    assert info["intents"] == {"plan": CHAIN[:3], "code": CHAIN[3:5]} and info["parent"] is None
    assert client.get("/v1/sessions/s1/intents/plan").json()["chunk_hashes"] == CHAIN[:3]
    child = client.post("/v1/sessions/s1/fork", json={"child": "s2"})
    assert child.status_code == 201 and child.json()["parent"] == "s1"
    assert child.json()["intents"] == info["intents"]
    assert client.post("/v1/sessions/s1/fork", json={"child": "s2"}).status_code == 409
    # the child moves on: its "code" intent no longer shares the parent's chunks
    client.put("/v1/sessions/s2/intents/code", json={"chunk_hashes": CHAIN[6:8]})
    r = client.post("/v1/evict", json={"chunk_hashes": CHAIN[:8], "session_id": "s2"})
    assert r.status_code == 200
    # plan chunks are still referenced by s1; s1's code chunks too; s2's own don't protect
    assert r.json()["protected"] == CHAIN[:5]
    forced = client.post("/v1/evict", json={"chunk_hashes": CHAIN[:8], "force": True}).json()
    assert forced["protected"] == []
    closed = client.delete("/v1/sessions/s1")
    assert closed.status_code == 200 and closed.json()["chunk_hashes"] == sorted(CHAIN[:5])
    r = client.post("/v1/evict", json={"chunk_hashes": CHAIN[:8], "session_id": "s2"}).json()
    assert r["protected"] == []
    assert client.delete("/v1/sessions/s2/intents/plan").json()["intents"] == {
        "code": CHAIN[6:8]}
    assert client.get("/v1/sessions/s2/intents/plan").status_code == 404


def test_openapi_and_metrics(client):
    spec = client.get("/openapi.json").json()
    for path in ("/v1/pods", "/v1/events", "/v1/lookup", "/v1/prefetch", "/v1/evict",
                 "/v1/chunks/{chunk_hash}", "/v1/sessions/{session_id}/fork",
                 "/v1/pods/{pod}/chunks"):
        assert path in spec["paths"], path
    register(client, "m")
    send(client, "m", 1, [{"op": "stored", "tier": "cpu", "chunk_hashes": CHAIN[:4]}])
    client.post("/v1/lookup", json={"chunk_hashes": CHAIN})
    text = client.get("/metrics").text
    assert 'kvindex_chunk_events_total{source="rest"} 4.0' in text
    assert 'kvindex_lookups_total{result="hit"} 1.0' in text
    assert "kvindex_backend_op_seconds_bucket" in text
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json()["status"] == "ready"
