"""vLLM's server surface beside the OpenAI routes, through the proxy: ``POST /tokenize``,
``POST /detokenize``, ``GET /version``, ``GET /health``, each answered by a worker pod, since
a pod holds the model's tokenizer (vLLM pods serve them natively, the reference worker with
the same shapes: core.tokenize_protocol). Clients written for ``vllm serve`` probe them:
``vllm bench serve`` counts prompt tokens through ``/tokenize``.

A request goes to a pod serving the named model (any pod where the pods' models are not
known: pods given by URL without a registry), one not recently failed and least busy first;
a pod that fails (no connection, a 5xx) is marked failed and the next is asked. When none
answers: 503 naming each pod's failure. A pod's 4xx is its verdict on the request and comes
back as it is. The proxy checks only what it needs to route (a JSON object; the field that
holds the input): the pod validates the rest, as it does a turn's body.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import CollectorRegistry, Counter

from agentserving.core.schemas import TENANT_HEADER
from agentserving.core.service import ApiError, document_models, error_responses, json_object
from agentserving.core.tokenize_protocol import (
    TOKENIZE_BODY,
    TOKENIZE_BODY_MODELS,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeResponse,
    VersionResponse,
)
from agentserving.proxy.auth import Principal
from agentserving.proxy.jsonio import dumps
from agentserving.proxy.openapi import turn_body
from agentserving.proxy.pods import PodPool, PodState
from agentserving.proxy.upstream import UPSTREAM_ERRORS, Reply, UpstreamFailed

H_POD = "x-agentserving-pod"  # the pod that answered
_JSON = {"content-type": "application/json"}
_UNAVAILABLE = {503: {**error_responses(503)[503],
                      "description": "No worker pod answered; the message names each failure."}}


def pods_to_ask(pods: list[PodState], model: str | None, now: float) -> list[PodState]:
    """The pods that may answer for ``model``, in the order to ask them: those not recently
    failed first, then the least busy. A pod whose model is not known may serve any."""
    if model is not None:
        pods = [p for p in pods if p.model is None or p.model == model]
    return sorted(pods, key=lambda p: (p.failed_until > now, p.inflight))


class EngineRouteMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "proxy_engine_route_requests_total",
            "/tokenize, /detokenize, /version, /health requests, by route and outcome: ok (a "
            "pod answered), failover (after another pod failed), unavailable (none did).",
            ["route", "outcome"], registry=registry)


async def _ask(pool: PodPool, http: Any, pod: PodState, method: str, path: str,
               body: dict[str, Any] | None, headers: Mapping[str, str]) -> Reply:
    data = dumps(body) if body is not None else None
    pool.acquire(pod.name)
    try:
        async with http.request(method, pod.url + path, data=data,
                                headers={**_JSON, **headers}) as resp:
            reply = Reply(resp.status, resp.headers, await resp.read())
    except UPSTREAM_ERRORS as exc:
        raise UpstreamFailed(pod.name, f"{type(exc).__name__}: {exc}") from exc
    finally:
        pool.release(pod.name)
    if reply.status_code >= 500:
        raise UpstreamFailed(pod.name, f"HTTP {reply.status_code}: {reply.text[:200]}")
    return reply


class PodForwarder:
    """Asks the pods in turn for one answer (see the module docstring)."""

    def __init__(self, orch: Callable[[], Any], metrics: EngineRouteMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._orch, self._metrics, self._clock = orch, metrics, clock

    async def forward(self, method: str, path: str, body: dict[str, Any] | None = None,
                      tenant: str | None = None) -> tuple[str, Reply]:
        """(the pod that answered, its answer)."""
        orch = self._orch()
        pool: PodPool = orch.pool
        model = body.get("model") if body is not None else None
        model = model if isinstance(model, str) else None
        pods = pods_to_ask(pool.all(), model, self._clock())
        if not pods:
            await pool.refresh()
            pods = pods_to_ask(pool.all(), model, self._clock())
        if not pods:
            self._metrics.requests.labels(path, "unavailable").inc()
            if model is not None and pool.all():
                raise ApiError(404, f"The model `{model}` does not exist; the pods serve "
                               f"{', '.join(pool.models())}.", param="model",
                               type="not_found_error", code="model_not_found")
            raise ApiError(503, f"no worker pod known to answer {path}",
                           type="service_unavailable")
        headers = {TENANT_HEADER: tenant} if tenant else {}
        failures: list[str] = []
        for pod in pods:
            try:
                reply = await _ask(pool, orch.http, pod, method, path, body, headers)
            except UpstreamFailed as exc:
                pool.mark_failed(pod.name)
                failures.append(str(exc))
                continue
            self._metrics.requests.labels(path, "failover" if failures else "ok").inc()
            return pod.name, reply
        self._metrics.requests.labels(path, "unavailable").inc()
        raise ApiError(503, f"no worker pod answered {path}: {'; '.join(failures)}",
                       type="service_unavailable")


def _passed_on(answer: tuple[str, Reply]) -> Response:
    pod, reply = answer
    return Response(reply.content, status_code=reply.status_code,
                    media_type="application/json", headers={H_POD: pod})


def install_engine_routes(app: FastAPI, registry: CollectorRegistry,
                          authenticate: Callable[[Request], Principal | None]) -> PodForwarder:
    """The four routes, answered through ``app.state.orch``'s pods and client (their
    forwarder is returned: other routes that need a pod's tokenizer ask through it).
    ``/tokenize`` and ``/detokenize`` take the API key as a turn does (they reach a pod);
    ``/version`` and ``/health`` are probes, open as on vLLM."""
    forwarder = PodForwarder(lambda: app.state.orch, EngineRouteMetrics(registry))
    router = APIRouter(tags=["vllm"])

    async def read(request: Request, *inputs: str) -> tuple[dict[str, Any], str | None]:
        principal = authenticate(request)
        body = json_object(await request.body())
        if not any(field in body for field in inputs):
            raise ApiError(400, f"{inputs[0]}: field required"
                           + "".join(f" (or {f})" for f in inputs[1:]), param=inputs[0])
        return body, principal.tenant if principal else None

    @router.post("/tokenize", response_model=TokenizeResponse, openapi_extra=TOKENIZE_BODY,
                 responses={**error_responses(400, 401, 404, 413), **_UNAVAILABLE},
                 summary="A prompt's (or chat's, templated) token ids, from a pod of the "
                         "model: vLLM's /tokenize.")
    async def tokenize(request: Request) -> Response:
        body, tenant = await read(request, "prompt", "messages")
        return _passed_on(await forwarder.forward("POST", "/tokenize", body, tenant))

    @router.post("/detokenize", response_model=DetokenizeResponse,
                 openapi_extra=turn_body(DetokenizeRequest),
                 responses={**error_responses(400, 401, 404, 413), **_UNAVAILABLE},
                 summary="The text of token ids, from a pod of the model: vLLM's /detokenize.")
    async def detokenize(request: Request) -> Response:
        body, tenant = await read(request, "tokens")
        return _passed_on(await forwarder.forward("POST", "/detokenize", body, tenant))

    @router.get("/version", response_model=VersionResponse, responses=_UNAVAILABLE,
                summary="The version of the engine serving behind the proxy.")
    async def version() -> Response:
        return _passed_on(await forwarder.forward("GET", "/version"))

    @router.get("/health", response_class=Response, tags=["health"],
                responses={200: {"description": "Empty: a worker pod serves."},
                           **_UNAVAILABLE},
                summary="vLLM's health probe: 200 with an empty body while a pod serves.")
    async def health() -> Response:
        pod, reply = await forwarder.forward("GET", "/health")
        return Response(status_code=reply.status_code, headers={H_POD: pod})

    app.include_router(router)
    document_models(app, *TOKENIZE_BODY_MODELS, DetokenizeRequest)
    return forwarder
