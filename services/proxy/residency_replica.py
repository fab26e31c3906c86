"""The kvindex's residency, replicated in the proxy, so a kv-aware turn is routed without a
kvindex round trip (llm-d's precise router keeps its index in-process the same way).

``ResidencyView`` is the state and the lookup, pure: each pod's role and (chunk -> tier mask)
map, loaded from the kvindex's listing and moved by its change feed
(``kvindex/index/changes.py``), counted with the kvindex's own rules (``prefix_of``,
``answer_lookup``), so a replica that is caught up answers what the kvindex would.

``ResidencyReplica`` follows the feed: list, then long-poll the changes after the listing's
cursor; list again when the cursor expired (410), when a change names a pod it does not know
(a registration it missed), when the kvindex was unreachable, and every ``resync_s`` (a change
the kvindex applied but failed to publish is not lost for longer than that). It answers only
while fresh: when its last answer from the kvindex is older than ``max_lag_s``, ``lookup``
returns None and the proxy asks the kvindex itself, as it did before it had a replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from agentserving.core.clients import KvindexClient, RequestRejected, ServiceUnavailable
from agentserving.core.logging import get_logger
from agentserving.core.residency import TIER_BITS, answer_lookup, prefix_of, role_matches
from agentserving.core.schemas import (
    TIERS_FASTEST_FIRST,
    ChangeKind,
    EventOp,
    LookupRequest,
    LookupResponse,
    PodRole,
    ResidencyChange,
    ResidencyEvent,
    ResidencyListing,
    Tier,
)

log = get_logger(__name__)

_ALL_TIERS = sum(TIER_BITS.values())


def _masks(chunks: dict[Tier, list[str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for tier in TIERS_FASTEST_FIRST:
        bit = TIER_BITS[tier]
        for chunk in chunks.get(tier, ()):
            out[chunk] = out.get(chunk, 0) | bit
    return out


class ResidencyView:
    """What every live pod holds, as the kvindex's listing and changes said."""

    def __init__(self) -> None:
        self.roles: dict[str, PodRole] = {}
        self.chunks: dict[str, dict[str, int]] = {}

    def load(self, listing: ResidencyListing) -> None:
        self.roles = {p.info.pod: p.info.role for p in listing.pods}
        self.chunks = {p.info.pod: _masks(p.chunks) for p in listing.pods}

    def apply(self, change: ResidencyChange) -> bool:
        """Apply one change; False when it names a pod this view does not know (it missed
        that pod's registration: list again)."""
        pod = change.pod
        if change.kind is ChangeKind.GONE:
            self.roles.pop(pod, None)
            self.chunks.pop(pod, None)
            return True
        if change.kind is ChangeKind.POD:
            assert change.registration is not None
            self.roles[pod] = change.registration.role
            self.chunks.setdefault(pod, {})
            return True
        held = self.chunks.get(pod)
        if held is None:
            return False
        if change.kind is ChangeKind.SNAPSHOT:
            assert change.snapshot is not None
            self.chunks[pod] = _masks(change.snapshot.chunks)
        else:
            for event in change.events or ():
                _apply_event(held, event)
        return True

    def lookup(self, req: LookupRequest) -> LookupResponse:
        wanted = None if req.pods is None else set(req.pods)
        prefixes = []
        for pod, held in self.chunks.items():
            if wanted is not None and pod not in wanted:
                continue
            if not role_matches(self.roles[pod], req.role):
                continue
            found = prefix_of(held.get(h, 0) for h in req.chunk_hashes)
            if found is not None:
                found.pod = pod
                prefixes.append(found)
        return answer_lookup(len(req.chunk_hashes), prefixes)

    def num_chunks(self) -> int:
        return sum(len(held) for held in self.chunks.values())


def _apply_event(held: dict[str, int], event: ResidencyEvent) -> None:
    if event.op is EventOp.CLEARED:
        bits = TIER_BITS[event.tier] if event.tier else _ALL_TIERS
        for chunk, mask in list(held.items()):
            _set(held, chunk, mask & ~bits)
        return
    assert event.tier is not None
    bit = TIER_BITS[event.tier]
    for chunk in event.chunk_hashes:
        mask = held.get(chunk, 0)
        _set(held, chunk, mask | bit if event.op is EventOp.STORED else mask & ~bit)


def _set(held: dict[str, int], chunk: str, mask: int) -> None:
    if mask:
        held[chunk] = mask
    else:
        held.pop(chunk, None)


class ReplicaMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.lists = Counter("proxy_residency_replica_lists_total",
                             "Full listings the replica loaded, by why.", ["reason"],
                             registry=registry)
        self.changes = Counter("proxy_residency_replica_changes_total",
                               "Residency changes the replica applied.", registry=registry)
        self.lag = Gauge("proxy_residency_replica_staleness_seconds",
                         "Seconds since the replica last heard from the kvindex (set at "
                         "each scrape).", registry=registry)
        self.chunks = Gauge("proxy_residency_replica_chunks",
                            "(pod, chunk) residencies the replica holds.", registry=registry)


class ResidencyReplica:
    WAIT_S = 2.0  # each long poll's wait: the replica hears from the kvindex at least this often

    def __init__(self, client: KvindexClient, metrics: ReplicaMetrics, *,
                 wait_s: float = WAIT_S,
                 max_lag_s: float = 5.0, resync_s: float = 60.0, retry_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.view = ResidencyView()
        self.client = client
        self._metrics = metrics
        self._wait_s = wait_s
        self._max_lag_s = max_lag_s
        self._resync_s = resync_s
        self._retry_s = retry_s
        self._clock = clock
        self._heard_at: float | None = None  # the kvindex's last answer (None: never listed)
        metrics.lag.set_function(self.staleness)

    def staleness(self) -> float:
        return float("inf") if self._heard_at is None else self._clock() - self._heard_at

    def fresh(self) -> bool:
        return self.staleness() <= self._max_lag_s

    def lookup(self, req: LookupRequest) -> LookupResponse | None:
        """The replica's answer, or None when it is too stale to trust."""
        if not self.fresh():
            return None
        return self.view.lookup(req)

    async def run_forever(self) -> None:
        reason = "start"
        while True:
            try:
                reason = await self._follow(reason)
            except asyncio.CancelledError:
                raise
            except (ServiceUnavailable, RequestRejected) as exc:
                expired = isinstance(exc, RequestRejected) and exc.status_code == 410
                if not expired:
                    log.warning("residency_replica_kvindex_unreachable", error=str(exc))
                    await asyncio.sleep(self._retry_s)
                reason = "expired" if expired else "reconnect"

    async def _follow(self, reason: str) -> str:
        """List, then apply changes until a relist is due; returns the relist's reason."""
        listing = await self.client.residency()
        self.view.load(listing)
        self._heard(reason=reason)
        listed_at, cursor = self._clock(), listing.cursor
        while self._clock() - listed_at < self._resync_s:
            got = await self.client.residency_changes(cursor, self._wait_s)
            if not all(self.view.apply(change) for change in got.changes):
                return "unknown-pod"
            self._metrics.changes.inc(len(got.changes))
            cursor = got.cursor
            self._heard()
        return "resync"

    def _heard(self, reason: str | None = None) -> None:
        self._heard_at = self._clock()
        if reason is not None:
            self._metrics.lists.labels(reason).inc()
        self._metrics.chunks.set(self.view.num_chunks())


@contextlib.asynccontextmanager
async def following(replica: ResidencyReplica | None):  # type: ignore[no-untyped-def]
    """Run ``replica`` in the background for the duration (nothing when None)."""
    if replica is None:
        yield
        return
    task = asyncio.create_task(replica.run_forever())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
