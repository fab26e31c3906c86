"""The worker's Prometheus metrics, served by the API process at ``/metrics``.

Per-request figures come with each request's engine outputs; tier sizes with residency
messages; engine counters (transfers, corrupt chunks, ...) arrive as cumulative values in
stats messages and are turned into counter increments here.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

P = "agentserving_worker_"
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
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter(P + "requests", "Requests by endpoint and outcome.",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens received.", registry=r)
        self.cached_tokens = Counter(
            P + "cached_tokens", "Prompt tokens whose KV was reused, by where it came from "
            "(cpu, disk, remote = pulled from a prefill pod).", ["tier"], registry=r)
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

    def observe_first(self, meta: dict[str, Any]) -> None:
        self.prompt_tokens.inc(meta.get("prompt_tokens", 0))
        for tier, n in (meta.get("cached_tokens_by_tier") or {}).items():
            self.cached_tokens.labels(tier).inc(n)
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
