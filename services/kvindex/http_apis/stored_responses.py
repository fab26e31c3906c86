"""Stored responses: the proxy's Responses API objects (``store: true``) with the conversation
behind each, kept here rather than in a proxy's memory so that a continuation
(``previous_response_id``) reaching any proxy replica, or a restarted one, finds it.

They are soft state with a bound on both axes: each expires (``--stored-response-ttl``, the
default and the most), each is capped in size (``--max-stored-response-bytes``), and past
``--max-stored-responses`` the oldest written goes. Apart from sessions: a stored response
references no chunk and protects nothing. Scoped by tenant as sessions are (``scope``), so
one tenant cannot read or delete another's by guessing its id.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path

from agentserving.core.schemas import RESPONSE_ID_PATTERN, StoredResponse, StoredResponseDeleted
from agentserving.core.service import ApiError, error_responses
from agentserving.kvindex.http_apis.deps import KvindexState, guarded, state
from agentserving.kvindex.http_apis.scope import SessionScope, session_scope

router = APIRouter(prefix="/v1/stored-responses", tags=["stored-responses"],
                   responses=error_responses(503))
Scope = Depends(session_scope)
ResponseId = Annotated[str, Path(pattern=RESPONSE_ID_PATTERN,
                                 description="The response's id, e.g. resp_<hex>.")]


def effective_ttl_s(asked: float | None, most: float) -> float:
    """The proxy may keep a response shorter than the kvindex's TTL, never longer: the
    operator's TTL bounds how long a conversation outlives its client."""
    return most if asked is None else min(asked, most)


def _serialized(st: KvindexState, body: StoredResponse) -> str:
    """What the store keeps; over the byte bound a 413 before it reaches the store, since
    every response is held whole in the kvindex's memory or Redis."""
    limit, value = st.settings.max_stored_response_bytes, body.model_dump_json()
    size = len(value.encode())
    if size > limit:
        st.metrics.stored_responses.labels("put", "too_large").inc()
        raise ApiError(413, f"stored response (response and messages) is {size} bytes "
                       f"serialized, over the limit of {limit} (--max-stored-response-bytes)",
                       param="messages")
    return value


def _missing(st: KvindexState, op: str, response_id: str) -> ApiError:
    st.metrics.stored_responses.labels(op, "not_found").inc()
    return ApiError(404, f"no stored response '{response_id}'", param="response_id",
                    type="not_found_error")


@router.put("/{response_id}", response_model=StoredResponse, responses=error_responses(413),
            summary="Keep a response with its conversation for ttl_s (at most, and by default, "
                    "--stored-response-ttl); rewriting it restarts its TTL. Answers it with "
                    "the TTL it was kept for.")
async def put_stored_response(response_id: ResponseId, body: StoredResponse,
                              st: KvindexState = Depends(state),
                              scope: SessionScope = Scope) -> StoredResponse:
    ttl_s = effective_ttl_s(body.ttl_s, st.settings.stored_response_ttl_s)
    stored = body.model_copy(update={"ttl_s": ttl_s})
    await guarded(st, st.sessions.put_stored_response(
        scope.key(response_id), _serialized(st, stored), ttl_s,
        st.settings.max_stored_responses))
    st.metrics.stored_responses.labels("put", "ok").inc()
    return stored


@router.get("/{response_id}", response_model=StoredResponse, responses=error_responses(404),
            summary="A stored response with its conversation; 404 once expired or deleted.")
async def get_stored_response(response_id: ResponseId, st: KvindexState = Depends(state),
                              scope: SessionScope = Scope) -> StoredResponse:
    value = await guarded(st, st.sessions.get_stored_response(scope.key(response_id)))
    if value is None:
        raise _missing(st, "get", response_id)
    st.metrics.stored_responses.labels("get", "ok").inc()
    return StoredResponse.model_validate_json(value)


@router.delete("/{response_id}", response_model=StoredResponseDeleted,
               responses=error_responses(404),
               summary="Forget a stored response; answers as OpenAI's DELETE /v1/responses/{id}.")
async def delete_stored_response(response_id: ResponseId, st: KvindexState = Depends(state),
                                 scope: SessionScope = Scope) -> StoredResponseDeleted:
    if not await guarded(st, st.sessions.delete_stored_response(scope.key(response_id))):
        raise _missing(st, "delete", response_id)
    st.metrics.stored_responses.labels("delete", "ok").inc()
    return StoredResponseDeleted(id=response_id)
