"""The KV server's process: the FastAPI app, whose lifespan runs the LMCache protocol server
on the same event loop, over one ``BlobStore``.

HTTP routes: ``/healthz``, ``/metrics``, ``GET /v1/chunks`` (what is held), ``POST
/memory/evict``, ``POST /memory/pin`` and ``POST /memory/unpin`` (the pods' memory-API verbs,
by chunk hash, with the pods' bodies), ``POST /v1/export`` (the peer side of a pull: the blobs
of some chunks as a record stream, ``records``) and ``POST /v1/pull`` (fetch chunks from
another KV server's export, ``pull``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Query
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry

from agentserving.core.internal_auth import auth_headers
from agentserving.core.logging import get_logger
from agentserving.core.schemas import (
    POD_EVICT_LOCATIONS,
    ErrorResponse,
    MemoryEvictRequest,
    MemoryPinRequest,
    MemoryPinResult,
    MemoryUnpinRequest,
    MemoryUnpinResult,
)
from agentserving.core.service import (
    ApiError,
    error_responses,
    install_error_handlers,
    install_health_route,
    install_internal_auth,
    install_metrics_route,
)
from agentserving.engine.kvserver.metrics import KvServerMetrics
from agentserving.engine.kvserver.schemas import (
    ChunkInfo,
    ChunkListing,
    ExportRequest,
    KvEvictResult,
    PullRequest,
    PullResult,
)
from agentserving.engine.kvserver.settings import KvServerSettings
from agentserving.engine.kvserver.store import BlobStore

log = get_logger(__name__)
SHUTDOWN_STEP_S = 5.0
MAX_LISTING = 10_000
_UPSTREAM_ERRORS: dict[int | str, dict[str, Any]] = {
    502: {"model": ErrorResponse, "description": "The source is unreachable, answered an error "
          "or sent no valid export stream; `error.param` is `source`."},
    504: {"model": ErrorResponse, "description": "The source did not send the chunks within "
          "`timeout_s`; `error.param` is `source`."},
}


@dataclass
class KvServerState:
    settings: KvServerSettings
    store: BlobStore
    metrics: KvServerMetrics
    lmcache: Any  # lmcache_server.LmcacheProtocolServer, once started
    http: httpx.AsyncClient


def _check_size(chunk_hashes: list[str], limit: int) -> None:
    if len(chunk_hashes) > limit:
        raise ApiError(413, f"{len(chunk_hashes)} chunk hashes, over the limit of {limit}",
                       param="chunk_hashes")


def _check_locations(locations: list[str] | None) -> None:
    """The pods' location names are accepted (this server is one tier, which every evict
    reaches); anything else is refused as the pods refuse it."""
    for i, loc in enumerate(locations or ()):
        if loc not in POD_EVICT_LOCATIONS:
            raise ApiError(400, f"locations[{i}]: unknown location '{loc}': expected one of "
                           f"{', '.join(POD_EVICT_LOCATIONS)}", param=f"locations[{i}]")


def create_app(settings: KvServerSettings, store: BlobStore | None = None) -> FastAPI:
    store = BlobStore(settings.capacity_bytes, settings.pin_share) if store is None else store
    registry = CollectorRegistry()
    metrics = KvServerMetrics(registry, store)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from agentserving.engine.kvserver.lmcache_server import LmcacheProtocolServer

        lmcache = LmcacheProtocolServer(store, metrics, settings.host, settings.port)
        await lmcache.start()
        http = httpx.AsyncClient(headers=auth_headers(settings.internal_token))
        app.state.kv = KvServerState(settings, store, metrics, lmcache, http)
        log.info("kvserver_started", lmcache_port=lmcache.port,
                 capacity_bytes=store.capacity_bytes)
        try:
            yield
        finally:
            await lmcache.stop(SHUTDOWN_STEP_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(http.aclose(), SHUTDOWN_STEP_S)

    app = FastAPI(
        title="AgentServing KV server",
        version="v1",
        summary="A bounded KV chunk store speaking LMCache's remote protocol (lm://), with "
                "eviction by chunk hash and pulls between servers.",
        lifespan=lifespan,
    )
    install_error_handlers(app, max_body_bytes=settings.max_body_bytes)
    install_internal_auth(app, settings.internal_token)
    install_metrics_route(app, registry)
    install_health_route(app)

    def st() -> KvServerState:
        return app.state.kv

    @app.get("/v1/chunks", response_model=ChunkListing, tags=["chunks"],
             summary="The chunks held, with their keys and bytes (paged, by chunk hash).")
    async def chunks(offset: int = Query(0, ge=0),
                     limit: int = Query(1000, ge=1, le=MAX_LISTING)) -> ChunkListing:
        total, page = store.listing(offset, limit)
        held = store.held_by_pin()
        return ChunkListing(
            total_chunks=total, offset=offset, used_bytes=store.used_bytes,
            capacity_bytes=store.capacity_bytes, pinned_chunks=held.pinned_chunks,
            pinned_bytes=held.pinned_bytes,
            chunks=[ChunkInfo(chunk_hash=e.chunk, keys=e.keys, bytes=e.bytes, pinned=e.pinned)
                    for e in page])

    @app.post("/memory/evict", response_model=KvEvictResult, tags=["chunks"],
              responses=error_responses(413),
              summary="Drop every key of these chunks (the pods' memory-API evict). The server "
                      "is one tier: any of the pods' `locations` reaches it.")
    async def evict(req: MemoryEvictRequest) -> KvEvictResult:
        _check_size(req.chunk_hashes, settings.max_batch_chunks)
        _check_locations(req.locations)
        done = store.evict_chunks(req.chunk_hashes)
        metrics.evicted("evict", len(done.keys), done.freed_bytes)
        log.info("kvserver_evicted", chunks=len(done.chunks), keys=len(done.keys),
                 freed_bytes=done.freed_bytes, missing=len(done.missing))
        return KvEvictResult(num_evicted=len(done.chunks), num_keys=len(done.keys),
                             freed_bytes=done.freed_bytes, num_missing=len(done.missing),
                             missing=done.missing)

    @app.post("/memory/pin", response_model=MemoryPinResult, tags=["chunks"],
              responses=error_responses(413), response_model_exclude={"num_pinned_kv_server"},
              summary="Keep these chunks out of the LRU for ttl_s, within the pin share (the "
                      "pods' memory-API pin, fanned out for the KV they hand through here).")
    async def pin(req: MemoryPinRequest) -> MemoryPinResult:
        _check_size(req.chunk_hashes, settings.max_batch_chunks)
        done = store.pin(req.chunk_hashes, req.ttl_s)
        for outcome in ("pinned", "extended", "missing"):
            if n := getattr(done, outcome):
                metrics.pins.labels(outcome).inc(n)
        return MemoryPinResult(num_pinned=done.pinned, num_extended=done.extended,
                               num_missing=done.missing)

    @app.post("/memory/unpin", response_model=MemoryUnpinResult, tags=["chunks"],
              responses=error_responses(413), response_model_exclude={"num_unpinned_kv_server"},
              summary="Give these chunks' pins back: they stay, evictable again.")
    async def unpin(req: MemoryUnpinRequest) -> MemoryUnpinResult:
        _check_size(req.chunk_hashes, settings.max_batch_chunks)
        released = store.unpin(req.chunk_hashes)
        metrics.pins.labels("unpinned").inc(released)
        return MemoryUnpinResult(num_unpinned=released)

    @app.post("/v1/export", tags=["peers"], responses={
        **error_responses(413),
        200: {"content": {"application/octet-stream": {}},
              "description": "The record stream (engine/kvserver/records.py): the magic, one "
                             "record per key of the chunks held (key, LMCache metadata, bytes), "
                             "an end marker. Chunks not held are simply absent."}},
              response_class=StreamingResponse,
              summary="The blobs of these chunks, for another KV server's pull.")
    async def export(req: ExportRequest) -> StreamingResponse:
        from agentserving.engine.kvserver.records import END, MAGIC, encode

        _check_size(req.chunk_hashes, settings.max_batch_chunks)
        blobs = store.blobs_of(req.chunk_hashes)  # a snapshot: later evictions do not tear it

        async def stream() -> AsyncIterator[bytes]:
            yield MAGIC
            for blob in blobs:
                for piece in encode(blob):
                    yield piece
                metrics.export_bytes.inc(blob.length)
            yield END

        return StreamingResponse(stream(), media_type="application/octet-stream")

    @app.post("/v1/pull", response_model=PullResult, tags=["peers"],
              responses={**error_responses(413), **_UPSTREAM_ERRORS},
              summary="Fetch these chunks from another KV server (its /v1/export) into this one.")
    async def pull_route(req: PullRequest) -> PullResult:
        from agentserving.engine.kvserver.pull import PullFailed, pull

        _check_size(req.chunk_hashes, settings.max_batch_chunks)
        timeout_s = req.timeout_s or settings.pull_timeout_s
        try:
            out = await pull(st().http, store, metrics, req.source, req.chunk_hashes, timeout_s)
        except PullFailed as exc:
            log.warning("kvserver_pull_failed", source=req.source, status=exc.status_code,
                        error=exc.message)
            raise ApiError(exc.status_code, exc.message, param="source",
                           type="upstream_error") from exc
        log.info("kvserver_pulled", source=req.source, chunks=len(out.chunks), keys=out.keys,
                 bytes=out.bytes, missing=len(out.missing), seconds=round(out.seconds, 4))
        return PullResult(pulled_chunks=len(out.chunks), pulled_keys=out.keys,
                          pulled_bytes=out.bytes, already_held=out.already_held,
                          missing=out.missing, seconds=out.seconds)

    return app
