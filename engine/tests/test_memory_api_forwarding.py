"""The forwarding memory API (the API process's) passes any lookup id on to the engine
processes intact: one with a newline or non-ASCII used to make an invalid URL and a 500
(found by the API fuzzer, tests/fuzz)."""

from __future__ import annotations

import urllib.parse

from fastapi import FastAPI
from fastapi.testclient import TestClient

from agentserving.core.schemas import MemoryPrefetchStatus
from agentserving.engine.memory_api import EngineFanout, forwarding_memory_app
from testkit.servers import ThreadedServer


def test_a_lookup_id_any_string_is_forwarded_intact():
    engine = FastAPI()

    @engine.get("/memory/prefetch/{lookup_id}")
    def status(lookup_id: str) -> MemoryPrefetchStatus:
        return MemoryPrefetchStatus(lookup_id=lookup_id, state="done", requested=1)

    server = ThreadedServer(engine)
    try:
        app = forwarding_memory_app(EngineFanout([server.url], timeout_s=5), ["LocalCPUBackend"])
        with TestClient(app) as client:
            for lookup_id in ("\nöö¾", "a b?c#d%", "plain"):
                r = client.get("/memory/prefetch/" + urllib.parse.quote(lookup_id, safe=""))
                assert r.status_code == 200, r.text
                assert r.json()["lookup_id"] == lookup_id and r.json()["state"] == "done"
    finally:
        server.stop()
