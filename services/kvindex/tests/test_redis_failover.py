"""The kvindex on Redis behind Sentinel: a master, two replicas and a sentinel, real
redis-server processes on loopback. Residency batches flow in while the master is killed -9;
the kvindex answers again within seconds on the promoted replica, and every batch it had
acknowledged (``--redis-min-acks 1``: each write WAITs for a replica) is still there."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest
import redis
from fastapi.testclient import TestClient

from agentserving.core.hashing import ChunkHasher
from agentserving.kvindex.app import create_app
from agentserving.kvindex.index.redis import sentinel_parts
from agentserving.kvindex.settings import KvindexSettings
from testkit.servers import redis_sentinel_set, wait_until

CHAIN = ChunkHasher(chunk_size=4).hashes(list(range(400)))  # 100 chained hashes


@pytest.fixture
def sentinel_set() -> Iterator[tuple[str, subprocess.Popen, int]]:
    """(store URL, the master's process, the sentinel's port)."""
    with redis_sentinel_set() as made:
        yield made


def test_sentinel_urls():
    assert sentinel_parts("redis+sentinel://a:1,b/kv/2") == ([("a", 1), ("b", 26379)], "kv", 2,
                                                             None)
    assert sentinel_parts("redis+sentinel://:pw@a:1/kv") == ([("a", 1)], "kv", 0, "pw")
    with pytest.raises(ValueError, match="service name"):
        sentinel_parts("redis+sentinel://a:1")


def test_a_killed_master_loses_nothing_acknowledged(sentinel_set):
    url, master, sentinel_port = sentinel_set
    settings = KvindexSettings(store=url, redis_min_acks=1, lease_ttl_s=300)
    acked, refused, recovered_in = [], 0, None
    with TestClient(create_app(settings)) as kv:
        r = kv.post("/v1/pods", json={"pod": "p", "memory_api_url": "http://127.0.0.1:9",
                                      "model": "m", "chunk_size": 4})
        assert r.status_code == 200, r.text
        killed_at = None
        for seq, chunk in enumerate(CHAIN, start=1):
            if seq == 20:  # the master dies between two acknowledged batches
                master.kill()
                killed_at = time.monotonic()
            r = kv.post("/v1/events", json={"pod": "p", "seq": seq, "events": [
                {"op": "stored", "tier": "cpu", "chunk_hashes": [chunk]}]})
            if r.status_code == 200:
                acked.append(chunk)
                if killed_at is not None and recovered_in is None:
                    recovered_in = time.monotonic() - killed_at
            else:
                assert r.status_code == 503, r.text  # unavailable, never wrong
                refused += 1
                time.sleep(0.2)
            if recovered_in is not None and len(acked) >= 40:
                break
        assert recovered_in is not None and recovered_in < 15, (recovered_in, refused)
        # what was acknowledged before and after the failover is all there, on the new master
        for chunk in acked:
            got = kv.get(f"/v1/chunks/{chunk}")
            assert got.status_code == 200 and got.json()["locations"] == [
                {"pod": "p", "tier": "cpu"}], (chunk, got.text)
        # ready again as soon as each store's client has met the new master (its background
        # reaper may have tripped the session store's one-second breaker during the failover)
        wait_until(lambda: kv.get("/readyz").status_code == 200, 5, "/readyz")
    promoted = redis.Redis(port=sentinel_port).sentinel_get_master_addr_by_name("kv")
    assert promoted[1] != master.args[master.args.index("--port") + 1]  # a replica took over


def test_a_pooled_connection_left_on_a_demoted_master_is_dropped(sentinel_set):
    """SENTINEL FAILOVER demotes the live master to a replica under the kvindex's pooled
    connection. A script that writes nothing still runs there and only its WAIT is refused;
    that call is unavailable (503, not a 500) and the pool is emptied, so the next calls reach
    the new master (before the fix, every later call failed on the replica)."""
    import asyncio

    from agentserving.kvindex.index.base import BackendUnavailable
    from agentserving.kvindex.index.redis import RedisIndex

    url, _master, sentinel_port = sentinel_set
    watcher = redis.Redis(port=sentinel_port)
    old = watcher.sentinel_get_master_addr_by_name("kv")
    index = RedisIndex(url, min_acks=1)

    async def go() -> list[str]:
        seen = []
        try:
            await index.expire_leases()                  # a pooled connection to the master
            # NOGOODSLAVE until the sentinel has heard from the replicas for a while
            wait_until(lambda: watcher.execute_command("SENTINEL", "FAILOVER", "kv"), 20,
                       "the sentinel to accept a failover", ignoring=(redis.ResponseError,),
                       interval_s=0.5)
            wait_until(lambda: watcher.sentinel_get_master_addr_by_name("kv") != old and
                       redis.Redis(port=int(old[1])).role()[0] == b"slave", 20,
                       "the old master to be a replica")
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                try:
                    await index.expire_leases()          # writes nothing: WAIT is the test
                    seen.append("ok")
                    break
                except BackendUnavailable as exc:
                    seen.append("replica" if "replica instance" in str(exc) else "unavailable")
                    await asyncio.sleep(0.3)
        finally:
            await index.close()
        return seen

    seen = asyncio.run(go())
    assert seen[0] == "replica" and seen[-1] == "ok", seen
