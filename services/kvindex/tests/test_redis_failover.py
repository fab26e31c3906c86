"""The kvindex on Redis behind Sentinel (issue 18): a master, two replicas and a sentinel, real
redis-server processes on loopback. Residency batches flow in while the master is killed -9;
the kvindex answers again within seconds on the promoted replica, and every batch it had
acknowledged (``--redis-min-acks 1``: each write WAITs for a replica) is still there."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from agentserving.core.hashing import ChunkHasher
from agentserving.core.testing import free_port, wait_for_port
from agentserving.kvindex.app import create_app
from agentserving.kvindex.index.redis import sentinel_parts
from agentserving.kvindex.settings import KvindexSettings

CHAIN = ChunkHasher(chunk_size=4).hashes(list(range(400)))  # 100 chained hashes


@contextlib.contextmanager
def redis_process(port: int, workdir: Path, *args: str) -> Iterator[subprocess.Popen]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server not found: run `make setup` (installs Debian's)")
    proc = subprocess.Popen([binary, *args, "--bind", "127.0.0.1", "--port", str(port),
                             "--dir", str(workdir), "--save", "", "--appendonly", "no",
                             "--repl-diskless-sync-delay", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def wait_until(check, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError):
            if value := check():
                return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def sentinel_set() -> Iterator[tuple[str, subprocess.Popen, int]]:
    """(store URL, the master's process, the sentinel's port)."""
    root = Path(tempfile.mkdtemp(prefix="agentserving-sentinel-"))
    ports = [free_port() for _ in range(4)]
    master, replicas, sentinel = ports[0], ports[1:3], ports[3]
    for name in ("m", "r0", "r1", "s"):
        (root / name).mkdir()
    conf = root / "s" / "sentinel.conf"
    conf.write_text(f"sentinel monitor kv 127.0.0.1 {master} 1\n"
                    "sentinel down-after-milliseconds kv 1000\n"
                    "sentinel failover-timeout kv 3000\n")
    with contextlib.ExitStack() as stack:
        m = stack.enter_context(redis_process(master, root / "m"))
        for i, port in enumerate(replicas):
            stack.enter_context(redis_process(port, root / f"r{i}", "--replicaof", "127.0.0.1",
                                              str(master)))
        stack.enter_context(redis_process(sentinel, root / "s", str(conf), "--sentinel"))
        primary = redis.Redis(port=master)
        wait_until(lambda: [primary.info("replication").get(f"slave{i}", {}).get("state")
                            for i in range(2)] == ["online", "online"], 20,
                   "both replicas to sync")
        watcher = redis.Redis(port=sentinel)
        wait_until(lambda: len(watcher.sentinel_slaves("kv")) == 2, 20,
                   "the sentinel to find both replicas")
        yield f"redis+sentinel://127.0.0.1:{sentinel}/kv/0", m, sentinel
    shutil.rmtree(root, ignore_errors=True)


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
