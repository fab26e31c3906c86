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

Sizes count payload bytes only: the per-key overhead (the key, a few ints) is small beside a
KV chunk and is left out of the bound.

The store makes no I/O and knows nothing of LMCache's types: ``fmt``, ``dtype`` and ``shape``
are carried as the protocol layer gives them and handed back unchanged.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
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


class BlobStore:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be > 0")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._blobs: OrderedDict[str, Blob] = OrderedDict()  # least recently used first
        self._chunks: dict[str, set[str]] = {}
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
            chunks = sorted(self._chunks)
            page = chunks[offset:None if limit is None else offset + limit]
            return len(chunks), [
                ChunkEntry(c, sorted(self._chunks[c]),
                           sum(self._blobs[k].length for k in self._chunks[c]))
                for c in page]

    # ------------------------------------------------------------ writes

    def put(self, blob: Blob) -> PutResult:
        if blob.length > self.capacity_bytes:
            return PutResult(stored=False)
        with self._lock:
            self._remove(blob.key)
            evicted_keys = evicted_bytes = 0
            while self._used + blob.length > self.capacity_bytes:
                oldest = next(iter(self._blobs))
                evicted_bytes += self._remove(oldest)
                evicted_keys += 1
            self._blobs[blob.key] = blob
            self._chunks.setdefault(blob.chunk, set()).add(blob.key)
            self._used += blob.length
            return PutResult(True, evicted_keys, evicted_bytes)

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

    def _remove(self, key: str) -> int:
        """Drop ``key`` (held lock); the bytes it freed (0 if absent)."""
        blob = self._blobs.pop(key, None)
        if blob is None:
            return 0
        held = self._chunks[blob.chunk]
        held.discard(key)
        if not held:
            del self._chunks[blob.chunk]
        self._used -= blob.length
        return blob.length
