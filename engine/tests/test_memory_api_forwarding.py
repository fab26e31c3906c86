"""The forwarding memory API (the API process's): it passes any lookup id on to the engine
processes intact (one with a newline or non-ASCII used to make an invalid URL and a 500, found
by the API fuzzer, tests/fuzz), and its listing of the pod's chunks includes the engine's own
KV pool where it has one."""

from __future__ import annotations

import urllib.parse

from fastapi import FastAPI
from fastapi.testclient import TestClient

from agentserving.core.schemas import (
    MemoryChunks,
    MemoryPinRequest,
    MemoryPinResult,
    MemoryPrefetchRequest,
    MemoryPrefetchResult,
    MemoryPrefetchStatus,
    Tier,
)
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


def test_an_announced_prefetch_waits_for_the_scheduler_that_takes_it():
    # the pod's scheduler takes a prefetch announced ahead of its request (``expected_in_s``)
    # and reads when it predicts the admission; with no taker, or a plain prefetch, the ranks
    # read at once
    seen: list[dict] = []
    engine = FastAPI()

    @engine.post("/memory/prefetch")
    def prefetch(req: MemoryPrefetchRequest) -> MemoryPrefetchResult:
        seen.append(req.model_dump(exclude_none=True))
        return MemoryPrefetchResult(lookup_id=req.lookup_id, num_chunks=len(req.chunk_hashes))

    pins: list[dict] = []

    @engine.post("/memory/pin")
    def pin(req: MemoryPinRequest) -> MemoryPinResult:
        pins.append(req.model_dump())
        return MemoryPinResult(num_pinned=len(req.chunk_hashes))

    taken: list[MemoryPrefetchRequest] = []
    taker: list = [None]
    server = ThreadedServer(engine)
    try:
        app = forwarding_memory_app(EngineFanout([server.url], timeout_s=5), ["LocalCPUBackend"],
                                    announced=lambda: taker[0],
                                    residency=lambda hashes: [Tier.DISK for _ in hashes])
        announced = {"chunk_hashes": ["ab"], "lookup_id": "tool-gap:s", "expected_in_s": 2.0}
        with TestClient(app) as client:
            r = client.post("/memory/prefetch", json=announced)
            assert r.json()["status"] == "prefetch_started" and len(seen) == 1  # no taker
            taker[0] = lambda req: taken.append(req) or True
            r = client.post("/memory/prefetch", json=announced)
            assert r.status_code == 200 and r.json()["status"] == "prefetch_scheduled"
            assert len(seen) == 1 and taken[0].expected_in_s == 2.0
            # where the pod's book puts the chunks at the announce: the KV to move
            assert (r.json()["num_to_load"], r.json()["num_in_cpu"]) == (1, 0)
            assert pins == [] and r.json()["num_held"] == 0  # no hold asked for
            # with a hold, what the ranks hold now is pinned at once, the scheduler's read
            # later carrying the rest of it
            r = client.post("/memory/prefetch", json={**announced, "hold_s": 12.5})
            assert r.json()["status"] == "prefetch_scheduled" and r.json()["num_held"] == 1
            assert pins == [{"chunk_hashes": ["ab"], "ttl_s": 12.5}]
            assert taken[-1].hold_s == 12.5 and len(seen) == 1
            r = client.post("/memory/prefetch", json={"chunk_hashes": ["ab"]})
            assert r.json()["status"] == "prefetch_started" and len(seen) == 2
            r = client.post("/memory/prefetch", json={**announced, "expected_in_s": -1})
            assert r.status_code == 400 and "expected_in_s" in r.text
    finally:
        server.stop()


class _Pool:
    """An engine's own KV pool as the forwarding API reaches it (``DeviceTier``)."""

    def __init__(self, chunks: list[str]) -> None:
        self.chunks = chunks

    def release(self, chunk_hashes, evict: bool) -> None:  # noqa: ANN001
        self.chunks = [c for c in self.chunks if not evict or c not in chunk_hashes]

    def device_chunks(self) -> list[str]:
        return list(self.chunks)


def test_the_pods_chunk_listing_includes_its_device_pool():
    # what the kvindex hears as tier device is in the pod's own listing too, so a caller can
    # find (and evict) a context vLLM's cache alone still holds
    engine = FastAPI()

    @engine.get("/memory/chunks")
    def chunks() -> MemoryChunks:
        return MemoryChunks(chunks={"cpu": ["0a", "0b"]}, bytes={"cpu": 2048})

    pool = _Pool(["0b", "0c"])
    server = ThreadedServer(engine)
    try:
        with TestClient(forwarding_memory_app(EngineFanout([server.url], timeout_s=5),
                                              ["LocalCPUBackend"], device=lambda: pool)) as client:
            listing = client.get("/memory/chunks").json()
            assert listing["chunks"] == {"cpu": ["0a", "0b"], "device": ["0b", "0c"]}
            assert listing["bytes"] == {"cpu": 2048}
        with TestClient(forwarding_memory_app(EngineFanout([server.url], timeout_s=5),
                                              ["LocalCPUBackend"])) as client:
            assert client.get("/memory/chunks").json()["chunks"] == {"cpu": ["0a", "0b"]}
    finally:
        server.stop()
