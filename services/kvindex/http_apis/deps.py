"""What the routers share: the service state on ``app.state.kv`` and error mapping."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import httpx
from fastapi import Request
from prometheus_client import CollectorRegistry, Counter, Histogram

from agentserving.core.service import ApiError
from agentserving.kvindex.index.base import (
    BackendUnavailable,
    Index,
    SessionExists,
    SessionStore,
    UnknownPod,
    UnknownSession,
)
from agentserving.kvindex.index.changes import ChangeFeed
from agentserving.kvindex.settings import KvindexSettings

T = TypeVar("T")


class ServiceMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.chunk_events = Counter("kvindex_chunk_events_total",
                                    "Chunk residency events applied.", ["source"],
                                    registry=registry)
        self.batches = Counter("kvindex_event_batches_total", "Event batches received.",
                               ["result"], registry=registry)
        self.lookups = Counter("kvindex_lookups_total", "Prefix lookups.", ["result"],
                               registry=registry)
        self.lookup_prefix = Histogram("kvindex_lookup_best_prefix_chunks",
                                       "Best pod's prefix length per lookup.",
                                       buckets=(0, 1, 4, 16, 64, 256, 1024, 4096),
                                       registry=registry)
        self.fanout = Counter("kvindex_fanout_calls_total", "Memory API calls to pods.",
                              ["op", "ok"], registry=registry)
        self.reclaimed_chunks = Counter(
            "kvindex_reclaimed_chunks_total",
            "Chunks pods accepted to drop for a session's lifecycle, by reason (close: the "
            "session closed; context_change: its new turn left them) and tier (as the index "
            "had them).", ["reason", "tier"], registry=registry)
        self.reclaimed_bytes = Counter(
            "kvindex_reclaimed_bytes_total",
            "Bytes of those chunks, by each pod's reported bytes per chunk in the tier.",
            ["reason", "tier"], registry=registry)
        self.stored_responses = Counter(
            "kvindex_stored_responses_total",
            "Stored-response calls, by op (put, get, delete) and result (ok; not_found; "
            "too_large: over --max-stored-response-bytes).", ["op", "result"],
            registry=registry)
        self.unavailable = Counter("kvindex_backend_unavailable_total",
                                   "Requests answered 503 because the store was down.",
                                   registry=registry)


@dataclass
class KvindexState:
    settings: KvindexSettings
    index: Index
    sessions: SessionStore
    http: httpx.AsyncClient
    registry: CollectorRegistry
    metrics: ServiceMetrics
    feed: ChangeFeed


def state(request: Request) -> KvindexState:
    return request.app.state.kv


async def guarded(st: KvindexState, op: Awaitable[T]) -> T:
    """Await a store call, mapping its errors to HTTP answers."""
    try:
        return await op
    except BackendUnavailable as exc:
        st.metrics.unavailable.inc()
        raise ApiError(503, f"kvindex store unavailable: {exc}", type="service_unavailable",
                       code="store_unavailable", headers={"Retry-After": "1"}) from exc
    except UnknownPod as exc:
        raise ApiError(404, str(exc), param="pod", type="not_found_error") from exc
    except UnknownSession as exc:
        raise ApiError(404, str(exc), param="session_id", type="not_found_error") from exc
    except SessionExists as exc:
        raise ApiError(409, str(exc), param="child", type="conflict_error") from exc
