"""The internal token over real HTTP: who gets in, what stays open, what the docs say, and
that every client sends it (the kvindex's fan-out to an engine's memory API included)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from agentserving.core.clients import KvindexClient, RequestRejected
from agentserving.core.internal_auth import bearer_of, check_token
from agentserving.core.service import (
    install_error_handlers,
    install_health_route,
    install_internal_auth,
)
from agentserving.kvindex.app import create_app as kvindex_app
from agentserving.kvindex.index.memory import InMemoryIndex, InMemorySessionStore
from agentserving.kvindex.settings import KvindexSettings
from testkit.servers import ThreadedServer

TOKEN = "t0ken-of-this-deployment"


def test_bearer_parsing_and_the_two_refusals():
    assert bearer_of("Bearer abc") == "abc" and bearer_of("bearer  abc ") == "abc"
    assert bearer_of("Basic abc") is None and bearer_of("Bearer ") is None
    assert bearer_of(None) is None
    assert check_token(f"Bearer {TOKEN}", TOKEN) is None
    assert check_token(None, TOKEN)[0] == 401
    assert check_token("Bearer other", TOKEN)[0] == 403
    assert check_token(f"Bearer {TOKEN}x", TOKEN)[0] == 403


def _app(token: str | None) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    install_internal_auth(app, token, lambda path: path.startswith("/memory/"))
    install_health_route(app)

    @app.get("/memory/chunks")
    def chunks() -> dict[str, list[str]]:
        return {"cpu": []}

    @app.get("/v1/models")
    def models() -> dict[str, list[str]]:
        return {"data": []}

    return app


def test_only_the_guarded_paths_need_the_token_over_http():
    server = ThreadedServer(_app(TOKEN))
    try:
        url = server.url
        r = httpx.get(url + "/memory/chunks")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["param"] == "authorization"
        assert httpx.get(url + "/memory/chunks",
                         headers={"authorization": "Bearer nope"}).status_code == 403
        assert httpx.get(url + "/memory/chunks",
                         headers={"authorization": f"Bearer {TOKEN}"}).json() == {"cpu": []}
        for path in ("/v1/models", "/healthz", "/openapi.json"):  # not guarded: open
            assert httpx.get(url + path).status_code == 200, path
        doc = httpx.get(url + "/openapi.json").json()
        guarded = doc["paths"]["/memory/chunks"]["get"]
        assert guarded["security"] == [{"internalToken": []}]
        assert {"401", "403"} <= set(guarded["responses"])
        assert "security" not in doc["paths"]["/v1/models"]["get"]
    finally:
        server.stop()


def test_no_token_configured_checks_nothing():
    with TestClient(_app(None)) as client:
        assert client.get("/memory/chunks").status_code == 200
        assert "securitySchemes" not in client.get("/openapi.json").json()["components"]


def test_the_kvindex_takes_its_callers_token_and_passes_it_on():
    """A pod's memory API that requires the token (an engine's, here) receives the kvindex's
    fan-out; a kvindex client without the token, or with another, is refused."""
    engine = _app(TOKEN)
    seen: list[str | None] = []

    @engine.post("/memory/evict")
    def evict(body: dict) -> dict:
        seen.append("evict")
        return {"status": "success", "num_evicted": len(body["chunk_hashes"])}

    pod = ThreadedServer(engine)
    index = ThreadedServer(kvindex_app(KvindexSettings(internal_token=TOKEN), InMemoryIndex(),
                                       InMemorySessionStore()))
    try:
        asyncio.run(_calls(index.url, pod.url, seen))
    finally:
        index.stop()
        pod.stop()


async def _calls(index_url: str, pod_url: str, seen: list[str | None]) -> None:
    for token, status in ((None, 401), ("other", 403)):
        refused = KvindexClient(index_url, token=token)
        with pytest.raises(RequestRejected) as err:
            await refused.pods()
        assert err.value.status_code == status and err.value.param == "authorization"
        await refused.aclose()
    client = KvindexClient(index_url, token=TOKEN)
    async with httpx.AsyncClient(base_url=index_url,
                                 headers={"authorization": f"Bearer {TOKEN}"}) as http:
        await http.post("/v1/pods", json={"pod": "p0", "memory_api_url": pod_url, "model": "m"})
        chunk = "ab" * 16
        await http.post("/v1/events", json={"pod": "p0", "seq": 1, "events": [
            {"op": "stored", "tier": "cpu", "chunk_hashes": [chunk]}]})
        r = await http.post("/v1/evict", json={"chunk_hashes": [chunk], "force": True})
    assert r.status_code == 200, r.text
    assert r.json()["results"]["p0"]["ok"] is True, r.json()
    assert seen == ["evict"]
    assert [p.pod for p in (await client.pods()).pods] == ["p0"]
    await client.aclose()
