"""The proxy's kvindex client: ``KvindexClient``'s routes and contract, over aiohttp.

Every routed turn asks the kvindex once, so under load the proxy holds many lookups in flight.
httpx's connection pool (httpcore) rescans every queued request against every connection on
each change, so once a burst queues more lookups than it has connections its CPU grows with the
square of the queue: with 1,000 agent sessions (``bench/control_plane_load_bench.py``) that
scan took 70 % of the proxy's CPU, lookups waited out the kvindex timeout, more than half the
turns were routed without the index and the P99 turn took over 13 s. aiohttp's pool hands a freed
connection to the next waiter in constant time, and its calls cost the proxy a quarter of
httpx's CPU (``upstream.py``).

Same methods, same models, same failures as ``KvindexClient`` (only its transport differs):
unreachable, a timeout or a 5xx is ``ServiceUnavailable``; a 4xx is ``RequestRejected`` (a 404
``NotFound``) with the kvindex's message and field. The timeout bounds each phase as httpx's
does: getting a connection (pool wait + connect), and each read.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from pydantic import BaseModel

from agentserving.core.clients import KvindexClient, M, ServiceUnavailable, answer
from agentserving.core.internal_auth import auth_headers

_JSON = {"content-type": "application/json"}


class AioKvindexClient(KvindexClient):
    """``KvindexClient`` on one pooled aiohttp session (create it inside the event loop)."""

    def __init__(self, base_url: str, timeout_s: float = 2.0, max_connections: int = 100,
                 *, token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers: dict[str, str] = {}  # per call (for_tenant); the token is the session's
        self._owns_client = True
        self._session = aiohttp.ClientSession(
            headers=auth_headers(token),
            timeout=aiohttp.ClientTimeout(total=None, connect=timeout_s,
                                          sock_connect=timeout_s, sock_read=timeout_s),
            connector=aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=60))

    async def aclose(self) -> None:
        if self._owns_client:
            await self._session.close()

    async def _call(self, method: str, path: str, body: BaseModel | None,
                    model: type[M] | None) -> Any:
        try:
            async with self._session.request(
                    method, self.base_url + path,
                    data=body.model_dump_json(exclude_none=True) if body is not None else None,
                    headers={**self._headers, **_JSON} if body is not None
                    else self._headers) as resp:
                status, content = resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ServiceUnavailable(f"{method} {self.base_url}{path}: {exc!r}") from exc
        return answer(method, path, status, content, model)
