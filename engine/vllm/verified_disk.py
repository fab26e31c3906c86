"""LMCache's local-disk tier, with every chunk checked before use.

LMCache 0.5.x's ``LocalDiskBackend`` trusts its files. A file gone from under it (a disk
cleaned, a volume remounted) is logged and its key dropped, but the memory object it was to
fill is handed on unfilled, or the metadata read after it raises; a truncated file fills part
of the object and the rest is whatever the buffer held; a file whose bytes changed is served
as it is. Each of these reaches vLLM's pages as KV that is not the prompt's, and the answer is
wrong without an error.

``install()`` wraps the backend's own two file operations:

- ``write_file`` records each chunk's size and checksum (blake3, 128 bits: the reference
  engine's ``engine.kv.connector.digest``) by path, the moment LMCache writes it;
- ``read_file`` checks the file's size before reading and the bytes' checksum after; a chunk
  that is missing, truncated, corrupt or unreadable is dropped from the tier (its key, its
  bytes' accounting, its file) and the read raises ``DiskChunkInvalid``.

LMCache's batched read (what a retrieve uses) already turns a raise into "not held" and gives
the buffer back; its single-key read (``load_bytes_from_disk``) is replaced by one that does
the same. Its asynchronous read (``batched_async_load_bytes_from_disk``, LMCache's async
loading, which the pods do not turn on) is left as it is. A retrieve then stops at the first
chunk it could not read, LMCache records the blocks it could not fill, and vLLM recomputes
them (``fallbacks``). A chunk written before this process started has no recorded checksum: its
size is still checked. ``remove`` forgets a chunk's record with its file, so the records
never outgrow the tier.

Exercised on LMCache's ``LocalDiskBackend`` in a real ``vllm serve`` (e2e/vllm/test_vllm_fleet.py:
a chunk deleted, truncated and corrupted under worker-0, each answered as a recompute) and on
its own (engine/vllm/tests/test_verified_disk.py).
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

from agentserving.core.logging import get_logger

from .fallbacks import fell_back

log = get_logger(__name__)


class DiskChunkInvalid(OSError):
    def __init__(self, path: str, cause: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.cause = cause


class ChunkRecords:
    """(size, checksum) per file path, as written."""

    def __init__(self) -> None:
        self._records: dict[str, tuple[int, bytes]] = {}
        self._lock = threading.Lock()

    def record(self, path: str, buffer: Any) -> None:
        from agentserving.engine.kv.connector import digest

        size, check = len(memoryview(buffer).cast("B")), digest(buffer)
        with self._lock:
            self._records[path] = (size, check)

    def expected(self, path: str) -> tuple[int, bytes] | None:
        with self._lock:
            return self._records.get(path)

    def forget(self, path: str) -> None:
        with self._lock:
            self._records.pop(path, None)

    def __len__(self) -> int:
        return len(self._records)


def check_read(records: ChunkRecords, path: str, buffer: Any, read: Any) -> None:
    """``read()`` fills ``buffer`` from ``path`` once its size is right; raises
    ``DiskChunkInvalid`` when the file is missing, its size is not the chunk's, the read fails
    or the bytes are not those written."""
    from agentserving.engine.kv.connector import digest

    want = len(memoryview(buffer).cast("B"))
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise DiskChunkInvalid(path, "disk_missing", "no such file") from None
    if size != want:
        raise DiskChunkInvalid(path, "disk_truncated", f"{size} bytes, expected {want}")
    try:
        read()
    except OSError as exc:
        raise DiskChunkInvalid(path, "disk_read_error", repr(exc)) from exc
    written = records.expected(path)
    if written is not None and written != (want, digest(buffer)):
        raise DiskChunkInvalid(path, "disk_corrupt", "checksum differs from the one written")


def _drop(backend: Any, key: Any, path: str) -> None:
    """Take an invalid chunk out of the tier: its key, its bytes' accounting, its file."""
    with backend.disk_lock:
        meta = backend.dict.pop(key, None)
        if meta is not None:
            backend.usage -= getattr(meta, "size", 0)
    try:
        os.remove(path)
    except OSError:
        pass


_WRAPPED = ("write_file", "read_file", "load_bytes_from_disk", "remove")


def install() -> None:
    """Wrap ``LocalDiskBackend``'s file reads and writes (once per process)."""
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend as Backend

    if getattr(Backend, "_agentserving_verified", False):
        return
    records = ChunkRecords()
    write_file, read_file = Backend.write_file, Backend.read_file
    load_bytes, remove = Backend.load_bytes_from_disk, Backend.remove

    @functools.wraps(write_file)
    def write_checked(self: Any, buffer: Any, path: str) -> Any:
        records.record(path, buffer)
        return write_file(self, buffer, path)

    @functools.wraps(read_file)
    def read_checked(self: Any, key: Any, buffer: Any, path: str) -> Any:
        try:
            check_read(records, path, buffer, lambda: read_file(self, key, buffer, path))
        except DiskChunkInvalid as exc:
            _drop(self, key, path)
            records.forget(path)
            fell_back(exc.cause, path=path, error=str(exc))
            raise

    @functools.wraps(load_bytes)
    def load_or_none(self: Any, key: Any, path: str, dtype: Any, shape: Any, fmt: Any
                     ) -> Any:
        # LMCache's own, but a chunk that cannot be read gives its buffer back and answers
        # None, LMCache's "not held": the retrieve stops there and the rest is recomputed
        memory_obj = self.local_cpu_backend.allocate(shape, dtype, fmt)
        if memory_obj is None:
            return None
        try:
            self.read_file(key, memory_obj.byte_array, path)
            meta = self.dict.get(key)
        except DiskChunkInvalid:
            meta = None
        if meta is None:
            memory_obj.ref_count_down()
            return None
        memory_obj.metadata.cached_positions = meta.cached_positions
        return memory_obj

    @functools.wraps(remove)
    def remove_and_forget(self: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
        meta = self.dict.get(key)
        if meta is not None:
            records.forget(meta.path)
        return remove(self, key, *args, **kwargs)

    Backend._agentserving_originals = {name: getattr(Backend, name) for name in _WRAPPED}
    Backend.write_file, Backend.read_file = write_checked, read_checked
    Backend.load_bytes_from_disk, Backend.remove = load_or_none, remove_and_forget
    Backend._agentserving_verified = True


def uninstall() -> None:
    """LMCache's own methods back (a test process that also runs LMCache unchecked)."""
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend as Backend

    if not getattr(Backend, "_agentserving_verified", False):
        return
    for name, method in Backend._agentserving_originals.items():
        setattr(Backend, name, method)
    Backend._agentserving_verified = False
