"""HTTP clients for the kvindex and the pods' memory API, speaking core.schemas.

Failures of the remote side surface as ``ServiceUnavailable`` (connection refused, timeout,
503), so callers can degrade (route without the index, recompute) with one ``except``.
A 4xx surfaces as ``RequestRejected`` carrying the server's message and field.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any, Self, TypeVar
from urllib.parse import quote, urlencode

import httpx
from pydantic import BaseModel

from agentserving.core.internal_auth import auth_headers
from agentserving.core.schemas import (
    TENANT_HEADER,
    ChunkLocations,
    ChunkSnapshot,
    ContextWritten,
    EventBatch,
    EventBatchResult,
    EvictRequest,
    FanoutResponse,
    ForkRequest,
    IntentChunks,
    LeaseInfo,
    LookupRequest,
    LookupResponse,
    MemoryEvictRequest,
    MemoryEvictResponse,
    MemoryPrefetchRequest,
    MemoryPrefetchResponse,
    PinRequest,
    PodInfo,
    PodList,
    PodRegistration,
    PrefetchRequest,
    PriorityRequest,
    ResidencyChanges,
    ResidencyListing,
    SessionClosed,
    SessionContext,
    SessionInfo,
    SessionRoute,
    StoredResponse,
    StoredResponseDeleted,
)

M = TypeVar("M", bound=BaseModel)


def session_path(session_id: str, *below: str) -> str:
    """A kvindex session route, each segment percent-quoted: a session id is anything but '/'
    (the proxy writes a client's '/' as %2F), so '?', '#', '%' or a space must reach the
    kvindex as part of the id, not end the path."""
    return "/".join(["/v1/sessions", *(quote(part, safe="") for part in (session_id, *below))])


def stored_response_path(response_id: str) -> str:
    """A kvindex stored-response route; the id percent-quoted, so a malformed one reaches the
    kvindex whole and is refused there (400) rather than naming another route."""
    return f"/v1/stored-responses/{quote(response_id, safe='')}"


class ServiceUnavailable(Exception):
    """The service could not be reached or said it cannot serve now."""


class RequestRejected(Exception):
    def __init__(self, status_code: int, message: str, param: str | None) -> None:
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.param = param


class NotFound(RequestRejected):
    pass


class _JsonClient:
    def __init__(self, base_url: str, timeout_s: float = 2.0,
                 client: httpx.AsyncClient | None = None, *, token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self._owns_client = client is None
        self._headers = auth_headers(token)  # core.internal_auth: the deployment's token

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    def for_tenant(self, tenant: str | None) -> Self:
        """This client acting for ``tenant``: the kvindex scopes the sessions it names by it
        (``TENANT_HEADER``). Shares this client's connections; closing it closes nothing."""
        if tenant is None:
            return self
        view = copy.copy(self)
        view._headers = {**self._headers, TENANT_HEADER: tenant}
        view._owns_client = False
        return view

    async def _call(self, method: str, path: str, body: BaseModel | None,
                    model: type[M] | None) -> Any:
        try:
            resp = await self._client.request(
                method, self.base_url + path,
                content=body.model_dump_json(exclude_none=True) if body is not None else None,
                headers={**self._headers, "content-type": "application/json"}
                if body is not None else self._headers,
            )
        except httpx.HTTPError as exc:
            raise ServiceUnavailable(f"{method} {self.base_url}{path}: {exc!r}") from exc
        return answer(method, path, resp.status_code, resp.content, model)


def answer(method: str, path: str, status: int, content: bytes, model: type[M] | None) -> Any:
    """One reply, whatever the transport that fetched it: a 5xx is ``ServiceUnavailable``, a
    4xx ``RequestRejected`` (404: ``NotFound``) with the server's message and field, else
    ``model`` parsed (None for no model or a 204)."""
    if status >= 500:
        text = content.decode(errors="replace")
        raise ServiceUnavailable(f"{method} {path}: HTTP {status} {text[:200]}")
    if status >= 400:
        try:
            err = json.loads(content).get("error", {})
        except (ValueError, AttributeError):
            err = {}
        if not isinstance(err, dict):
            err = {}
        cls = NotFound if status == 404 else RequestRejected
        raise cls(status, err.get("message", content.decode(errors="replace")[:200]),
                  err.get("param"))
    if model is None or status == 204:
        return None
    return model.model_validate_json(content)


class KvindexClient(_JsonClient):
    """The kvindex's REST API (services/kvindex), one method per route."""

    async def register(self, reg: PodRegistration) -> PodInfo:
        return await self._call("POST", "/v1/pods", reg, PodInfo)

    async def heartbeat(self, pod: str) -> LeaseInfo:
        return await self._call("POST", f"/v1/pods/{pod}/heartbeat", None, LeaseInfo)

    async def deregister(self, pod: str) -> None:
        await self._call("DELETE", f"/v1/pods/{pod}", None, None)

    async def pods(self) -> PodList:
        return await self._call("GET", "/v1/pods", None, PodList)

    async def events(self, batch: EventBatch) -> EventBatchResult:
        return await self._call("POST", "/v1/events", batch, EventBatchResult)

    async def snapshot(self, pod: str, snap: ChunkSnapshot) -> LeaseInfo:
        return await self._call("PUT", f"/v1/pods/{pod}/chunks", snap, LeaseInfo)

    async def locate(self, chunk_hash: str) -> ChunkLocations:
        return await self._call("GET", f"/v1/chunks/{chunk_hash}", None, ChunkLocations)

    async def lookup(self, req: LookupRequest) -> LookupResponse:
        return await self._call("POST", "/v1/lookup", req, LookupResponse)

    async def residency(self) -> ResidencyListing:
        return await self._call("GET", "/v1/residency", None, ResidencyListing)

    async def residency_changes(self, after: str, wait_s: float = 0.0, limit: int = 1000
                                ) -> ResidencyChanges:
        query = urlencode({"after": after, "wait_s": wait_s, "limit": limit})
        return await self._call("GET", f"/v1/residency/changes?{query}", None, ResidencyChanges)

    async def prefetch(self, req: PrefetchRequest) -> FanoutResponse:
        return await self._call("POST", "/v1/prefetch", req, FanoutResponse)

    async def evict(self, req: EvictRequest) -> FanoutResponse:
        return await self._call("POST", "/v1/evict", req, FanoutResponse)

    async def put_intent(self, session_id: str, intent: str, chunks: list[str]) -> SessionInfo:
        return await self._call("PUT", session_path(session_id, "intents", intent),
                                IntentChunks(chunk_hashes=chunks), SessionInfo)

    async def get_intent(self, session_id: str, intent: str) -> list[str]:
        body = await self._call("GET", session_path(session_id, "intents", intent), None,
                                IntentChunks)
        return body.chunk_hashes

    async def session(self, session_id: str) -> SessionInfo:
        return await self._call("GET", session_path(session_id), None, SessionInfo)

    async def close_session(self, session_id: str) -> SessionClosed:
        """End the session: the kvindex evicts its chunks that no other live session uses."""
        return await self._call("DELETE", session_path(session_id), None, SessionClosed)

    async def pin(self, session_id: str, ttl_s: float, pods: Sequence[str] = ()) -> SessionInfo:
        return await self._call("POST", session_path(session_id, "pin"),
                                PinRequest(ttl_s=ttl_s, pods=list(pods)), SessionInfo)

    async def release(self, session_id: str) -> SessionInfo:
        return await self._call("POST", session_path(session_id, "release"), None, SessionInfo)

    async def set_priority(self, session_id: str, priority: int) -> SessionInfo:
        return await self._call("PUT", session_path(session_id, "priority"),
                                PriorityRequest(priority=priority), SessionInfo)

    async def put_route(self, session_id: str, route: SessionRoute) -> SessionRoute:
        return await self._call("PUT", session_path(session_id, "route"), route, SessionRoute)

    async def put_context(self, session_id: str, ctx: SessionContext) -> ContextWritten:
        """The turn's context under the session (creating it), with the routing record and
        the context-change eviction, in one call."""
        return await self._call("PUT", session_path(session_id, "context"), ctx,
                                ContextWritten)

    async def get_route(self, session_id: str) -> SessionRoute:
        return await self._call("GET", session_path(session_id, "route"), None, SessionRoute)

    async def fork(self, session_id: str, child: str) -> SessionInfo:
        return await self._call("POST", session_path(session_id, "fork"),
                                ForkRequest(child=child), SessionInfo)

    async def put_stored_response(self, response_id: str, stored: StoredResponse
                                  ) -> StoredResponse:
        """Keep a Responses API object with its conversation for every proxy replica; the
        answer carries the TTL the kvindex kept it for."""
        return await self._call("PUT", stored_response_path(response_id), stored,
                                StoredResponse)

    async def get_stored_response(self, response_id: str) -> StoredResponse:
        return await self._call("GET", stored_response_path(response_id), None, StoredResponse)

    async def delete_stored_response(self, response_id: str) -> StoredResponseDeleted:
        return await self._call("DELETE", stored_response_path(response_id), None,
                                StoredResponseDeleted)


class MemoryApiClient(_JsonClient):
    """A pod's memory API (seed 000): asynchronous prefetch, evict by location."""

    async def prefetch(self, req: MemoryPrefetchRequest) -> MemoryPrefetchResponse:
        return await self._call("POST", "/memory/prefetch", req, MemoryPrefetchResponse)

    async def evict(self, req: MemoryEvictRequest) -> MemoryEvictResponse:
        return await self._call("POST", "/memory/evict", req, MemoryEvictResponse)
