"""The memory API's backend over an LMCache engine's storage manager (a vLLM worker process).

``LMCacheStorageBackend`` implements ``engine.memory_api.MemoryBackend`` on the
``StorageManager`` that LMCache builds inside each vLLM worker (TP rank), so the very same HTTP
code as the reference engine serves ``/memory/prefetch``, ``/memory/evict`` and
``/memory/chunks`` here (seed 000 §4, §5):

- keys: a wire hash is LMCache's int (``int(hex, 16)``); the ``CacheEngineKey`` is rebuilt by
  the engine's own token database (``_make_key_by_hash``: this rank's model, world size,
  worker id and dtype), i.e. seed 000's ``_hashes_to_keys``.
- prefetch: disk-only chunks are pinned on the disk backend only, read, and put into
  ``LocalCPUBackend``'s hot cache (§5.1), then unpinned on that backend only (selective
  unpin, §5.2) and the read buffer's own pin is dropped (§5.3). Runs in one background thread;
  ``prefetch`` answers at once. Chunks already in DRAM are counted, unknown ones are missing.
- evict: ``backend.remove(key)`` on the named backends (all when none are named).
- residency: read from the backends' own indexes, so LMCache's LRU evictions show up.

Unlike the reference ``KVStore`` there is no fingerprint check of disk reads: the bytes were
written by LMCache's own worker and are served by LMCache as it would serve them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from agentserving.core.hashing import is_chunk_hash
from agentserving.core.logging import get_logger
from agentserving.core.schemas import TIER_BACKENDS, Tier
from agentserving.engine.kv.pins import ChunkPins, pin_bound
from agentserving.engine.kv.prefetches import PrefetchRegistry, PrefetchStatus, evict_chunks
from agentserving.engine.memory_api import backend_names

from .hashes import wire_hash

log = get_logger(__name__)

CPU_BACKEND = TIER_BACKENDS[Tier.CPU]
DISK_BACKEND = TIER_BACKENDS[Tier.DISK]


REMOTE_BACKEND = "RemoteBackend"


def flush_remote_puts(storage_manager: Any, barrier_key: Any, timeout_s: float) -> bool:
    """Block until the KV server (LMCache's remote) holds every chunk this process handed it
    (True), or ``timeout_s`` passes (False). LMCache writes to its remote asynchronously, and a
    finished write only means the bytes were sent; a prefill pod flushes here so that its
    answer means "the KV is on the server" (its own, or the central one), and the decode pod
    asked next loads all of it instead of
    racing the writes (a shorter hit, or a load that fails and vLLM recomputes). The barrier is
    one ``exists`` round trip on the same connection: the server answers it only after the
    writes sent before it."""
    backend = (getattr(storage_manager, "storage_backends", None) or {}).get(REMOTE_BACKEND)
    if backend is None:
        return True
    pending = getattr(backend, "put_tasks", None) or set()
    deadline = time.monotonic() + timeout_s
    while pending:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    connection = getattr(backend, "connection", None)
    if connection is not None and hasattr(connection, "exists_sync"):
        connection.exists_sync(barrier_key)
    return True


class LMCacheKeys:
    """Wire hash <-> ``CacheEngineKey`` for one LMCache engine (one TP rank)."""

    def __init__(self, token_database: Any, metadata: Any) -> None:
        self.token_database = token_database
        self.metadata = metadata

    def key(self, value: int) -> Any:
        make = getattr(self.token_database, "_make_key_by_hash", None)
        if make is not None:
            return make(value)
        from lmcache.utils import CacheEngineKey

        md = self.metadata
        return CacheEngineKey(md.model_name, md.world_size, md.worker_id, value, md.kv_dtype)

    def key_of(self, wire: str) -> Any | None:
        return self.key(int(wire, 16)) if is_chunk_hash(wire) else None

    @staticmethod
    def wire_of_int(value: int) -> str:
        return wire_hash(value)


def chunk_bytes_of(metadata: Any) -> int:
    """Bytes of one full chunk on this rank (0 when the metadata does not say)."""
    import torch

    shape = getattr(metadata, "kv_shape", None)
    dtype = getattr(metadata, "kv_dtype", None)
    if not shape or dtype is None:
        return 0
    n = 1
    for dim in shape:
        n *= int(dim)
    return n * torch.empty((), dtype=dtype).element_size()


class LMCacheStorageBackend:
    def __init__(self, storage_manager: Any, token_database: Any, metadata: Any,
                 cpu_bytes: int = 0, pin_share: float = 0.5) -> None:
        self.storage = storage_manager
        self.keys = LMCacheKeys(token_database, metadata)
        self.chunk_bytes = chunk_bytes_of(metadata)
        self._prefetches = PrefetchRegistry("lmcache-prefetch")
        self.pins = ChunkPins(lambda: self.storage.storage_backends, self.keys.key_of,
                              pin_bound(cpu_bytes, self.chunk_bytes, pin_share),
                              name="lmcache-pins")

    @property
    def backends(self) -> list[str]:
        return list(self.storage.storage_backends)

    @property
    def cpu(self) -> Any | None:
        return self.storage.storage_backends.get(CPU_BACKEND)

    @property
    def disk(self) -> Any | None:
        return self.storage.storage_backends.get(DISK_BACKEND)

    def tier_of(self, key: Any) -> Tier | None:
        if self.cpu is not None and self.cpu.contains(key):
            return Tier.CPU
        if self.disk is not None and self.disk.contains(key):
            return Tier.DISK
        return None

    # -------------------------------------------------------------- evict
    def resolve_locations(self, locations: Sequence[str] | None) -> list[str]:
        return backend_names(locations, self.backends)

    def evict(self, wire_hashes: Sequence[str],
              backends: Sequence[str]) -> tuple[list[str], list[str]]:
        return evict_chunks(wire_hashes, backends, self.keys.key_of, self._remove)

    def _remove(self, name: str, key: Any) -> bool:
        try:
            return bool(self.storage.storage_backends[name].remove(key))
        except OSError:  # the disk file was already gone: the entry is
            return True
        finally:
            self.pins.forget(key, name)

    # -------------------------------------------------------------- prefetch
    def prefetch(self, wire_hashes: Sequence[str], lookup_id: str | None) -> PrefetchStatus:
        load = self._prefetch_run if self.cpu is not None else None
        return self._prefetches.start(wire_hashes, lookup_id, self.keys.key_of, self.tier_of,
                                      load)

    def prefetch_status(self, lookup_id: str) -> PrefetchStatus | None:
        return self._prefetches.get(lookup_id)

    def after_prefetches(self, fn: Callable[[], None]) -> bool:
        return self._prefetches.after_loads(fn)

    def _prefetch_run(self, status: PrefetchStatus, keys: list[Any]) -> None:
        disk, cpu = self.disk, self.cpu
        assert disk is not None and cpu is not None
        pinned = [k for k in keys if disk.pin(k)]  # pin where the data is read, only there
        try:
            for key in pinned:
                obj = disk.get_blocking(key)
                if obj is None:  # gone between lookup and read (evicted, unreadable)
                    continue
                try:
                    cpu.submit_put_task(key, obj)  # hot-cache registration
                    status.loaded += 1
                finally:
                    if obj.is_pinned:  # the disk read pins its fresh buffer (§5.3)
                        obj.unpin()
                    obj.ref_count_down()
            status.state = "done"
        except Exception as exc:  # noqa: BLE001 - reported through the status endpoint
            status.state, status.error = "failed", repr(exc)
            log.exception("prefetch_failed", lookup_id=status.lookup_id)
        finally:
            for key in pinned:  # selective unpin: the backend that took the pin
                disk.unpin(key)
            status.finished_at = time.time()

    # -------------------------------------------------------------- residency
    def residency(self) -> dict[Tier, set[int]]:
        out: dict[Tier, set[int]] = {}
        if self.cpu is not None:
            out[Tier.CPU] = {k.chunk_hash for k in self.cpu.get_keys()}
        disk = self.disk
        if disk is not None:
            with disk.disk_lock:
                out[Tier.DISK] = {k.chunk_hash for k in disk.dict}
        return out

    def close(self) -> None:
        self._prefetches.close()
        self.pins.close()
