"""The in-cluster Redis with Sentinel, without Kubernetes: three members on loopback, each a
real redis-server and a real sentinel started by the pods' own ``start.sh`` from the
operator's rendered templates (``redis_ha.redis_conf``/``sentinel_conf`` with 127.0.0.1 and
free ports in place of the pods' DNS names and fixed ports).

The master is killed -9 while residency batches flow into a kvindex store on
``redis+sentinel://`` (``min_acks=1``: each write waits for a replica), and restarted at once
as the kubelet would restart its container, empty. The sentinels promote a replica, the
store answers again within seconds, every acknowledged batch is still there, and the old
master comes back as a replica of the new one instead of as an empty master."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from agentserving.core.hashing import ChunkHasher
from agentserving.core.schemas import EventBatch, PodRegistration
from agentserving.kvindex.index.base import BackendUnavailable
from agentserving.kvindex.index.factory import new_index
from agentserving.operator.builders.redis_ha import (
    MASTER_NAME,
    SELF,
    START_SH,
    quorum,
    redis_conf,
    sentinel_conf,
)
from testkit.servers import free_port, wait_for_port, wait_until

CHAIN = ChunkHasher(chunk_size=4).hashes(list(range(400)))  # 100 chained hashes
HOST = "127.0.0.1"
MEMBERS = 3

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None
                                or shutil.which("redis-cli") is None,
                                reason="redis-server/redis-cli not installed (make setup)")


class Member:
    """One pod of the StatefulSet: its ports, its folders, its two processes."""

    def __init__(self, root: Path, k: int, ports: list[tuple[int, int]]) -> None:
        self.k = k
        self.port, self.sentinel_port = ports[k]
        self.conf = root / f"conf-{k}"  # the ConfigMap
        self.data = root / f"data-{k}"  # the emptyDir
        self.conf.mkdir()
        self.data.mkdir()
        # The operator's templates, with this member's loopback ports instead of a pod's
        (self.conf / "redis.conf").write_text(redis_conf(
            announce_host=SELF, port=self.port, bind=HOST, data_dir=str(self.data)))
        (self.conf / "sentinel.conf").write_text(sentinel_conf(
            announce_host=SELF, master=("@MASTER_HOST@", "@MASTER_PORT@"),
            quorum=quorum(MEMBERS), port=self.sentinel_port, bind=HOST,
            data_dir=str(self.data), down_after_ms=1000, failover_timeout_ms=3000))
        (self.conf / "start.sh").write_text(START_SH)
        self.env = {**os.environ, "SELF": HOST, "REDIS_PORT": str(self.port),
                    "SENTINEL_PORT": str(self.sentinel_port),
                    "PEERS": " ".join(f"{HOST}:{s}" for _, s in ports),
                    "SEED": f"{HOST}:{ports[0][0]}", "MASTER_NAME": MASTER_NAME,
                    "CONF": str(self.conf), "DATA": str(self.data), "MASTER_WAIT_S": "30"}
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = root / f"logs-{k}"
        self.logs.mkdir()

    def start(self, what: str, wait: bool = True) -> None:
        """``sh start.sh redis|sentinel``, as the container's command."""
        log = open(self.logs / f"{what}.log", "ab")  # noqa: SIM115
        self.procs[what] = subprocess.Popen(
            ["sh", str(self.conf / "start.sh"), what], env=self.env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        if wait:
            wait_for_port(self.port if what == "redis" else self.sentinel_port, 20)

    def kill(self, what: str) -> None:
        proc = self.procs.pop(what, None)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def master(self) -> str:
        """What ``start.sh master`` prints: the master the other sentinels name now."""
        return subprocess.run(["sh", str(self.conf / "start.sh"), "master"], env=self.env,
                              capture_output=True, text=True, timeout=20,
                              check=True).stdout.strip()


def logs_of(members: list[Member]) -> str:
    return "\n".join(f"--- {p.parent.name}/{p.name}\n" + "\n".join(
        p.read_text(errors="replace").splitlines()[-15:])
        for m in members for p in sorted(m.logs.iterdir()))


@pytest.fixture
def members(tmp_path: Path) -> Iterator[list[Member]]:
    """Three members started in the StatefulSet's order, synced, every sentinel seeing the
    two replicas and the two other sentinels."""
    ports = [(free_port(), free_port()) for _ in range(MEMBERS)]
    group = [Member(tmp_path, k, ports) for k in range(MEMBERS)]
    try:
        for m in group:  # OrderedReady: pod k+1 starts once pod k is up
            m.start("redis")
            m.start("sentinel")
        primary = redis.Redis(port=group[0].port)
        wait_until(lambda: [primary.info("replication").get(f"slave{i}", {}).get("state")
                            for i in range(MEMBERS - 1)] == ["online"] * (MEMBERS - 1), 20,
                   "both replicas to sync")
        for m in group:
            watcher = redis.Redis(port=m.sentinel_port)
            wait_until(lambda w=watcher: len(w.sentinel_slaves(MASTER_NAME)) == MEMBERS - 1
                       and len(w.sentinel_sentinels(MASTER_NAME)) == MEMBERS - 1, 20,
                       f"sentinel {m.k} to find the replicas and the other sentinels")
        yield group
    except BaseException:
        print(logs_of(group))
        raise
    finally:
        for m in group:
            m.kill("sentinel")
            m.kill("redis")


def test_the_rendered_sentinel_set_fails_over_and_loses_nothing_acknowledged(members):
    first = members[0]
    assert first.master() == f"{HOST} {first.port}"  # a new set: pod 0 is master
    assert redis.Redis(port=members[1].port).info("replication")["role"] == "slave"
    url = "redis+sentinel://" + ",".join(f"{HOST}:{m.sentinel_port}" for m in members) + (
        f"/{MASTER_NAME}/0")
    acked, refused, recovered_in = asyncio.run(
        feed_through_a_failover(url, members))
    assert recovered_in is not None and recovered_in < 15, (recovered_in, refused,
                                                           logs_of(members))
    promoted = members[1].master()
    assert promoted != f"{HOST} {first.port}", promoted  # a replica took over
    new_port = int(promoted.split()[1])
    # the old master came back empty and waited: now a replica of the new one, synced
    mine = redis.Redis(port=first.port)
    wait_until(lambda: mine.info("replication").get("master_port") == new_port
               and mine.info("replication").get("master_link_status") == "up", 20,
               f"the restarted member to replicate {promoted}\n{logs_of(members)}")
    new_master = redis.Redis(port=new_port)
    wait_until(lambda: mine.dbsize() == new_master.dbsize() > 0, 10, "the same keys")
    assert asyncio.run(located(url, acked)) == len(acked)


async def feed_through_a_failover(url: str, members: list[Member]):
    index, sessions = new_index(url, min_acks=1)
    acked: list[str] = []
    refused, recovered_in, killed_at = 0, None, None
    try:
        await index.register_pod(PodRegistration(pod="p", memory_api_url="http://127.0.0.1:9",
                                                 model="m", chunk_size=4), ttl_s=300)
        for seq, chunk in enumerate(CHAIN, start=1):
            if seq == 20:  # the master dies between two acknowledged batches ...
                members[0].kill("redis")
                killed_at = time.monotonic()
                members[0].start("redis", wait=False)  # ... and its container restarts
            batch = EventBatch.model_validate({"pod": "p", "seq": seq, "events": [
                {"op": "stored", "tier": "cpu", "chunk_hashes": [chunk]}]})
            try:
                await index.apply_events(batch)
            except BackendUnavailable:  # unavailable (or not replicated), never wrong
                refused += 1
                await asyncio.sleep(0.2)
                continue
            acked.append(chunk)
            if killed_at is not None and recovered_in is None:
                recovered_in = time.monotonic() - killed_at
            if recovered_in is not None and len(acked) >= 40:
                break
    finally:
        await index.close()
        await sessions.close()
    return acked, refused, recovered_in


async def located(url: str, chunks: list[str]) -> int:
    """How many of ``chunks`` the store (through the sentinels) still places on pod p."""
    index, sessions = new_index(url)
    try:
        found = 0
        for chunk in chunks:
            locations = await index.locate(chunk)
            found += [(loc.pod, loc.tier.value) for loc in locations] == [("p", "cpu")]
        return found
    finally:
        await index.close()
        await sessions.close()
