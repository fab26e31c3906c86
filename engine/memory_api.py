"""The memory API of seed 000 on both of a worker's processes.

- Engine process ``k`` (port ``memory_port_start + 1 + k``) acts on its own LMCache tiers:
  ``POST /memory/prefetch`` (asynchronous disk -> DRAM; answers ``prefetch_started`` at
  once; with ``hold_s``, the chunks are pinned where they are and, once read, in DRAM: an
  announced turn's KV held until it arrives, ``Hold``), ``POST /memory/evict`` (named
  locations, or every tier), ``POST /memory/pin`` and ``POST /memory/unpin`` (TTL pins
  LMCache's own eviction honours, ``engine.kv.pins``), plus ``GET /memory/prefetch/{lookup_id}``
  (progress) and ``GET /memory/chunks`` (residency). The same server carries the P/D hand-off
  endpoint (``/v1/kv/{transfer_id}``).
- The API process (port ``memory_port_start``) holds no KV: it forwards each call to every
  engine process in parallel and merges the answers (seed 000 §4.2, scheduler -> workers).

Locations may be LMCache backend names (``LocalCPUBackend``, ``LocalDiskBackend``) or tier
names (``cpu``, ``disk``); an unknown one is a 400 naming ``locations[i]``. Unknown chunk
hashes are counted as missing, never errors.

The HTTP layer is shared; the KV tiers behind it are pluggable (``MemoryBackend``): the
reference engine passes its ``KVStore`` (engine/kv/store.py), the vLLM connector passes
``LMCacheStorageBackend`` (engine/vllm/storage.py) over the LMCache storage manager that vLLM's
worker process owns. Both are served by ``engine_memory_app``; the scheduler-side process of
either serves ``forwarding_memory_app``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import httpx
from fastapi import APIRouter, FastAPI
from prometheus_client import REGISTRY

from agentserving.core.internal_auth import auth_headers
from agentserving.core.logging import get_logger
from agentserving.core.schemas import (
    TIER_BACKENDS,
    MemoryChunks,
    MemoryEvictRequest,
    MemoryEvictResult,
    MemoryPinRequest,
    MemoryPinResult,
    MemoryPrefetchRequest,
    MemoryPrefetchResult,
    MemoryPrefetchStatus,
    MemoryUnpinRequest,
    MemoryUnpinResult,
    Tier,
)
from agentserving.core.service import (
    ApiError,
    error_responses,
    install_error_handlers,
    install_health_route,
    install_internal_auth,
    install_metrics_route,
)
from agentserving.engine.kv.pins import ChunkPins

log = get_logger(__name__)

KNOWN_LOCATIONS = {*TIER_BACKENDS.values(), *(t.value for t in TIER_BACKENDS)}


def check_locations(locations: Sequence[str] | None, available: Sequence[str]) -> None:
    if locations is None:
        return
    avail = set(available) | {t.value for t, b in TIER_BACKENDS.items() if b in available}
    for i, loc in enumerate(locations):
        if loc not in KNOWN_LOCATIONS or loc not in avail:
            raise ApiError(400, f"unknown location {loc!r}; this pod has "
                           f"{sorted(avail)}", param=f"locations[{i}]")


def backend_names(locations: Sequence[str] | None, available: Sequence[str]) -> list[str]:
    """Backend names for the memory API's ``locations`` (backend or tier names; None: all).
    Raises KeyError for one ``available`` lacks (``check_locations`` reports it first)."""
    if locations is None:
        return list(available)
    tier_names = {t.value: b for t, b in TIER_BACKENDS.items()}
    out = []
    for loc in locations:
        name = tier_names.get(loc, loc)
        if name not in available:
            raise KeyError(loc)
        out.append(name)
    return out


class ChunkKeysLike(Protocol):
    def key_of(self, wire: str) -> Any | None: ...  # None: not a hash of this scheme

    def wire_of_int(self, value: int) -> str: ...


class DeviceTier(Protocol):
    """An engine's own KV pool, reached by chunk hash (``engine.vllm.device_kv``)."""

    def release(self, chunk_hashes: Sequence[str], evict: bool) -> None: ...

    def device_chunks(self) -> list[str]: ...  # the chunks its blocks still hold


class KvServerTier(Protocol):
    """The KV server a pod hands P/D KV through, reached by chunk hash
    (``engine.vllm.handoff.KvServerVerbs``): each verb answers the server's count, or None
    when it could not be asked."""

    async def evict(self, chunk_hashes: Sequence[str]) -> int | None: ...

    async def pin(self, chunk_hashes: Sequence[str], ttl_s: float) -> int | None: ...

    async def unpin(self, chunk_hashes: Sequence[str]) -> int | None: ...


class PrefetchProgress(Protocol):
    lookup_id: str
    requested: int
    in_cpu: int
    to_load: int
    missing: int
    state: str  # running | done | failed
    loaded: int
    corrupt: int
    error: str | None


class MemoryBackend(Protocol):
    """The KV tiers of one engine process, as the memory API acts on them."""

    keys: ChunkKeysLike
    chunk_bytes: int
    pins: ChunkPins  # TTL pins the tiers' own eviction honours

    @property
    def backends(self) -> list[str]: ...  # LMCache backend names this process has

    def tier_of(self, key: Any) -> Tier | None: ...  # fastest tier holding the key

    def prefetch(self, wire_hashes: Sequence[str],
                 lookup_id: str | None) -> PrefetchProgress: ...  # returns at once

    def prefetch_status(self, lookup_id: str) -> PrefetchProgress | None: ...

    def after_prefetches(self, fn: Callable[[], None]) -> bool: ...  # fn once the loads end

    def resolve_locations(self, locations: Sequence[str] | None) -> list[str]: ...

    def evict(self, wire_hashes: Sequence[str],
              backends: Sequence[str]) -> tuple[list[str], list[str]]: ...  # evicted, missing

    def residency(self) -> dict[Tier, set[int]]: ...  # chunk ints per tier, right now


# ---------------------------------------------------------------- engine process


def engine_process_url(memory_url: str, rank: int = 0) -> str:
    """Engine process ``rank``'s memory API, from the pod's (the API process's) URL: where its
    own counters and pins are (``memory_port_start + 1 + rank``)."""
    parts = urllib.parse.urlsplit(memory_url)
    return f"{parts.scheme}://{parts.hostname}:{(parts.port or 0) + 1 + rank}"


def _memory_path(path: str) -> bool:
    """What the internal token guards on a pod: the memory API (the KV hand-off, which a
    decode pod pulls by an unguessable transfer id, is not yet)."""
    return path.startswith("/memory/")


def engine_memory_app(store: MemoryBackend, extra_routers: Sequence[APIRouter] = (),
                      token: str | None = None) -> FastAPI:
    """The memory API of one engine process, acting on its KV tiers (any ``MemoryBackend``);
    with ``token``, its ``/memory/`` routes require it (``core.internal_auth``)."""
    app = FastAPI(title="AgentServing engine memory API", version="v1")
    install_error_handlers(app, max_body_bytes=64 * 1024 * 1024)
    install_internal_auth(app, token, _memory_path)
    install_health_route(app)
    install_metrics_route(app, REGISTRY)  # LMCache's own metrics live in the default registry

    @app.post("/memory/prefetch", response_model=MemoryPrefetchResult,
              responses=error_responses(413))
    def prefetch(req: MemoryPrefetchRequest) -> MemoryPrefetchResult:
        missing = [h for h in req.chunk_hashes if _tier_of(store, h) is None]
        held = hold(store, req.chunk_hashes, req.hold_s) if req.hold_s is not None else None
        st = store.prefetch(req.chunk_hashes, req.lookup_id)
        if held is not None and st.to_load:
            store.after_prefetches(held.again)
        return MemoryPrefetchResult(lookup_id=st.lookup_id, num_chunks=len(req.chunk_hashes),
                                    num_to_load=st.to_load, num_in_cpu=st.in_cpu,
                                    num_missing=st.missing, missing=missing,
                                    num_held=held.chunks if held is not None else 0)

    @app.get("/memory/prefetch/{lookup_id}", response_model=MemoryPrefetchStatus)
    def prefetch_status(lookup_id: str) -> MemoryPrefetchStatus:
        st = store.prefetch_status(lookup_id)
        if st is None:
            return MemoryPrefetchStatus(lookup_id=lookup_id, state="unknown")
        return MemoryPrefetchStatus(
            lookup_id=lookup_id, state=st.state, requested=st.requested, to_load=st.to_load,
            loaded=st.loaded, corrupt=st.corrupt, in_cpu=st.in_cpu, missing=st.missing,
            error=st.error)

    @app.post("/memory/evict", response_model=MemoryEvictResult,
              responses=error_responses(400, 413))
    def evict(req: MemoryEvictRequest) -> MemoryEvictResult:
        check_locations(req.locations, store.backends)
        evicted, missing = store.evict(req.chunk_hashes, store.resolve_locations(req.locations))
        return MemoryEvictResult(num_evicted=len(evicted), num_missing=len(missing),
                                 missing=missing)

    @app.post("/memory/pin", response_model=MemoryPinResult, responses=error_responses(413))
    def pin(req: MemoryPinRequest) -> MemoryPinResult:
        out = store.pins.pin(req.chunk_hashes, req.ttl_s)
        return MemoryPinResult(num_pinned=out.pinned, num_extended=out.extended,
                               num_missing=out.missing, num_refused=out.refused)

    @app.post("/memory/unpin", response_model=MemoryUnpinResult, responses=error_responses(413))
    def unpin(req: MemoryUnpinRequest) -> MemoryUnpinResult:
        return MemoryUnpinResult(num_unpinned=store.pins.unpin(req.chunk_hashes))

    @app.get("/memory/chunks", response_model=MemoryChunks)
    def chunks() -> MemoryChunks:
        res = store.residency()
        wire = store.keys.wire_of_int
        return MemoryChunks(chunks={t: sorted(wire(v) for v in vals) for t, vals in res.items()},
                            bytes={t: len(vals) * store.chunk_bytes for t, vals in res.items()})

    for router in extra_routers:
        app.include_router(router)
    return app


@dataclasses.dataclass
class Hold:
    """An announced turn's KV held on this engine process (``MemoryPrefetchRequest.hold_s``):
    pinned where it is now, and ``again()`` once the prefetch has read the disk-only chunks
    into DRAM, so their DRAM copies are held for what is left of it. Pins, not a tier of their
    own: LMCache's eviction already skips a pinned object, and a hold that outlives its turn
    lapses by itself like any pin."""

    pins: ChunkPins
    chunk_hashes: Sequence[str]
    until: float
    chunks: int  # pinned or extended at the announce

    def again(self) -> None:
        left = self.until - time.monotonic()
        if left > 0:
            self.pins.pin(self.chunk_hashes, left)


def hold(store: MemoryBackend, chunk_hashes: Sequence[str], ttl_s: float) -> Hold:
    out = store.pins.pin(chunk_hashes, ttl_s)
    return Hold(store.pins, list(chunk_hashes), time.monotonic() + ttl_s,
                out.pinned + out.extended)


def _tier_of(store: MemoryBackend, wire: str) -> Tier | None:
    key = store.keys.key_of(wire)
    return None if key is None else store.tier_of(key)


# ---------------------------------------------------------------- API process (forwarding)


class EngineFanout:
    """Calls every engine process's memory API in parallel (seed 000's
    ``_forward_to_all_workers``)."""

    def __init__(self, engine_urls: Sequence[str], timeout_s: float = 10.0,
                 token: str | None = None) -> None:
        self.engine_urls = list(engine_urls)
        self._client = httpx.AsyncClient(timeout=timeout_s, headers=auth_headers(token))

    async def aclose(self) -> None:
        await self._client.aclose()

    async def call(self, method: str, path: str, body: Any = None) -> list[dict[str, Any]]:
        async def one(url: str) -> dict[str, Any]:
            try:
                resp = await self._client.request(
                    method, url + path,
                    content=body.model_dump_json() if body is not None else None,
                    headers={"content-type": "application/json"} if body is not None else None)
            except httpx.HTTPError as exc:
                raise ApiError(503, f"engine at {url} unreachable: {exc!r}",
                               type="service_unavailable") from exc
            if resp.status_code >= 400:
                err = resp.json().get("error", {}) if resp.content else {}
                raise ApiError(resp.status_code if resp.status_code < 500 else 503,
                               err.get("message", resp.text[:200]), param=err.get("param"))
            return resp.json()

        return list(await asyncio.gather(*(one(u) for u in self.engine_urls)))


def forwarding_memory_app(fanout: EngineFanout, backends: Sequence[str],
                          token: str | None = None,
                          announced: Callable[[], Callable[[MemoryPrefetchRequest], bool] | None]
                          = lambda: None,
                          device: Callable[[], DeviceTier | None] = lambda: None,
                          kv_server: KvServerTier | None = None,
                          residency: Callable[[Sequence[str]], list[Tier | None]] | None = None
                          ) -> FastAPI:
    """``announced()``: the pod scheduler's taker of announced requests (a prefetch with
    ``expected_in_s``), None while it has none; when it takes one, the read waits for it, and
    the answer says where ``residency`` (the pod's book of its ranks' chunks, a poll behind)
    puts the chunks now: the session's KV at the moment its turn was announced.
    ``device()``: the engine's own KV pool as a tier (vLLM's prefix cache), which an unpin
    and an evict of every tier reach too; None when the engine has none.
    ``kv_server``: the KV server the pod hands KV through (P/D), which an evict of every tier,
    a pin and an unpin reach too; None when the pod has none."""
    # every route forwards: an engine process's error comes back as it is (5xx: 503)
    app = FastAPI(title="AgentServing worker memory API", version="v1",
                  responses=error_responses(503))
    install_error_handlers(app, max_body_bytes=64 * 1024 * 1024)
    install_internal_auth(app, token, _memory_path)
    install_health_route(app)

    @app.post("/memory/prefetch", response_model=MemoryPrefetchResult,
              responses=error_responses(413))
    async def prefetch(req: MemoryPrefetchRequest) -> MemoryPrefetchResult:
        req = req.model_copy(update={"lookup_id": req.lookup_id or f"prefetch-{uuid.uuid4().hex}"})
        take = announced() if req.expected_in_s is not None else None
        if take is not None and take(req):
            # the scheduler reads later (its own prefetch carries what is left of the hold);
            # what the ranks hold now is held from now
            tiers = residency(req.chunk_hashes) if residency is not None else []
            held = await _hold_now(req) if req.hold_s is not None else 0
            return MemoryPrefetchResult(
                status="prefetch_scheduled", lookup_id=req.lookup_id,
                num_chunks=len(req.chunk_hashes), num_in_cpu=tiers.count(Tier.CPU),
                num_to_load=tiers.count(Tier.DISK), num_missing=tiers.count(None),
                num_held=held)
        parts = [MemoryPrefetchResult.model_validate(r)
                 for r in await fanout.call("POST", "/memory/prefetch", req)]
        missing = set.intersection(*(set(p.missing) for p in parts)) if parts else set()
        return MemoryPrefetchResult(
            lookup_id=req.lookup_id, num_chunks=len(req.chunk_hashes),
            num_to_load=sum(p.num_to_load for p in parts),
            num_in_cpu=sum(p.num_in_cpu for p in parts), num_missing=len(missing),
            missing=[h for h in req.chunk_hashes if h in missing],
            num_held=sum(p.num_held for p in parts))

    async def _hold_now(req: MemoryPrefetchRequest) -> int:
        """An announce's hold on the ranks' tiers; 0 when a rank could not be asked (the
        announce stands: the turn is read for as if nothing had been held)."""
        assert req.hold_s is not None
        try:
            parts = [MemoryPinResult.model_validate(r) for r in await fanout.call(
                "POST", "/memory/pin",
                MemoryPinRequest(chunk_hashes=req.chunk_hashes, ttl_s=req.hold_s))]
        except ApiError as exc:
            log.warning("announce_hold_failed", lookup_id=req.lookup_id, error=exc.message)
            return 0
        return sum(p.num_pinned + p.num_extended for p in parts)

    @app.get("/memory/prefetch/{lookup_id}", response_model=MemoryPrefetchStatus)
    async def prefetch_status(lookup_id: str) -> MemoryPrefetchStatus:
        parts = [MemoryPrefetchStatus.model_validate(r)
                 for r in await fanout.call(
                     "GET", f"/memory/prefetch/{urllib.parse.quote(lookup_id, safe='')}")]
        states = {p.state for p in parts}
        state = ("failed" if "failed" in states else "running" if "running" in states
                 else "done" if "done" in states else "unknown")
        return MemoryPrefetchStatus(
            lookup_id=lookup_id, state=state, requested=max(p.requested for p in parts),
            to_load=sum(p.to_load for p in parts), loaded=sum(p.loaded for p in parts),
            corrupt=sum(p.corrupt for p in parts), in_cpu=sum(p.in_cpu for p in parts),
            missing=min(p.missing for p in parts),
            error="; ".join(p.error for p in parts if p.error) or None)

    @app.post("/memory/evict", response_model=MemoryEvictResult,
              responses=error_responses(400, 413))
    async def evict(req: MemoryEvictRequest) -> MemoryEvictResult:
        check_locations(req.locations, backends)
        if req.locations is None and (pool := device()) is not None:
            pool.release(req.chunk_hashes, evict=True)
        parts = [MemoryEvictResult.model_validate(r)
                 for r in await fanout.call("POST", "/memory/evict", req)]
        missing = set.intersection(*(set(p.missing) for p in parts)) if parts else set()
        on_server = (await kv_server.evict(req.chunk_hashes)
                     if kv_server is not None and req.locations is None else None)
        return MemoryEvictResult(num_evicted=sum(p.num_evicted for p in parts),
                                 num_missing=len(missing),
                                 missing=[h for h in req.chunk_hashes if h in missing],
                                 num_evicted_kv_server=on_server)

    @app.post("/memory/pin", response_model=MemoryPinResult, responses=error_responses(413))
    async def pin(req: MemoryPinRequest) -> MemoryPinResult:
        parts = [MemoryPinResult.model_validate(r)
                 for r in await fanout.call("POST", "/memory/pin", req)]
        on_server = (await kv_server.pin(req.chunk_hashes, req.ttl_s)
                     if kv_server is not None else None)
        return MemoryPinResult(num_pinned_kv_server=on_server, **{
            f: sum(getattr(p, f) for p in parts)
            for f in ("num_pinned", "num_extended", "num_missing", "num_refused")})

    @app.post("/memory/unpin", response_model=MemoryUnpinResult, responses=error_responses(413))
    async def unpin(req: MemoryUnpinRequest) -> MemoryUnpinResult:
        if (pool := device()) is not None:
            pool.release(req.chunk_hashes, evict=False)
        parts = [MemoryUnpinResult.model_validate(r)
                 for r in await fanout.call("POST", "/memory/unpin", req)]
        on_server = (await kv_server.unpin(req.chunk_hashes)
                     if kv_server is not None else None)
        return MemoryUnpinResult(num_unpinned=sum(p.num_unpinned for p in parts),
                                 num_unpinned_kv_server=on_server)

    @app.get("/memory/chunks", response_model=MemoryChunks)
    async def chunks() -> MemoryChunks:
        parts = [MemoryChunks.model_validate(r) for r in await fanout.call("GET", "/memory/chunks")]
        merged: dict[Tier, set[str]] = {}
        nbytes: dict[Tier, int] = {}
        for p in parts:
            for tier, hashes in p.chunks.items():
                merged.setdefault(tier, set()).update(hashes)
            for tier, n in p.bytes.items():
                nbytes[tier] = nbytes.get(tier, 0) + n
        if (pool := device()) is not None:  # the engine's own cache, as the kvindex sees it
            merged[Tier.DEVICE] = set(pool.device_chunks())
        return MemoryChunks(chunks={t: sorted(v) for t, v in merged.items()}, bytes=nbytes)

    return app
