"""A session's context (``PUT /v1/sessions/{id}/context``) on both backends: it makes the
session exist from its first turn (pin, priority and close then act on it), carries the
proxy's routing record, and, asked to, evicts what a context change dropped, refcount-aware;
the frees of a close and of a context change are counted on /metrics per tier. The pods'
memory APIs are real HTTP servers recording what they are sent."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from agentserving.core.schemas import PodCallResult, PodInfo, Tier
from agentserving.kvindex.controllers.fanout import freed_by_tier
from agentserving.kvindex.index.base import dropped_context
from agentserving.kvindex.tests.test_lifecycle import CHAIN, evicted, kvindex, ok

SYSTEM = CHAIN[:2]  # the chunks every prompt of the agent starts with


def context(client: TestClient, sid: str, chunks: list[str] | None, evict: bool = True,
            **extra: object) -> dict:
    return ok(client.put(f"/v1/sessions/{sid}/context",
                         json={"chunk_hashes": chunks, "evict_dropped": evict, **extra}))


def pod_with_bytes(client: TestClient, pod: str, url: str, chunks: list[str]) -> None:
    """A pod holding ``chunks`` in DRAM and on disk, reporting 1000 bytes per chunk."""
    ok(client.post("/v1/pods", json={"pod": pod, "memory_api_url": url, "model": "m",
                                     "chunk_size": 4}))
    ok(client.post("/v1/events", json={"pod": pod, "seq": 1, "events": [
        {"op": "stored", "tier": t, "chunk_hashes": chunks, "bytes": 1000 * len(chunks)}
        for t in ("cpu", "disk")]}))


def reclaimed(client: TestClient, what: str, reason: str, tier: str) -> float:
    text = client.get("/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == f"kvindex_reclaimed_{what}_total"
               and s.labels == {"reason": reason, "tier": tier})


@pytest.mark.parametrize(("previous", "current", "dropped"), [
    ([], CHAIN[:3], []),  # a first turn
    (CHAIN[:3], CHAIN[:5], []),  # the next turn extends the context
    (CHAIN[:3], CHAIN[:3], []),  # the same prompt again
    (CHAIN[:5], CHAIN[:2], CHAIN[2:5]),  # a shorter prompt: the tail went
    (CHAIN[:5], SYSTEM + ["ab", "cd"], CHAIN[2:5]),  # compacted: only the system prompt stays
    (CHAIN[:5], ["ab"], CHAIN[:5]),  # a new system prompt: everything went
    (CHAIN[:4], CHAIN[:2] + [CHAIN[3]], [CHAIN[2]]),  # a chunk that recurs is kept
])
def test_dropped_context_is_the_previous_tail_from_the_divergence(previous, current,
                                                                   dropped) -> None:
    assert dropped_context(previous, current) == dropped


def test_freed_by_tier_counts_what_pods_accepted_in_each_tier_they_held_it() -> None:
    info = PodInfo(pod="p", memory_api_url="http://p", model="m", registered_at=0,
                   last_heartbeat=0, lease_expires_at=0, seq=0, needs_resync=False,
                   chunks={Tier.CPU: 4, Tier.DISK: 2}, used_bytes={Tier.CPU: 400,
                                                                   Tier.DISK: 1000})
    holders = {"p": {"a": 2 | 4, "b": 2}, "q": {"c": 2}}
    results = {"p": PodCallResult(ok=True, num_chunks=2),
               "q": PodCallResult(ok=False, num_chunks=1, error="HTTP 500")}
    freed = freed_by_tier({"p": ["a", "b"], "q": ["c"]}, holders, {"p": info}, results)
    assert freed == {Tier.CPU: (2, 200), Tier.DISK: (1, 500)}  # q failed: nothing freed there


def test_a_session_exists_from_its_first_turn_and_its_verbs_act_on_it(store, memory_api):
    peer = memory_api()
    with kvindex(store, session_idle_ttl_s=600) as client:
        pod_with_bytes(client, "p", peer.url, CHAIN[:6])
        assert client.post("/v1/sessions/s/pin", json={"ttl_s": 30}).status_code == 404
        info = context(client, "s", CHAIN[:4])["session"]
        assert info["intents"] == {"~context": CHAIN[:4]} and info["expires_at"] is not None
        assert ok(client.post("/v1/sessions/s/pin", json={"ttl_s": 30}))["pinned_until"]
        assert ok(client.put("/v1/sessions/s/priority", json={"priority": 3}))["priority"] == 3
        # an engine that named no chunks leaves the context as it was
        assert context(client, "s", None)["session"]["intents"] == {"~context": CHAIN[:4]}
        assert context(client, "fresh", None)["session"]["intents"] == {"~context": []}

        # close reclaims the whole context on the pod, counted per tier on /metrics
        closed = ok(client.delete("/v1/sessions/s"))
        assert closed["chunk_hashes"] == sorted(CHAIN[:4]) == sorted(evicted(peer))
        assert reclaimed(client, "chunks", "close", "cpu") == 4
        assert reclaimed(client, "chunks", "close", "disk") == 4
        assert reclaimed(client, "bytes", "close", "disk") == 4000


def test_a_compaction_evicts_the_dropped_context_except_what_others_reference(store,
                                                                              memory_api):
    peer = memory_api()
    with kvindex(store, session_idle_ttl_s=600) as client:
        pod_with_bytes(client, "p", peer.url, CHAIN[:8])
        context(client, "agent", CHAIN[:3])
        assert context(client, "agent", CHAIN[:6])["dropped"] == []  # an extension
        assert evicted(peer) == []
        ok(client.post("/v1/sessions/agent/fork", json={"child": "branch"}))
        ok(client.put("/v1/sessions/agent/intents/plan", json={"chunk_hashes": [CHAIN[5]]}))

        # compacted: the new prompt shares only the system prompt
        r = context(client, "agent", SYSTEM + CHAIN[7:8])
        assert r["dropped"] == CHAIN[2:6]
        assert r["session"]["intents"]["~context"] == SYSTEM + CHAIN[7:8]
        # the fork references the old context, so the pod keeps all of it
        assert r["evict"]["protected"] == CHAIN[2:6] and evicted(peer) == []

        # the fork compacts too: now only the agent's own "plan" intent keeps CHAIN[5]
        r = context(client, "branch", SYSTEM)
        assert r["dropped"] == CHAIN[2:6] and r["evict"]["protected"] == [CHAIN[5]]
        assert evicted(peer) == CHAIN[2:5]
        assert reclaimed(client, "chunks", "context_change", "cpu") == 3
        assert reclaimed(client, "bytes", "context_change", "cpu") == 3000

        # without evict_dropped (the proxy's --no-context-change-evict) nothing is evicted
        r = context(client, "agent", CHAIN[6:7], evict=False)
        assert r["dropped"] == [] and r["evict"] is None and evicted(peer) == []


def test_the_routing_record_rides_along_and_bad_bodies_name_their_field(store):
    with kvindex(store, session_idle_ttl_s=600) as client:
        route = {"turns": 2, "chunk_hashes": CHAIN[:2], "last_pod": "p"}
        context(client, "s", CHAIN[:2], route=route)
        assert ok(client.get("/v1/sessions/s/route"))["last_pod"] == "p"
        for body, param in [({"chunk_hashes": ["xyz"]}, "chunk_hashes[0]"),
                            ({"chunk_hashes": [], "evict_dropped": 1}, "evict_dropped"),
                            ({"chunk_hashes": [], "route": {"turns": -1}}, "route.turns"),
                            ({"chunks": []}, "chunks")]:
            r = client.put("/v1/sessions/s/context", json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param
    with kvindex(store, max_batch_chunks=2) as client:
        r = client.put("/v1/sessions/s/context", json={"chunk_hashes": CHAIN[:3]})
        assert r.status_code == 413, r.text
