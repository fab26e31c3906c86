"""Where stored Responses API objects and their conversations live (``store: true``).

With a kvindex the store is its Redis (``/v1/stored-responses``): every proxy replica reads
what another stored, entries expire and their number and size are bounded there. Without one
(a single proxy in front of pods given by URL) it is this process's memory, bounded the same
way; a restart forgets it, which the docs say. Entries are the tenant's: one tenant never
reads another's, by the kvindex's tenant scope or by the key here.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable
from typing import Protocol, TypeVar

from agentserving.core.clients import KvindexClient, NotFound, RequestRejected, ServiceUnavailable
from agentserving.core.schemas import StoredResponse
from agentserving.core.service import ApiError

T = TypeVar("T")


class ResponseStore(Protocol):
    async def put(self, tenant: str | None, response_id: str, entry: StoredResponse) -> None: ...

    async def get(self, tenant: str | None, response_id: str) -> StoredResponse | None: ...

    async def delete(self, tenant: str | None, response_id: str) -> bool: ...


async def _guarded(call: Awaitable[T]) -> T | None:
    """A kvindex call's answer, None for a 404; a kvindex that is down is a 503 (never a
    response taken as missing), its verdict on an id or an entry the client's 4xx."""
    try:
        return await call
    except NotFound:
        return None
    except ServiceUnavailable as exc:
        raise ApiError(503, f"the response store is unavailable: {exc}",
                       type="service_unavailable", code="response_store_unavailable",
                       headers={"Retry-After": "1"}) from exc
    except RequestRejected as exc:  # an id it cannot hold, an entry over its size bound
        raise ApiError(exc.status_code, f"response store: {exc}",
                       param=exc.param or "store") from exc


class KvindexResponseStore:
    """The kvindex's store, shared by every proxy replica."""

    def __init__(self, kvindex: KvindexClient) -> None:
        self.kvindex = kvindex

    async def put(self, tenant: str | None, response_id: str, entry: StoredResponse) -> None:
        await _guarded(self.kvindex.for_tenant(tenant).put_stored_response(response_id, entry))

    async def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        return await _guarded(self.kvindex.for_tenant(tenant).get_stored_response(response_id))

    async def delete(self, tenant: str | None, response_id: str) -> bool:
        return await _guarded(
            self.kvindex.for_tenant(tenant).delete_stored_response(response_id)) is not None


class LocalResponseStore:
    """This process's store: least recently written out past ``max_entries``, each entry
    gone after its TTL."""

    def __init__(self, max_entries: int, ttl_s: float, clock=time.monotonic) -> None:  # type: ignore[no-untyped-def]
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self._entries: OrderedDict[tuple[str | None, str], tuple[float, StoredResponse]] = \
            OrderedDict()

    async def put(self, tenant: str | None, response_id: str, entry: StoredResponse) -> None:
        ttl = min(entry.ttl_s or self.ttl_s, self.ttl_s)
        key = (tenant, response_id)
        self._entries.pop(key, None)
        self._entries[key] = (self.clock() + ttl, entry.model_copy(update={"ttl_s": ttl}))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    async def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        found = self._entries.get((tenant, response_id))
        if found is None:
            return None
        if found[0] <= self.clock():
            del self._entries[(tenant, response_id)]
            return None
        return found[1]

    async def delete(self, tenant: str | None, response_id: str) -> bool:
        return (await self.get(tenant, response_id) is not None
                and self._entries.pop((tenant, response_id), None) is not None)
