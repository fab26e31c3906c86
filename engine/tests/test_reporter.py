"""Residency merging and the kvindex reporter against a real kvindex process: numbered
batches, outage while serving, resync by snapshot, re-registration after a restart."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
import pytest

from agentserving.core.clients import KvindexClient
from agentserving.core.hashing import ChunkHasher
from agentserving.core.schemas import EventOp, PodRegistration, Tier
from agentserving.engine.reporter import KvindexReporter, ResidencyBook, group_events
from testkit.servers import AGENTSERVING, free_port, service_process

H = ChunkHasher("blake3", 4).hashes(list(range(40)))  # 10 chained hashes


def test_book_merges_engines_and_reports_pod_level_changes():
    book = ResidencyBook(chunk_bytes=100)
    assert book.apply(0, {"cpu": H[:3]}, {}) == [(EventOp.STORED, Tier.CPU, h) for h in H[:3]]
    assert book.apply(1, {"cpu": H[:2], "disk": H[:1]}, {}) == [(EventOp.STORED, Tier.DISK,
                                                                  H[0])]
    assert book.apply(0, {}, {"cpu": H[:3]}) == [(EventOp.REMOVED, Tier.CPU, H[2])]
    assert book.snapshot() == {Tier.CPU: sorted(H[:2]), Tier.DISK: [H[0]]}
    assert book.bytes() == {Tier.CPU: 200, Tier.DISK: 100}
    assert book.best_engine(H[:3], [0, 1]) == {0: 0, 1: 2}
    events = group_events([(EventOp.STORED, Tier.CPU, H[0]), (EventOp.STORED, Tier.CPU, H[1]),
                           (EventOp.REMOVED, Tier.CPU, H[0])], 100)
    assert [(e.op, e.chunk_hashes, e.bytes) for e in events] == [
        (EventOp.STORED, H[:2], 200), (EventOp.REMOVED, H[:1], 100)]


@contextlib.contextmanager
def kvindex(tmp: Path, port: int, name: str):
    exe = AGENTSERVING
    with service_process([exe, "kvindex", "--port", str(port), "--store", "memory",
                          "--lease-ttl", "30"], f"http://127.0.0.1:{port}/healthz",
                         log_path=tmp / f"{name}.log") as proc:
        yield proc


def locate(port: int, h: str) -> list[tuple[str, str]]:
    r = httpx.get(f"http://127.0.0.1:{port}/v1/chunks/{h}", timeout=5)
    return sorted((loc["pod"], loc["tier"]) for loc in r.json()["locations"])


def test_reporter_batches_survives_outage_and_resyncs(tmp_path):
    port = free_port()

    async def scenario() -> None:
        book = ResidencyBook(chunk_bytes=10)
        reg = PodRegistration(pod="p1", memory_api_url="http://127.0.0.1:9", model="tiny",
                              chunk_size=4)
        rep = KvindexReporter(KvindexClient(f"http://127.0.0.1:{port}", timeout_s=1.0),
                              lambda: reg, book, heartbeat_interval_s=0.0)
        try:
            with kvindex(tmp_path, port, "kv1"):
                rep.on_changes(book.apply(0, {"cpu": H[:3]}, {}))
                await rep.tick()  # register, snapshot (empty before the changes), batch
                assert rep.up and rep.registered
                assert locate(port, H[0]) == [("p1", "cpu")]
                seq = rep.seq
                rep.on_changes(book.apply(0, {"disk": H[:2]}, {"cpu": [H[2]]}))
                await rep.tick()
                assert rep.seq == seq + 1  # one numbered batch per flush
                assert locate(port, H[1]) == [("p1", "cpu"), ("p1", "disk")]
                assert locate(port, H[2]) == []
            # the kvindex is gone: the pod keeps changing; nothing is lost for good
            rep.on_changes(book.apply(0, {"cpu": H[3:6]}, {}))
            await rep.tick()
            assert not rep.up and rep.needs_snapshot
            with kvindex(tmp_path, port, "kv2"):  # back, empty (in-memory store)
                await rep.tick()
                assert rep.up and not rep.needs_snapshot
                for h in H[:6]:
                    if h == H[2]:
                        continue
                    assert ("p1", "cpu") in locate(port, h)
                assert locate(port, H[0]) == [("p1", "cpu"), ("p1", "disk")]
                # a sequence gap seen by the kvindex: it asks for a resync on the heartbeat
                r = httpx.post(f"http://127.0.0.1:{port}/v1/events", json={
                    "pod": "p1", "seq": rep.seq + 5, "events": []})
                assert r.json()["needs_resync"] is True
                rep.seq += 5
                await rep.tick()
                pod = httpx.get(f"http://127.0.0.1:{port}/v1/pods/p1").json()
                assert pod["needs_resync"] is False and pod["seq"] == rep.seq
        finally:
            await rep.close(deregister=False)

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", ["memory"])
def test_reporter_deregisters_on_close(tmp_path, kind):
    port = free_port()

    async def scenario() -> None:
        book = ResidencyBook(chunk_bytes=10)
        reg = PodRegistration(pod="p2", memory_api_url="http://127.0.0.1:9", model="tiny")
        rep = KvindexReporter(KvindexClient(f"http://127.0.0.1:{port}"), lambda: reg, book)
        await rep.tick()
        assert httpx.get(f"http://127.0.0.1:{port}/v1/pods/p2").status_code == 200
        await rep.close(deregister=True)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/pods/p2").status_code == 404

    with kvindex(tmp_path, port, "kv3"):
        asyncio.run(scenario())
