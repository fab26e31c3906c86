"""The connector's memory API and kvindex reporting end to end on the CPU, over real LMCache:
two LMCache engines as two TP ranks of one vLLM pod (stock ``ChunkedTokenDatabase``, CPU and
disk tiers), each served by ``WorkerServices`` (the reference engine's ``engine_memory_app``),
the scheduler's ``SchedulerServices`` forwarding to both and reporting to a real kvindex
process, all over real HTTP. No vLLM here: these are the worker-side objects vLLM's
connector hands to LMCache's storage manager."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import pytest
import torch

from agentserving.core.hashing import ChunkHasher
from agentserving.core.schemas import PodRole, Tier
from agentserving.engine.vllm.hashes import wire_hash
from agentserving.engine.vllm.services import (
    SchedulerServices,
    WorkerServices,
    pod_registration,
)
from agentserving.engine.vllm.settings import ConnectorSettings
from agentserving.engine.vllm.storage import LMCacheStorageBackend
from testkit.servers import AGENTSERVING, free_port, free_port_run, service_process, wait_for_http

from .conftest import CHUNK, random_kv, until

POD = "vllm-demo-decode-0"


@contextlib.contextmanager
def kvindex(tmp: Path):
    port = free_port()
    exe = AGENTSERVING
    with service_process([exe, "kvindex", "--port", str(port), "--store", "memory",
                          "--lease-ttl", "30"], f"http://127.0.0.1:{port}/healthz",
                         log_path=tmp / "kvindex.log"):
        yield f"http://127.0.0.1:{port}"


def locations(kvi: str, h: str) -> list[tuple[str, str]]:
    r = httpx.get(f"{kvi}/v1/chunks/{h}", timeout=5)
    return sorted((loc["pod"], loc["tier"]) for loc in r.json()["locations"])


@pytest.fixture
def pod(engines, tmp_path):
    """Two ranks holding the same 3 chunks (different KV shards), served as one pod."""
    tokens = list(range(3 * CHUNK + 5))  # 3 full chunks and a partial one (never stored)
    ranks = []
    for rank in range(2):
        eng = engines(rank, 2)
        kv = random_kv(len(tokens), seed=rank)
        eng.store(torch.tensor(tokens), kv=kv)
        ranks.append((eng, kv))
    hashes = [wire_hash(h) for _, e, h in
              ranks[0][0].token_database.process_tokens(tokens, make_key=False) if e % CHUNK == 0]
    backends = [LMCacheStorageBackend(e.storage_manager, e.token_database, e.metadata)
                for e, _ in ranks]
    for b in backends:  # LMCache writes disk asynchronously
        until(lambda b=b: len(b.residency().get(Tier.DISK, ())) == 3, what="disk writes")
    with kvindex(tmp_path) as kvi:
        start = free_port_run(3)
        settings = ConnectorSettings(pod_name=POD, public_host="127.0.0.1",
                                     memory_host="127.0.0.1", memory_port_start=start,
                                     kvindex_url=kvi, report_interval_s=0.1,
                                     heartbeat_interval_s=1.0)
        workers = [WorkerServices(settings, b, k) for k, b in enumerate(backends)]
        sched = SchedulerServices(
            settings, 2, ["LocalCPUBackend", "LocalDiskBackend"],
            lambda: pod_registration(settings, role=PodRole.DECODE, model="tiny-vllm",
                                     chunk_size=CHUNK, capacity={Tier.CPU: 1 << 20},
                                     world_size=2), chunk_bytes=backends[0].chunk_bytes)
        for port in (start, start + 1, start + 2):
            wait_for_http(f"http://127.0.0.1:{port}/healthz", timeout_s=30)
        try:
            yield dict(tokens=tokens, ranks=ranks, hashes=hashes, backends=backends, kvi=kvi,
                       url=f"http://127.0.0.1:{start}", sched=sched)
        finally:
            sched.stop()
            for w in workers:
                w.stop()


def test_hashes_are_lmcache_builtin_chain(engines):
    # LMCache's own hashes (no vLLM: NONE_HASH 0) are the lmcache-builtin scheme of the index
    tokens = list(range(3 * CHUNK + 5))
    db = engines().token_database
    ours = [wire_hash(h) for _, e, h in db.process_tokens(tokens, make_key=False)
            if e % CHUNK == 0]
    assert ours == ChunkHasher("lmcache-builtin", CHUNK).hashes(tokens)[:3]


def test_memory_api_on_lmcache_storage_manager(pod):
    url, hashes, kvi = pod["url"], pod["hashes"], pod["kvi"]
    chunks = httpx.get(f"{url}/memory/chunks", timeout=10).json()
    assert chunks["chunks"] == {"cpu": sorted(hashes), "disk": sorted(hashes)}
    assert chunks["bytes"]["cpu"] == 2 * 3 * pod["backends"][0].chunk_bytes  # two ranks

    # the pod registered itself and its residency reached the kvindex
    pods = {p["pod"]: p for p in httpx.get(f"{kvi}/v1/pods", timeout=5).json()["pods"]}
    assert pods[POD]["memory_api_url"] == url and pods[POD]["role"] == "decode"
    until(lambda: locations(kvi, hashes[0]) == [(POD, "cpu"), (POD, "disk")], what="report")

    # a bad location is a 400 naming it; nothing is evicted
    r = httpx.post(f"{url}/memory/evict", json={"chunk_hashes": hashes,
                                                "locations": ["LocalCPUBackend", "nvme"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "locations[1]"

    # evict from DRAM on every rank (seed 000's call): disk keeps them
    r = httpx.post(f"{url}/memory/evict", json={"chunk_hashes": hashes,
                                                "locations": ["LocalCPUBackend"]}, timeout=10)
    assert r.status_code == 200 and r.json()["num_evicted"] == 6
    for b in pod["backends"]:
        assert b.residency()[Tier.CPU] == set() and len(b.residency()[Tier.DISK]) == 3
    until(lambda: locations(kvi, hashes[1]) == [(POD, "disk")], what="evict reported")

    # prefetch disk -> DRAM; an unknown hash is missing, not an error
    unknown = "7f" * 8
    r = httpx.post(f"{url}/memory/prefetch", json={"chunk_hashes": [*hashes, unknown],
                                                   "lookup_id": "p1"}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["num_to_load"] == 6 and body["missing"] == [unknown]
    st = until(lambda: (s := httpx.get(f"{url}/memory/prefetch/p1", timeout=5).json())
               ["state"] == "done" and s, what="prefetch done")
    assert st["loaded"] == 6 and st["error"] is None
    until(lambda: locations(kvi, hashes[2]) == [(POD, "cpu"), (POD, "disk")],
          what="prefetch reported")

    # KV served from DRAM after the prefetch is bit-identical to what each rank stored
    n = 3 * CHUNK
    for eng, kv in pod["ranks"]:
        out = torch.zeros_like(kv)
        hit = eng.retrieve(torch.tensor(pod["tokens"][:n]), out=out)
        assert int(hit.sum()) == n
        assert torch.equal(out[:, :, :n], kv[:, :, :n])

    # evict everywhere: nothing left, and the kvindex forgets the chunks
    r = httpx.post(f"{url}/memory/evict", json={"chunk_hashes": hashes}, timeout=10)
    assert r.json()["num_evicted"] == 6
    assert httpx.get(f"{url}/memory/chunks", timeout=10).json()["chunks"] == {"cpu": [],
                                                                              "disk": []}
    until(lambda: locations(kvi, hashes[0]) == [], what="full evict reported")


def test_scheduler_deregisters_on_stop(pod):
    kvi = pod["kvi"]
    until(lambda: POD in {p["pod"] for p in httpx.get(f"{kvi}/v1/pods").json()["pods"]},
          what="registered")
    pod["sched"].stop()
    assert POD not in {p["pod"] for p in httpx.get(f"{kvi}/v1/pods", timeout=5).json()["pods"]}


def test_scheduler_hooks_read_the_tiers_prefetch_and_measure(pod):
    """What a prefill policy in vLLM's scheduler asks of the pod (``SchedulerKvHooks``), over
    the real ranks: tiers from the scheduler services' residency book, a prefetch that moves
    disk-only chunks to DRAM on every rank, the measurement at admission, the stats route."""
    from types import SimpleNamespace

    from agentserving.engine.vllm.scheduler_hooks import SchedulerKvHooks

    url, hashes, sched = pod["url"], pod["hashes"], pod["sched"]
    db = pod["ranks"][0][0].token_database
    ints = [h for _, e, h in db.process_tokens(pod["tokens"], make_key=False) if e % CHUNK == 0]
    hooks = SchedulerKvHooks(sched, lambda request: ints, world_size=2)
    request = SimpleNamespace(request_id="turn-1")
    assert hooks.chunk_hashes(request) == hashes
    until(lambda: hooks.tiers(hashes) == [Tier.CPU] * 3, what="residency polled")
    assert hooks.tiers(["7f" * 8]) == [None]

    r = httpx.get(f"{url}/memory/scheduler", timeout=5)
    assert r.status_code == 404 and "fcfs" in r.json()["error"]["message"]
    hooks.publish(lambda: {"steps": 7})
    stats = httpx.get(f"{url}/memory/scheduler", timeout=5).json()
    assert stats == {"steps": 7, "tiers": {"chunks": {"cpu": 3, "disk": 3},
                                           "prefetches_started": 0, "prefetches_failed": 0}}

    httpx.post(f"{url}/memory/evict", json={"chunk_hashes": hashes,
                                            "locations": ["LocalCPUBackend"]}, timeout=10)
    until(lambda: hooks.tiers(hashes) == [Tier.DISK] * 3, what="eviction polled")
    assert hooks.measure([("never-prefetched", hashes)]) == [(0, 0)]
    hooks.prefetch("turn-1", hashes)  # returns at once; the ranks load in the background
    until(lambda: hooks.measure([("turn-1", hashes)]) == [(3, 3)], what="prefetch landed")
    assert hooks.prefetches_started == 1 and hooks.prefetches_failed == 0
    for b in pod["backends"]:
        assert len(b.residency()[Tier.CPU]) == 3
