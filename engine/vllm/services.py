"""The connector's background services, outside vLLM's own loops (threads of their own).

- ``WorkerServices`` (each vLLM worker process, TP rank k): the memory API
  (``engine_memory_app``) over that rank's LMCache storage manager, on ``port_start + 1 + k``.
- ``SchedulerServices`` (vLLM's scheduler process, which holds no KV): the forwarding memory
  API on ``port_start`` (seed 000 §4.2: every call fanned out to all ranks, answers merged),
  and the kvindex reporter: it registers the pod, polls the ranks' ``/memory/chunks``, merges
  them in a ``ResidencyBook`` (a chunk is on the pod while any rank holds it) and sends the
  changes as numbered batches (``engine/reporter.py``, with its snapshot-on-resync and
  re-register-on-unknown-pod rules). Polling costs one small GET per rank per interval and sees
  LMCache's own LRU evictions, which no per-store hook would.

Decisions are the pure functions below (``residency_changes``, ``pod_registration``); the
classes only start, feed and stop things.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import uvicorn
from prometheus_client import REGISTRY

from agentserving.core.clients import KvindexClient
from agentserving.core.logging import get_logger
from agentserving.core.schemas import (
    MemoryChunks,
    MemoryPrefetchRequest,
    MemoryPullRequest,
    MemoryPullResult,
    PodRegistration,
    PodRole,
    Tier,
)
from agentserving.core.service import error_responses, install_metrics_route
from agentserving.engine import failpoints
from agentserving.engine.memory_api import (
    EngineFanout,
    MemoryBackend,
    engine_memory_app,
    forwarding_memory_app,
)
from agentserving.engine.reporter import Change, KvindexReporter, ResidencyBook

from .handoff import KvServerVerbs
from .hashes import FinishedParams
from .settings import ConnectorSettings
from .step_times import StepClock, merge_summaries

log = get_logger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without signal handling: vLLM owns the process's signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def residency_changes(prev: Mapping[str, set[str]], cur: Mapping[str, Sequence[str]]
                      ) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(stored, removed) per tier name between two ``/memory/chunks`` readings of one rank."""
    stored: dict[str, list[str]] = {}
    removed: dict[str, list[str]] = {}
    for tier in set(prev) | set(cur):
        before, now = prev.get(tier, set()), set(cur.get(tier, ()))
        if now - before:
            stored[tier] = sorted(now - before)
        if before - now:
            removed[tier] = sorted(before - now)
    return stored, removed


def configured_backends(lmcache_config: Any) -> list[str]:
    """The LMCache backends a rank has, from its config (for the forwarding API's checks)."""
    out = []
    if getattr(lmcache_config, "local_cpu", True):
        out.append("LocalCPUBackend")
    if getattr(lmcache_config, "local_disk", None):
        out.append("LocalDiskBackend")
    return out


def capacity_bytes(lmcache_config: Any) -> dict[Tier, int]:
    out = {}
    if getattr(lmcache_config, "local_cpu", True):
        out[Tier.CPU] = int(float(getattr(lmcache_config, "max_local_cpu_size", 0)) * 1024**3)
    if getattr(lmcache_config, "local_disk", None):
        out[Tier.DISK] = int(float(getattr(lmcache_config, "max_local_disk_size", 0)) * 1024**3)
    return out


def pod_registration(settings: ConnectorSettings, *, role: PodRole, model: str,
                     chunk_size: int, capacity: Mapping[Tier, int],
                     world_size: int) -> PodRegistration:
    host = settings.public_host
    return PodRegistration(
        pod=settings.pod_name, memory_api_url=f"http://{host}:{settings.memory_port_start}",
        api_url=f"http://{host}:{settings.api_port}", role=role, model=model,
        hash_scheme=settings.hash_scheme, chunk_size=chunk_size, capacity_bytes=dict(capacity),
        labels={"engine": "vllm", "engine_processes": str(world_size)})


def _serve_thread(app: Any, host: str, port: int, name: str) -> tuple[_Server, threading.Thread]:
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                    access_log=False))
    thread = threading.Thread(target=server.run, daemon=True, name=name)
    thread.start()
    return server, thread


def step_times_router(summary: Callable[[int], dict[str, Any]]) -> Any:
    """``GET /memory/steps``: this rank's KV wait on the critical path vs forward time
    (``step_times``); the scheduler's forwarding API answers the pod's (``add_steps_route``)."""
    from fastapi import APIRouter, Query

    router = APIRouter()

    @router.get("/memory/steps", tags=["memory"],
                summary="KV wait exposed per step that loads KV, next to the forward time.")
    async def steps(since: int = Query(0, ge=0, description="Only the steps numbered after "
                                       "this (a previous answer's last_step).")
                    ) -> dict[str, Any]:
        return summary(since)

    return router


def add_pull_route(app: Any, fanout: EngineFanout) -> None:
    """``POST /memory/pull`` on the forwarding API: every rank reads its own keys of the
    chunks from the named KV server (``peer_pull``); the pod's figures are the ranks' sums
    (a chunk counts as pulled by each rank that read its part)."""

    @app.post("/memory/pull", response_model=MemoryPullResult, tags=["memory"],
              responses=error_responses(503),
              summary="Read chunks from another pod's KV server into this pod's DRAM tier "
                      "(point-to-point P/D).")
    async def pull(req: MemoryPullRequest) -> MemoryPullResult:
        parts = [MemoryPullResult.model_validate(r)
                 for r in await fanout.call("POST", "/memory/pull", req)]
        return MemoryPullResult(
            num_pulled=min(p.num_pulled for p in parts), num_held=min(p.num_held for p in parts),
            num_missing=max(p.num_missing for p in parts),
            pulled_bytes=sum(p.pulled_bytes for p in parts),
            seconds=max(p.seconds for p in parts))


def add_steps_route(app: Any, fanout: EngineFanout) -> None:
    """``GET /memory/steps`` on the forwarding API: every rank's figures and the pod's (the
    slowest rank's: TP ranks wait for each other). A rank that does not answer is a 503."""
    from fastapi import Query

    @app.get("/memory/steps", tags=["memory"],
             summary="KV wait exposed per step that loads KV, next to the forward time, for "
                     "the pod and per rank.")
    async def steps(since: int = Query(0, ge=0, description="Only the steps numbered after "
                                       "this (a previous answer's pod.last_step).")
                    ) -> dict[str, Any]:
        ranks = await fanout.call("GET", f"/memory/steps?since={since}")
        return {"pod": merge_summaries(ranks), "ranks": ranks}


class WorkerServices:
    """The memory API of one vLLM worker process (TP rank ``rank``)."""

    def __init__(self, settings: ConnectorSettings, backend: MemoryBackend, rank: int,
                 steps: StepClock | None = None, routers: Sequence[Any] = ()) -> None:
        self.port = settings.worker_port(rank)
        self.backend = backend
        routers = [*routers, *([step_times_router(steps.summary)] if steps is not None else []),
                   *([failpoints.router()] if failpoints.enabled() else [])]
        self.server, self.thread = _serve_thread(engine_memory_app(backend, routers,
                                                                   token=settings.internal_token),
                                                 settings.memory_host, self.port,
                                                 f"agentserving-memory-{rank}")
        log.info("vllm_worker_memory_api", port=self.port, rank=rank)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()


class ResidencyPoller:
    """Reads every rank's ``/memory/chunks`` and turns differences into book changes."""

    def __init__(self, fanout: EngineFanout, book: ResidencyBook,
                 on_changes: Callable[[list[Change]], None],
                 device: Callable[[], Any | None] = lambda: None) -> None:
        self.fanout = fanout
        self.device = device  # vLLM's prefix cache (device_kv): rank 0 reports its chunks
        self.book = book
        self.on_changes = on_changes
        self._seen: list[dict[str, set[str]]] = [{} for _ in fanout.engine_urls]
        self.up = False

    async def poll_once(self) -> int:
        """One reading of all ranks; returns how many pod-level changes it produced. A rank
        that does not answer (still loading) is skipped this round."""
        try:
            parts = await self.fanout.call("GET", "/memory/chunks")
        except Exception as exc:  # noqa: BLE001 - ranks come up after the scheduler
            if self.up:
                log.warning("residency_poll_failing", error=repr(exc))
            self.up = False
            return 0
        if not self.up:
            log.info("residency_poll_ranks_up", ranks=len(parts))
        self.up = True
        n = 0
        for rank, raw in enumerate(parts):
            chunks = MemoryChunks.model_validate(raw).chunks
            cur = {str(t): list(v) for t, v in chunks.items()}
            device = self.device() if rank == 0 else None
            if device is not None:  # one block pool for every rank: reported once
                cur[str(Tier.DEVICE)] = device.device_chunks()
            stored, removed = residency_changes(self._seen[rank], cur)
            self._seen[rank] = {t: set(v) for t, v in cur.items()}
            changes = self.book.apply(rank, stored, removed)
            n += len(changes)
            self.on_changes(changes)
        return n


def add_finished_params_route(app: Any, finished: FinishedParams) -> None:
    """``GET /memory/requests/{request_id}/kv_transfer_params``: what a finished request's
    ``kv_transfer_params`` gained in this process at ``request_finished`` (chunk hashes, prompt
    sources), taken once. vLLM's API server streams no ``kv_transfer_params``; its middleware
    (``stream_hashes``) asks here for the stream's last event."""
    from agentserving.core.service import ApiError

    @app.get("/memory/requests/{request_id}/kv_transfer_params", tags=["memory"],
             summary="What a finished request's kv_transfer_params gained: chunk hashes and "
             "prompt sources (taken once; 404 when unknown).")
    async def finished_params(request_id: str) -> dict[str, Any]:
        params = finished.pop(request_id)
        if params is None:
            raise ApiError(404, f"request_id: no finished request {request_id!r} here",
                           param="request_id", type="not_found_error")
        return {"request_id": request_id, "kv_transfer_params": params}


def _ignore(changes: list[Change]) -> None:
    """Residency changes with no kvindex to report them to."""


def add_scheduler_stats_route(app: Any, stats: Callable[[], Callable[[], dict[str, Any]] | None]
                              ) -> None:
    """``GET /memory/scheduler``: the live figures of the prefill policy running in this
    pod's vLLM scheduler (``prefill.vllm_plugin``: the steps it decided and those it left to
    vLLM's own pass; with the ShadowScheduler, the N+1 window's prediction quality and the
    prefetches it started); 404 when vLLM's own scheduler runs."""
    from agentserving.core.service import ApiError

    @app.get("/memory/scheduler", tags=["memory"],
             summary="The vLLM scheduler plugin's live figures (404 without the plugin).")
    async def scheduler_stats() -> dict[str, Any]:
        fn = stats()
        if fn is None:
            raise ApiError(404, "no AgentServing scheduler policy runs in this pod's vLLM "
                           "scheduler (--scheduler-policy fcfs)", type="not_found_error")
        return fn()


class SchedulerServices:
    """Forwarding memory API + residency reporting, on one asyncio loop in its own thread."""

    def __init__(self, settings: ConnectorSettings, world_size: int, backends: Sequence[str],
                 registration: Callable[[], PodRegistration], chunk_bytes: int = 0,
                 finished: FinishedParams | None = None) -> None:
        self.finished = finished
        self.settings = settings
        self.world_size = world_size
        self.backends = list(backends)
        self.registration = registration
        self.book = ResidencyBook(chunk_bytes)
        self.reporter: KvindexReporter | None = None
        self.poller: ResidencyPoller | None = None
        self.fanout: EngineFanout | None = None
        # the scheduler plugin's live figures, served at GET /memory/scheduler (publish())
        self.scheduler_stats: Callable[[], dict[str, Any]] | None = None
        # the scheduler plugin's taker of announced requests (SchedulerKvHooks.take_announced)
        self.announced: Callable[[MemoryPrefetchRequest], bool] | None = None
        # vLLM's prefix cache as a tier (device_kv.DeviceKv, SchedulerKvHooks.take_device)
        self.device: Any | None = None
        self.loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name="agentserving-scheduler-services")
        self.thread.start()
        if not self._started.wait(30):
            raise RuntimeError("scheduler services did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        s = self.settings
        self._stop = asyncio.Event()
        fanout = self.fanout = EngineFanout(s.worker_urls(self.world_size), timeout_s=5.0,
                                            token=s.internal_token)
        server = s.kv_server_api
        app = forwarding_memory_app(
            fanout, self.backends, s.internal_token, announced=lambda: self.announced,
            device=lambda: self.device,
            kv_server=KvServerVerbs(server, s.internal_token) if server else None,
            residency=self.book.tiers)
        # this process's reuse counters (prompt tokens, device-tier hits: ``reuse``)
        install_metrics_route(app, REGISTRY)
        if self.finished is not None:
            add_finished_params_route(app, self.finished)
        add_scheduler_stats_route(app, lambda: self.scheduler_stats)
        add_steps_route(app, fanout)
        if s.kv_transfer_p2p:
            add_pull_route(app, fanout)
        api = _Server(uvicorn.Config(app, host=s.memory_host, port=s.memory_port_start,
                                     log_level="warning", access_log=False))
        tasks = [asyncio.create_task(api.serve())]
        if s.kvindex_url:
            self.reporter = KvindexReporter(
                KvindexClient(s.kvindex_url, timeout_s=2.0, token=s.internal_token),
                self.registration, self.book,
                heartbeat_interval_s=s.heartbeat_interval_s,
                flush_interval_s=s.report_interval_s)
            self.reporter.start()
        # the book is also what a prefill policy in vLLM's scheduler reads tiers from
        # (scheduler_hooks), kvindex or not
        on_changes = self.reporter.on_changes if self.reporter is not None else _ignore
        self.poller = ResidencyPoller(fanout, self.book, on_changes,
                                      device=lambda: self.device)
        tasks.append(asyncio.create_task(self._poll_forever()))
        self._started.set()
        log.info("vllm_scheduler_services", memory_port=s.memory_port_start,
                 kvindex=s.kvindex_url, ranks=self.world_size)
        try:
            await self._stop.wait()
        finally:
            api.should_exit = True
            for t in tasks[1:]:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.reporter is not None:
                await self.reporter.close(deregister=True)
            await fanout.aclose()

    async def _poll_forever(self) -> None:
        assert self.poller is not None
        while True:
            await self.poller.poll_once()
            await asyncio.sleep(self.settings.report_interval_s)

    def run_coroutine(self, coro: Any, timeout_s: float = 10.0) -> Any:
        """Run ``coro`` on the services' loop (tests drive a poll round with it)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        if self._stop is not None and self.loop.is_running():
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(10)
