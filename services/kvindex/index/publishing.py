"""Wraps any Index so that every residency change it applies also goes to the change feed.

Wrapping the index, not the HTTP routes, catches every source of change alike: REST event
batches and snapshots, the vLLM and LMCache ingest, registrations and the lease reaper.
Publishing is best effort: the index's write stands even when the feed's append fails (the
caller's request succeeded; followers recover by listing again), and the failure is counted.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter

from agentserving.core.logging import get_logger
from agentserving.core.schemas import (
    ChangeKind,
    ChunkSnapshot,
    EventBatch,
    EventBatchResult,
    LeaseInfo,
    PodInfo,
    PodRegistration,
    ResidencyChange,
)
from agentserving.kvindex.index.base import BackendUnavailable
from agentserving.kvindex.index.changes import ChangeFeed

log = get_logger(__name__)


class FeedMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.published = Counter("kvindex_residency_changes_published_total",
                                 "Residency changes appended to the change feed, by kind.",
                                 ["kind"], registry=registry)
        self.failed = Counter("kvindex_residency_changes_unpublished_total",
                              "Residency changes applied but missing from the feed (its "
                              "append failed; followers list again).", registry=registry)


class Publishing:
    """``Index`` whose writes are published to ``feed``; reads pass through."""

    def __init__(self, inner: Any, feed: ChangeFeed, metrics: FeedMetrics) -> None:
        self._inner = inner
        self._feed = feed
        self._metrics = metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def _publish(self, *changes: ResidencyChange) -> None:
        try:
            await self._feed.append(list(changes))
        except BackendUnavailable as exc:
            self._metrics.failed.inc(len(changes))
            log.warning("residency_change_unpublished", error=str(exc),
                        kinds=[c.kind.value for c in changes])
            return
        for change in changes:
            self._metrics.published.labels(change.kind.value).inc()

    async def register_pod(self, reg: PodRegistration, ttl_s: float) -> PodInfo:
        info = await self._inner.register_pod(reg, ttl_s)
        pod = ResidencyChange(kind=ChangeKind.POD, pod=reg.pod, registration=reg)
        if info.chunks:  # a live pod re-registering keeps its residency
            await self._publish(pod)
        else:  # a new (or lapsed and re-created) pod holds nothing yet
            await self._publish(ResidencyChange(kind=ChangeKind.GONE, pod=reg.pod), pod)
        return info

    async def deregister(self, pod: str) -> bool:
        gone = await self._inner.deregister(pod)
        if gone:
            await self._publish(ResidencyChange(kind=ChangeKind.GONE, pod=pod))
        return gone

    async def expire_leases(self) -> list[str]:
        gone = await self._inner.expire_leases()
        if gone:
            await self._publish(*(ResidencyChange(kind=ChangeKind.GONE, pod=p) for p in gone))
        return gone

    async def apply_events(self, batch: EventBatch) -> EventBatchResult:
        result = await self._inner.apply_events(batch)
        if result.applied and batch.events:
            await self._publish(ResidencyChange(kind=ChangeKind.EVENTS, pod=batch.pod,
                                                events=batch.events))
        return result

    async def replace_chunks(self, pod: str, snapshot: ChunkSnapshot) -> LeaseInfo:
        lease = await self._inner.replace_chunks(pod, snapshot)
        await self._publish(ResidencyChange(kind=ChangeKind.SNAPSHOT, pod=pod,
                                            snapshot=snapshot))
        return lease
