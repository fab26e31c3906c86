"""A thread-safe, byte-bounded LRU of the blobs LMCache's clients PUT, keyed by their
``CacheEngineKey`` string and grouped by chunk hash.

Contract:

- ``used_bytes <= capacity_bytes`` at every moment a caller can observe: a put evicts the
  least recently used blobs until the new one fits, before it is stored.
- A blob larger than the whole bound is refused (counted, never stored) and evicts nothing.
- A put under a key already held replaces it (not an eviction); ``get`` makes a key the most
  recently used, ``contains`` does not (an existence probe is no use of the bytes).
- A blob's bytes are immutable (``bytes``): a reader holding one while it is evicted keeps a
  consistent copy, so a GET reply or an export stream never sees a half-replaced blob.
- Pins: a chunk pinned with a TTL (the pods' ``POST /memory/pin``, fanned out here for the KV
  a session handed through this server) is passed over by the LRU while the pinned chunks'
  bytes are within ``pin_share`` of the bound; past it, the least recently used pinned ones
  are evicted as any other. When only pinned blobs are left to make room, they go too, oldest
  first: a pin never refuses the KV of a turn being served. A pin lapses at its TTL (checked
  when it matters, no thread), on ``unpin``, or when its chunk leaves the store.

Sizes count payload bytes only: the per-key overhead (the key, a few ints) is small beside a
KV chunk and is left out of the bound.

The store makes no I/O and knows nothing of LMCache's types: ``fmt``, ``dtype`` and ``shape``
are carried as the protocol layer gives them and handed back unchanged.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Blob:
    """One stored value: what a GET reply carries (metadata, then ``data``)."""

    key: str
    chunk: str  # the chunk hash's wire form (core.schemas.ChunkHash)
    fmt: Any
    dtype: Any
    shape: Any
    data: bytes = field(repr=False)

    @property
    def length(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class PutResult:
    stored: bool  # False: larger than the whole bound, refused
    evicted_keys: int = 0  # LRU evictions this put made room with
    evicted_bytes: int = 0


@dataclass(frozen=True)
class EvictResult:
    keys: list[str]
    freed_bytes: int
    chunks: list[str]  # the requested chunks that held at least one key
    missing: list[str]  # the requested chunks that held none


@dataclass(frozen=True)
class ChunkEntry:
    chunk: str
    keys: list[str]
    bytes: int
    pinned: bool = False


@dataclass(frozen=True)
class PinResult:
    pinned: int = 0  # newly pinned
    extended: int = 0  # already pinned: TTL extended
    missing: int = 0  # not held here


@dataclass(frozen=True)
class HeldByPin:
    """Chunks and bytes held, by pin state."""

    pinned_chunks: int
    pinned_bytes: int
    unpinned_chunks: int
    unpinned_bytes: int


class BlobStore:
    def __init__(self, capacity_bytes: int, pin_share: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be > 0")
        if not 0 <= pin_share <= 1:
            raise ValueError("pin_share must be within [0, 1]")
        self.capacity_bytes = capacity_bytes
        self.pin_share = pin_share
        self._clock = clock
        self._lock = threading.Lock()
        self._blobs: OrderedDict[str, Blob] = OrderedDict()  # least recently used first
        self._chunks: dict[str, set[str]] = {}
        self._pins: dict[str, float] = {}  # chunk -> until (clock)
        self._used = 0

    # ------------------------------------------------------------ reads

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._blobs)

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    def get(self, key: str) -> Blob | None:
        with self._lock:
            blob = self._blobs.get(key)
            if blob is not None:
                self._blobs.move_to_end(key)
            return blob

    def contains(self, key: str) -> bool:
        return key in self._blobs

    def has_chunk(self, chunk: str) -> bool:
        return chunk in self._chunks

    def keys_of(self, chunks: Iterable[str]) -> list[str]:
        """Every key held for these chunks, in the order the chunks are given."""
        with self._lock:
            return [k for c in dict.fromkeys(chunks) for k in sorted(self._chunks.get(c, ()))]

    def blobs_of(self, chunks: Iterable[str]) -> list[Blob]:
        """The blobs of these chunks as they are now (an export's snapshot; LRU untouched)."""
        with self._lock:
            return [self._blobs[k] for c in dict.fromkeys(chunks)
                    for k in sorted(self._chunks.get(c, ()))]

    def lru_keys(self) -> list[str]:
        """Keys from least to most recently used: the order eviction takes them."""
        with self._lock:
            return list(self._blobs)

    def listing(self, offset: int = 0, limit: int | None = None) -> tuple[int, list[ChunkEntry]]:
        """(number of chunks held, one page of them sorted by chunk hash)."""
        with self._lock:
            self._expire()
            chunks = sorted(self._chunks)
            page = chunks[offset:None if limit is None else offset + limit]
            return len(chunks), [
                ChunkEntry(c, sorted(self._chunks[c]), self._chunk_bytes(c), c in self._pins)
                for c in page]

    def held_by_pin(self) -> HeldByPin:
        with self._lock:
            self._expire()
            pinned_bytes = sum(self._chunk_bytes(c) for c in self._pins)
            return HeldByPin(len(self._pins), pinned_bytes, len(self._chunks) - len(self._pins),
                             self._used - pinned_bytes)

    def pinned(self, chunk: str) -> bool:
        with self._lock:
            self._expire()
            return chunk in self._pins

    # ------------------------------------------------------------ writes

    def put(self, blob: Blob) -> PutResult:
        if blob.length > self.capacity_bytes:
            return PutResult(stored=False)
        with self._lock:
            self._remove(blob.key)
            evicted_keys = evicted_bytes = 0
            need = self._used + blob.length - self.capacity_bytes
            for victim in self._victims(need) if need > 0 else ():
                evicted_bytes += self._remove(victim)
                evicted_keys += 1
            self._blobs[blob.key] = blob
            self._chunks.setdefault(blob.chunk, set()).add(blob.key)
            self._used += blob.length
            return PutResult(True, evicted_keys, evicted_bytes)

    def pin(self, chunks: Iterable[str], ttl_s: float) -> PinResult:
        """Keep these chunks from the LRU for ``ttl_s`` (within the pin share); pinning again
        extends (the later expiry wins). Only chunks held here can be pinned."""
        pinned = extended = missing = 0
        with self._lock:
            self._expire()
            until = self._clock() + ttl_s
            for chunk in dict.fromkeys(chunks):
                if chunk not in self._chunks:
                    missing += 1
                elif chunk in self._pins:
                    self._pins[chunk] = max(self._pins[chunk], until)
                    extended += 1
                else:
                    self._pins[chunk] = until
                    pinned += 1
        return PinResult(pinned, extended, missing)

    def unpin(self, chunks: Iterable[str]) -> int:
        """Give these chunks' pins back (they stay, evictable again): how many were pinned."""
        with self._lock:
            self._expire()
            return sum(self._pins.pop(c, None) is not None for c in dict.fromkeys(chunks))

    def evict_chunks(self, chunks: Iterable[str]) -> EvictResult:
        keys: list[str] = []
        freed = 0
        hit: list[str] = []
        missing: list[str] = []
        with self._lock:
            for chunk in dict.fromkeys(chunks):
                held = sorted(self._chunks.get(chunk, ()))
                (hit if held else missing).append(chunk)
                for key in held:
                    freed += self._remove(key)
                    keys.append(key)
        return EvictResult(keys, freed, hit, missing)

    # ------------------------------------------------------------ inside the lock

    def _victims(self, need: int) -> list[str]:
        """Keys whose removal frees ``need`` bytes, least recently used first, passing over
        the pinned ones while the pinned bytes are within the pin share; pinned ones last."""
        self._expire()
        if not self._pins:
            victims, freed = [], 0
            for key, blob in self._blobs.items():
                if freed >= need:
                    break
                victims.append(key)
                freed += blob.length
            return victims
        pinned_bytes = sum(self._chunk_bytes(c) for c in self._pins)
        protected = self.pin_share * self.capacity_bytes
        victims, spared, freed = [], [], 0
        for key, blob in self._blobs.items():
            if freed >= need:
                return victims
            if blob.chunk in self._pins:
                if pinned_bytes <= protected:
                    spared.append(key)
                    continue
                pinned_bytes -= blob.length
            victims.append(key)
            freed += blob.length
        for key in spared:  # only pinned blobs left to make room: pins give way
            if freed >= need:
                break
            victims.append(key)
            freed += self._blobs[key].length
        return victims

    def _expire(self) -> None:
        now = self._clock()
        for chunk in [c for c, until in self._pins.items() if until <= now]:
            del self._pins[chunk]

    def _chunk_bytes(self, chunk: str) -> int:
        return sum(self._blobs[k].length for k in self._chunks.get(chunk, ()))

    def _remove(self, key: str) -> int:
        """Drop ``key`` (held lock); the bytes it freed (0 if absent)."""
        blob = self._blobs.pop(key, None)
        if blob is None:
            return 0
        held = self._chunks[blob.chunk]
        held.discard(key)
        if not held:
            del self._chunks[blob.chunk]
            self._pins.pop(blob.chunk, None)
        self._used -= blob.length
        return blob.length
