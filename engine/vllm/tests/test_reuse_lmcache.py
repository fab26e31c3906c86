"""A vLLM pod's reuse metrics (``engine.vllm.reuse``) over a real LMCache engine (stock
``ChunkedTokenDatabase``, CPU and disk tiers; no vLLM): LMCache loads counted by the tier they
came from and the tenant in their ``request_configs``, vLLM's device-tier hits once per
request, and the scheduler process's ``/metrics`` serving them."""

from __future__ import annotations

import httpx
import torch
from prometheus_client import CollectorRegistry, generate_latest

from agentserving.core.schemas import TENANT_HEADER, Tier
from agentserving.engine.metrics import ReuseMetrics, tenant_name
from agentserving.engine.vllm import reuse, salting
from agentserving.engine.vllm.load_log import LoadLog, LoadRecord, LoadsMeta
from agentserving.engine.vllm.request_body import header
from agentserving.engine.vllm.services import SchedulerServices
from agentserving.engine.vllm.settings import ConnectorSettings, parse_settings
from agentserving.engine.vllm.storage import LMCacheStorageBackend
from testkit.servers import free_port_run, wait_for_http
from testkit.worker import metric_sum

from .conftest import CHUNK, random_kv, until

CACHED = "agentserving_worker_cached_tokens_total"
PROMPT = "agentserving_worker_prompt_tokens_total"
A = {salting.SALT_KEY: "salt-of-a", salting.TENANT_KEY: "tenant-a"}


def _text(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_lmcache_loads_are_counted_by_tier_and_tenant(engines) -> None:
    engine = engines()
    registry = CollectorRegistry()
    metrics = ReuseMetrics(registry)
    reuse.count_retrieves(engine, metrics)
    reuse.count_retrieves(engine, metrics)  # once only
    tokens = list(range(3 * CHUNK + 5))  # 3 full chunks (48 tokens) and a partial, unstored
    engine.store(torch.tensor(tokens), kv=random_kv(len(tokens), 1), request_configs=A)
    out = torch.zeros_like(random_kv(len(tokens), 2))

    got = engine.retrieve(torch.tensor(tokens), out=out, request_configs=A)
    assert int(got.sum()) == 3 * CHUNK
    text = _text(registry)
    assert metric_sum(text, CACHED, tier="cpu", tenant="tenant-a") == 3 * CHUNK
    assert metric_sum(text, CACHED, tier="disk") == 0

    # vLLM held the first chunk (its mask is off there): the two others are loaded
    mask = torch.ones(len(tokens), dtype=torch.bool)
    mask[:CHUNK] = False
    engine.retrieve(torch.tensor(tokens), mask, out=out, request_configs=A)
    assert metric_sum(_text(registry), CACHED, tier="cpu", tenant="tenant-a") == \
        5 * CHUNK

    # DRAM dropped, disk kept: the same load comes from disk
    backend = LMCacheStorageBackend(engine.storage_manager, engine.token_database,
                                    engine.metadata)
    until(lambda: len(backend.residency().get(Tier.DISK, ())) == 3, what="disk writes")
    engine.clear(tokens, ["LocalCPUBackend"], A)
    assert not backend.residency().get(Tier.CPU)
    engine.retrieve(torch.tensor(tokens), out=out, request_configs=A)
    text = _text(registry)
    assert metric_sum(text, CACHED, tier="disk", tenant="tenant-a") == 3 * CHUNK
    assert metric_sum(text, CACHED, tier="cpu", tenant="tenant-a") == 5 * CHUNK
    # nothing under any other tenant; no prompt tokens here (the scheduler counts those)
    assert metric_sum(text, CACHED) == 8 * CHUNK and metric_sum(text, PROMPT) == 0


def test_each_retrieve_is_recorded_for_its_request(engines) -> None:
    engine = engines()
    loads = LoadLog()
    reuse.count_retrieves(engine, ReuseMetrics(CollectorRegistry()), loads)
    tokens = list(range(2 * CHUNK))
    engine.store(torch.tensor(tokens), kv=random_kv(len(tokens), 1))
    out = torch.zeros_like(random_kv(len(tokens), 2))
    engine.retrieve(torch.tensor(tokens), out=out, req_id="a", vllm_cached_tokens=CHUNK + 1)
    engine.retrieve(torch.tensor(tokens[:CHUNK]), out=out, req_id="b")
    loads.failed("b")
    meta = loads.take()
    assert meta is not None and loads.take() is None
    assert meta.loads["a"].tokens == {"cpu": CHUNK - 1} and meta.loads["a"].load_s > 0
    assert meta.loads["b"].tokens == {"cpu": CHUNK} and meta.loads["b"].failed
    # TP ranks' metadata aggregate by request
    both = meta.aggregate(LoadsMeta({"a": LoadRecord({"disk": 3}, 1.0, 1.0)}))
    assert both.loads["a"].tokens == {"cpu": CHUNK - 1, "disk": 3}


def test_tokens_by_tier_caps_to_what_was_retrieved() -> None:
    mapping = {"LocalCPUBackend": [("k0", 0, 4), ("k1", 4, 8)],
               "LocalDiskBackend": [("k2", 8, 12)], "RemoteBackend": [("k3", 12, 16)]}
    assert reuse.tokens_by_tier(mapping, [True] * 16) == {"cpu": 8, "disk": 4, "remote": 4}
    # the last block failed to load: LMCache cut the mask there
    assert reuse.tokens_by_tier(mapping, [True] * 10 + [False] * 6) == {"cpu": 8, "disk": 2}
    # vLLM's prefix cache held the first 6 tokens: counted as device, not again here
    assert reuse.tokens_by_tier(mapping, [True] * 16, skip=6) == {"cpu": 2, "disk": 4,
                                                                   "remote": 4}


def test_scheduler_counts_prompt_and_device_tokens_once_per_request() -> None:
    registry = CollectorRegistry()
    sched = reuse.SchedulerReuse(ReuseMetrics(registry))
    assert sched.first_look("r1", 100, 64, A)
    assert not sched.first_look("r1", 100, 64, A)  # asked again while waiting
    assert sched.first_look("r2", 50, 0, {salting.SALT_KEY: "salt-of-b"})
    # r1's worker records arrive (two steps' worth) and finish gives its prompt sources
    sched.loaded(LoadsMeta({"r1": LoadRecord({"cpu": 16}, 0.5, 0.0)}))
    sched.loaded(LoadsMeta({"r1": LoadRecord({"disk": 16}, 0.25, 0.2, failed=True),
                            "never-looked-up": LoadRecord({"cpu": 16})}))
    assert sched.finish("r1") == {
        "tokens": {"device": 64, "cpu": 16, "disk": 16, "remote": 0, "computed": 4},
        "load_s": 0.75, "disk_read_s": 0.2, "fell_back": True}
    assert sched.finish("r1") is None and sched.finish("never-looked-up") is None
    assert sched.finish("r2")["tokens"]["computed"] == 50
    text = generate_latest(registry).decode()
    assert metric_sum(text, PROMPT, tenant="tenant-a") == 100
    assert metric_sum(text, CACHED, tier="device", tenant="tenant-a") == 64
    b = tenant_name(None, "salt-of-b")
    assert metric_sum(text, PROMPT, tenant=b) == 50
    assert metric_sum(text, CACHED, tenant=b) == 0


def test_middleware_body_carries_the_tenant_header() -> None:
    out = salting.salted_body({"prompt": [1], "cache_salt": "s"}, "acme")
    assert out["kv_transfer_params"] == {salting.SALT_KEY: "s", salting.TENANT_KEY: "acme"}
    out = salting.salted_body({"prompt": [1]}, "acme")
    assert out["kv_transfer_params"] == {salting.TENANT_KEY: "acme"}
    name = TENANT_HEADER.encode()
    assert header({"headers": [(name.upper(), b"acme")]}, name) == "acme"
    assert header({"headers": []}, name) is None
    assert parse_settings({"metrics_max_tenants": 5}, {}).metrics_max_tenants == 5


def test_scheduler_process_serves_the_reuse_counters() -> None:
    start = free_port_run(2)
    settings = ConnectorSettings(pod_name="p", public_host="127.0.0.1",
                                 memory_host="127.0.0.1", memory_port_start=start)
    reuse.process_metrics().observe("tenant-s", 10, {"device": 4})
    sched = SchedulerServices(settings, 1, ["LocalCPUBackend"], lambda: None)
    try:
        wait_for_http(f"http://127.0.0.1:{start}/healthz", timeout_s=30)
        text = httpx.get(f"http://127.0.0.1:{start}/metrics", timeout=10).text
        assert metric_sum(text, CACHED, tier="device", tenant="tenant-s") >= 4
    finally:
        sched.stop()
