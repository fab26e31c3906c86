"""The KV server's Prometheus metrics, on the app's own registry (``GET /metrics``).

The store's size is read at scrape time (gauges with a function), so nothing has to keep a
copy of it up to date; everything else is counted where it happens.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from agentserving.engine.kvserver.store import BlobStore, PutResult

PREFIX = "agentserving_kvserver"
EVICTION_REASONS = ("lru", "evict", "refused")
COMMANDS = ("PUT", "GET", "EXIST", "LIST", "HEALTH")


class KvServerMetrics:
    def __init__(self, registry: CollectorRegistry, store: BlobStore) -> None:
        gauges = (
            ("stored_bytes", "Payload bytes held.", lambda: store.used_bytes),
            ("capacity_bytes", "The byte bound (--max-gib).", lambda: store.capacity_bytes),
            ("keys", "LMCache keys held.", lambda: len(store)),
            ("chunks", "Chunk hashes held (a chunk may hold several keys).",
             lambda: store.num_chunks),
        )
        for name, doc, read in gauges:
            Gauge(f"{PREFIX}_{name}", doc, registry=registry).set_function(read)
        by_pin = {"chunks": Gauge(f"{PREFIX}_chunks_by_pin", "Chunk hashes held, by pin state.",
                                  ["pinned"], registry=registry),
                  "bytes": Gauge(f"{PREFIX}_bytes_by_pin", "Payload bytes held, by pin state.",
                                 ["pinned"], registry=registry)}
        for state in ("true", "false"):
            for what, gauge in by_pin.items():
                field = f"{'pinned' if state == 'true' else 'unpinned'}_{what}"
                gauge.labels(state).set_function(
                    lambda field=field: getattr(store.held_by_pin(), field))
        self.pins = Counter(f"{PREFIX}_pins_total", "Pin requests per chunk by outcome "
                            "(pinned, extended, missing: not held here), and unpins.",
                            ["outcome"], registry=registry)
        self.commands = Counter(f"{PREFIX}_commands_total",
                                "LMCache protocol commands answered.", ["command"],
                                registry=registry)
        self.hits = Counter(f"{PREFIX}_hits_total", "GET/EXIST commands that found the key.",
                            ["command"], registry=registry)
        self.misses = Counter(f"{PREFIX}_misses_total",
                              "GET/EXIST commands that did not find the key.", ["command"],
                              registry=registry)
        self.received_bytes = Counter(f"{PREFIX}_put_bytes_total", "Payload bytes PUT.",
                                      registry=registry)
        self.sent_bytes = Counter(f"{PREFIX}_get_bytes_total", "Payload bytes sent by GETs.",
                                  registry=registry)
        self.protocol_errors = Counter(
            f"{PREFIX}_protocol_errors_total",
            "Connections closed on a header that is no LMCache command.", registry=registry)
        self.connections = Gauge(f"{PREFIX}_connections", "Open LMCache protocol connections.",
                                 registry=registry)
        self.evictions = Counter(
            f"{PREFIX}_evictions_total",
            "Keys dropped: lru (room for a PUT), evict (POST /memory/evict), refused (a PUT "
            "larger than the whole bound, never stored).", ["reason"], registry=registry)
        self.evicted_bytes = Counter(f"{PREFIX}_evicted_bytes_total",
                                     "Payload bytes dropped, by the same reasons.", ["reason"],
                                     registry=registry)
        self.pull_bytes = Counter(f"{PREFIX}_pull_bytes_total",
                                  "Payload bytes pulled from peers (POST /v1/pull).",
                                  registry=registry)
        self.pull_keys = Counter(f"{PREFIX}_pull_keys_total", "Keys pulled from peers.",
                                 registry=registry)
        self.pull_seconds = Histogram(f"{PREFIX}_pull_seconds", "Duration of POST /v1/pull.",
                                      ["outcome"], registry=registry)
        self.export_bytes = Counter(f"{PREFIX}_export_bytes_total",
                                    "Payload bytes served to peers (POST /v1/export).",
                                    registry=registry)
        for command in COMMANDS:
            self.commands.labels(command)
        for reason in EVICTION_REASONS:
            self.evictions.labels(reason)
            self.evicted_bytes.labels(reason)
        for command in ("GET", "EXIST"):
            self.hits.labels(command)
            self.misses.labels(command)

    def evicted(self, reason: str, keys: int, nbytes: int) -> None:
        if keys:
            self.evictions.labels(reason).inc(keys)
            self.evicted_bytes.labels(reason).inc(nbytes)

    def put(self, result: PutResult, nbytes: int) -> None:
        """Count one store put of ``nbytes``: its LRU evictions, or its refusal."""
        if result.stored:
            self.evicted("lru", result.evicted_keys, result.evicted_bytes)
        else:
            self.evicted("refused", 1, nbytes)
