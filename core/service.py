"""What every HTTP service shares: error format, request-size limit, /metrics and /healthz,
the internal token's check (``core.internal_auth``).

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, so an OpenAI
client shows them as they are, and ``param`` names the offending field (``chunk_hashes[3]``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match

from agentserving.core.internal_auth import OPEN_PATHS, TOKEN_ENV, check_token
from agentserving.core.openai_protocol import INTEGER_OUT_OF_RANGE
from agentserving.core.schemas import ErrorResponse


class ApiError(Exception):
    """An error the caller can act on; rendered in OpenAI's error shape."""

    def __init__(
        self, status_code: int, message: str, *, param: str | None = None,
        type: str = "invalid_request_error", code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers


def error_body(message: str, *, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def field_path(loc: Sequence[Any]) -> str:
    """('body', 'events', 2, 'tier') -> 'events[2].tier'."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


def invalid_body(exc: ValidationError) -> ApiError:
    """The 400 for a body a route validates itself (one of several models, say): the first
    error's field named, as a validation error of FastAPI's is."""
    err = exc.errors()[0]
    param = field_path(err["loc"])
    return ApiError(400, f"{param}: {err['msg']}", param=param)


def json_object(raw: bytes) -> dict[str, Any]:
    """A body read raw, as a JSON object; else a 400 naming ``body``."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"malformed JSON: {exc}", param="body") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "body must be a JSON object", param="body")
    return body


def document_models(app: FastAPI, *models: type[BaseModel]) -> None:
    """Add ``models`` to the app's OpenAPI components: a route that reads its body raw
    (``openapi_extra``) refers to them there."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        _, defs = models_json_schema([(m, "validation") for m in models],
                                     ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(
            defs.get("$defs", {}))
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _validation_message(exc: RequestValidationError) -> tuple[str, str]:
    errors = exc.errors()
    first = errors[0]
    param = field_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return "body", f"malformed JSON: {first.get('msg')}"
    msgs = [f"{field_path(e.get('loc', ()))}: {e.get('msg')}" for e in errors[:5]]
    return param, "; ".join(msgs)


# validation errors whose type names a limit no schema carries: their type is the 400's code
LIMIT_ERROR_TYPES = frozenset({INTEGER_OUT_OF_RANGE})


def _limit_code(exc: RequestValidationError) -> str | None:
    kind = exc.errors()[0].get("type")
    return kind if kind in LIMIT_ERROR_TYPES else None


_ERROR_DESCRIPTIONS = {
    400: "Bad input; `error.param` names the field.",
    401: "Missing or invalid API key.",
    404: "No such resource; `error.param` names the field.",
    409: "Conflicts with what exists; `error.param` names the field.",
    410: "What the request points at is no longer kept (an expired cursor): start over.",
    413: "The body or a list in it is over its size limit.",
    503: "A backend (store, engine, upstream) is unavailable; retry.",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` for the error answers a route really gives, in OpenAI's shape."""
    return {code: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[code]}
            for code in codes}


_ERROR_REF = "#/components/schemas/ErrorResponse"


def _document_validation_errors(app: FastAPI) -> None:
    """FastAPI documents a request that fails validation as a 422 ``HTTPValidationError``;
    ``install_error_handlers`` answers it as a 400 in OpenAI's error shape. Make the OpenAPI
    document say so, for every route."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        for item in schema.get("paths", {}).values():
            for op in item.values():
                responses = op.get("responses") if isinstance(op, dict) else None
                if not responses or "422" not in responses:
                    continue
                del responses["422"]
                responses.setdefault("400", {
                    "description": _ERROR_DESCRIPTIONS[400],
                    "content": {"application/json": {"schema": {"$ref": _ERROR_REF}}}})
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        _, defs = models_json_schema([(ErrorResponse, "serialization")],
                                     ref_template="#/components/schemas/{model}")
        components.update(defs.get("$defs", {}))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _allowed_methods(request: Request) -> list[str]:
    """Every method the app's routes serve at this request's path (Starlette's own 405 names
    only the first route's, though GET and DELETE of one path are two routes)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        route_methods = getattr(route, "methods", None)
        if match is not Match.NONE and route_methods:
            methods.update(route_methods)
    return sorted(methods)


def install_error_handlers(app: FastAPI, max_body_bytes: int | None = None) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.message, type=exc.type, param=exc.param, code=exc.code),
            status_code=exc.status_code, headers=exc.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        param, message = _validation_message(exc)
        return JSONResponse(error_body(message, type="invalid_request_error", param=param,
                                       code=_limit_code(exc)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # RFC 9110: Allow names every method of the path
            headers["Allow"] = ", ".join(_allowed_methods(request))
        message, param = str(exc.detail), None
        if exc.status_code == 400:  # FastAPI's own: a body it could not parse (e.g. not UTF-8)
            message, param = f"body: {message}: expected a JSON document in UTF-8", "body"
        return JSONResponse(error_body(message, type=kind, param=param),
                            status_code=exc.status_code, headers=headers or None)

    _document_validation_errors(app)

    if max_body_bytes is not None:
        @app.middleware("http")
        async def _limit_body(request: Request, call_next):  # type: ignore[no-untyped-def]
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > max_body_bytes:
                return JSONResponse(
                    error_body(f"body of {length} bytes exceeds the limit of {max_body_bytes}",
                               type="invalid_request_error", param="body"),
                    status_code=413,
                )
            return await call_next(request)


def install_metrics_route(app: FastAPI, registry: CollectorRegistry) -> None:
    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def install_health_route(app: FastAPI) -> None:
    @app.get("/healthz", tags=["health"], summary="The process is up.")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}


_SCHEME = "internalToken"
_TOKEN_REFUSALS = {"401": "No internal token sent.",
                   "403": "The token sent is not this deployment's internal token."}


def install_internal_auth(app: FastAPI, token: str | None,
                          protects: Callable[[str], bool] = lambda path: True) -> None:
    """Require ``token`` on every path ``protects`` (all but ``OPEN_PATHS``), and say so in
    the app's OpenAPI document. Without a token: nothing."""
    if not token:
        return

    def guarded(path: str) -> bool:
        return path not in OPEN_PATHS and protects(path)

    @app.middleware("http")
    async def _require_token(request: Request, call_next):  # type: ignore[no-untyped-def]
        if guarded(request.url.path):
            refused = check_token(request.headers.get("authorization"), token)
            if refused is not None:
                status, message = refused
                return JSONResponse(
                    error_body(message, type="authentication_error", param="authorization",
                               code="invalid_internal_token"),
                    status_code=status, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    _document_auth(app, guarded)


def _document_auth(app: FastAPI, guarded: Callable[[str], bool]) -> None:
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        schema.setdefault("components", {}).setdefault("securitySchemes", {})[_SCHEME] = {
            "type": "http", "scheme": "bearer",
            "description": f"The deployment's internal token ({TOKEN_ENV})."}
        ref = {"content": {"application/json": {"schema": {"$ref": _ERROR_REF}}}}
        for path, item in schema.get("paths", {}).items():
            if not guarded(path):
                continue
            for op in item.values():
                if not isinstance(op, dict) or "responses" not in op:
                    continue
                op["security"] = [{_SCHEME: []}]
                for code in ("401", "403"):
                    op["responses"].setdefault(code, {"description": _TOKEN_REFUSALS[code],
                                                      **ref})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
