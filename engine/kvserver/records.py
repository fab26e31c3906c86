"""LMCache's wire types <-> the store's blobs, and the export stream that carries blobs from
one KV server to another (``POST /v1/export`` answers it, ``pull`` reads it).

The stream: ``MAGIC``, then one record per blob -- the key's length (u32, big-endian), the key
(UTF-8), the metadata as LMCache's own GET reply header (``ServerMetaMessage``: length, fmt,
dtype, shape), then ``length`` payload bytes -- then a u32 0. The magic rejects an answer that
is no export (a proxy's error page); the end marker tells a complete stream from one cut short,
whose last whole records are still good (each is a blob as LMCache PUT it).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

from agentserving.engine.kvserver.store import Blob
from agentserving.engine.vllm.hashes import wire_hash

MAGIC = b"AGKVEXP1"
_U32 = struct.Struct(">I")
END = _U32.pack(0)
MAX_KEY_BYTES = 1024  # LMCache's own keys are at most 150 (protocol.MAX_KEY_LENGTH)


class RecordError(ValueError):
    """The stream is no export, or a record in it is malformed."""


def chunk_of(key: Any) -> str:
    """A ``CacheEngineKey``'s (or ``LayerCacheEngineKey``'s) chunk hash in wire form: the
    strings the kvindex and the pods' memory API name chunks by."""
    return wire_hash(key.chunk_hash)


def blob_of(key_str: str, fmt: Any, dtype: Any, shape: Any, data: bytes) -> Blob:
    """A blob for ``key_str`` (raises ValueError when it is no LMCache key)."""
    from lmcache.utils import parse_cache_key

    return Blob(key_str, chunk_of(parse_cache_key(key_str)), fmt, dtype, shape, data)


def reply_header(blob: Blob | None) -> bytes:
    """LMCache's GET reply header: SUCCESS with the blob's metadata, or FAIL with zeros."""
    from lmcache.v1.protocol import ServerMetaMessage, ServerReturnCode

    if blob is None:
        return status_header(False)
    return ServerMetaMessage(ServerReturnCode.SUCCESS, blob.length, blob.fmt, blob.dtype,
                             blob.shape).serialize()


def status_header(ok: bool) -> bytes:
    """LMCache's reply to EXIST, HEALTH (and LIST, which it never implemented): a code, zeros."""
    import torch
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.protocol import ServerMetaMessage, ServerReturnCode

    code = ServerReturnCode.SUCCESS if ok else ServerReturnCode.FAIL
    return ServerMetaMessage(code, 0, MemoryFormat(1), torch.float16,
                             torch.Size((0, 0, 0, 0))).serialize()


def encode(blob: Blob) -> Iterator[bytes]:
    """One record, as pieces to write (the payload is not copied)."""
    key = blob.key.encode()
    yield _U32.pack(len(key)) + key + reply_header(blob)
    yield blob.data


class RecordReader:
    """Parses an export stream fed in arbitrary pieces; ``feed`` returns the blobs completed."""

    def __init__(self) -> None:
        from lmcache.v1.protocol import ServerMetaMessage

        self._meta_len = ServerMetaMessage.packlength()
        self._deserialize = ServerMetaMessage.deserialize
        self._buf = bytearray()
        self._magic_seen = False
        self.done = False
        self.bytes_read = 0

    def feed(self, data: bytes) -> list[Blob]:
        if self.done and data:
            raise RecordError("data after the end of the export stream")
        self._buf += data
        self.bytes_read += len(data)
        out: list[Blob] = []
        if not self._magic_seen:
            if len(self._buf) < len(MAGIC):
                return out
            if bytes(self._buf[:len(MAGIC)]) != MAGIC:
                raise RecordError("not a KV server export stream (bad magic)")
            del self._buf[:len(MAGIC)]
            self._magic_seen = True
        while not self.done:
            blob = self._next()
            if blob is None:
                break
            out.append(blob)
        return out

    def _next(self) -> Blob | None:
        buf = self._buf
        if len(buf) < 4:
            return None
        (key_len,) = _U32.unpack_from(buf)
        if key_len == 0:
            if len(buf) > 4:
                raise RecordError("data after the end of the export stream")
            self.done = True
            del buf[:4]
            return None
        if key_len > MAX_KEY_BYTES:
            raise RecordError(f"key of {key_len} bytes")
        head = 4 + key_len + self._meta_len
        if len(buf) < head:
            return None
        try:
            meta = self._deserialize(bytes(buf[4 + key_len:head]))
        except (ValueError, KeyError, struct.error) as exc:
            raise RecordError(f"bad record metadata: {exc!r}") from exc
        if meta.length < 0:
            raise RecordError(f"negative length {meta.length}")
        if len(buf) < head + meta.length:
            return None
        try:
            key = bytes(buf[4:4 + key_len]).decode()
            blob = blob_of(key, meta.fmt, meta.dtype, meta.shape,
                           bytes(buf[head:head + meta.length]))
        except (ValueError, KeyError, IndexError) as exc:  # a key LMCache cannot parse
            raise RecordError(f"bad record: {exc!r}") from exc
        del buf[:head + meta.length]
        return blob
