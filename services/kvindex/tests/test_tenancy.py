"""Sessions are scoped by tenant (``x-agentserving-tenant``), on both backends: tenant B,
naming A's session id, reaches a session of its own and cannot read, overwrite, fork, pin,
close or evict through A's. Before the scope every one of these reached A's session."""

from __future__ import annotations

import time

import pytest

from agentserving.core.schemas import TENANT_HEADER
from testkit.clock import ManualClock

from .test_lifecycle import CHAIN, evicted, kvindex, ok, pod_holding, put


@pytest.fixture
def kv(store):  # type: ignore[no-untyped-def]
    with kvindex(store, ManualClock(time.time()), session_idle_ttl_s=600) as c:
        yield c


A = {TENANT_HEADER: "acme"}
B = {TENANT_HEADER: "beta"}


def test_one_tenants_session_id_never_names_anothers(kv, memory_api):
    peer = memory_api()
    pod_holding(kv, "p", peer.url, CHAIN[:6])
    a = ok(kv.put("/v1/sessions/s1/intents/plan", json={"chunk_hashes": CHAIN[:3]},
                      headers=A))
    assert a["session_id"] == "s1" and a["intents"] == {"plan": CHAIN[:3]}

    # B reads: A's session is not there for it
    assert kv.get("/v1/sessions/s1", headers=B).status_code == 404
    assert kv.get("/v1/sessions/s1/intents/plan", headers=B).status_code == 404
    # nor for a caller with no tenant (the unscoped namespace)
    assert kv.get("/v1/sessions/s1").status_code == 404
    # B writes under the same id: a session of its own; A's intent is unchanged
    b = ok(kv.put("/v1/sessions/s1/intents/plan", json={"chunk_hashes": CHAIN[3:4]},
                      headers=B))
    assert b["session_id"] == "s1" and b["intents"] == {"plan": CHAIN[3:4]}
    assert ok(kv.get("/v1/sessions/s1/intents/plan", headers=A))["chunk_hashes"] == \
        CHAIN[:3]
    # B cannot fork A's session into its own namespace, nor A's into A's (child exists)
    assert kv.post("/v1/sessions/s2/fork", json={"child": "c"}, headers=B).status_code \
        == 404
    forked = ok(kv.post("/v1/sessions/s1/fork", json={"child": "c"}, headers=A))
    assert forked["session_id"] == "c" and forked["parent"] == "s1"
    assert kv.get("/v1/sessions/c", headers=B).status_code == 404

    # A pins its chunks: B's evict, even at the top priority and naming A's session id as its
    # own, keeps them (its "s1" is B's session, whose references do not include A's chunks)
    ok(kv.post("/v1/sessions/s1/pin", json={"ttl_s": 60}, headers=A))
    r = ok(kv.post("/v1/evict", json={"chunk_hashes": CHAIN[:3], "session_id": "s1",
                                          "priority": 1000}, headers=B))
    assert r["protected"] == CHAIN[:3] and evicted(peer) == []
    # A itself, as s1, may evict its own pinned chunks (the fork "c" references them too,
    # unpinned at the default priority, so only an evict above it takes them)
    r = ok(kv.post("/v1/evict", json={"chunk_hashes": CHAIN[:3], "session_id": "s1",
                                          "priority": 1000}, headers=A))
    assert r["protected"] == [] and evicted(peer) == CHAIN[:3]

    # B closes "s1": its own session goes, A's stays
    closed = ok(kv.delete("/v1/sessions/s1", headers=B))
    assert closed["chunk_hashes"] == CHAIN[3:4]
    assert ok(kv.get("/v1/sessions/s1", headers=A))["intents"] == {"plan": CHAIN[:3]}
    assert kv.delete("/v1/sessions/s1", headers=B).status_code == 404
    # and the unscoped namespace is a third one
    put(kv, "s1", "plan", CHAIN[4:5])
    assert ok(kv.get("/v1/sessions/s1"))["intents"] == {"plan": CHAIN[4:5]}
    assert ok(kv.get("/v1/sessions/s1", headers=A))["intents"] == {"plan": CHAIN[:3]}


@pytest.mark.parametrize("method, path, body, headers, param", [
    ("put", "/v1/sessions/s1/intents/plan", {"chunk_hashes": []}, {TENANT_HEADER: "a/b"},
     TENANT_HEADER),
    ("get", "/v1/sessions/s1", None, {TENANT_HEADER: "x" * 129}, TENANT_HEADER),
    ("post", "/v1/sessions/s1/fork", {"child": "acme/c"}, {}, "child"),
    ("post", "/v1/evict", {"chunk_hashes": CHAIN[:1], "session_id": "beta/s1"}, {},
     "session_id"),
])
def test_a_scope_cannot_be_spelled_into_an_id(kv, method, path, body, headers, param):
    """The separator of a tenant's scope is refused in a tenant's name and in a session id,
    so no caller's id names a session of another scope."""
    kw = {"json": body} if body is not None else {}
    r = kv.request(method.upper(), path, headers=headers, **kw)
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["param"], r.json()


def test_openapi_documents_the_tenant_header(kv):
    doc = kv.get("/openapi.json").json()
    for path, method in (("/v1/sessions/{session_id}", "get"), ("/v1/evict", "post"),
                         ("/v1/sessions/{session_id}/fork", "post")):
        params = doc["paths"][path][method].get("parameters", [])
        assert any(p["name"] == TENANT_HEADER and p["in"] == "header" for p in params), path
