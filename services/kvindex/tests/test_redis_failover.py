"""The kvindex on Redis behind Sentinel (issue 18): a master, two replicas and a sentinel, real
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
