"""The worker's Prometheus metrics, served by the API process at ``/metrics``.

Per-request figures come with each request's engine outputs; tier sizes with residency
messages; engine counters (transfers, corrupt chunks, ...) arrive as cumulative values in
stats messages and are turned into counter increments here.

Prompt-token reuse by tier and tenant (``ReuseMetrics``) is one contract for both engines:
``agentserving_worker_prompt_tokens{tenant}`` and
``agentserving_worker_cached_tokens{tier, tenant}``, tier one of ``device`` (the engine's own
KV pool: vLLM's prefix cache; the reference engine has none), ``cpu`` (LMCache DRAM), ``disk``
(LMCache local disk), ``remote`` (pulled from a prefill pod or a KV server). The pod is
the scrape target, so "per pod" is Prometheus's ``pod``/``instance`` label. The tenant label
is bounded (``TenantLabels``).
"""

from __future__ import annotations

import hashlib
import re
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from agentserving.core.schemas import TENANT_PATTERN

P = "agentserving_worker_"
REUSE_TIERS = ("device", "cpu", "disk", "remote")
NO_TENANT = "none"  # no tenant header and no cache_salt: a single-tenant fleet
OTHER_TENANT = "other"  # every tenant past the cap
DEFAULT_MAX_TENANTS = 64
_TENANT = re.compile(TENANT_PATTERN.strip("^$"))


def tenant_name(tenant: str | None, cache_salt: str | None) -> str:
    """A request's tenant as the metrics name it: the tenant the caller named
    (``TENANT_HEADER``), else ``salt-`` and 8 hex digits of the SHA-256 of its ``cache_salt``
    (the proxy salts each tenant apart; the digest tells tenants apart on a dashboard without
    revealing the salt, which would let anyone rebuild that tenant's chunk hashes), else
    ``NO_TENANT``. A tenant name that is not a valid one (``TENANT_PATTERN``) is ignored."""
    if tenant and _TENANT.fullmatch(tenant):
        return tenant
    if cache_salt:
        return "salt-" + hashlib.sha256(cache_salt.encode()).hexdigest()[:8]
    return NO_TENANT


class TenantLabels:
    """Bounded ``tenant`` label values: the first ``max_tenants`` distinct tenants seen keep
    their name, later ones are counted as ``OTHER_TENANT`` (one series set per tenant per
    tier, so a fleet with many tenants cannot blow up the scrape). Thread-safe."""

    def __init__(self, max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        self.max_tenants = max_tenants
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str | None, cache_salt: str | None = None) -> str:
        name = tenant_name(tenant, cache_salt)
        if name in self._seen or name in (NO_TENANT, OTHER_TENANT):
            return name
        with self._lock:
            if len(self._seen) >= self.max_tenants:
                return OTHER_TENANT
            self._seen.add(name)
            return name


class ReuseMetrics:
    """Prompt tokens and the tokens among them whose KV was reused, by tier and tenant."""

    def __init__(self, registry: CollectorRegistry | None,
                 max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        kw: dict[str, Any] = {} if registry is None else {"registry": registry}
        self.tenants = TenantLabels(max_tenants)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens received, by tenant.",
                                     ["tenant"], **kw)
        self.cached_tokens = Counter(
            P + "cached_tokens", "Prompt tokens whose KV was reused, by where it came from "
            "(device = the engine's own KV pool, cpu = LMCache DRAM, disk = LMCache disk, "
            "remote = pulled from a prefill pod or KV server) and tenant.",
            ["tier", "tenant"], **kw)

    def observe(self, tenant: str, prompt_tokens: int, by_tier: dict[str, int]) -> None:
        """One request's figures; ``tenant`` a label from ``self.tenants``."""
        if prompt_tokens:
            self.prompt_tokens.labels(tenant).inc(prompt_tokens)
        for tier, n in by_tier.items():
            if n:
                self.cached_tokens.labels(tier, tenant).inc(n)
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# engine counter name -> (metric attribute, label values)
_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "transfer_bytes_sent": ("transfer_bytes", ("sent",)),
    "transfer_bytes_received": ("transfer_bytes", ("received",)),
    "transfer_failures": ("transfer_failures", ()),
    "transfer_tokens_skipped": ("transfer_reused_tokens", ("prefill",)),
    "transfer_tokens_local": ("transfer_reused_tokens", ("decode",)),
    "handoffs_registered": ("handoffs", ("registered",)),
    "handoffs_claimed": ("handoffs", ("claimed",)),
    "handoffs_expired": ("handoffs", ("expired",)),
    "kv_corrupt_chunks": ("chunk_errors", ("corrupt",)),
    "kv_missing_chunks": ("chunk_errors", ("missing",)),
    "kv_disk_write_errors": ("chunk_errors", ("disk_write",)),
    "kv_prefetched_chunks": ("prefetched_chunks", ()),
    "kv_evicted_chunks": ("evicted_chunks", ()),
    "kv_stored_chunks": ("stored_chunks", ()),
}


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None,
                 max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter(P + "requests", "Requests by endpoint and outcome.",
                                ["endpoint", "outcome"], registry=r)
        self.reuse = ReuseMetrics(r, max_tenants)
        self.tenants = self.reuse.tenants
        self.prompt_tokens = self.reuse.prompt_tokens
        self.cached_tokens = self.reuse.cached_tokens
        self.computed_tokens = Counter(P + "computed_prompt_tokens",
                                       "Prompt tokens prefilled here.", registry=r)
        self.completion_tokens = Counter(P + "completion_tokens", "Tokens generated.",
                                         registry=r)
        self.ttft = Histogram(P + "ttft_seconds", "Time to first token (HTTP in to first "
                              "token out).", buckets=_LATENCY, registry=r)
        self.e2e = Histogram(P + "request_seconds", "Request latency, end to end.",
                             buckets=_LATENCY, registry=r)
        self.prefill_time = Histogram(P + "prefill_seconds", "Prefill compute per request.",
                                      buckets=_LATENCY, registry=r)
        self.kv_load_time = Histogram(P + "kv_load_seconds", "Reading a request's cached "
                                      "prefix from the KV tiers.", buckets=_LATENCY, registry=r)
        self.decode_time = Histogram(P + "decode_seconds", "Decode compute per request.",
                                     buckets=_LATENCY, registry=r)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "Decode time per token.",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
                              registry=r)
        self.queue = Gauge(P + "queue_length", "Requests in the engines, by state.", ["state"],
                           registry=r)
        self.kv_bytes = Gauge(P + "kv_bytes", "KV bytes held, by tier.", ["tier"], registry=r)
        self.kv_chunks = Gauge(P + "kv_chunks", "KV chunks held, by tier.", ["tier"],
                               registry=r)
        self.kv_capacity = Gauge(P + "kv_capacity_bytes", "KV capacity, by tier.", ["tier"],
                                 registry=r)
        self.transfer_bytes = Counter(P + "transfer_bytes", "P/D hand-off KV bytes.",
                                      ["direction"], registry=r)
        self.transfer_failures = Counter(P + "transfer_failures", "Hand-off pulls that failed "
                                         "(the prompt was recomputed).", registry=r)
        self.transfer_reused_tokens = Counter(
            P + "transfer_reused_tokens", "P/D: prompt tokens a decode pod already held (the "
            "session's previous turn) and so did not pull; side=prefill: not sent, "
            "side=decode: found locally.", ["side"], registry=r)
        self.handoffs = Counter(P + "handoffs", "Prefill-side hand-offs by outcome.",
                                ["outcome"], registry=r)
        self.chunk_errors = Counter(P + "kv_chunk_errors", "Disk chunks refused (checksum "
                                    "mismatch or missing file) and recomputed, or not "
                                    "written (kind=disk_write: a full disk, an I/O error).",
                                    ["kind"], registry=r)
        self.prefetched_chunks = Counter(P + "kv_prefetched_chunks", "Chunks loaded disk -> "
                                         "DRAM by /memory/prefetch.", registry=r)
        self.evicted_chunks = Counter(P + "kv_evicted_chunks", "Chunks removed by "
                                      "/memory/evict.", registry=r)
        self.stored_chunks = Counter(P + "kv_stored_chunks", "Chunks stored after prefill.",
                                     registry=r)
        self.kvindex_up = Gauge(P + "kvindex_up", "1 when the last kvindex call succeeded.",
                                registry=r)
        self.kvindex_batches = Counter(P + "kvindex_event_batches", "Residency event batches "
                                       "sent to the kvindex.", registry=r)
        self.kvindex_resyncs = Counter(P + "kvindex_resyncs", "Full residency snapshots sent.",
                                       registry=r)
        self.kvindex_errors = Counter(P + "kvindex_errors", "kvindex calls that failed.",
                                      registry=r)
        self._last: dict[tuple[int, str], float] = {}
        self._waiting: dict[int, int] = {}
        self._running: dict[int, int] = {}

    def observe_first(self, meta: dict[str, Any], tenant: str = NO_TENANT) -> None:
        """The first output of a request; ``tenant`` a label from ``self.tenants``."""
        self.reuse.observe(tenant, int(meta.get("prompt_tokens", 0)),
                           dict(meta.get("cached_tokens_by_tier") or {}))
        self.computed_tokens.inc(meta.get("prefill_tokens", 0))
        self.prefill_time.observe(meta.get("prefill_seconds", 0.0))
        self.kv_load_time.observe(meta.get("load_seconds", 0.0))

    def observe_finish(self, meta: dict[str, Any], e2e_s: float) -> None:
        n = int(meta.get("completion_tokens", 0))
        self.completion_tokens.inc(n)
        decode = float(meta.get("decode_seconds", 0.0))
        self.decode_time.observe(decode)
        if n > 1:
            self.tpot.observe(decode / (n - 1))
        self.e2e.observe(e2e_s)

    def engine_stats(self, engine: int, waiting: int, running: int,
                     counters: dict[str, float]) -> None:
        self._waiting[engine], self._running[engine] = waiting, running
        self.queue.labels("waiting").set(sum(self._waiting.values()))
        self.queue.labels("running").set(sum(self._running.values()))
        for name, value in counters.items():
            target = _COUNTERS.get(name)
            prev = self._last.get((engine, name), 0.0)
            self._last[(engine, name)] = value
            if target is None or value <= prev:
                continue
            metric = getattr(self, target[0])
            (metric.labels(*target[1]) if target[1] else metric).inc(value - prev)
