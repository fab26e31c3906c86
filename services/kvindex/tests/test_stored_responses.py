"""Stored responses (the proxy's Responses API objects kept for ``previous_response_id``),
through the kvindex's REST API and its clients, on the memory backend and on a real
redis-server: a round trip, TTLs (clamped, and lapsing on the real clock), the byte and count
bounds, 404s, tenant scoping and an unreachable store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from agentserving.core.clients import KvindexClient, NotFound, RequestRejected
from agentserving.core.schemas import TENANT_HEADER, StoredResponse, StoredResponseDeleted
from agentserving.kvindex.app import create_app
from agentserving.kvindex.index.redis import RedisIndex, RedisSessionStore
from agentserving.kvindex.settings import KvindexSettings
from agentserving.proxy.kvindex_http import AioKvindexClient
from testkit.servers import ThreadedServer, free_port

from .test_lifecycle import kvindex, ok

TTL_S, MAX_BYTES, MAX_COUNT = 60.0, 4000, 3
BOUNDS = {"stored_response_ttl_s": TTL_S, "max_stored_response_bytes": MAX_BYTES,
          "max_stored_responses": MAX_COUNT}
A = {TENANT_HEADER: "acme"}
B = {TENANT_HEADER: "beta"}
PATH = "/v1/stored-responses/"


def stored(rid: str, text: str = "hello", **extra: Any) -> dict[str, Any]:
    """A body as the proxy writes it; the response's null fields must come back as nulls."""
    return {"response": {"id": rid, "object": "response", "status": "completed",
                         "previous_response_id": None, "incomplete_details": None,
                         "output": [{"type": "message", "role": "assistant",
                                     "content": [{"type": "output_text", "text": text}]}]},
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": text}], **extra}


@pytest.fixture
def kv(store: str) -> Iterator[TestClient]:
    with kvindex(store, **BOUNDS) as client:
        yield client


def test_round_trip_keeps_the_body_and_answers_the_ttl_it_kept(kv: TestClient) -> None:
    body = stored("resp_01", session_id="agent-7")
    put = ok(kv.put(PATH + "resp_01", json=body))
    assert put == {**body, "ttl_s": TTL_S}  # no ttl_s asked: the kvindex's own
    assert ok(kv.get(PATH + "resp_01")) == put
    assert ok(kv.get(PATH + "resp_01"))["response"]["previous_response_id"] is None

    assert ok(kv.put(PATH + "resp_02", json=stored("resp_02", ttl_s=5)))["ttl_s"] == 5
    assert ok(kv.put(PATH + "resp_03", json=stored("resp_03", ttl_s=TTL_S * 100)))["ttl_s"] \
        == TTL_S  # clamped to the most
    assert ok(kv.get(PATH + "resp_03"))["ttl_s"] == TTL_S

    rewritten = ok(kv.put(PATH + "resp_01", json=stored("resp_01", "changed")))
    assert ok(kv.get(PATH + "resp_01")) == rewritten
    assert rewritten["messages"][-1]["content"] == "changed" and rewritten["session_id"] is None


def test_a_stored_response_lapses_with_its_ttl(kv: TestClient) -> None:
    ok(kv.put(PATH + "resp_short", json=stored("resp_short", ttl_s=0.3)))
    ok(kv.put(PATH + "resp_long", json=stored("resp_long")))
    assert ok(kv.get(PATH + "resp_short"))["ttl_s"] == 0.3
    time.sleep(0.5)
    assert kv.get(PATH + "resp_short").status_code == 404
    assert kv.delete(PATH + "resp_short").status_code == 404
    assert ok(kv.get(PATH + "resp_long"))["response"]["id"] == "resp_long"


def test_absent_deleted_and_malformed_ids(kv: TestClient) -> None:
    missing = kv.get(PATH + "resp_nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "response_id"
    assert kv.delete(PATH + "resp_nope").status_code == 404

    ok(kv.put(PATH + "resp_gone", json=stored("resp_gone")))
    assert ok(kv.delete(PATH + "resp_gone")) == {"id": "resp_gone", "object": "response",
                                                 "deleted": True}
    assert kv.get(PATH + "resp_gone").status_code == 404
    assert kv.delete(PATH + "resp_gone").status_code == 404

    for bad in ("resp.x", "resp%20x", "r" * 257):
        r = kv.put(PATH + bad, json=stored("x"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_id", bad
    for ttl in (0, -1):
        r = kv.put(PATH + "resp_t", json=stored("resp_t", ttl_s=ttl))
        assert r.status_code == 400 and r.json()["error"]["param"] == "ttl_s"
    assert kv.get(PATH + "resp_t").status_code == 404


def test_a_body_over_the_byte_bound_is_413_and_not_kept(kv: TestClient) -> None:
    big = stored("resp_big", "x" * MAX_BYTES)
    r = kv.put(PATH + "resp_big", json=big)
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["param"] == "messages" and str(MAX_BYTES) in err["message"]
    assert kv.get(PATH + "resp_big").status_code == 404
    # just under the bound is kept
    fits = stored("resp_big", "x" * (MAX_BYTES // 3))
    assert ok(kv.put(PATH + "resp_big", json=fits))["messages"] == fits["messages"]
    assert 'kvindex_stored_responses_total{op="put",result="too_large"} 1.0' in \
        kv.get("/metrics").text


def test_the_count_bound_drops_the_oldest_written(kv: TestClient) -> None:
    for i in range(MAX_COUNT):
        ok(kv.put(PATH + f"resp_{i}", json=stored(f"resp_{i}")))
    ok(kv.put(PATH + "resp_0", json=stored("resp_0", "again")))  # rewritten: now the newest
    ok(kv.put(PATH + "resp_new", json=stored("resp_new")))
    assert kv.get(PATH + "resp_1").status_code == 404  # the oldest written
    for rid in ("resp_0", "resp_2", "resp_new"):
        assert ok(kv.get(PATH + rid))["response"]["id"] == rid
    # every tenant's count against one bound: B's write pushes out the oldest, resp_2
    ok(kv.put(PATH + "resp_b", json=stored("resp_b"), headers=B))
    assert kv.get(PATH + "resp_2").status_code == 404
    assert ok(kv.get(PATH + "resp_b", headers=B))["response"]["id"] == "resp_b"


def test_one_tenants_response_id_never_names_anothers(kv: TestClient) -> None:
    ok(kv.put(PATH + "resp_x", json=stored("resp_x", "acme's"), headers=A))
    assert kv.get(PATH + "resp_x", headers=B).status_code == 404
    assert kv.get(PATH + "resp_x").status_code == 404  # the unscoped namespace
    assert kv.delete(PATH + "resp_x", headers=B).status_code == 404
    assert kv.delete(PATH + "resp_x").status_code == 404

    ok(kv.put(PATH + "resp_x", json=stored("resp_x", "beta's"), headers=B))
    assert ok(kv.get(PATH + "resp_x", headers=A))["messages"][-1]["content"] == "acme's"
    assert ok(kv.get(PATH + "resp_x", headers=B))["messages"][-1]["content"] == "beta's"
    assert ok(kv.delete(PATH + "resp_x", headers=A))["deleted"] is True
    assert kv.get(PATH + "resp_x", headers=A).status_code == 404
    assert ok(kv.get(PATH + "resp_x", headers=B))["messages"][-1]["content"] == "beta's"
    r = kv.get(PATH + "resp_x", headers={TENANT_HEADER: "a/b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == TENANT_HEADER


def test_redis_keeps_one_expiring_key_each_and_a_bounded_write_order(redis_server) -> None:
    raw = redis.Redis(port=redis_server.port, decode_responses=True)
    raw.flushdb()
    with kvindex(redis_server.url, **BOUNDS) as kv:
        for i in range(MAX_COUNT + 2):
            ok(kv.put(PATH + f"resp_{i}", json=stored(f"resp_{i}"), headers=A))
        keys = [f"acme/resp_{i}" for i in range(2, MAX_COUNT + 2)]
        assert raw.zrange("as:resps", 0, -1) == keys
        assert sorted(raw.keys("as:resp:*")) == sorted(f"as:resp:{k}" for k in keys)
        assert 0 < raw.pttl(f"as:resp:{keys[0]}") <= TTL_S * 1000
        for i in range(2, MAX_COUNT + 2):
            ok(kv.delete(PATH + f"resp_{i}", headers=A))
        assert raw.keys("as:resp*") == []


def test_an_unreachable_store_is_503() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    conf = KvindexSettings(reap_interval_s=3600)
    with TestClient(create_app(conf, RedisIndex(url), RedisSessionStore(url))) as kv:
        for r in (kv.put(PATH + "resp_1", json=stored("resp_1")), kv.get(PATH + "resp_1"),
                  kv.delete(PATH + "resp_1")):
            assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"


@pytest.fixture
def served(store: str) -> Iterator[str]:
    """The kvindex on ``store`` over real HTTP, for the clients."""
    if store == "memory":
        app = create_app(KvindexSettings(**BOUNDS))
    else:
        app = create_app(KvindexSettings(**BOUNDS), RedisIndex(store), RedisSessionStore(store))
    server = ThreadedServer(app)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.mark.parametrize("client_class", [KvindexClient, AioKvindexClient])
def test_the_clients_round_trip(served: str, client_class: type[KvindexClient]) -> None:
    async def scenario() -> None:
        client = client_class(served, 5.0)
        a, b = client.for_tenant("acme"), client.for_tenant("beta")
        try:
            body = StoredResponse.model_validate(stored("resp_c", session_id="s1", ttl_s=30))
            put = await a.put_stored_response("resp_c", body)
            assert put == body and put.ttl_s == 30
            got = await a.get_stored_response("resp_c")
            assert got == body and got.response["previous_response_id"] is None
            with pytest.raises(NotFound):
                await b.get_stored_response("resp_c")
            with pytest.raises(NotFound):
                await b.delete_stored_response("resp_c")
            assert await a.delete_stored_response("resp_c") == StoredResponseDeleted(id="resp_c")
            with pytest.raises(NotFound):
                await a.get_stored_response("resp_c")
            with pytest.raises(NotFound):
                await a.delete_stored_response("resp_c")

            default = await a.put_stored_response("resp_d", body.model_copy(
                update={"ttl_s": None}))
            assert default.ttl_s == TTL_S
            big = StoredResponse.model_validate(stored("resp_e", "x" * MAX_BYTES))
            with pytest.raises(RequestRejected) as too_big:
                await a.put_stored_response("resp_e", big)
            assert too_big.value.status_code == 413 and too_big.value.param == "messages"
            with pytest.raises(RequestRejected) as bad_id:
                await a.get_stored_response("resp?x#y")
            assert bad_id.value.status_code == 400 and bad_id.value.param == "response_id"
        finally:
            await client.aclose()

    asyncio.run(scenario())
