"""Prompt-token reuse by tier and tenant on a real worker's ``/metrics``
(``agentserving_worker_cached_tokens{tier, tenant}``, ``..._prompt_tokens{tenant}``): a real
``agentserving worker`` process driven over HTTP, KV reused from DRAM, then from disk after an
evict, each counted under the tenant that sent the turn and no other."""

from __future__ import annotations

import httpx
import pytest

from agentserving.core.schemas import TENANT_HEADER
from agentserving.engine.metrics import (
    NO_TENANT,
    OTHER_TENANT,
    ReuseMetrics,
    TenantLabels,
    WorkerMetrics,
    tenant_name,
)
from testkit.servers import wait_until
from testkit.worker import metric_sum, prompt, worker_process

CACHED = "agentserving_worker_cached_tokens_total"
PROMPT = "agentserving_worker_prompt_tokens_total"


def test_tenant_names_and_the_cap() -> None:
    assert tenant_name("acme", "s") == "acme"
    assert tenant_name(None, None) == NO_TENANT
    salted = tenant_name(None, "tenant:secret")
    assert salted.startswith("salt-") and len(salted) == 13 and "secret" not in salted
    assert tenant_name("bad tenant/name", None) == NO_TENANT  # not a tenant name: ignored
    labels = TenantLabels(max_tenants=2)
    assert [labels(t) for t in ("a", "b", "c", "a", None)] == ["a", "b", OTHER_TENANT, "a",
                                                               NO_TENANT]


def test_worker_metrics_keep_one_name_and_add_the_tenant() -> None:
    m = WorkerMetrics()
    m.observe_first({"prompt_tokens": 900, "cached_tokens_by_tier": {"cpu": 512, "disk": 256}},
                    "a")
    text = _text(m.registry)
    assert metric_sum(text, CACHED, tier="cpu", tenant="a") == 512
    assert metric_sum(text, CACHED, tier="disk", tenant="a") == 256
    assert metric_sum(text, PROMPT, tenant="a") == 900
    assert ReuseMetrics  # the vLLM engine's processes export the same two families


def _text(registry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reuse-metrics")
    with worker_process(tmp, "--max-model-len", "2048", "--disk-cache-dir", str(tmp / "kv"),
                        "--disk-cache-gib", "0.25", "--metrics-max-tenants", "3",
                        name="w-reuse") as w:
        yield w


def _complete(w, ids: list[int], tenant: str | None = None, salt: str | None = None) -> dict:
    body: dict = {"prompt": ids, "max_tokens": 2}
    if salt:
        body["cache_salt"] = salt
    headers = {TENANT_HEADER: tenant} if tenant else {}
    r = httpx.post(w.url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_reuse_by_tier_and_tenant_on_a_real_worker(worker) -> None:
    w = worker
    ids = prompt(900, seed=181)  # 3 full chunks of 256 before the last token: 768 reusable
    b_ids = prompt(600, seed=182)
    _complete(w, b_ids, "tenant-b", salt="salt-of-b")  # B's own cold turn
    cold = _complete(w, ids, "tenant-a", salt="salt-of-a")
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    before = w.metrics()
    b_before = {t: metric_sum(before, CACHED, tier=t, tenant="tenant-b")
                for t in ("cpu", "disk", "device", "remote")}
    assert metric_sum(before, PROMPT, tenant="tenant-a") == 900
    assert metric_sum(before, CACHED, tenant="tenant-a") == 0

    warm = _complete(w, ids, "tenant-a", salt="salt-of-a")  # from DRAM
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"] == {"cpu": 768}
    text = w.metrics()
    assert metric_sum(text, CACHED, tier="cpu", tenant="tenant-a") == 768
    assert metric_sum(text, CACHED, tier="disk", tenant="tenant-a") == 0
    assert metric_sum(text, PROMPT, tenant="tenant-a") == 1800

    # to disk only: wait for LMCache's disk writes, drop the DRAM copies, the same turn again
    hashes = cold["kv_transfer_params"]["chunk_hashes"]
    wait_until(lambda: set(hashes) <= set(httpx.get(w.memory_url + "/memory/chunks").json()
                                     ["chunks"].get("disk", [])), timeout_s=30, what="disk writes")
    r = httpx.post(w.memory_url + "/memory/evict",
                   json={"chunk_hashes": hashes, "locations": ["cpu"]})
    assert r.json()["num_evicted"] == 3
    disk = _complete(w, ids, "tenant-a", salt="salt-of-a")
    assert disk["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"] == {"disk": 768}
    text = w.metrics()
    assert metric_sum(text, CACHED, tier="cpu", tenant="tenant-a") == 768
    assert metric_sum(text, CACHED, tier="disk", tenant="tenant-a") == 768
    assert metric_sum(text, PROMPT, tenant="tenant-a") == 2700
    # tenant B: its prompt counted once, nothing of A's reuse
    assert metric_sum(text, PROMPT, tenant="tenant-b") == 600
    assert {t: metric_sum(text, CACHED, tier=t, tenant="tenant-b")
            for t in ("cpu", "disk", "device", "remote")} == b_before == {
        "cpu": 0, "disk": 0, "device": 0, "remote": 0}

    # no tenant header (a proxy that only salts): a digest of the salt; past the cap (3
    # named): "other"
    _complete(w, b_ids, salt="salt-of-b")
    _complete(w, prompt(300, seed=183), "tenant-c")
    text = w.metrics()
    salted = tenant_name(None, "salt-of-b")
    assert metric_sum(text, PROMPT, tenant=salted) == 600
    assert metric_sum(text, CACHED, tier="cpu", tenant=salted) == 512
    assert metric_sum(text, PROMPT, tenant=OTHER_TENANT) == 300
    assert metric_sum(text, PROMPT, tenant="tenant-c") == 0
