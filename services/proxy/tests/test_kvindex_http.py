"""The proxy's aiohttp kvindex client keeps ``KvindexClient``'s contract, against a real
kvindex process: the same models back, 4xx as ``RequestRejected`` / ``NotFound`` naming the
field, unreachable or too slow as ``ServiceUnavailable``; and many lookups in flight at once
(what 1,000 agent sessions make: httpx's pool collapsed under them) all answer."""

from __future__ import annotations

import asyncio
import socket

import pytest

from agentserving.core.clients import (
    KvindexClient,
    NotFound,
    RequestRejected,
    ServiceUnavailable,
)
from agentserving.core.hashing import ChunkHasher
from agentserving.core.schemas import (
    EventBatch,
    LookupRequest,
    PodRegistration,
    PodRole,
    PrefetchRequest,
    ResidencyEvent,
)
from agentserving.proxy.kvindex_http import AioKvindexClient
from testkit.servers import AGENTSERVING, free_port, service_process

H = ChunkHasher("blake3", 4).hashes(list(range(40)))  # 10 chained hashes


@pytest.fixture(scope="module")
def kvindex(tmp_path_factory):  # type: ignore[no-untyped-def]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("kvindex") / "kvindex.log"
    with service_process([AGENTSERVING, "kvindex", "--port", str(port), "--store", "memory",
                          "--log-level", "warning"], url + "/readyz", log_path=log):
        yield url


def test_same_answers_as_the_httpx_client(kvindex: str) -> None:
    async def scenario() -> None:
        aio, ref = AioKvindexClient(kvindex, 5.0), KvindexClient(kvindex, 5.0)
        try:
            reg = PodRegistration(pod="aio-a", memory_api_url="http://127.0.0.1:9",
                                  api_url="http://127.0.0.1:10", model="m", chunk_size=4)
            info = await aio.register(reg)
            assert info.pod == "aio-a" and info.api_url == "http://127.0.0.1:10"
            await aio.events(EventBatch(pod="aio-a", seq=info.seq + 1, events=[
                ResidencyEvent(op="stored", tier="device", chunk_hashes=H[:6])]))
            req = LookupRequest(chunk_hashes=H, pods=["aio-a"], role=PodRole.PREFILL)
            got, want = await aio.lookup(req), await ref.lookup(req)
            assert got == want and got.best_pod == "aio-a" and got.pods[0].prefix_chunks == 6
            assert [p.pod for p in (await aio.pods()).pods] == \
                [p.pod for p in (await ref.pods()).pods]
            assert (await aio.locate(H[0])).locations[0].pod == "aio-a"
            await aio.deregister("aio-a")  # a 204: no body to read
            with pytest.raises(NotFound):
                await aio.heartbeat("aio-a")
            with pytest.raises(RequestRejected) as rejected:
                await aio.prefetch(PrefetchRequest.model_construct(chunk_hashes=["XYZ"]))
            assert rejected.value.status_code == 400 and rejected.value.param
            assert not isinstance(rejected.value, NotFound)
        finally:
            await aio.aclose()
            await ref.aclose()

    asyncio.run(scenario())


def test_unreachable_and_silent_kvindex_are_service_unavailable() -> None:
    async def scenario(silent_port: int) -> None:
        down = AioKvindexClient(f"http://127.0.0.1:{free_port()}", 0.5)
        silent = AioKvindexClient(f"http://127.0.0.1:{silent_port}", 0.3)
        try:
            with pytest.raises(ServiceUnavailable):
                await down.pods()
            with pytest.raises(ServiceUnavailable):  # accepts, never answers: read timeout
                await silent.lookup(LookupRequest(chunk_hashes=H))
        finally:
            await down.aclose()
            await silent.aclose()

    with socket.socket() as listener:  # a peer that accepts and says nothing
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        asyncio.run(scenario(listener.getsockname()[1]))


def test_many_lookups_in_flight_all_answer(kvindex: str) -> None:
    async def scenario() -> None:
        aio = AioKvindexClient(kvindex, 30.0)
        try:
            info = await aio.register(PodRegistration(
                pod="aio-b", memory_api_url="http://127.0.0.1:9", model="m", chunk_size=4))
            await aio.events(EventBatch(pod="aio-b", seq=info.seq + 1, events=[
                ResidencyEvent(op="stored", tier="cpu", chunk_hashes=H)]))
            req = LookupRequest(chunk_hashes=H, pods=["aio-b"])
            answers = await asyncio.gather(*(aio.lookup(req) for _ in range(400)))
            assert all(a.best_pod == "aio-b" for a in answers)
        finally:
            await aio.aclose()

    asyncio.run(scenario())
