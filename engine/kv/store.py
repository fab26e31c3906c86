"""The KV chunk store: LMCache 0.5.x's CPU-DRAM and local-disk tiers, with checksums.

Contract (what the engine and the memory API rely on):

- ``store(tokens, layers, skip_chunks)`` puts every *full* chunk of ``tokens`` past the first
  ``skip_chunks`` into LMCache (``LMCacheEngine.store``: the CPU tier at once, the disk tier
  by LMCache's asynchronous writer). Each chunk's bytes are fingerprinted as they are copied
  (``connector.digest``).
- ``lookup(ints)`` is the leading run of chunks present in some tier, each with the fastest
  tier holding it (CPU before disk), without reading anything.
- ``fetch_prefix(ints)`` reads and verifies that run and hands back the LMCache memory objects
  themselves (references held until ``release()``), so the engine can copy them into its
  paged cache layer by layer while the forward pass runs (``engine.kv.layerwise``);
  ``load_prefix(ints)`` copies them into fresh per-layer tensors at once. A chunk read from disk
  is served only if its bytes match the fingerprint taken at store time; a missing file, a
  short file or flipped bits end the prefix there, and the bad chunk is dropped from every
  tier (the engine recomputes it and stores it again). Verified disk chunks are written back
  to the CPU tier, as LMCache's own ``StorageManager.batched_get`` does — but only *after*
  verification, so a corrupt chunk never reaches DRAM. (LMCache alone would serve a missing
  or short file's stale buffer: ``LocalDiskBackend.read_file`` only logs.)
- ``prefetch(hashes)`` loads disk-only chunks into DRAM in the background and registers each
  in ``LocalCPUBackend``'s hot cache, so the next lookup hits DRAM without touching disk
  (seed 000 §5.1). Pins are taken only on the disk backend, for the chunks being read, and
  released only there (selective unpin, §5.2). A fetch of a chunk whose prefetch is still in
  flight (a late prefetch: the ShadowScheduler's N+1 guess came true sooner than the read)
  waits for that read, up to ``prefetch_wait_s``, instead of reading the same file a second
  time beside it; a prefetch still queued behind others (not reading yet), one that failed
  or one later than that leaves the chunk on disk, and the fetch reads and verifies it
  itself.
- ``evict(hashes, backends)`` removes chunks from the named backends (all when None);
  unknown hashes are reported as missing, never as errors.
- ``residency()`` is what each tier holds right now, read from LMCache's own indexes, so
  LMCache's LRU evictions show up too.
- A disk write that fails (ENOSPC on a full disk, EIO) costs that chunk its disk copy only:
  the DRAM copy stays, the half-written file is removed and the chunk is written by the next
  store that has it. (LMCache alone leaves the write "in flight" for ever — no later store of
  that chunk reaches the disk — plus the partial file, a reference on the DRAM buffer and the
  bytes counted as used: ``_guard_disk_writes``.)

Thread safety: the engine's step loop, the memory API's HTTP thread and the prefetch thread
call in concurrently; LMCache's backends lock their indexes and reference-count memory
objects, and the digest table has its own lock.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.core.logging import get_logger
from agentserving.core.schemas import TIER_BACKENDS, Tier
from agentserving.engine.kv.connector import CPUKVConnector, digest
from agentserving.engine.kv.keys import SALT_CONFIG_KEY, ChunkKeys, make_token_database
from agentserving.engine.kv.pins import ChunkPins, pin_bound
from agentserving.engine.kv.prefetches import PrefetchRegistry, PrefetchStatus, evict_chunks

log = get_logger(__name__)

CPU_BACKEND = TIER_BACKENDS[Tier.CPU]
DISK_BACKEND = TIER_BACKENDS[Tier.DISK]
BACKEND_TIERS = {name: tier for tier, name in TIER_BACKENDS.items()}

LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class KVStoreConfig:
    model_name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    chunk_size: int = DEFAULT_CHUNK_SIZE
    cpu_gib: float = 1.0
    disk_dir: Path | None = None
    disk_gib: float = 0.0
    verify_cpu: bool = False
    instance_id: str = "engine-0"
    prefetch_wait_s: float = 2.0  # longest a fetch waits for a chunk's in-flight prefetch
    direct_io: bool = False  # the disk tier bypasses the page cache (O_DIRECT)
    pin_share: float = 0.5  # of the DRAM tier's chunks, at most, pinned at once (kv.pins)


@dataclasses.dataclass
class LoadResult:
    layers: list[LayerKV] | None
    num_tokens: int
    tokens_by_tier: dict[Tier, int]
    corrupt: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


@dataclasses.dataclass
class FetchedPrefix:
    """Verified memory objects of a prefix, in chunk order; references held until
    ``release()`` (LMCache cannot free or reuse them meanwhile)."""

    objs: list[Any]
    num_tokens: int
    tokens_by_tier: dict[Tier, int]
    corrupt: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def release(self) -> None:
        objs, self.objs = self.objs, []
        for obj in objs:
            obj.ref_count_down()


@dataclasses.dataclass
class KVStoreStats:
    """Cumulative counters (the engine turns them into metrics)."""

    corrupt_chunks: int = 0
    missing_chunks: int = 0
    prefetched_chunks: int = 0
    evicted_chunks: int = 0
    stored_chunks: int = 0
    prefetch_waits: int = 0  # fetches that found one of their chunks' prefetch in flight
    prefetch_wait_seconds: float = 0.0
    prefetch_late: int = 0  # ... and stopped waiting for it (read the disk themselves)
    disk_write_errors: int = 0  # chunks whose disk write failed (full disk, I/O error)


SHORT_FILE = object()  # a disk chunk whose file is not the size written: corrupt


class KVStore:
    def __init__(self, config: KVStoreConfig, chunk_keys: ChunkKeys) -> None:
        from lmcache.v1.cache_engine import LMCacheEngine
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        self.config = config
        self.keys = chunk_keys
        self.chunk_size = config.chunk_size
        cfg: dict[str, Any] = {
            "chunk_size": config.chunk_size,
            "local_cpu": True,
            "max_local_cpu_size": config.cpu_gib,
            "save_unfull_chunk": False,
            "py_enable_gc": True,
            "lmcache_instance_id": config.instance_id,
        }
        if config.disk_dir is not None:
            config.disk_dir.mkdir(parents=True, exist_ok=True)
            cfg["local_disk"] = str(config.disk_dir)
            cfg["max_local_disk_size"] = config.disk_gib
            if config.direct_io:
                cfg["extra_config"] = {"use_odirect": True}
        self._lm_config = LMCacheEngineConfig.from_dict(cfg)
        self._metadata = LMCacheMetadata(
            model_name=config.model_name, world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=config.dtype,
            kv_shape=(config.num_layers, 2, config.chunk_size, config.num_kv_heads,
                      config.head_dim),
            chunk_size=config.chunk_size)
        self.connector = CPUKVConnector(config.num_layers, config.num_kv_heads, config.head_dim)
        token_db = make_token_database(chunk_keys, self._lm_config, self._metadata)
        self.engine = LMCacheEngine(self._lm_config, self._metadata, token_db, self.connector,
                                    lambda *a, **k: None, lambda *a, **k: None)
        self.engine.post_init()
        sm = self.engine.storage_manager
        assert sm is not None
        self.storage = sm
        self.cpu = sm.storage_backends[CPU_BACKEND]
        self.disk = sm.storage_backends.get(DISK_BACKEND)
        if self.disk is not None:
            self._guard_disk_writes()
        self.chunk_bytes = (2 * config.num_layers * config.chunk_size * config.num_kv_heads
                            * config.head_dim * torch.empty((), dtype=config.dtype).element_size())
        self._digests: dict[int, tuple[bytes, int]] = {}  # chunk int -> (digest, nbytes)
        self._digest_lock = threading.Lock()
        self._absent_once: set[int] = set()
        self._storing: set[int] = set()  # chunks inside a store() call right now
        self._prefetches = PrefetchRegistry("kv-prefetch")
        # chunk int -> [set when its prefetch's read ends, whether that read has started]
        self._inflight: dict[int, list[Any]] = {}
        self._inflight_lock = threading.Lock()
        self.stats = KVStoreStats()
        self.pins = ChunkPins(lambda: self.storage.storage_backends, self.keys.key_of,
                              pin_bound(self.capacity_bytes()[Tier.CPU], self.chunk_bytes,
                                        config.pin_share), name=f"{config.instance_id}-pins")

    def _guard_disk_writes(self) -> None:
        """Undo what a failed disk write leaves behind in LMCache's ``LocalDiskBackend``.

        Its writer (``async_save_bytes_to_disk``, run on its own event loop) raises out of
        ``write_file`` before any of its clean-up: the key stays in the in-flight put tasks
        (``submit_put_task`` then skips every later write of it), the memory object keeps the
        reference taken for the write, ``current_cache_size`` and ``usage`` keep its bytes,
        and the truncated file stays on the disk, in no index. Seen with the KV disk tier on
        a full filesystem (``python -m bench faults``, disk-full)."""
        disk = self.disk
        save = disk.async_save_bytes_to_disk

        def guarded(key: Any, memory_obj: Any, on_complete_callback: Any = None) -> None:
            try:
                save(key, memory_obj, on_complete_callback)
            except OSError as exc:
                self._disk_write_failed(key, memory_obj, exc)

        disk.async_save_bytes_to_disk = guarded

    def _disk_write_failed(self, key: Any, memory_obj: Any, exc: OSError) -> None:
        disk = self.disk
        with contextlib.suppress(OSError):
            os.remove(disk._key_to_path(key))
        size = memory_obj.get_physical_size()
        with disk.disk_lock:
            disk.current_cache_size -= size
            disk.usage -= len(memory_obj.byte_array)
            if key not in disk.dict:
                disk.cache_policy.update_on_force_evict(key)
        memory_obj.ref_count_down()
        disk.disk_worker.remove_put_task(key)
        self.stats.disk_write_errors += 1
        log.warning("kv_disk_write_failed", chunk=self.keys.wire_of(key), error=str(exc))

    @property
    def backends(self) -> list[str]:
        return list(self.storage.storage_backends)

    # ------------------------------------------------------------------ store
    def store(self, tokens: Sequence[int], layers: Sequence[LayerKV] | None,
              skip_chunks: int = 0, cache_salt: str | None = None, *,
              paged: Any = None) -> int:
        """Store the full chunks of ``tokens`` after the first ``skip_chunks`` from per-layer
        tensors (``layers``) or the engine's paged cache (``paged``, a ``PagedKV``); returns
        how many chunks were handed to LMCache."""
        size = self.chunk_size
        n_full = len(tokens) // size
        if n_full <= skip_chunks:
            return 0
        toks = torch.tensor(list(tokens[: n_full * size]), dtype=torch.long)
        mask = torch.ones(n_full * size, dtype=torch.bool)
        mask[: skip_chunks * size] = False
        ints = self.keys.int_hashes(toks, cache_salt)
        request_configs = {SALT_CONFIG_KEY: cache_salt} if cache_salt else None
        filled = 0

        def on_digest(start: int, d: bytes, nbytes: int) -> None:
            # recorded before LMCache publishes the chunk in any tier
            nonlocal filled
            filled += 1
            with self._digest_lock:
                self._digests[ints[start // size]] = (d, nbytes)

        with self._digest_lock:
            self._storing.update(ints[skip_chunks:])
        try:
            source = {"paged": paged} if paged is not None else {"layers": list(layers or [])}
            self.engine.store(toks, mask=mask, on_digest=on_digest,
                              request_configs=request_configs, **source)
        finally:
            with self._digest_lock:
                self._storing.difference_update(ints[skip_chunks:])
        self.stats.stored_chunks += filled
        return filled

    def expected_digest(self, value: int) -> tuple[bytes, int] | None:
        with self._digest_lock:
            return self._digests.get(value)

    # ------------------------------------------------------------------ lookup / load
    def tier_of(self, key: Any) -> Tier | None:
        if self.cpu.contains(key):
            return Tier.CPU
        if self.disk is not None and self.disk.contains(key):
            return Tier.DISK
        return None

    def lookup(self, ints: Sequence[int]) -> list[Tier]:
        """The leading run of chunks held in some tier, fastest tier per chunk."""
        out: list[Tier] = []
        for value in ints:
            tier = self.tier_of(self.keys.key(value))
            if tier is None:
                break
            out.append(tier)
        return out

    def load_prefix(self, ints: Sequence[int]) -> LoadResult:
        """Read the leading cached run of ``ints`` into new per-layer tensors, verified."""
        t0 = time.perf_counter()
        fetched = self.fetch_prefix(ints)
        result = LoadResult(None, fetched.num_tokens, fetched.tokens_by_tier,
                            fetched.corrupt, fetched.missing)
        try:
            if fetched.num_tokens:
                cfg, size, n = self.config, self.chunk_size, fetched.num_tokens
                layers = [(torch.empty(1, cfg.num_kv_heads, n, cfg.head_dim, dtype=cfg.dtype),
                           torch.empty(1, cfg.num_kv_heads, n, cfg.head_dim, dtype=cfg.dtype))
                          for _ in range(cfg.num_layers)]
                for i, obj in enumerate(fetched.objs):
                    self.connector.to_gpu(obj, i * size, (i + 1) * size, layers=layers)
                result.layers = layers
        finally:
            fetched.release()
        result.seconds = time.perf_counter() - t0
        return result

    def fetch_prefix(self, ints: Sequence[int], *, paged: Any = None) -> FetchedPrefix:
        """The leading cached run of ``ints`` as verified memory objects (see
        ``FetchedPrefix``). With ``paged`` (a ``PagedKV``), they are also copied into its
        blocks (all layers per chunk, one kernel launch) and released at once."""
        t0 = time.perf_counter()
        self._await_prefetches(ints)
        tiers = self.lookup(ints)
        n = len(tiers)
        result = FetchedPrefix([], 0, {})
        by_tier: dict[Tier, int] = collections.Counter()
        keys = self.keys.keys(ints[:n])
        i = 0
        try:
            while i < n:
                j = i
                while j < n and tiers[j] == tiers[i]:
                    j += 1
                ok = self._fetch_run(keys[i:j], tiers[i], result)
                by_tier[tiers[i]] += ok * self.chunk_size
                if ok < j - i:
                    break
                i = j
            result.num_tokens = len(result.objs) * self.chunk_size
            result.tokens_by_tier = dict(by_tier)
            if paged is not None:
                size = self.chunk_size
                for c, obj in enumerate(result.objs):
                    self.connector.to_gpu(obj, c * size, (c + 1) * size, paged=paged)
        finally:
            if paged is not None:
                result.release()
        result.seconds = time.perf_counter() - t0
        return result

    def _fetch_run(self, keys: list[Any], tier: Tier, result: FetchedPrefix) -> int:
        """Fetch a run of chunks from one tier into ``result.objs``; returns how many were
        good. Disk runs are read in batches that fit LMCache's DRAM pool (the read buffers
        come from it, and a read that cannot get a buffer would wait forever)."""
        step = len(keys) if tier is Tier.CPU else self._disk_batch
        good = 0
        for lo in range(0, len(keys), step):
            part = keys[lo: lo + step]
            ok = self._fetch_batch(part, tier, result)
            good += ok
            if ok < len(part):
                break
        return good

    @property
    def _disk_batch(self) -> int:
        return max(1, int(self.config.cpu_gib * 1024**3) // self.chunk_bytes // 4)

    def _fetch_batch(self, keys: list[Any], tier: Tier, result: FetchedPrefix) -> int:
        if tier is Tier.CPU:
            objs = [self.cpu.get_blocking(k) for k in keys]
        else:
            objs = self._disk_read(keys)
        verified: list[tuple[Any, Any]] = []
        try:
            for key, obj in zip(keys, objs, strict=True):
                wire = self.keys.wire_of(key)
                if obj is SHORT_FILE:
                    result.corrupt.append(wire)
                    self.stats.corrupt_chunks += 1
                    self._drop_bad(key)
                    log.warning("kv_chunk_corrupt", chunk=wire, tier=tier.value, why="size")
                    break
                if obj is None:
                    if tier is Tier.DISK:  # listed, but the file could not be read
                        result.missing.append(wire)
                        self.stats.missing_chunks += 1
                        self._drop_bad(key)
                        log.warning("kv_chunk_missing", chunk=wire, tier=tier.value)
                    break
                if tier is Tier.DISK or self.config.verify_cpu:
                    verdict = self._verify(key, obj)
                    if verdict is not True:
                        if verdict is False:
                            result.corrupt.append(wire)
                            self.stats.corrupt_chunks += 1
                            self._drop_bad(key)
                            log.warning("kv_chunk_corrupt", chunk=wire, tier=tier.value)
                        break
                verified.append((key, obj))
            if tier is Tier.DISK and verified:
                # LMCache's write-back to DRAM, after verification.
                self.cpu.batched_submit_put_task([k for k, _ in verified],
                                                 [o for _, o in verified])
        finally:
            kept = {id(o) for _, o in verified}
            for obj in objs:
                if obj is not None and obj is not SHORT_FILE and id(obj) not in kept:
                    obj.ref_count_down()
        result.objs += [o for _, o in verified]
        return len(verified)

    def _disk_read(self, keys: list[Any]) -> list[Any]:
        """LMCache's disk read of ``keys``, aligned with them: a memory object, ``None`` for a
        missing file, or ``SHORT_FILE`` for a file whose size is not the size written (LMCache
        would leave stale bytes in the read buffer for the part it could not read)."""
        assert self.disk is not None
        out: list[Any] = [None] * len(keys)
        todo: list[int] = []
        for i, key in enumerate(keys):
            state = self._file_state(key)
            if state == "ok":
                todo.append(i)
            elif state == "short":
                out[i] = SHORT_FILE
        read = [keys[i] for i in todo]
        if len(read) > 1:
            objs = list(self.disk.batched_get_blocking(read))
        elif read:
            try:  # LMCache's single-key path raises instead of returning None
                objs = [self.disk.get_blocking(read[0])]
            except (KeyError, AssertionError, OSError):
                objs = [None]
        else:
            objs = []
        for i, obj in zip(todo, objs, strict=True):
            out[i] = obj
        return out

    def _file_state(self, key: Any) -> str:
        expected = self.expected_digest(key.chunk_hash)
        with self.disk.disk_lock:
            meta = self.disk.dict.get(key)
        if meta is None:
            return "missing"
        try:
            size = os.path.getsize(meta.path)
        except OSError:
            return "missing"
        return "short" if expected is not None and size != expected[1] else "ok"

    def _verify(self, key: Any, obj: Any) -> bool | None:
        """True: matches; False: corrupt; None: no fingerprint yet (a store in flight)."""
        expected = self.expected_digest(key.chunk_hash)
        if expected is None:
            return None
        return digest(obj.byte_array) == expected[0]

    def _remove(self, name: str, key: Any) -> bool:
        backend = self.storage.storage_backends[name]
        if backend is self.disk:
            with self.disk.disk_lock:
                meta = self.disk.dict.get(key)
            if meta is not None and not os.path.exists(meta.path):
                # LMCache's remove() deletes the file and fails half-way if it is gone:
                # give it one to delete, so its own bookkeeping stays whole.
                open(meta.path, "wb").close()
        try:
            return bool(backend.remove(key))
        except OSError:
            return True
        finally:
            self.pins.forget(key, name)

    def _drop_bad(self, key: Any) -> None:
        """Remove a corrupt or unreadable chunk from every tier (it is recomputed later)."""
        for name in self.storage.storage_backends:
            self._remove(name, key)
        with self._digest_lock:
            self._digests.pop(key.chunk_hash, None)

    # ------------------------------------------------------------------ evict
    def resolve_locations(self, locations: Iterable[str] | None) -> list[str]:
        """Backend names for the memory API's ``locations`` (backend or tier names)."""
        if locations is None:
            return self.backends
        out = []
        for loc in locations:
            name = TIER_BACKENDS.get(Tier(loc)) if loc in Tier._value2member_map_ else loc
            if name not in self.storage.storage_backends:
                raise KeyError(loc)
            out.append(name)
        return out

    def evict(self, wire_hashes: Sequence[str], backends: Sequence[str]) -> tuple[list[str],
                                                                                 list[str]]:
        """Remove chunks from ``backends``; returns (evicted, missing) wire hashes."""
        evicted, missing = evict_chunks(wire_hashes, backends, self.keys.key_of, self._remove,
                                        on_removed=self._forget_digest)
        self.stats.evicted_chunks += len(evicted)
        return evicted, missing

    def _forget_digest(self, key: Any) -> None:
        if self.tier_of(key) is None:
            with self._digest_lock:
                self._digests.pop(key.chunk_hash, None)

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, wire_hashes: Sequence[str], lookup_id: str | None) -> PrefetchStatus:
        """Start loading the disk-only chunks among ``wire_hashes`` into DRAM; returns at once."""
        status = self._prefetches.start(wire_hashes, lookup_id, self.keys.key_of, self.tier_of,
                                        self._prefetch_run, on_queued=self._mark_inflight)
        if status.state == "failed":  # never queued (closing): nothing will end its reads
            self._end_inflight(k for w in wire_hashes if (k := self.keys.key_of(w)) is not None)
        return status

    def prefetch_status(self, lookup_id: str) -> PrefetchStatus | None:
        return self._prefetches.get(lookup_id)

    def after_prefetches(self, fn: Callable[[], None]) -> bool:
        return self._prefetches.after_loads(fn)

    def _mark_inflight(self, keys: list[Any]) -> None:
        with self._inflight_lock:
            for key in keys:
                self._inflight.setdefault(key.chunk_hash, [threading.Event(), False])

    def _start_inflight(self, keys: Iterable[Any]) -> None:
        with self._inflight_lock:
            for key in keys:
                entry = self._inflight.get(key.chunk_hash)
                if entry is not None:
                    entry[1] = True

    def _end_inflight(self, keys: Iterable[Any]) -> None:
        with self._inflight_lock:
            entries = [self._inflight.pop(k.chunk_hash, None) for k in keys]
        for entry in entries:
            if entry is not None:
                entry[0].set()

    def _await_prefetches(self, ints: Sequence[int]) -> None:
        """Wait (bounded) for the prefetch reads already under way of any of ``ints``'
        chunks: they land in DRAM, where the lookup that follows finds them. A prefetch still
        queued is not waited for: reading the chunk here is sooner (and that prefetch then
        finds it in DRAM and skips it)."""
        with self._inflight_lock:
            if not self._inflight:
                return
            events = [e[0] for v in ints if (e := self._inflight.get(v)) is not None and e[1]]
        if not events:
            return
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.config.prefetch_wait_s
        late = False
        for ev in events:
            if not ev.wait(max(0.0, deadline - time.monotonic())):
                late = True
                break
        self.stats.prefetch_waits += 1
        self.stats.prefetch_late += late
        self.stats.prefetch_wait_seconds += time.perf_counter() - t0

    def _prefetch_run(self, status: PrefetchStatus, keys: list[Any]) -> None:
        assert self.disk is not None
        # a chunk another prefetch (or a fetch's write-back) brought to DRAM meanwhile is
        # not read again
        todo = [k for k in keys if not self.cpu.contains(k)]
        skipped = len(keys) - len(todo)
        status.loaded += skipped  # in DRAM: what the prefetch was for
        pinned = [k for k in todo if self.disk.pin(k)]  # pins only where the data is read
        reading = set(pinned)
        self._end_inflight(k for k in keys if k not in reading)
        try:
            for lo in range(0, len(pinned), self._disk_batch):
                batch = pinned[lo: lo + self._disk_batch]
                self._start_inflight(batch)
                try:
                    self._prefetch_batch(status, batch)
                finally:
                    self._end_inflight(batch)
            self.stats.prefetched_chunks += status.loaded - skipped
            status.state = "done"
        except Exception as exc:  # noqa: BLE001 - reported through the status endpoint
            status.state, status.error = "failed", repr(exc)
            log.exception("prefetch_failed", lookup_id=status.lookup_id)
        finally:
            for key in pinned:  # selective unpin: only the backend that took the pin
                self.disk.unpin(key)
            self._end_inflight(keys)
            status.finished_at = time.time()

    def _prefetch_batch(self, status: PrefetchStatus, pinned: list[Any]) -> None:
        if pinned:
            objs = self._disk_read(pinned)
            for key, obj in zip(pinned, objs, strict=True):
                if obj is None or obj is SHORT_FILE:
                    if obj is None:
                        self.stats.missing_chunks += 1
                    else:
                        status.corrupt += 1
                        self.stats.corrupt_chunks += 1
                    self._drop_bad(key)
                    continue
                try:
                    verdict = self._verify(key, obj)
                    if verdict:
                        # hot-cache registration: the next lookup finds it in DRAM
                        self.cpu.submit_put_task(key, obj)
                        status.loaded += 1
                    elif verdict is False:
                        status.corrupt += 1
                        self.stats.corrupt_chunks += 1
                        self._drop_bad(key)
                        log.warning("kv_chunk_corrupt", chunk=self.keys.wire_of(key),
                                    tier="disk", during="prefetch")
                finally:
                    if obj.is_pinned:
                        obj.unpin()
                    obj.ref_count_down()

    # ------------------------------------------------------------------ residency
    def residency(self) -> dict[Tier, set[int]]:
        with self.cpu.cpu_lock:
            cpu = {k.chunk_hash for k in self.cpu.hot_cache}
        out = {Tier.CPU: cpu}
        if self.disk is not None:
            with self.disk.disk_lock:
                out[Tier.DISK] = {k.chunk_hash for k in self.disk.dict}
        return out

    def forget_digests(self, resident: set[int]) -> None:
        """Drop fingerprints of chunks no tier holds any more (LMCache's own evictions).

        A chunk being stored (fingerprinted, not yet put) or being written to disk (in no
        index yet) is kept; so is one absent from a single scan only."""
        keep = set(resident)
        with self._digest_lock:
            keep |= self._storing
        if self.disk is not None:
            with self.disk.disk_worker.put_lock:
                keep |= {k.chunk_hash for k in self.disk.disk_worker.put_tasks}
        with self._digest_lock:
            absent = {v for v in self._digests if v not in keep}
            for value in absent & self._absent_once:
                del self._digests[value]
            self._absent_once = absent

    def trim_lmcache_bookkeeping(self, resident: set[int]) -> None:
        """Drop what LMCache remembers, for statistics only, of chunks and requests gone.

        LMCache keeps a first-seen time for every chunk hash it ever stored (up to 12.5 M per
        tier: its chunk-lifespan statistic) and every store and retrieve request's stats until
        a stats logger drains them. This engine runs no such logger (its metrics are its own),
        so over a soak both grew with every turn. First-seen times are kept for resident chunks
        only; the request stats are drained."""
        from lmcache.observability import LMCStatsMonitor

        LMCStatsMonitor.GetOrCreate().get_stats_and_clear()
        for backend in (self.cpu, self.disk):
            seen = getattr(getattr(backend, "cache_policy", None),
                           "chunk_hash_to_init_timestamp", None)
            if isinstance(seen, dict):
                for value in list(seen):  # a C-level copy: LMCache's threads may insert
                    if value not in resident:
                        seen.pop(value, None)

    def capacity_bytes(self) -> dict[Tier, int]:
        out = {Tier.CPU: int(self.config.cpu_gib * 1024**3)}
        if self.disk is not None:
            out[Tier.DISK] = int(self.config.disk_gib * 1024**3)
        return out

    def disk_path(self, wire: str) -> str | None:
        """Where a chunk's file lies (tests and debugging)."""
        key = self.keys.key_of(wire)
        if self.disk is None or key is None:
            return None
        with self.disk.disk_lock:
            meta = self.disk.dict.get(key)
        return meta.path if meta is not None else None

    def wait_disk_writes(self, timeout_s: float = 10.0) -> bool:
        """Block until LMCache's asynchronous disk writer is idle (tests, benchmarks)."""
        if self.disk is None:
            return True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            worker = self.disk.disk_worker
            if not getattr(worker, "put_tasks", None):
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self._prefetches.close()
        self.pins.close()
        done = threading.Event()

        def _close() -> None:
            try:
                self.engine.close()
            finally:
                done.set()

        threading.Thread(target=_close, daemon=True, name="lmcache-close").start()
        if not done.wait(10):
            log.warning("lmcache_close_timeout")


def disk_file_size(path: str) -> int:
    return os.path.getsize(path)
