"""The kvindex service: the FastAPI app, its lifespan (reapers, event ingest), and routers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from agentserving.core.internal_auth import auth_headers
from agentserving.core.logging import get_logger
from agentserving.core.service import (
    ApiError,
    error_responses,
    install_error_handlers,
    install_health_route,
    install_internal_auth,
    install_metrics_route,
)
from agentserving.kvindex.controllers.reaper import expire_sessions_forever, reap_forever
from agentserving.kvindex.http_apis import (
    control,
    pods,
    residency,
    residency_feed,
    session_context,
    sessions,
    stored_responses,
)
from agentserving.kvindex.http_apis.deps import KvindexState, ServiceMetrics
from agentserving.kvindex.index.base import BackendUnavailable, Index, SessionStore
from agentserving.kvindex.index.changes import ChangeFeed, MemoryChangeFeed
from agentserving.kvindex.index.factory import new_feed, new_index
from agentserving.kvindex.index.instrumented import IndexMetrics, Instrumented
from agentserving.kvindex.index.publishing import FeedMetrics, Publishing
from agentserving.kvindex.settings import KvindexSettings

log = get_logger(__name__)
SHUTDOWN_STEP_S = 5.0


async def _bounded(what: str, step: Awaitable[object]) -> None:
    """One shutdown step, given up after ``SHUTDOWN_STEP_S``: a store connection stuck in a
    command a cancelled reaper left behind must not keep the process from exiting."""
    try:
        await asyncio.wait_for(step, SHUTDOWN_STEP_S)
    except TimeoutError:
        log.warning("kvindex_shutdown_step_timed_out", step=what, after_s=SHUTDOWN_STEP_S)


def create_app(settings: KvindexSettings, index: Index | None = None,
               session_store: SessionStore | None = None, feed: ChangeFeed | None = None
               ) -> FastAPI:
    """Build the app; ``index``/``session_store`` default to the backends named by ``store``
    and ``feed`` to the change feed beside them (in-process when the backends are given)."""
    if index is None or session_store is None:
        index, session_store = new_index(settings.store, **settings.redis_options())
        feed = feed or new_feed(settings.store, settings.change_feed_max,
                                **settings.redis_options())
    feed = feed or MemoryChangeFeed(settings.change_feed_max)
    registry = CollectorRegistry()
    store_kind = "memory" if settings.store == "memory" else "redis"
    index_metrics = IndexMetrics(registry)
    feed_metrics = FeedMetrics(registry)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        st = KvindexState(
            settings=settings,
            index=Publishing(Instrumented(index, index_metrics, store_kind), feed,  # type: ignore[arg-type]
                             feed_metrics),
            sessions=Instrumented(session_store, index_metrics, store_kind),  # type: ignore[arg-type]
            http=httpx.AsyncClient(headers=auth_headers(settings.internal_token)),
            registry=registry,
            metrics=ServiceMetrics(registry),
            feed=feed,
        )
        app.state.kv = st
        tasks = [asyncio.create_task(reap_forever(st.index, settings.reap_interval_s)),
                 asyncio.create_task(expire_sessions_forever(st.sessions,
                                                             settings.reap_interval_s))]
        if settings.vllm_event_endpoints:
            from agentserving.kvindex.ingest.vllm_events import subscribe_forever

            tasks.append(asyncio.create_task(subscribe_forever(st, settings.vllm_event_endpoints)))
        if settings.lmcache_controller:
            from agentserving.kvindex.ingest.lmcache_controller import LmcacheControllerEndpoint

            app.state.lmcache = LmcacheControllerEndpoint(
                st, settings.lmcache_controller, settings.lmcache_controller_reply,
                settings.lmcache_instance_pods)
            tasks.append(asyncio.create_task(app.state.lmcache.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await _bounded("background_tasks", asyncio.gather(*tasks, return_exceptions=True))
            for name, close in (("http", st.http.aclose), ("index", index.close),
                                ("sessions", session_store.close), ("feed", feed.close)):
                await _bounded(name, close())

    app = FastAPI(
        title="AgentServing kvindex",
        version="v1",
        summary="The cluster's directory of KV chunks: chunk_hash -> (pod, tier).",
        lifespan=lifespan,
    )
    install_error_handlers(app, max_body_bytes=settings.max_body_bytes)
    install_internal_auth(app, settings.internal_token)
    install_metrics_route(app, registry)
    install_health_route(app)

    @app.get("/readyz", tags=["health"], responses=error_responses(503),
             summary="The store behind the index answers.")
    async def readyz() -> dict[str, str]:
        st: KvindexState = app.state.kv
        try:
            await st.index.ping()
            await st.sessions.ping()
            await st.feed.ping()
        except BackendUnavailable as exc:
            raise ApiError(503, f"store unavailable: {exc}", type="service_unavailable") from exc
        return {"status": "ready", "store": store_kind}

    for router in (pods.router, residency.router, residency_feed.router, control.router,
                   sessions.router, session_context.router, stored_responses.router):
        app.include_router(router)
    return app
