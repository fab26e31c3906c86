"""Pins with a TTL on an LMCache storage manager's tiers, which LMCache's own eviction honours.

A session pinned through a tool call must keep its KV on the pod, not only in the kvindex's
eyes: LMCache's CPU and disk backends make room by their own LRU, and they skip an object only
while it is pinned (``can_evict``). ``ChunkPins`` takes one LMCache pin per chunk and backend
holding it, and gives it back when the pin lapses (its TTL), on ``unpin`` (a release, a close),
or never when the chunk left the tier by a forced remove (an evict: LMCache drops an object's
pins with it, so the book only forgets it).

Bounded: at most ``max_chunks`` chunks pinned at once (a share of the DRAM tier), so pins can
never leave LMCache without room for the KV of the turns being served; a pin past the bound is
refused and counted, never forced. Pinning a chunk again extends its TTL (the latest expiry
wins) and adds the backends that came to hold it since (a prefetch brought it to DRAM).

Used by both memory-API backends (the reference engine's ``KVStore`` and vLLM's
``LMCacheStorageBackend``), exercised on LMCache 0.5.6's ``LocalCPUBackend`` and
``LocalDiskBackend``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge

from agentserving.engine.kv.prefetches import KeyOf

PINNED = Gauge("agentserving_kv_pinned_chunks",
               "Chunks this engine process holds pinned in its LMCache tiers now.")
PINS = Counter("agentserving_kv_pins_total",
               "Pin requests per chunk by outcome (pinned, extended, missing, refused: past "
               "the bound), and pins given back (expired, unpinned).", ["outcome"])


@dataclasses.dataclass
class PinOutcome:
    pinned: int = 0  # newly pinned
    extended: int = 0  # already pinned: TTL extended
    missing: int = 0  # in no tier of this process
    refused: int = 0  # past the bound


@dataclasses.dataclass
class _Held:
    until: float
    backends: set[str]


class ChunkPins:
    def __init__(self, backends: Callable[[], Mapping[str, Any]], key_of: KeyOf,
                 max_chunks: int, clock: Callable[[], float] = time.monotonic,
                 name: str = "kv-pins") -> None:
        self._backends = backends
        self._key_of = key_of
        self.max_chunks = max(0, int(max_chunks))
        self._clock = clock
        self._held: dict[Any, _Held] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._expire_loop, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ verbs
    def pin(self, wire_hashes: Iterable[str], ttl_s: float) -> PinOutcome:
        out = PinOutcome()
        with self._cond:
            until = self._clock() + ttl_s
            for wire in wire_hashes:
                key = self._key_of(wire)
                if key is None:
                    out.missing += 1
                    continue
                held = self._held.get(key)
                if held is None and len(self._held) >= self.max_chunks:
                    if self._holding(key):
                        out.refused += 1
                    else:
                        out.missing += 1
                    continue
                took = self._pin_backends(key, held.backends if held else set())
                if held is None and not took:
                    out.missing += 1
                    continue
                if held is None:
                    self._held[key] = _Held(until, took)
                    out.pinned += 1
                else:
                    held.until = max(held.until, until)
                    held.backends |= took
                    out.extended += 1
            self._cond.notify()
        self._count(out)
        PINNED.set(len(self._held))
        return out

    def unpin(self, wire_hashes: Iterable[str]) -> int:
        with self._cond:
            released = sum(self._release(key) for key in map(self._key_of, wire_hashes)
                           if key is not None)
        PINS.labels("unpinned").inc(released)
        PINNED.set(len(self._held))
        return released

    def forget(self, key: Any, backend: str) -> None:
        """``key`` left ``backend`` by a forced remove, which dropped its pins there."""
        with self._cond:
            held = self._held.get(key)
            if held is not None:
                held.backends.discard(backend)
                if not held.backends:
                    del self._held[key]
        PINNED.set(len(self._held))

    def expire(self) -> int:
        with self._cond:
            now = self._clock()
            due = [k for k, h in self._held.items() if h.until <= now]
            released = sum(self._release(k) for k in due)
        PINS.labels("expired").inc(released)
        PINNED.set(len(self._held))
        return released

    def pinned(self, wire: str) -> bool:
        with self._cond:
            return self._key_of(wire) in self._held

    def __len__(self) -> int:
        return len(self._held)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    # ------------------------------------------------------------------ inside the lock
    def _holding(self, key: Any) -> bool:
        return any(b.contains(key) for b in self._backends().values())

    def _pin_backends(self, key: Any, already: set[str]) -> set[str]:
        took = set()
        for name, backend in self._backends().items():
            if name not in already and backend.pin(key):
                took.add(name)
        return took

    def _release(self, key: Any) -> int:
        held = self._held.pop(key, None)
        if held is None:
            return 0
        backends = self._backends()
        for name in held.backends:
            if name in backends:
                backends[name].unpin(key)
        return 1

    def _expire_loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                nxt = min((h.until for h in self._held.values()), default=None)
                wait = None if nxt is None else max(0.0, nxt - self._clock())
                if wait is None or wait > 0:
                    self._cond.wait(timeout=None if wait is None else min(wait, 60.0))
                    continue
            self.expire()

    @staticmethod
    def _count(out: PinOutcome) -> None:
        for field in dataclasses.fields(out):
            n = getattr(out, field.name)
            if n:
                PINS.labels(field.name).inc(n)


def pin_bound(cpu_bytes: int, chunk_bytes: int, share: float) -> int:
    """How many chunks pins may hold: ``share`` of the DRAM tier's chunks (at least one)."""
    if chunk_bytes <= 0 or cpu_bytes <= 0 or share <= 0:
        return 0
    return max(1, int(share * cpu_bytes // chunk_bytes))
