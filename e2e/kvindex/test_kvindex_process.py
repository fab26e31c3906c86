"""`agentserving kvindex` as a real process on a real Redis: serve, survive an outage, recover."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest

from agentserving.core.hashing import chunk_hashes
from testkit.servers import AGENTSERVING, free_port, redis_server, service_process

CHAIN = chunk_hashes(list(range(64)), chunk_size=8)


@pytest.fixture
def redis():
    with redis_server() as server:
        yield server


def test_help_explains_every_flag():
    out = subprocess.run([AGENTSERVING, "kvindex", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--host", "--port", "--store", "--lease-ttl", "--reap-interval",
                 "--max-batch-chunks", "--fanout-timeout", "--vllm-events", "--log-level"):
        assert flag in out, flag
    assert "AGENTSERVING_KVINDEX_STORE" in out


def test_redis_outage_degrades_and_loses_nothing(redis, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {"AGENTSERVING_KVINDEX_STORE": redis.url}  # config by environment, too
    with service_process([AGENTSERVING, "kvindex", "--port", str(port)], base + "/readyz",
                         env=env, log_path=tmp_path / "kvindex.log"):
        with httpx.Client(base_url=base, timeout=5) as c:
            assert c.post("/v1/pods", json={"pod": "w0", "memory_api_url": "http://127.0.0.1:1",
                                            "model": "tiny"}).status_code == 200
            r = c.post("/v1/events", json={"pod": "w0", "seq": 1, "events": [
                {"op": "stored", "tier": "cpu", "chunk_hashes": CHAIN}]})
            assert r.status_code == 200 and r.json()["chunk_events"] == len(CHAIN)
            assert c.post("/v1/lookup", json={"chunk_hashes": CHAIN}).json()["best_pod"] == "w0"

            os.kill(redis.proc.pid, signal.SIGSTOP)  # a partition: Redis stops answering
            try:
                assert c.get("/readyz").status_code == 503
                started = time.monotonic()
                r = c.post("/v1/lookup", json={"chunk_hashes": CHAIN})
                elapsed = time.monotonic() - started
                assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
                assert elapsed < 1.0, elapsed  # answered at once, so the proxy can route on
                r = c.post("/v1/events", json={"pod": "w0", "seq": 2, "events": [
                    {"op": "removed", "tier": "cpu", "chunk_hashes": CHAIN[:1]}]})
                assert r.status_code == 503  # not acknowledged: the pod keeps it to resend
            finally:
                os.kill(redis.proc.pid, signal.SIGCONT)

            deadline = time.monotonic() + 10
            while c.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, "kvindex did not recover"
                time.sleep(0.2)
            body = c.post("/v1/lookup", json={"chunk_hashes": CHAIN}).json()
            assert body["pods"][0]["prefix_chunks"] == len(CHAIN)  # nothing was lost
            assert "kvindex_backend_unavailable_total" in c.get("/metrics").text
