"""A decode rank reads a prompt's chunks straight from the prefill pod's KV server into its own
DRAM tier, with LMCache's own ``lm://`` client (``LMCServerConnector``).

This is the receiving half of point-to-point P/D (``handoff``): the bytes cross one hop, from
the prefill pod's server to the decode rank that loads them, and land where LMCache's lookup
finds them first. A decode pod's own KV server is not in the path (a copy into it and a second
read out of it would double the hand-off's cost: measured at 2-3.6x the added first-token time
of a central server with the same bytes).

Keys are this rank's: the prefill pod's rank k wrote them with the same model, world size and
worker id, so a wire chunk hash names the same ``CacheEngineKey`` on both sides. Chunks the
DRAM tier holds already are not read again; a chunk the source lacks is reported missing and
LMCache computes it. One client per source, kept open; a broken one is dropped and the pull
reports what arrived before.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter

from agentserving.core.logging import get_logger
from agentserving.core.schemas import MemoryPullRequest, MemoryPullResult
from agentserving.core.service import ApiError, error_responses

log = get_logger(__name__)


@dataclass
class PullCounts:
    pulled: int = 0
    held: int = 0
    missing: int = 0
    nbytes: int = 0


def lm_address(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("lm://").rpartition(":")
    return host.strip("[]"), int(port)


class PeerPull:
    """Reads chunks from other pods' KV servers into one rank's LMCache DRAM tier."""

    def __init__(self, cpu_backend: Any, key_of: Any) -> None:
        self.cpu = cpu_backend  # LMCache's LocalCPUBackend: allocates and keeps what arrives
        self.key_of = key_of  # wire chunk hash -> this rank's CacheEngineKey (None: not one)
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()  # one pull at a time: LMCache's client is one socket
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="agentserving-peer-pull")
        self._thread.start()

    def _run(self, coro: Any, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def _client(self, source: str) -> Any:
        client = self._clients.get(source)
        if client is None:
            from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector

            host, port = lm_address(source)

            async def make() -> Any:  # its lock belongs to the loop it runs on
                return LMCServerConnector(host, port, self.loop, self.cpu)

            client = self._clients[source] = self._run(make(), 10.0)
        return client

    def _drop(self, source: str) -> None:
        client = self._clients.pop(source, None)
        if client is not None:
            try:
                self._run(client.close(), 5.0)
            except Exception:  # noqa: BLE001 - already broken
                log.debug("peer_pull_close_failed", source=source)

    def pull(self, source: str, wire_hashes: Sequence[str], timeout_s: float) -> PullCounts:
        counts = PullCounts()
        keys = []
        for wire in wire_hashes:
            key = self.key_of(wire)
            if key is None or self.cpu.contains(key):
                counts.held += key is not None
                continue
            keys.append(key)
        if not keys:
            return counts
        deadline = time.monotonic() + timeout_s
        with self._lock:
            try:
                client = self._client(source)
                for key in keys:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"pull from {source} past {timeout_s:g} s")
                    obj = self._run(client.get(key), left)
                    if obj is None:
                        counts.missing += 1
                        continue
                    try:
                        counts.nbytes += len(obj.byte_array)
                        self.cpu.submit_put_task(key, obj)
                        counts.pulled += 1
                    finally:
                        obj.ref_count_down()
            except Exception as exc:  # noqa: BLE001 - what arrived stays; LMCache computes
                self._drop(source)
                log.warning("peer_pull_failed", source=source, pulled=counts.pulled,
                            wanted=len(keys), error=repr(exc)[:300])
                raise
        return counts

    def close(self) -> None:
        for source in list(self._clients):
            self._drop(source)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def pull_router(peer: PeerPull) -> APIRouter:
    """``POST /memory/pull`` on a rank's memory API."""
    router = APIRouter()

    @router.post("/memory/pull", response_model=MemoryPullResult, tags=["memory"],
                 responses=error_responses(503),
                 summary="Read chunks from another pod's KV server into this rank's DRAM "
                         "tier (point-to-point P/D).")
    def pull(req: MemoryPullRequest) -> MemoryPullResult:
        started = time.perf_counter()
        try:
            counts = peer.pull(req.source, req.chunk_hashes, req.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the caller computes instead
            raise ApiError(503, f"pull from {req.source} failed: {exc!r}"[:500],
                           type="service_unavailable", param="source") from exc
        return MemoryPullResult(num_pulled=counts.pulled, num_held=counts.held,
                                num_missing=counts.missing, pulled_bytes=counts.nbytes,
                                seconds=round(time.perf_counter() - started, 6))

    return router
