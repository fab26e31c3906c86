"""On a fixed period, drops pods whose lease lapsed (with their residency) and agent sessions
that expired idle (with their chunk references).

Both are invisible to every read the moment they lapse, so the sweeps only reclaim storage: a
late or failed sweep never makes a dead pod routable or an expired session protect chunks.
Expired sessions are dropped, not evicted from the pods: their KV may still be someone's
prefix, and the pods' own LRU ages it out once nothing protects it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from agentserving.core.logging import get_logger
from agentserving.kvindex.index.base import BackendUnavailable, Index, SessionStore

log = get_logger(__name__)


async def _sweep_forever(sweep: Callable[[], Awaitable[list[str]]], interval_s: float,
                         what: str, key: str) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            gone = await sweep()
        except BackendUnavailable:
            continue
        except Exception:  # a reaper that dies silently would leak dead state forever
            log.exception(f"{what}_reaper_failed")
            continue
        for name in gone:
            log.info(f"{what}_expired", **{key: name})


async def reap_forever(index: Index, interval_s: float) -> None:
    await _sweep_forever(index.expire_leases, interval_s, "pod_lease", "pod")


async def expire_sessions_forever(sessions: SessionStore, interval_s: float) -> None:
    await _sweep_forever(sessions.expire_sessions, interval_s, "session", "session_id")
