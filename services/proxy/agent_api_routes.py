"""The front doors coding agents speak besides chat completions: Anthropic Messages
(``/v1/messages``, ``/v1/messages/count_tokens``: Claude Code) and OpenAI Responses
(``/v1/responses``, ``GET``/``DELETE /v1/responses/{id}``: Codex).

Each request is translated to the chat request its conversation makes
(``anthropic_messages``, ``openai_responses``) and runs as any chat turn does (routing to its
KV, P/D, admission, pins, tenants, API keys, stall fail-over); the answer, blocking or
streamed, is translated back. Errors come in the API's own shape: Anthropic's
``{"type": "error", "error": {...}}`` on its routes, OpenAI's on the Responses routes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Path, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agentserving.core.logging import get_logger
from agentserving.core.schemas import (
    RESPONSE_ID_PATTERN,
    StoredResponse,
    StoredResponseDeleted,
)
from agentserving.core.service import ApiError, document_models, error_responses
from agentserving.proxy import anthropic_messages as anthropic
from agentserving.proxy import openai_responses as responses
from agentserving.proxy.agent_api_common import ChatUsage, new_id, validated
from agentserving.proxy.auth import Principal
from agentserving.proxy.engine_routes import PodForwarder
from agentserving.proxy.intake import json_body, read_turn
from agentserving.proxy.openapi import TURN_RESPONSES, turn_body
from agentserving.proxy.orchestrator import H_DEGRADED
from agentserving.proxy.response_store import ResponseStore
from agentserving.proxy.session_identity import BodyIds, SessionIdentity, identify
from agentserving.proxy.sessions import kvindex_session_id

log = get_logger(__name__)
CHAT = "/v1/chat/completions"
H_SESSION_SOURCE = "x-agentserving-session-source"  # which header or field named the session
RESPONSE_ID = Path(pattern=RESPONSE_ID_PATTERN, description="A response's id (resp_...).")


def _passed_headers(answer: Response) -> dict[str, str]:
    """The proxy's own headers on a turn's answer (pods, routing, P/D), for the translation."""
    return {k: v for k, v in answer.headers.items() if k.startswith("x-agentserving-")}


def _payload(answer: Response) -> Any:
    try:
        return json.loads(bytes(answer.body))
    except ValueError:
        return None


def _anthropic_error(exc: ApiError) -> JSONResponse:
    """Anthropic's errors have no ``param``: the message starts with the field it names."""
    message = exc.message
    if exc.param and not message.startswith(f"{exc.param}:"):
        message = f"{exc.param}: {message}"
    return JSONResponse(anthropic.error_body(exc.status_code, message, exc.code),
                        status_code=exc.status_code, headers=exc.headers)


def install_agent_api_routes(app: FastAPI, authenticate: Callable[[Request], Principal | None],
                             forwarder: PodForwarder) -> None:
    """The routes, answered through ``app.state.orch`` and ``app.state.responses`` (the
    response store)."""

    def tenant_of(principal: Principal | None) -> str | None:
        return principal.tenant if principal else None

    # ------------------------------------------------------------------ Anthropic Messages
    @app.post("/v1/messages", tags=["anthropic"], responses=TURN_RESPONSES,
              openapi_extra=turn_body(anthropic.MessagesRequest),
              summary="Anthropic Messages (Claude Code): a turn routed to its session's KV, "
                      "blocking or streamed as Anthropic's events.")
    async def messages(request: Request) -> Response:
        try:
            principal = authenticate(request)
            req = validated(anthropic.MessagesRequest, json_body(await request.body()))
            who = identify(request.headers, BodyIds(
                metadata_user_id=req.metadata.user_id if req.metadata else None))
            body = await _output_capped(app, anthropic.chat_body(req))
            turn = read_turn(request.headers, principal, CHAT, body, who,
                             app.state.orch.metrics, "messages")
            answer = await app.state.orch.handle(turn)
        except ApiError as exc:
            return _anthropic_error(exc)
        headers = {**_passed_headers(answer), **_source(who)}
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(anthropic.MessageStream(req).events(answer.body_iterator),
                                     media_type="text/event-stream", headers=headers)
        payload = _payload(answer)
        if answer.status_code != 200 or not isinstance(payload, dict):
            return JSONResponse(anthropic.from_chat_error(answer.status_code, payload,
                                                          "upstream error"),
                                status_code=answer.status_code, headers=headers)
        return JSONResponse(anthropic.message(payload, req), headers=headers)

    @app.post("/v1/messages/count_tokens", tags=["anthropic"],
              openapi_extra=turn_body(anthropic.CountTokensRequest),
              responses=error_responses(400, 401, 404, 503),
              summary="The prompt tokens a Messages request would be, templated by a pod of "
                      "the model.")
    async def count_tokens(request: Request) -> JSONResponse:
        try:
            principal = authenticate(request)
            req = validated(anthropic.CountTokensRequest, json_body(await request.body()))
            _, reply = await forwarder.forward("POST", "/tokenize", anthropic.tokenize_body(req),
                                               tenant_of(principal))
        except ApiError as exc:
            return _anthropic_error(exc)
        payload = reply.json() if reply.content else None
        if reply.status_code != 200 or not isinstance(payload, dict) or "count" not in payload:
            status = reply.status_code if reply.status_code >= 400 else 502
            return JSONResponse(anthropic.from_chat_error(status, payload, reply.text),
                                status_code=status)
        return JSONResponse({"input_tokens": payload["count"]})

    # ------------------------------------------------------------------ OpenAI Responses
    @app.post("/v1/responses", tags=["openai"], responses=TURN_RESPONSES,
              openapi_extra=turn_body(responses.ResponsesRequest),
              summary="OpenAI Responses (Codex): a turn routed to its session's KV; with "
                      "previous_response_id it continues a stored conversation.")
    async def create_response(request: Request) -> Response:
        principal = authenticate(request)
        req = validated(responses.ResponsesRequest, json_body(await request.body()))
        store: ResponseStore = app.state.responses
        tenant = tenant_of(principal)
        history: list[dict[str, Any]] = []
        chain_session = None
        if req.previous_response_id is not None:
            previous = await store.get(tenant, req.previous_response_id)
            if previous is None:
                raise ApiError(404, f"Previous response with id '{req.previous_response_id}' "
                               "not found.", param="previous_response_id",
                               code="previous_response_not_found")
            history, chain_session = previous.messages, previous.session_id
        resp_id = new_id("resp")
        who = _responses_session(request, req, chain_session, resp_id)
        body = await _output_capped(app, responses.chat_body(req, history))
        turn = read_turn(request.headers, principal, CHAT, body, who, app.state.orch.metrics,
                         "responses")
        answer = await app.state.orch.handle(turn)
        headers = {**_passed_headers(answer), **_source(who)}
        asked = [*history, *responses.input_messages(req.input)]

        async def keep(response: dict[str, Any]) -> None:
            if not req.store:
                return
            entry = StoredResponse(response=response, session_id=who.session_id, messages=[
                *asked, *responses.output_messages(response["output"])])
            try:
                await store.put(tenant, resp_id, entry)
            except ApiError as exc:  # the answer stands; only its continuation is lost
                log.warning("response_not_stored", response_id=resp_id, error=exc.message)
                headers[H_DEGRADED] = f"response-store: not stored ({exc.message})"

        if isinstance(answer, StreamingResponse):
            stream = responses.ResponseStream(req, resp_id, keep)
            return StreamingResponse(stream.events(answer.body_iterator),
                                     media_type="text/event-stream", headers=headers)
        payload = _payload(answer)
        if answer.status_code != 200 or not isinstance(payload, dict):
            return JSONResponse(payload, status_code=answer.status_code, headers=headers)
        finish = ((payload.get("choices") or [{}])[0]).get("finish_reason")
        response = responses.response_object(
            resp_id, req, _created(payload), responses.output_items(payload),
            ChatUsage.of(payload.get("usage")), responses.status_of(finish))
        await keep(response)
        return JSONResponse(response, headers=headers)

    @app.get("/v1/responses/{response_id}", tags=["openai"],
             responses=error_responses(400, 401, 404, 503),
             summary="A stored response (store: true), as it was returned.")
    async def get_response(request: Request, response_id: str = RESPONSE_ID) -> dict[str, Any]:
        found = await app.state.responses.get(tenant_of(authenticate(request)), response_id)
        if found is None:
            raise _no_response(response_id)
        return found.response

    @app.delete("/v1/responses/{response_id}", tags=["openai"],
                response_model=StoredResponseDeleted,
                responses=error_responses(400, 401, 404, 503),
                summary="Forget a stored response: a continuation from it is then a 404.")
    async def delete_response(request: Request, response_id: str = RESPONSE_ID
                              ) -> StoredResponseDeleted:
        if not await app.state.responses.delete(tenant_of(authenticate(request)), response_id):
            raise _no_response(response_id)
        return StoredResponseDeleted(id=response_id)

    document_models(app, anthropic.MessagesRequest, anthropic.CountTokensRequest,
                    responses.ResponsesRequest)


async def _output_capped(app: FastAPI, body: dict[str, Any]) -> dict[str, Any]:
    """An output cap at or past the model's context length (Claude Code asks 32,000 tokens of
    any model) is one the context sets anyway: the pods generate to the context's end, where
    chat completions would refuse the request."""
    limit = await app.state.orch.context_length()
    if limit is not None and body.get("max_tokens", 0) >= limit:
        del body["max_tokens"]
    return body


def _no_response(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id",
                    type="invalid_request_error", code="response_not_found")


def _source(who: SessionIdentity) -> dict[str, str]:
    return {H_SESSION_SOURCE: who.source} if who.source else {}


def _created(payload: dict[str, Any]) -> int:
    created = payload.get("created")
    return created if isinstance(created, int) else int(time.time())


def _responses_session(request: Request, req: responses.ResponsesRequest,
                       chain_session: str | None, resp_id: str) -> SessionIdentity:
    """A Responses turn's session: a header or ``prompt_cache_key``; else the chain's (a
    continuation stays with its KV); else ``user``; else, when stored, a session of its own
    named by this response, which its continuations keep."""
    who = identify(request.headers, BodyIds(prompt_cache_key=req.prompt_cache_key))
    if who.session_id is not None:
        return who
    if chain_session is not None:
        return SessionIdentity(chain_session, who.parent_session_id, "previous_response_id")
    if req.user:
        return SessionIdentity(kvindex_session_id(req.user), who.parent_session_id, "user")
    if req.store:
        return SessionIdentity(resp_id, who.parent_session_id, "response")
    return who
