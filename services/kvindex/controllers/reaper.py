"""Drops pods whose lease lapsed, with their residency, on a fixed period."""

from __future__ import annotations

import asyncio

from agentserving.core.logging import get_logger
from agentserving.kvindex.index.base import BackendUnavailable, Index

log = get_logger(__name__)


async def reap_forever(index: Index, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            gone = await index.expire_leases()
        except BackendUnavailable:
            continue
        except Exception:  # a reaper that dies silently would leak dead pods forever
            log.exception("lease_reaper_failed")
            continue
        for pod in gone:
            log.info("pod_lease_expired", pod=pod)
