"""The kvindex reporter keeps residency changes that arrive while a batch is in flight.

The worker's engine client hands changes to the reporter from its own task, so a change can
come in while ``POST /v1/events`` is awaited. Such changes were dropped for good (the pending
list was replaced by what was left of it when the batch was cut), and the kvindex never learnt
of those chunks until a resync: found by ``bench/control_plane_load_bench.py``, where the
index held fewer chunks than the pods did. Against a real kvindex process.
"""

from __future__ import annotations

import asyncio

import httpx

from agentserving.core.clients import KvindexClient
from agentserving.core.hashing import ChunkHasher
from agentserving.core.schemas import EventBatch, EventBatchResult, PodRegistration
from agentserving.engine.reporter import KvindexReporter, ResidencyBook
from testkit.servers import AGENTSERVING, free_port, service_process

H = ChunkHasher("blake3", 4).hashes(list(range(40)))  # 10 chained hashes


class ChangesDuringEvents(KvindexClient):
    """A real client whose first event batch sees more changes arrive while it is sent."""

    def __init__(self, url: str, arrive) -> None:  # type: ignore[no-untyped-def]
        super().__init__(url, timeout_s=5.0)
        self.arrive = arrive

    async def events(self, batch: EventBatch) -> EventBatchResult:
        call = asyncio.ensure_future(super().events(batch))
        if self.arrive is not None:
            await asyncio.sleep(0)  # the request is under way
            self.arrive()
            self.arrive = None
        return await call


def test_changes_arriving_while_a_batch_is_sent_reach_the_kvindex(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    exe = AGENTSERVING

    async def scenario() -> None:
        book = ResidencyBook(chunk_bytes=10)
        reg = PodRegistration(pod="p1", memory_api_url="http://127.0.0.1:9", model="tiny",
                              chunk_size=4)
        rep = KvindexReporter(ChangesDuringEvents(
            url, lambda: rep.on_changes(book.apply(0, {"cpu": H[3:6]}, {}))),
            lambda: reg, book, heartbeat_interval_s=60.0)
        try:
            await rep.tick()  # register and the (empty) first snapshot
            rep.on_changes(book.apply(0, {"cpu": H[:3]}, {}))
            await rep.tick()  # sends H[:3]; H[3:6] arrive meanwhile, and go next
            pod = httpx.get(f"{url}/v1/pods/p1", timeout=5).json()
            assert pod["chunks"] == {"cpu": 6}
            assert not rep._pending  # noqa: SLF001
        finally:
            await rep.close(deregister=False)

    with service_process([exe, "kvindex", "--port", str(port), "--store", "memory"],
                         url + "/healthz", log_path=tmp_path / "kvindex.log"):
        asyncio.run(scenario())
