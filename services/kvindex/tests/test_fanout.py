"""Prefetch/evict fan-out over real HTTP to pods' memory APIs, one of them down or slow."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from agentserving.core.hashing import ChunkHasher
from agentserving.core.schemas import Tier
from agentserving.kvindex.app import create_app
from agentserving.kvindex.controllers.fanout import plan, tiers_for_locations
from agentserving.kvindex.index.base import TIER_BITS
from agentserving.kvindex.index.memory import InMemoryIndex, InMemorySessionStore
from agentserving.kvindex.settings import KvindexSettings
from testkit.servers import free_port

CHAIN = ChunkHasher(chunk_size=2).hashes(list(range(20)))


@pytest.fixture
def peers(memory_api):  # type: ignore[no-untyped-def]
    return memory_api(), memory_api(delay_s=3.0)


def test_fanout_reaches_holders_and_reports_failures(peers):
    fast, slow = peers
    dead_url = f"http://127.0.0.1:{free_port()}"
    settings = KvindexSettings(fanout_timeout_s=0.5)
    with TestClient(create_app(settings, InMemoryIndex(), InMemorySessionStore())) as client:
        for pod, url in (("fast", fast.server.url), ("slow", slow.server.url), ("dead", dead_url)):
            assert client.post("/v1/pods", json={"pod": pod, "memory_api_url": url,
                                                 "model": "m"}).status_code == 200
        events = {"fast": [{"op": "stored", "tier": "disk", "chunk_hashes": CHAIN[:4]},
                           {"op": "stored", "tier": "cpu", "chunk_hashes": CHAIN[:2]}],
                  "slow": [{"op": "stored", "tier": "disk", "chunk_hashes": CHAIN[2:6]}],
                  "dead": [{"op": "stored", "tier": "cpu", "chunk_hashes": CHAIN[:1]}]}
        for pod, evs in events.items():
            client.post("/v1/events", json={"pod": pod, "seq": 1, "events": evs})

        wanted = CHAIN[:8]
        r = client.post("/v1/prefetch", json={"chunk_hashes": wanted, "lookup_id": "turn-7"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["lookup_id"] == "turn-7"
        assert body["missing"] == CHAIN[6:8]
        res = body["results"]
        assert res["fast"]["ok"] and res["fast"]["num_chunks"] == 4
        assert res["fast"]["response"] == {"status": "prefetch_started", "lookup_id": "turn-7",
                                           "num_chunks": 4}
        assert not res["slow"]["ok"] and "Timeout" in res["slow"]["error"]
        assert not res["dead"]["ok"] and res["dead"]["error"]
        assert fast.calls == [("prefetch", {"chunk_hashes": CHAIN[:4], "lookup_id": "turn-7"})]

        # an announced turn's prefetch reaches the pods with its expected arrival and size
        client.post("/v1/prefetch", json={"chunk_hashes": CHAIN[:2], "lookup_id": "tool-gap:s",
                                          "pod": "fast", "expected_in_s": 1.5,
                                          "expected_tokens": 300, "hold_s": 9.5})
        assert fast.calls[-1] == ("prefetch", {"chunk_hashes": CHAIN[:2], "lookup_id":
                                               "tool-gap:s", "expected_in_s": 1.5,
                                               "expected_tokens": 300, "hold_s": 9.5})

        # the index never claims what a pod has not confirmed: a prefetch changes nothing
        assert client.get(f"/v1/chunks/{CHAIN[3]}").json()["locations"] == [
            {"pod": "fast", "tier": "disk"}, {"pod": "slow", "tier": "disk"}]

        # evict only the DRAM copies, named as the seed names them
        r = client.post("/v1/evict", json={"chunk_hashes": wanted,
                                           "locations": ["LocalCPUBackend"], "pod": "fast"})
        body = r.json()
        assert list(body["results"]) == ["fast"] and body["results"]["fast"]["ok"]
        assert fast.calls[-1] == ("evict", {"chunk_hashes": CHAIN[:2],
                                            "locations": ["LocalCPUBackend"]})


def test_plan_is_pure_and_ordered():
    holders = {"a": {"h1": TIER_BITS[Tier.CPU], "h2": TIER_BITS[Tier.DISK]},
               "b": {"h2": TIER_BITS[Tier.CPU] | TIER_BITS[Tier.DISK]}}
    per_pod, missing = plan(["h2", "h1", "h3"], holders)
    assert per_pod == {"a": ["h2", "h1"], "b": ["h2"]} and missing == ["h3"]
    per_pod, _ = plan(["h1", "h2"], holders, tiers={Tier.DISK})
    assert per_pod == {"a": ["h2"], "b": ["h2"]}
    per_pod, missing = plan(["h1", "h2"], holders, only_pod="b", skip={"h2"})
    assert per_pod == {} and missing == ["h1"]  # missing: not held by the pods asked
    assert tiers_for_locations(["cpu", "LocalDiskBackend"]) == {Tier.CPU, Tier.DISK}
    with pytest.raises(ValueError, match="unknown location 'tape'"):
        tiers_for_locations(["tape"])
