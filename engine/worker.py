"""``agentserving worker``: the API process, which starts and supervises the engine processes.

One asyncio loop serves two HTTP servers — the OpenAI-compatible API on ``port`` and the
forwarding memory API on ``memory_port_start`` — next to the engine client (ZMQ) and the
kvindex reporter. Both servers answer while the engines load (``/readyz`` says when they are
ready). SIGTERM/SIGINT stop it cleanly: servers first, then the kvindex registration, then
the engine processes. If an engine process dies, the worker exits with status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

import uvicorn

from agentserving.core.clients import KvindexClient
from agentserving.core.logging import get_logger
from agentserving.core.schemas import PodRegistration, Tier
from agentserving.engine.api.engine_client import EngineClient, EngineDead
from agentserving.engine.api.server import WorkerApi, create_api_app
from agentserving.engine.memory_api import EngineFanout, forwarding_memory_app
from agentserving.engine.metrics import WorkerMetrics
from agentserving.engine.model.tokenizer import load_tokenizer
from agentserving.engine.reporter import KvindexReporter, ResidencyBook
from agentserving.engine.settings import WorkerSettings

log = get_logger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (two servers share one loop here)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def registration(settings: WorkerSettings, client: EngineClient) -> PodRegistration:
    host = settings.public_host
    capacity = {Tier(t): n for t, n in client.capacity_bytes().items()}
    return PodRegistration(
        pod=settings.pod_name, memory_api_url=f"http://{host}:{settings.memory_port_start}",
        api_url=f"http://{host}:{settings.port}", role=settings.role, model=settings.model_name,
        hash_scheme=settings.hash_scheme, chunk_size=settings.chunk_size,
        capacity_bytes=capacity, labels={"engine_processes": str(settings.engine_processes)})


async def serve(settings: WorkerSettings) -> int:
    metrics = WorkerMetrics(max_tenants=settings.metrics_max_tenants)
    book = ResidencyBook()
    reporter: KvindexReporter | None = None
    client = EngineClient(settings, metrics, book,
                          on_changes=lambda ch: reporter.on_changes(ch) if reporter else None)
    tokenizer = load_tokenizer(settings.model)
    api = WorkerApi(settings, client, tokenizer, metrics, max_model_len=1)

    def _on_ready(ready: object) -> None:  # before any request passes wait_ready
        api.max_model_len = ready.max_model_len  # type: ignore[attr-defined]

    client.on_ready = _on_ready
    fanout = EngineFanout(client.memory_urls(), token=settings.internal_token)
    servers = [
        _Server(uvicorn.Config(create_api_app(api), host=settings.host, port=settings.port,
                               log_level="warning", access_log=False, timeout_keep_alive=30)),
        _Server(uvicorn.Config(forwarding_memory_app(fanout, _backends(settings),
                                                     settings.internal_token),
                               host=settings.host, port=settings.memory_port_start,
                               log_level="warning", access_log=False)),
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    code = 0
    try:
        try:
            await client.start()
        except EngineDead as exc:
            log.error("worker_start_failed", error=str(exc))
            return 1
        log.info("worker_ready", port=settings.port, memory_port=settings.memory_port_start,
                 engines=settings.engine_processes, model=settings.model_name,
                 role=settings.role.value)
        if settings.kvindex_url:
            reporter = KvindexReporter(
                KvindexClient(settings.kvindex_url, timeout_s=2.0,
                              token=settings.internal_token),
                lambda: registration(settings, client), book,
                heartbeat_interval_s=settings.heartbeat_interval_s,
                flush_interval_s=settings.event_flush_interval_s, metrics=metrics)
            reporter.on_changes([])  # changes so far are in the book: the first snapshot has them
            reporter.start()
        died = asyncio.create_task(client.died.wait())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({died, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if client.dead:
            code = 1
        died.cancel()
        stopped.cancel()
    finally:
        for s in servers:
            s.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
        if reporter is not None:
            await reporter.close(deregister=True)
        await fanout.aclose()
        await client.close()
        log.info("worker_stopped", code=code)
    return code


def _backends(settings: WorkerSettings) -> list[str]:
    out = ["LocalCPUBackend"]
    if settings.disk_cache_dir is not None:
        out.append("LocalDiskBackend")
    return out


def run(settings: WorkerSettings) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per memory-API call
    return asyncio.run(serve(settings))
