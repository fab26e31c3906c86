"""The proxy's pod pool following a real kvindex registry over HTTP: a registry that lists no
pod at all, where it listed some (every lease lapsed in a store outage), keeps the last-known
pods for a grace period; any other change is followed at once."""

from __future__ import annotations

import asyncio

from agentserving.core.schemas import PodRegistration, PodRole
from agentserving.kvindex.app import create_app as create_kvindex
from agentserving.kvindex.index.memory import InMemoryIndex, InMemorySessionStore
from agentserving.kvindex.settings import KvindexSettings
from agentserving.proxy.kvindex_http import AioKvindexClient
from agentserving.proxy.pods import PodPool
from testkit.clock import ManualClock
from testkit.servers import ThreadedServer

LEASE_S = 1.5  # long enough for the first steps on a loaded machine


def _reg(pod: str) -> PodRegistration:
    return PodRegistration(pod=pod, memory_api_url=f"http://127.0.0.1:1/{pod}", role=PodRole.BOTH,
                           model="m", api_url=f"http://127.0.0.1:1/{pod}")


def _names(pool: PodPool) -> list[str]:
    return sorted(c.name for c in pool.prefill_candidates())


def test_an_emptied_registry_keeps_the_last_known_pods_for_the_grace_period():
    server = ThreadedServer(create_kvindex(KvindexSettings(lease_ttl_s=LEASE_S),
                                           InMemoryIndex(), InMemorySessionStore()))
    clock = ManualClock()

    async def go() -> list[list[str]]:
        kv = AioKvindexClient(server.url, 1.0)
        pool = PodPool([], [], kv, empty_registry_grace_s=10.0, clock=clock)
        seen = []
        try:
            for pod in ("a", "b"):
                await kv.register(_reg(pod))
            await pool.refresh()
            seen.append(_names(pool))                     # both registered
            await kv.deregister("b")
            await pool.refresh()
            seen.append(_names(pool))                     # a smaller list: followed at once
            await asyncio.sleep(LEASE_S + 0.5)            # no heartbeat: a's lease lapses
            assert (await kv.pods()).pods == []
            await pool.refresh()
            seen.append(_names(pool))                     # none listed: a is kept
            clock.now += 9.0
            await pool.refresh()
            seen.append(_names(pool))                     # still within the grace period
            await kv.register(_reg("c"))                  # a pod registers again: followed
            await pool.refresh()
            seen.append(_names(pool))
            await kv.deregister("c")
            await pool.refresh()                          # emptied again: a new grace period
            seen.append(_names(pool))
            clock.now += 10.0
            await pool.refresh()                          # past it: the registry is believed
            seen.append(_names(pool))
        finally:
            await kv.aclose()
        return seen

    try:
        seen = asyncio.run(go())
    finally:
        server.stop()
    assert seen == [["a", "b"], ["a"], ["a"], ["a"], ["c"], ["c"], []]


def test_without_a_grace_period_an_emptied_registry_is_followed_at_once():
    server = ThreadedServer(create_kvindex(KvindexSettings(), InMemoryIndex(),
                                           InMemorySessionStore()))

    async def go() -> tuple[list[str], list[str]]:
        kv = AioKvindexClient(server.url, 1.0)
        pool = PodPool([], [], kv)
        try:
            await kv.register(_reg("a"))
            await pool.refresh()
            before = _names(pool)
            await kv.deregister("a")
            await pool.refresh()
            return before, _names(pool)
        finally:
            await kv.aclose()

    try:
        assert asyncio.run(go()) == (["a"], [])
    finally:
        server.stop()
