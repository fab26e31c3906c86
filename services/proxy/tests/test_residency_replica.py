"""The proxy's residency replica against a real kvindex process: it catches up with what pods
report and answers lookups as the kvindex does; stale once the kvindex is gone (the proxy then
asks the kvindex itself); relisted from scratch when a new kvindex (a new process, its memory
store empty) answers on the same address."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from prometheus_client import CollectorRegistry

from agentserving.core.clients import KvindexClient
from agentserving.core.hashing import ChunkHasher
from agentserving.core.schemas import (
    EventBatch,
    LookupRequest,
    PodRegistration,
    PodRole,
    ResidencyEvent,
)
from agentserving.proxy.kvindex_http import AioKvindexClient
from agentserving.proxy.residency_replica import ReplicaMetrics, ResidencyReplica, following
from testkit.servers import AGENTSERVING, free_port, service_process

CHAIN = ChunkHasher("blake3", 4).hashes(list(range(64)))  # 16 chained hashes


@contextlib.contextmanager
def kvindex_on(port: int, log: Path):  # type: ignore[no-untyped-def]
    url = f"http://127.0.0.1:{port}"
    with service_process([AGENTSERVING, "kvindex", "--port", str(port), "--store", "memory",
                          "--log-level", "warning"], url + "/readyz", log_path=log):
        yield url


async def report(kv: KvindexClient, pod: str, role: str, chunks: dict[str, list[str]]) -> None:
    info = await kv.register(PodRegistration(pod=pod, memory_api_url="http://127.0.0.1:9",
                                             role=role, model="m", chunk_size=4))
    await kv.events(EventBatch(pod=pod, seq=info.seq + 1, events=[
        ResidencyEvent(op="stored", tier=tier, chunk_hashes=hashes)
        for tier, hashes in chunks.items()]))


async def until(check, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_the_replica_follows_loses_and_relists_a_real_kvindex(tmp_path: Path) -> None:
    port = free_port()
    registry = CollectorRegistry()
    metrics = ReplicaMetrics(registry)

    def count(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    async def scenario() -> None:
        replica = ResidencyReplica(AioKvindexClient(f"http://127.0.0.1:{port}", 3.0), metrics,
                                   wait_s=0.3, max_lag_s=1.0, retry_s=0.2)
        req = LookupRequest(chunk_hashes=CHAIN, role=PodRole.PREFILL)
        async with following(replica):
            assert replica.lookup(req) is None  # never listed: not trusted
            with kvindex_on(port, tmp_path / "kv1.log") as url:
                kv = KvindexClient(url, 5.0)
                await until(replica.fresh)
                await report(kv, "p0", "prefill", {"cpu": CHAIN[:10], "disk": CHAIN[:12]})
                await report(kv, "p1", "both", {"device": CHAIN[:4]})
                await report(kv, "d0", "decode", {"device": CHAIN})  # not a prefill pod
                want = await kv.lookup(req)
                await until(lambda: replica.lookup(req) == want)
                assert [p.pod for p in want.pods] == ["p0", "p1"]
                assert want.pods[0].tiers == {"cpu": 10, "disk": 2}
                # what changes later reaches it too, without a new listing
                await kv.events(EventBatch(pod="p1", seq=2, events=[
                    ResidencyEvent(op="stored", tier="device", chunk_hashes=CHAIN[4:16])]))
                want = await kv.lookup(req)
                assert want.best_pod == "p1"
                await until(lambda: replica.lookup(req) == want)
                assert count("proxy_residency_replica_lists_total", reason="start") == 1
                assert count("proxy_residency_replica_changes_total") >= 1
                await kv.aclose()
            # the kvindex is gone: after max_lag_s the replica no longer answers
            await until(lambda: replica.lookup(req) is None, timeout_s=5)
            with kvindex_on(port, tmp_path / "kv2.log") as url:  # a new, empty kvindex
                kv = KvindexClient(url, 5.0)
                await until(replica.fresh)
                assert replica.lookup(req).pods == []  # nothing of the old one's residency
                await report(kv, "p2", "prefill", {"cpu": CHAIN[:3]})
                await until(lambda: getattr(replica.lookup(req), "best_pod", None) == "p2")
                assert count("proxy_residency_replica_lists_total", reason="reconnect") >= 1
                await kv.aclose()
        await replica.client.aclose()

    asyncio.run(scenario())
