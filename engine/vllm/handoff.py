"""Point-to-point P/D between vLLM pods, through each pod's own KV server.

A prefill pod's LMCache writes a prompt's chunks to its own ``agentserving kvserver`` (its
``remote_url``, a container beside the engine). The prefill answer's ``kv_transfer_params``
name that server (``agentserving_kv_source``, ``lm://`` at the pod's advertised host) next to
the chunk hashes, and the proxy hands them to the decode pod with the request. Before LMCache
looks the request up there, the decode pod's ranks read those chunks from the named server
into their own DRAM tier (``POST /memory/pull``, ``peer_pull``), where the lookup finds them;
the decode pod's tiers keep what it loaded and computed.

So no process is shared by every pod (a central server carries every transfer and, in
LMCache's own, keeps every chunk forever), each pod's server is bounded by its LRU, and the
bytes cross one hop. What fails degrades: a pull that fails or times out leaves the decode pod
to compute what did not arrive.

The pull runs in vLLM's scheduler process, synchronously, once per request: the request's
first lookup waits for it (a 2k-token prompt of the tiny model is 16 MB).
"""

from __future__ import annotations

import re
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import Counter, Histogram

from agentserving.core.hashing import is_chunk_hash
from agentserving.core.internal_auth import auth_headers
from agentserving.core.logging import get_logger
from agentserving.core.schemas import LM_URL_PATTERN

log = get_logger(__name__)

SOURCE_PARAM = "agentserving_kv_source"

PULLS = Counter("agentserving_kv_handoff_pulls", "Point-to-point P/D pulls a decode pod's "
                "ranks made from a prefill pod's KV server, by outcome (ok: every chunk came; "
                "partial: the source lacked some; failed: the pull did not complete, the pod "
                "computes).",
                ["outcome"])
PULL_BYTES = Counter("agentserving_kv_handoff_pull_bytes", "Bytes of KV pulled point to "
                     "point from prefill pods' KV servers.")
PULL_SECONDS = Histogram("agentserving_kv_handoff_pull_seconds", "Time a request's first "
                         "lookup waited for its point-to-point pull.",
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


def advertised_source(lm_url: str, public_host: str) -> str:
    """The pod's own KV server as other pods reach it: its ``lm://`` address (loopback: the
    server is in the pod) with the pod's advertised host."""
    port = urllib.parse.urlsplit(lm_url).port
    host = f"[{public_host}]" if ":" in public_host else public_host
    return f"lm://{host}:{port}"


def with_source(params: dict[str, Any] | None, source: str) -> dict[str, Any] | None:
    """A prefill answer's hand-off parameters, naming where its chunks can be pulled from
    (nothing to name when there are no chunks)."""
    if not params or not params.get("chunk_hashes"):
        return params
    return {**params, SOURCE_PARAM: source}


def pull_plan(params: Mapping[str, Any] | None, own_source: str | None
              ) -> tuple[str, list[str]] | None:
    """(source lm:// address, chunk hashes) a decode request asks to pull, or None: not a
    P/D decode, no source named, the source is this pod itself, or nothing valid to pull."""
    if not isinstance(params, Mapping) or not params.get("do_remote_prefill"):
        return None
    source = params.get(SOURCE_PARAM)
    if not isinstance(source, str) or not re.match(LM_URL_PATTERN, source):
        return None
    if source == own_source:
        return None
    hashes = params.get("chunk_hashes")
    if not isinstance(hashes, list):
        return None
    valid = [h for h in hashes if isinstance(h, str) and is_chunk_hash(h)]
    return (source, valid) if valid else None


@dataclass(frozen=True)
class PullOutcome:
    outcome: str  # ok | partial | failed
    pulled_bytes: int = 0
    missing: int = 0
    seconds: float = 0.0


class HandoffPuller:
    """The decode side: one pull per request, by the pod's ranks (its memory API)."""

    def __init__(self, memory_url: str, own_source: str | None, timeout_s: float,
                 token: str | None = None, remember: int = 4096) -> None:
        self.memory_url = memory_url.rstrip("/")
        self.own_source = own_source
        self.timeout_s = timeout_s
        self._client = httpx.Client(timeout=timeout_s + 5, headers=auth_headers(token))
        self._done: OrderedDict[str, PullOutcome] = OrderedDict()
        self._remember = remember
        self._lock = threading.Lock()

    def pull_for(self, request_id: str, params: Mapping[str, Any] | None) -> PullOutcome | None:
        """Pull what ``params`` name before the request's first lookup; None when it names
        nothing. A request looked up again (vLLM retries waiting requests) pulls once."""
        with self._lock:
            if request_id in self._done:
                return self._done[request_id]
        plan = pull_plan(params, self.own_source)
        if plan is None:
            return None
        outcome = self._pull(*plan)
        with self._lock:
            self._done[request_id] = outcome
            while len(self._done) > self._remember:
                self._done.popitem(last=False)
        return outcome

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._done.pop(request_id, None)

    def _pull(self, source: str, hashes: Sequence[str]) -> PullOutcome:
        t0 = time.perf_counter()
        try:
            resp = self._client.post(f"{self.memory_url}/memory/pull", json={
                "source": source, "chunk_hashes": list(hashes), "timeout_s": self.timeout_s})
            resp.raise_for_status()
            body = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            seconds = time.perf_counter() - t0
            PULLS.labels("failed").inc()
            PULL_SECONDS.observe(seconds)
            log.warning("kv_handoff_pull_failed", source=source, chunks=len(hashes),
                        error=repr(exc)[:300])
            return PullOutcome("failed", seconds=seconds)
        seconds = time.perf_counter() - t0
        missing = int(body.get("num_missing") or 0)
        nbytes = int(body.get("pulled_bytes") or 0)
        outcome = PullOutcome("partial" if missing else "ok", nbytes, missing, seconds)
        PULLS.labels(outcome.outcome).inc()
        PULL_BYTES.inc(nbytes)
        PULL_SECONDS.observe(seconds)
        log.debug("kv_handoff_pulled", source=source, chunks=len(hashes), missing=missing,
                  bytes=nbytes, seconds=round(seconds, 4))
        return outcome

    def close(self) -> None:
        self._client.close()


class KvServerVerbs:
    """The pod's memory-API verbs that reach the KV server it hands KV through, so the KV a
    session left there follows its pod's pins and evictions: an evict of every tier (a close,
    a context change) drops it, a pin keeps it from the server's LRU for the TTL, an unpin
    gives that back. Each answers the count the server reports, or None when it could not be
    asked (the pod's own tiers were served all the same; the server's LRU reclaims the
    rest)."""

    def __init__(self, server_api: str, token: str | None = None,
                 timeout_s: float = 5.0) -> None:
        self.server_api = server_api.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    async def evict(self, chunk_hashes: Sequence[str]) -> int | None:
        return await self._post("evict", {"chunk_hashes": list(chunk_hashes)}, "num_evicted")

    async def pin(self, chunk_hashes: Sequence[str], ttl_s: float) -> int | None:
        """Chunks pinned or extended on the server."""
        answer = await self._post("pin", {"chunk_hashes": list(chunk_hashes), "ttl_s": ttl_s})
        return None if answer is None else int(answer.get("num_pinned", 0)) + int(
            answer.get("num_extended", 0))

    async def unpin(self, chunk_hashes: Sequence[str]) -> int | None:
        return await self._post("unpin", {"chunk_hashes": list(chunk_hashes)}, "num_unpinned")

    async def _post(self, verb: str, body: dict[str, Any], count: str | None = None
                    ) -> Any:
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s,
                                         headers=auth_headers(self.token)) as client:
                resp = await client.post(f"{self.server_api}/memory/{verb}", json=body)
                resp.raise_for_status()
                answer = resp.json()
                return answer if count is None else int(answer.get(count, 0))
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            log.warning(f"kv_server_{verb}_failed", server=self.server_api,
                        chunks=len(body["chunk_hashes"]), error=repr(exc)[:300])
            return None
