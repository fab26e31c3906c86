"""The Redis master killed during a multi-turn replay.

Two kvindex replicas share one Redis set behind Sentinel (a master, two replicas,
``--redis-min-acks 1``). The workers report their residency to one replica; the proxy
discovers the pods and follows the residency feed through the other, so everything it knows
crossed Redis (the feed is a Redis stream). Three agent sessions take turns through the proxy
while the master is killed -9 part way through. What must hold:

- no turn fails, and each session keeps reusing its context on its own pod after the failover;
- both kvindex replicas answer again within seconds, on the promoted replica;
- nothing acknowledged is lost: once the replay is over, the index's residency of each pod is
  exactly what the pod holds in its own tiers (no chunk lost, none invented);
- the proxy's residency replica is fresh again and answers the lookups.
"""

from __future__ import annotations

import itertools
import time

import httpx
import openai
import pytest

from testkit.servers import redis_sentinel_set

from .test_proxy_e2e import client, metric, prompt_for, turn, wait_for

SESSIONS = 3
TURNS = 7
KILL_AFTER_ROUND = 2


@pytest.fixture(scope="module")
def failover_fleet(fleet_factory):
    with redis_sentinel_set() as (url, master, sentinel_port):
        f = fleet_factory
        # the product's lease (15 s), not the e2e fleet's 3 s: a Sentinel failover (1 s to
        # call the master down, then the election and the clients' reconnect) can outlast 3 s
        # on a loaded 2-core machine, and every pod's lease would lapse while no kvindex could
        # take a heartbeat: a lease shorter than the store's failover is a misconfiguration
        store = ["--store", url, "--redis-min-acks", "1", "--lease-ttl", "15"]
        f.kv_a = f.start_kvindex(*store, name="kvindex-a")  # the workers report here
        f.kv_b = f.start_kvindex(*store, name="kvindex-b")  # the proxy reads here
        f.start_worker("w0", disk=False)
        f.start_worker("w1", disk=False)
        f.proxy = f.start_proxy("--kvindex", f.kv_b.url, name="proxy-b")
        wait_for(lambda: httpx.get(f.proxy.url + "/readyz", timeout=5).json().get(
            "prefill_pods") == 2, what="the proxy to find both pods through kvindex-b")
        f.master = master
        yield f
        f.stack.close()  # every process before the Redis set goes


def pod_view(fleet, pod: str) -> set[str]:  # type: ignore[no-untyped-def]
    """The chunks the pod holds in DRAM by its own memory API."""
    held = httpx.get(fleet.workers[pod].memory_url + "/memory/chunks", headers=fleet.headers,
                     timeout=5).json()["chunks"]
    return set(held.get("cpu", []))


def index_view(fleet, kvindex, pod: str) -> set[str] | None:  # type: ignore[no-untyped-def]
    """The chunks the index says the pod holds in DRAM (the residency listing)."""
    r = httpx.get(kvindex.url + "/v1/residency", headers=fleet.headers, timeout=10)
    if r.status_code == 503:  # a client of the store still meeting the new master: not yet
        return None
    assert r.status_code == 200, r.text
    listing = r.json()
    return {c for p in listing["pods"] if p["info"]["pod"] == pod
            for c in p["chunks"].get("cpu", [])}


def test_a_killed_redis_master_fails_no_turn_and_loses_no_residency(failover_fleet):
    f = failover_fleet
    c = client(f.proxy)
    prompts = {s: prompt_for(60 + s, 600) for s in range(SESSIONS)}
    served: dict[int, list[tuple[str, int, int]]] = {s: [] for s in range(SESSIONS)}
    killed_at = None
    for rnd in range(TURNS):
        if rnd == KILL_AFTER_ROUND:
            f.master.kill()
            killed_at = time.monotonic()
        for s in range(SESSIONS):
            try:
                resp, headers = turn(c, f"failover-{s}", prompts[s])
            except openai.APIError as exc:  # pragma: no cover - the assertion's message
                raise AssertionError(f"turn {rnd} of session {s} failed: {exc}") from exc
            assert resp.usage.completion_tokens == 4
            served[s].append((headers["x-agentserving-prefill-pod"], len(prompts[s]),
                              resp.usage.prompt_tokens_details.cached_tokens))
            prompts[s] = prompts[s] + list(range(100, 104)) + prompt_for(70 + rnd * 7 + s, 200)
        time.sleep(0.3)
    assert killed_at is not None
    # both kvindex replicas answer again, on the promoted replica, within seconds of the kill
    for kv in (f.kv_a, f.kv_b):
        wait_for(lambda kv=kv: httpx.get(kv.url + "/readyz", timeout=2).status_code == 200,
                 timeout_s=15, what=f"{kv.log.stem} ready again")
    assert time.monotonic() - killed_at < 60
    # each session stayed on one pod and reused its whole previous context every turn
    for turns in served.values():
        assert len({pod for pod, _, _ in turns}) == 1, turns
        for (_, before, _), (_, _, cached) in itertools.pairwise(turns):
            assert cached >= before // 256 * 256, turns
    # nothing acknowledged was lost: the index (read through either replica) ends equal to
    # what each pod holds in its own DRAM tier, once the workers' reporters have caught up
    held = {pod: pod_view(f, pod) for pod in ("w0", "w1")}
    assert sum(map(len, held.values())) >= SESSIONS * 4, held
    for pod in held:
        wait_for(lambda pod=pod: index_view(f, f.kv_b, pod) == pod_view(f, pod)
                 == index_view(f, f.kv_a, pod),
                 timeout_s=20, what=f"the index to hold exactly {pod}'s chunks")
    # the proxy's replica followed the failover and answers lookups again
    wait_for(lambda: metric(f.proxy, "proxy_residency_replica_staleness_seconds") < 3,
             timeout_s=20, what="the proxy's residency replica fresh again")
    assert metric(f.proxy, "proxy_kv_lookups_total", source="replica") > 0
    assert metric(f.proxy, "proxy_failed_turns_total", reason="upstream") == 0
