"""What every memory-API backend shares: sorting a prefetch's chunks by tier, the bounded
registry of prefetch statuses behind ``GET /memory/prefetch/{id}``, and eviction by wire hash.

The reference engine's ``KVStore`` and the vLLM connector's ``LMCacheStorageBackend`` both act on
an LMCache storage manager; they differ only in how a chunk is read from disk and removed, so
those are the callables passed in here, and the bookkeeping exists once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from agentserving.core.schemas import Tier

KeyOf = Callable[[str], Any]  # wire hash -> the backend's key, None when not a chunk hash
TierOf = Callable[[Any], Tier | None]


@dataclasses.dataclass
class PrefetchStatus:
    lookup_id: str
    requested: int
    in_cpu: int
    to_load: int
    missing: int
    state: str = "running"  # running | done | failed
    loaded: int = 0
    corrupt: int = 0
    error: str | None = None
    started_at: float = dataclasses.field(default_factory=time.time)
    finished_at: float | None = None


def sort_for_prefetch(wire_hashes: Sequence[str], key_of: KeyOf, tier_of: TierOf
                      ) -> tuple[list[Any], int, int]:
    """(disk-only keys to load, chunks already in DRAM, chunks nowhere)."""
    to_load, in_cpu, missing = [], 0, 0
    for wire in wire_hashes:
        key = key_of(wire)
        tier = tier_of(key) if key is not None else None
        if tier is Tier.CPU:
            in_cpu += 1
        elif tier is Tier.DISK:
            to_load.append(key)
        else:
            missing += 1
    return to_load, in_cpu, missing


class PrefetchRegistry:
    """The last ``keep`` prefetches by lookup id, loaded one at a time on a background thread
    (disk bandwidth is the limit; parallel reads would only interleave them)."""

    def __init__(self, thread_name: str, keep: int = 1024) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name)
        self._statuses: collections.OrderedDict[str, PrefetchStatus] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._keep = keep

    def start(self, wire_hashes: Sequence[str], lookup_id: str | None, key_of: KeyOf,
              tier_of: TierOf, load: Callable[[PrefetchStatus, list[Any]], None] | None,
              on_queued: Callable[[list[Any]], None] | None = None) -> PrefetchStatus:
        """Record the prefetch and hand its disk-only keys to ``load`` (None: nothing can be
        loaded, e.g. no DRAM tier); returns at once. ``on_queued(keys)`` runs before that, on
        the caller's thread, so a reader arriving right after this returns already sees the
        keys as in flight."""
        to_load, in_cpu, missing = sort_for_prefetch(wire_hashes, key_of, tier_of)
        status = PrefetchStatus(lookup_id or f"prefetch-{uuid.uuid4().hex[:12]}",
                                len(wire_hashes), in_cpu, len(to_load), missing)
        with self._lock:
            self._statuses[status.lookup_id] = status
            while len(self._statuses) > self._keep:
                self._statuses.popitem(last=False)
        if to_load and load is not None:
            if on_queued is not None:
                on_queued(to_load)
            try:
                self._pool.submit(load, status, to_load)
            except RuntimeError as exc:  # shut down: the status says so, nothing runs
                status.state, status.error, status.finished_at = "failed", repr(exc), time.time()
        else:
            status.state, status.finished_at = "done", time.time()
        return status

    def get(self, lookup_id: str) -> PrefetchStatus | None:
        with self._lock:
            return self._statuses.get(lookup_id)

    def after_loads(self, fn: Callable[[], None]) -> bool:
        """``fn()`` once every load queued so far has ended (the loads run one at a time, in
        order, so it queues behind them); False (never run) once the registry is closed."""
        try:
            self._pool.submit(fn)
        except RuntimeError:  # shut down: nothing more runs
            return False
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def evict_chunks(wire_hashes: Sequence[str], backends: Sequence[str], key_of: KeyOf,
                 remove: Callable[[str, Any], bool],
                 on_removed: Callable[[Any], None] | None = None
                 ) -> tuple[list[str], list[str]]:
    """Remove each chunk from ``backends``; (evicted, missing) wire hashes."""
    evicted, missing = [], []
    for wire in wire_hashes:
        key = key_of(wire)
        removed = False
        if key is not None:
            for name in backends:
                removed = remove(name, key) or removed
        if removed:
            evicted.append(wire)
            if on_removed is not None:
                on_removed(key)
        else:
            missing.append(wire)
    return evicted, missing
