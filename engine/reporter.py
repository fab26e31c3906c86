"""What this pod holds, merged over its engine processes, and the kvindex kept told of it.

``ResidencyBook`` merges the engine processes' residency changes into the pod's view: a
chunk is on the pod's tier while at least one engine holds it there. It also answers which
engine holds the longest prefix of a request (the API process routes by it).

``KvindexReporter`` registers the pod, renews its lease, and sends the book's changes as
numbered ``EventBatch``es (``seq`` strictly increasing, one batch per flush). The kvindex is
a hint, never a dependency: when it is unreachable the worker keeps serving, drops the
changes it could not send, and once the kvindex answers again sends a full snapshot (``PUT
/v1/pods/{pod}/chunks``) instead. It also resyncs when the kvindex asks (``needs_resync`` on
a heartbeat or a batch: it saw a sequence gap) and re-registers when it no longer knows the
pod (a restarted in-memory kvindex). On shutdown it deregisters.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

from agentserving.core.clients import KvindexClient, NotFound, RequestRejected, ServiceUnavailable
from agentserving.core.logging import get_logger
from agentserving.core.schemas import (
    ChunkSnapshot,
    EventBatch,
    EventOp,
    PodRegistration,
    ResidencyEvent,
    Tier,
)

log = get_logger(__name__)

Change = tuple[EventOp, Tier, str]


class ResidencyBook:
    def __init__(self, chunk_bytes: int = 0) -> None:
        self.chunk_bytes = chunk_bytes
        self._holders: dict[Tier, dict[str, set[int]]] = defaultdict(dict)

    def apply(self, engine: int, stored: dict[str, list[str]],
              removed: dict[str, list[str]]) -> list[Change]:
        """Apply one engine's change; returns the pod-level changes it caused."""
        out: list[Change] = []
        for tier_name, hashes in removed.items():
            tier = Tier(tier_name)
            holders = self._holders[tier]
            for h in hashes:
                engines = holders.get(h)
                if engines is None or engine not in engines:
                    continue
                engines.discard(engine)
                if not engines:
                    del holders[h]
                    out.append((EventOp.REMOVED, tier, h))
        for tier_name, hashes in stored.items():
            tier = Tier(tier_name)
            holders = self._holders[tier]
            for h in hashes:
                engines = holders.setdefault(h, set())
                if not engines:
                    out.append((EventOp.STORED, tier, h))
                engines.add(engine)
        return out

    def snapshot(self) -> dict[Tier, list[str]]:
        return {tier: sorted(holders) for tier, holders in self._holders.items() if holders}

    def counts(self) -> dict[Tier, int]:
        return {tier: len(holders) for tier, holders in self._holders.items()}

    def bytes(self) -> dict[Tier, int]:
        return {tier: n * self.chunk_bytes for tier, n in self.counts().items()}

    def holds(self, tier: Tier, chunk: str) -> bool:
        return chunk in self._holders.get(tier, {})

    def tiers(self, chunk_hashes: Sequence[str]) -> list[Tier | None]:
        """Each chunk's fastest LMCache tier here (DRAM before disk), None when absent."""
        return [Tier.CPU if self.holds(Tier.CPU, h) else Tier.DISK
                if self.holds(Tier.DISK, h) else None for h in chunk_hashes]

    def best_engine(self, chunk_hashes: Sequence[str], engines: Sequence[int]) -> dict[int, int]:
        """Per engine: how many leading chunks of ``chunk_hashes`` it holds in some tier."""
        out = {}
        for engine in engines:
            n = 0
            for h in chunk_hashes:
                if not any(engine in holders.get(h, ()) for holders in self._holders.values()):
                    break
                n += 1
            out[engine] = n
        return out


def group_events(changes: Sequence[Change], chunk_bytes: int) -> list[ResidencyEvent]:
    """Consecutive changes with the same (op, tier) become one event, order kept."""
    events: list[ResidencyEvent] = []
    run: list[str] = []
    key: tuple[EventOp, Tier] | None = None
    for op, tier, h in changes:
        if key != (op, tier) and run:
            assert key is not None
            events.append(ResidencyEvent(op=key[0], tier=key[1], chunk_hashes=run,
                                         bytes=len(run) * chunk_bytes))
            run = []
        key = (op, tier)
        run.append(h)
    if run and key is not None:
        events.append(ResidencyEvent(op=key[0], tier=key[1], chunk_hashes=run,
                                     bytes=len(run) * chunk_bytes))
    return events


class KvindexReporter:
    def __init__(self, client: KvindexClient, registration: Callable[[], PodRegistration],
                 book: ResidencyBook, *, heartbeat_interval_s: float = 5.0,
                 flush_interval_s: float = 0.2, max_batch: int = 4096,
                 metrics: object | None = None) -> None:
        self.client = client
        self._registration = registration
        self.book = book
        self.heartbeat_interval_s = heartbeat_interval_s
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        self.metrics = metrics
        self.pod = registration().pod
        self.seq = -1
        self.registered = False
        self.needs_snapshot = True
        self.up = False
        self._pending: list[Change] = []
        self._last_heartbeat = 0.0
        self._backoff = 0.0
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    # -- input
    def on_changes(self, changes: Sequence[Change]) -> None:
        if changes:
            self._pending.extend(changes)
            if len(self._pending) >= self.max_batch:
                self._wake.set()

    # -- lifecycle
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvindex-reporter")

    async def close(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if deregister and self.registered:
            try:
                await asyncio.wait_for(self.client.deregister(self.pod), 2.0)
            except (ServiceUnavailable, RequestRejected, TimeoutError):
                pass
        await self.client.aclose()

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the reporter must never stop
                log.exception("kvindex_reporter_error")
            delay = max(self.flush_interval_s, self._backoff)
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except TimeoutError:
                pass
            self._wake.clear()

    # -- one round (tests call it directly)
    async def tick(self) -> None:
        for _attempt in range(2):
            try:
                await self._round()
                self._ok()
                return
            except NotFound:
                # the kvindex no longer knows this pod (restarted, or the lease lapsed):
                # register again right away; the snapshot that follows restores residency
                self.registered = False
                self.needs_snapshot = True
                self._pending.clear()
                self._error("unknown_pod")
            except (ServiceUnavailable, RequestRejected) as exc:
                # changes not delivered are covered by the snapshot sent once it answers
                self.needs_snapshot = True
                self._pending.clear()
                self._error(repr(exc))
                return

    async def _round(self) -> None:
        if not self.registered:
            info = await self.client.register(self._registration())
            self.registered = True
            self.seq = max(self.seq, info.seq)
            self.needs_snapshot = True
            self._last_heartbeat = time.monotonic()
            log.info("kvindex_registered", pod=self.pod, seq=info.seq)
        if time.monotonic() - self._last_heartbeat >= self.heartbeat_interval_s:
            lease = await self.client.heartbeat(self.pod)
            self._last_heartbeat = time.monotonic()
            if lease.needs_resync:
                self.needs_snapshot = True
        if self.needs_snapshot:
            await self._snapshot()
        while self._pending:
            await self._send_batch()

    async def _snapshot(self) -> None:
        self._pending.clear()  # the snapshot is taken now: it includes them
        snap = ChunkSnapshot(seq=self.seq + 1, chunks=self.book.snapshot(),
                             bytes=self.book.bytes())
        await self.client.snapshot(self.pod, snap)
        self.seq += 1
        self.needs_snapshot = False
        if self.metrics is not None:
            self.metrics.kvindex_resyncs.inc()  # type: ignore[attr-defined]
        log.info("kvindex_snapshot_sent", pod=self.pod, seq=self.seq,
                 chunks=sum(len(v) for v in snap.chunks.values()))

    async def _send_batch(self) -> None:
        batch = self._pending[: self.max_batch]
        events = group_events(batch, self.book.chunk_bytes)
        result = await self.client.events(EventBatch(pod=self.pod, seq=self.seq + 1,
                                                     events=events))
        self.seq += 1
        # only what was sent goes: changes that came in while the batch was in flight were
        # appended behind it and are the next batch (replacing the list dropped them for good)
        del self._pending[: len(batch)]
        if self.metrics is not None:
            self.metrics.kvindex_batches.inc()  # type: ignore[attr-defined]
        if result.needs_resync:
            self.needs_snapshot = True
            await self._snapshot()

    def _ok(self) -> None:
        self._backoff = 0.0
        if not self.up:
            log.info("kvindex_up", pod=self.pod)
        self.up = True
        if self.metrics is not None:
            self.metrics.kvindex_up.set(1)  # type: ignore[attr-defined]

    def _error(self, why: str) -> None:
        if self.up:
            log.warning("kvindex_down_serving_on", pod=self.pod, error=why)
        self.up = False
        self._backoff = min(max(self._backoff * 2, 0.5), 5.0)
        if self.metrics is not None:
            self.metrics.kvindex_up.set(0)  # type: ignore[attr-defined]
            self.metrics.kvindex_errors.inc()  # type: ignore[attr-defined]
