"""Sessions are scoped by tenant (``x-agentserving-tenant``), on both backends: tenant B,
naming A's session id, reaches a session of its own and cannot read, overwrite, fork, pin,
close or evict through A's. Before the scope every one of these reached A's session."""

from __future__ import annotations

import pytest

from agentserving.core.schemas import TENANT_HEADER

from .test_lifecycle import CHAIN, evicted, ok, pod_holding, put
from .test_lifecycle import client, clock  # noqa: F401  (fixtures)

A = {TENANT_HEADER: "acme"}
B = {TENANT_HEADER: "beta"}


def test_one_tenants_session_id_never_names_anothers(client, memory_api):
    peer = memory_api()
    pod_holding(client, "p", peer.url, CHAIN[:6])
    a = ok(client.put("/v1/sessions/s1/intents/plan", json={"chunk_hashes": CHAIN[:3]},
                      headers=A))
    assert a["session_id"] == "s1" and a["intents"] == {"plan": CHAIN[:3]}

    # B reads: A's session is not there for it
    assert client.get("/v1/sessions/s1", headers=B).status_code == 404
    assert client.get("/v1/sessions/s1/intents/plan", headers=B).status_code == 404
    # nor for a caller with no tenant (the unscoped namespace)
    assert client.get("/v1/sessions/s1").status_code == 404
    # B writes under the same id: a session of its own; A's intent is unchanged
    b = ok(client.put("/v1/sessions/s1/intents/plan", json={"chunk_hashes": CHAIN[3:4]},
                      headers=B))
    assert b["session_id"] == "s1" and b["intents"] == {"plan": CHAIN[3:4]}
    assert ok(client.get("/v1/sessions/s1/intents/plan", headers=A))["chunk_hashes"] == \
        CHAIN[:3]
    # B cannot fork A's session into its own namespace, nor A's into A's (child exists)
    assert client.post("/v1/sessions/s2/fork", json={"child": "c"}, headers=B).status_code \
        == 404
    forked = ok(client.post("/v1/sessions/s1/fork", json={"child": "c"}, headers=A))
    assert forked["session_id"] == "c" and forked["parent"] == "s1"
    assert client.get("/v1/sessions/c", headers=B).status_code == 404

    # A pins its chunks: B's evict, even at the top priority and naming A's session id as its
    # own, keeps them (its "s1" is B's session, whose references do not include A's chunks)
    ok(client.post("/v1/sessions/s1/pin", json={"ttl_s": 60}, headers=A))
    r = ok(client.post("/v1/evict", json={"chunk_hashes": CHAIN[:3], "session_id": "s1",
                                          "priority": 1000}, headers=B))
    assert r["protected"] == CHAIN[:3] and evicted(peer) == []
    # A itself, as s1, may evict its own pinned chunks (the fork "c" references them too,
    # unpinned at the default priority, so only an evict above it takes them)
    r = ok(client.post("/v1/evict", json={"chunk_hashes": CHAIN[:3], "session_id": "s1",
                                          "priority": 1000}, headers=A))
    assert r["protected"] == [] and evicted(peer) == CHAIN[:3]

    # B closes "s1": its own session goes, A's stays
    closed = ok(client.delete("/v1/sessions/s1", headers=B))
    assert closed["chunk_hashes"] == CHAIN[3:4]
    assert ok(client.get("/v1/sessions/s1", headers=A))["intents"] == {"plan": CHAIN[:3]}
    assert client.delete("/v1/sessions/s1", headers=B).status_code == 404
    # and the unscoped namespace is a third one
    put(client, "s1", "plan", CHAIN[4:5])
    assert ok(client.get("/v1/sessions/s1"))["intents"] == {"plan": CHAIN[4:5]}
    assert ok(client.get("/v1/sessions/s1", headers=A))["intents"] == {"plan": CHAIN[:3]}


@pytest.mark.parametrize("method, path, body, headers, param", [
    ("put", "/v1/sessions/s1/intents/plan", {"chunk_hashes": []}, {TENANT_HEADER: "a/b"},
     TENANT_HEADER),
    ("get", "/v1/sessions/s1", None, {TENANT_HEADER: "x" * 129}, TENANT_HEADER),
    ("post", "/v1/sessions/s1/fork", {"child": "acme/c"}, {}, "child"),
    ("post", "/v1/evict", {"chunk_hashes": CHAIN[:1], "session_id": "beta/s1"}, {},
     "session_id"),
])
def test_a_scope_cannot_be_spelled_into_an_id(client, method, path, body, headers, param):
    """The separator of a tenant's scope is refused in a tenant's name and in a session id,
    so no caller's id names a session of another scope."""
    kw = {"json": body} if body is not None else {}
    r = client.request(method.upper(), path, headers=headers, **kw)
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["param"], r.json()


def test_openapi_documents_the_tenant_header(client):
    doc = client.get("/openapi.json").json()
    for path, method in (("/v1/sessions/{session_id}", "get"), ("/v1/evict", "post"),
                         ("/v1/sessions/{session_id}/fork", "post")):
        params = doc["paths"][path][method].get("parameters", [])
        assert any(p["name"] == TENANT_HEADER and p["in"] == "header" for p in params), path
