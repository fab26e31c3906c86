"""KV servers on loopback (the real app, its lifespan running the LMCache protocol server),
and LMCache's own ``lm://`` client against them (``testkit.kvserver``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit.kvserver import KvServer, LmClient, start_kvserver


@pytest.fixture
def kvserver_factory() -> Iterator:
    started: list[KvServer] = []

    def start(capacity_bytes: int = 1 << 20, **settings: object) -> KvServer:
        started.append(start_kvserver(capacity_bytes, **settings))
        return started[-1]

    yield start
    for server in started:
        server.http.stop()


@pytest.fixture
def kvserver(kvserver_factory) -> KvServer:  # type: ignore[no-untyped-def]
    return kvserver_factory()


@pytest.fixture
def lm_client_factory() -> Iterator:
    clients: list[LmClient] = []

    def connect(port: int) -> LmClient:
        clients.append(LmClient(port))
        return clients[-1]

    yield connect
    for client in clients:
        client.close()
