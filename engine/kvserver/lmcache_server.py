"""LMCache's remote protocol (``lm://HOST:PORT``, LMCache 0.5's ``lmcache.v1.server``) over
asyncio streams, on the event loop of the HTTP API, in front of a ``BlobStore``.

Per connection, a sequence of commands, each a ``ClientMetaMessage`` header:

- PUT: ``length`` payload bytes follow; no reply. A payload larger than the whole bound is
  read and dropped (the connection stays in step) and counted as refused.
- GET: ``ServerMetaMessage`` SUCCESS with the metadata as stored, then the bytes; or FAIL.
- EXIST: SUCCESS or FAIL. HEALTH: SUCCESS. LIST (never implemented upstream): FAIL.

Commands on one connection are answered strictly in order, each after the ones before it took
effect: an EXIST sent after PUTs is answered once those PUTs are stored, which LMCache's
prefill flush barrier relies on. A header that is no LMCache command (unknown command, format
or dtype, unparsable key, negative length) closes the connection: nothing after it can be
framed. (De)serialisation is LMCache's own ``lmcache.v1.protocol``.
"""

from __future__ import annotations

import asyncio
import contextlib

from agentserving.core.logging import get_logger
from agentserving.engine.kvserver.metrics import KvServerMetrics
from agentserving.engine.kvserver.records import chunk_of, reply_header, status_header
from agentserving.engine.kvserver.store import Blob, BlobStore

log = get_logger(__name__)
STREAM_LIMIT = 4 * 1024 * 1024  # asyncio's read buffer: whole KV chunks without many pauses
DISCARD_PIECE = 1024 * 1024


class ProtocolError(Exception):
    """A header that cannot be a command of LMCache's protocol."""


class LmcacheProtocolServer:
    def __init__(self, store: BlobStore, metrics: KvServerMetrics, host: str, port: int) -> None:
        from lmcache.v1 import protocol

        self._protocol = protocol
        self._header_len = protocol.ClientMetaMessage.packlength()
        self.store = store
        self.metrics = metrics
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task, asyncio.StreamWriter] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port,
                                                  limit=STREAM_LIMIT)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("kvserver_lmcache_listening", host=self.host, port=self.port)

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop listening and end every connection; returns within about ``timeout_s``.

        Connections are aborted, not their tasks cancelled: each handler then sees its
        stream end and returns as it does when a client leaves (a half-read PUT is dropped)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections.values()):
            writer.transport.abort()
        if self._connections:
            _, stuck = await asyncio.wait(list(self._connections), timeout=timeout_s)
            for task in stuck:
                task.cancel()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), timeout_s)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        self.metrics.connections.inc()
        peer = writer.get_extra_info("peername")
        try:
            while True:
                try:
                    header = await reader.readexactly(self._header_len)
                except asyncio.IncompleteReadError:
                    return  # the client closed between commands (or mid-header)
                await self._command(self._parse(header), reader, writer)
        except ProtocolError as exc:
            self.metrics.protocol_errors.inc()
            log.warning("kvserver_protocol_error", peer=str(peer), error=str(exc))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away mid-payload or mid-reply: nothing half-stored
        finally:
            self.metrics.connections.dec()
            self._connections.pop(task, None)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    def _parse(self, header: bytes):  # type: ignore[no-untyped-def]
        try:
            meta = self._protocol.ClientMetaMessage.deserialize(header)
        except Exception as exc:  # untrusted bytes: any failure to read them is the client's
            raise ProtocolError(f"unreadable header: {exc!r}") from exc
        if meta.length < 0:
            raise ProtocolError(f"negative length {meta.length}")
        return meta

    async def _command(self, meta, reader: asyncio.StreamReader,  # type: ignore[no-untyped-def]
                       writer: asyncio.StreamWriter) -> None:
        commands = self._protocol.ClientCommand
        command = meta.command
        self.metrics.commands.labels(command.name).inc()
        if command == commands.PUT:
            await self._put(meta, reader)
            return
        if command == commands.GET:
            blob = self.store.get(meta.key.to_string())
            self._count_lookup("GET", blob is not None)
            writer.write(reply_header(blob))
            if blob is not None:
                writer.write(blob.data)
                self.metrics.sent_bytes.inc(blob.length)
        elif command == commands.EXIST:
            found = self.store.contains(meta.key.to_string())
            self._count_lookup("EXIST", found)
            writer.write(status_header(found))
        elif command == commands.HEALTH:
            writer.write(status_header(True))
        else:  # LIST: LMCache's server never implemented it, and its client never sends it
            writer.write(status_header(False))
        await writer.drain()

    async def _put(self, meta, reader: asyncio.StreamReader) -> None:  # type: ignore[no-untyped-def]
        if meta.length > self.store.capacity_bytes:
            left = meta.length
            while left:  # keep the connection in step without holding the payload
                left -= len(await reader.readexactly(min(left, DISCARD_PIECE)))
            self.metrics.evicted("refused", 1, meta.length)
            log.warning("kvserver_put_refused", key=meta.key.to_string(), bytes=meta.length,
                        capacity_bytes=self.store.capacity_bytes)
            return
        data = await reader.readexactly(meta.length)
        blob = Blob(meta.key.to_string(), chunk_of(meta.key), meta.fmt, meta.dtype, meta.shape,
                    data)
        self.metrics.received_bytes.inc(len(data))
        self.metrics.put(self.store.put(blob), len(data))

    def _count_lookup(self, command: str, found: bool) -> None:
        (self.metrics.hits if found else self.metrics.misses).labels(command).inc()
