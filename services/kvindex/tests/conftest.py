"""Fixtures shared by the kvindex tests: one private redis-server for the whole session, the
``index``/``sessions`` pair parametrized over both backends (the contract suite), and pods'
memory APIs as real HTTP servers that record what the fan-out sends them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import redis

from agentserving.kvindex.index.base import Index, SessionStore
from agentserving.kvindex.index.factory import new_index
from testkit.servers import MemoryApiPeer, RedisServer
from testkit.servers import redis_server as running_redis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> str:
    """The ``store`` setting for one backend; the Redis database starts empty."""
    if request.param == "memory":
        return "memory"
    server: RedisServer = request.getfixturevalue("redis_server")
    with redis.Redis(port=server.port) as client:
        client.flushdb()
    return server.url


@pytest.fixture
async def backends(store: str) -> AsyncIterator[tuple[Index, SessionStore]]:
    index, sessions = new_index(store)
    try:
        yield index, sessions
    finally:
        await index.close()
        await sessions.close()


@pytest.fixture
def index(backends: tuple[Index, SessionStore]) -> Index:
    return backends[0]


@pytest.fixture
def sessions(backends: tuple[Index, SessionStore]) -> SessionStore:
    return backends[1]


@pytest.fixture
def memory_api() -> Iterator[Callable[..., MemoryApiPeer]]:
    """``memory_api(delay_s=0)`` starts a recording memory API; all stop after the test."""
    started: list[MemoryApiPeer] = []

    def start(delay_s: float = 0.0) -> MemoryApiPeer:
        started.append(MemoryApiPeer(delay_s))
        return started[-1]

    yield start
    for peer in started:
        peer.stop()
