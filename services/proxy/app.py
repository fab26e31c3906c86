"""The proxy service: OpenAI- and Anthropic-compatible routes in front of the worker pools."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry

from agentserving.core.service import (
    ApiError,
    error_responses,
    install_error_handlers,
    install_health_route,
    install_metrics_route,
)
from agentserving.proxy.agent_api_routes import install_agent_api_routes
from agentserving.proxy.auth import ApiKeys, Principal
from agentserving.proxy.engine_routes import install_engine_routes
from agentserving.proxy.intake import json_body, read_turn
from agentserving.proxy.jsonio import loads
from agentserving.proxy.kvindex_http import AioKvindexClient
from agentserving.proxy.metrics import ProxyMetrics
from agentserving.proxy.openapi import (
    TURN_RESPONSES,
    ChatTurn,
    CompletionTurn,
    document_turn_bodies,
    turn_body,
)
from agentserving.proxy.orchestrator import Orchestrator, Turn
from agentserving.proxy.pods import PodPool
from agentserving.proxy.residency_replica import ReplicaMetrics, ResidencyReplica, following
from agentserving.proxy.response_store import KvindexResponseStore, LocalResponseStore
from agentserving.proxy.routing import make_policy
from agentserving.proxy.settings import INDEXED_ROUTING, ProxySettings
from agentserving.proxy.upstream import UPSTREAM_ERRORS, new_session


def create_app(settings: ProxySettings) -> FastAPI:
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry)
    replica_metrics = ReplicaMetrics(registry)
    keys = (ApiKeys.load(settings.api_keys_file, settings.salt_secret)
            if settings.api_keys_file else None)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        http = new_session(settings.upstream_timeout_s, settings.upstream_connect_timeout_s)
        kvindex = (AioKvindexClient(settings.kvindex_url, settings.kvindex_timeout_s,
                                    token=settings.internal_token)
                   if settings.kvindex_url else None)
        pool = PodPool(settings.prefill_urls, settings.decode_urls, kvindex,
                       settings.empty_registry_grace_s)
        await pool.refresh()
        policy = make_policy(settings.routing, settings.chunk_size, settings.load_penalty_tokens)
        replica = _replica(settings, replica_metrics)
        app.state.responses = (
            KvindexResponseStore(kvindex) if kvindex is not None else
            LocalResponseStore(settings.max_stored_responses, settings.stored_response_ttl_s))
        app.state.orch = Orchestrator(settings, pool, kvindex, policy, http, metrics, replica)
        follower = asyncio.create_task(pool.follow(settings.discovery_interval_s))
        try:
            async with following(replica):
                yield
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await app.state.orch.aclose()
            await http.close()
            if kvindex is not None:
                await kvindex.aclose()
            if replica is not None:
                await replica.client.aclose()

    app = FastAPI(title="AgentServing proxy", version="v1", lifespan=lifespan,
                  summary="OpenAI-compatible front door routing each agent turn to its KV.")
    install_error_handlers(app)
    install_metrics_route(app, registry)
    install_health_route(app)

    def authenticate(request: Request) -> Principal | None:
        if keys is None:
            return None
        principal = keys.authenticate(_bearer(request))
        if principal is None:
            raise ApiError(401, "missing or invalid API key (Authorization: Bearer <key>, or "
                           "x-api-key: <key>)",
                           type="authentication_error", code="invalid_api_key")
        return principal

    async def read_openai_turn(request: Request, endpoint: str, required: str) -> Turn:
        principal = authenticate(request)
        body = json_body(await request.body())
        if required not in body:
            raise ApiError(400, f"{required}: field required", param=required)
        return read_turn(request.headers, principal, endpoint, body, metrics=metrics,
                         api="chat" if endpoint == "/v1/chat/completions" else "completions")

    @app.post("/v1/chat/completions", tags=["openai"], responses=TURN_RESPONSES,
              openapi_extra=turn_body(ChatTurn),
              summary="Chat completion, routed to the pod holding the session's KV.")
    async def chat_completions(request: Request) -> Any:
        return await app.state.orch.handle(
            await read_openai_turn(request, "/v1/chat/completions", "messages"))

    @app.post("/v1/completions", tags=["openai"], responses=TURN_RESPONSES,
              openapi_extra=turn_body(CompletionTurn),
              summary="Text completion, routed to the pod holding the session's KV.")
    async def completions(request: Request) -> Any:
        return await app.state.orch.handle(
            await read_openai_turn(request, "/v1/completions", "prompt"))

    @app.get("/v1/models", tags=["openai"], responses=error_responses(401),
             summary="The models the worker pools serve.")
    async def models(request: Request) -> dict[str, Any]:
        authenticate(request)
        orch: Orchestrator = app.state.orch
        await orch.pool.refresh()
        names = orch.pool.models() or await _models_from_pods(orch)
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "agentserving"}
            for m in names]}

    @app.get("/readyz", tags=["health"], responses=error_responses(503),
             summary="At least one worker pod is known.")
    async def readyz() -> dict[str, Any]:
        orch: Orchestrator = app.state.orch
        if not orch.pool.prefill_candidates():
            await orch.pool.refresh()
        pods = orch.pool.prefill_candidates()
        if not pods:
            raise ApiError(503, "no worker pods known", type="service_unavailable")
        return {"status": "ready", "prefill_pods": len(pods),
                "decode_pods": len(orch.pool.decode_candidates())}

    install_agent_api_routes(app, authenticate, install_engine_routes(app, registry,
                                                                      authenticate))
    document_turn_bodies(app)
    return app


def _bearer(request: Request) -> str | None:
    """The caller's key: ``Authorization: Bearer``, or Anthropic's ``x-api-key`` (what the
    anthropic SDK and Claude Code send)."""
    authorization = request.headers.get("authorization")
    if authorization is None and (key := request.headers.get("x-api-key")):
        return f"Bearer {key}"
    return authorization


def _replica(settings: ProxySettings, metrics: ReplicaMetrics) -> ResidencyReplica | None:
    """The in-process residency replica kv-aware routing reads, on a connection of its own
    (its long polls would hold a lookup's); None when routing does not look residency up."""
    if (not settings.residency_replica or settings.kvindex_url is None
            or settings.routing not in INDEXED_ROUTING):
        return None
    client = AioKvindexClient(settings.kvindex_url,
                              ResidencyReplica.WAIT_S + settings.kvindex_timeout_s + 1.0,
                              max_connections=1, token=settings.internal_token)
    return ResidencyReplica(client, metrics, max_lag_s=settings.replica_max_lag_s,
                            resync_s=settings.replica_resync_s)


async def _models_from_pods(orch: Orchestrator) -> list[str]:
    names: set[str] = set()
    for pod in orch.pool.all():
        try:
            async with orch.http.get(pod.url + "/v1/models",
                                     timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                payload = loads(await resp.read())
            names.update(m["id"] for m in payload.get("data", []))
        except (*UPSTREAM_ERRORS, ValueError, KeyError, TypeError, AttributeError):
            continue
    return sorted(names)
