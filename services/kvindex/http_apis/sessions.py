"""Sessions: an agent's intents mapped to the chunks they reuse; forks share copy-on-write.

And their lifecycle, the programmable-KV verbs: pin (retain the session's chunks through a
predicted tool gap, in the kvindex and in the tiers of the pods holding them, lapsing by
itself), release, an eviction priority, and close (the final
turn: the session's chunks leave every tier of every pod, except those another live session
still references). Every write restarts the session's idle TTL (``--session-idle-ttl``).
Sessions are the caller's tenant's (``scope``): every route keys the store by the scoped id.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from agentserving.core.schemas import (
    ForkRequest,
    IntentChunks,
    PinRequest,
    PriorityRequest,
    SessionClosed,
    SessionInfo,
    SessionRoute,
)
from agentserving.core.service import ApiError, error_responses
from agentserving.kvindex.http_apis.control import fan_out_evict, fan_out_pins
from agentserving.kvindex.http_apis.deps import KvindexState, guarded, state
from agentserving.kvindex.http_apis.scope import SessionScope, session_scope
from agentserving.kvindex.http_apis.validation import check_chain_size
from agentserving.kvindex.index.base import pinned_by_others, protected_chunks

router = APIRouter(prefix="/v1/sessions", tags=["sessions"],
                   responses=error_responses(503))
Scope = Depends(session_scope)


@router.get("/{session_id}", response_model=SessionInfo, responses=error_responses(404),
            summary="A live session: its intents, priority, pin and expiry.")
async def get_session(session_id: str, st: KvindexState = Depends(state),
                      scope: SessionScope = Scope) -> SessionInfo:
    return scope.shown(await guarded(st, st.sessions.get_session(scope.key(session_id))))


@router.delete("/{session_id}", response_model=SessionClosed, responses=error_responses(404),
               summary="Close a session: its references are released and its chunks evicted "
                       "from every tier of the pods holding them, except those another live "
                       "session references.")
async def close_session(session_id: str, st: KvindexState = Depends(state),
                        scope: SessionScope = Scope) -> SessionClosed:
    chunks = await guarded(st, st.sessions.close_session(scope.key(session_id)))
    if chunks is None:
        raise ApiError(404, f"unknown session '{session_id}'", param="session_id",
                       type="not_found_error")
    # closed first, so its own references are gone: whatever still references a chunk is
    # another session, and any live one (whatever its priority) keeps it
    refs = await guarded(st, st.sessions.references(chunks))
    evicted = await fan_out_evict(st, chunks, protected_chunks(refs, asker=None, priority=None),
                                  reclaimed="close")
    return SessionClosed(session_id=session_id, chunk_hashes=chunks, evict=evicted)


@router.put("/{session_id}/intents/{intent}", response_model=SessionInfo,
            responses=error_responses(413),
            summary="Set the chunks an intent reuses (creates the session if new).")
async def put_intent(session_id: str, intent: str, body: IntentChunks,
                     st: KvindexState = Depends(state),
                     scope: SessionScope = Scope) -> SessionInfo:
    check_chain_size(body.chunk_hashes, st.settings.max_batch_chunks)
    return scope.shown(await guarded(st, st.sessions.put_intent(
        scope.key(session_id), intent, body.chunk_hashes, st.settings.idle_ttl_s)))


@router.get("/{session_id}/intents/{intent}", response_model=IntentChunks,
            responses=error_responses(404),
            summary="The chunks an intent reuses.")
async def get_intent(session_id: str, intent: str,
                     st: KvindexState = Depends(state),
                     scope: SessionScope = Scope) -> IntentChunks:
    chunks = await guarded(st, st.sessions.get_intent(scope.key(session_id), intent))
    return IntentChunks(chunk_hashes=chunks)


@router.delete("/{session_id}/intents/{intent}", response_model=SessionInfo,
               responses=error_responses(404),
               summary="Forget an intent; its chunk references are released.")
async def delete_intent(session_id: str, intent: str,
                        st: KvindexState = Depends(state),
                        scope: SessionScope = Scope) -> SessionInfo:
    return scope.shown(await guarded(st, st.sessions.delete_intent(
        scope.key(session_id), intent, st.settings.idle_ttl_s)))


@router.post("/{session_id}/fork", response_model=SessionInfo, status_code=201,
             responses=error_responses(404, 409, 413),
             summary="Start a child session sharing the parent's chunks copy-on-write.")
async def fork(session_id: str, body: ForkRequest,
               st: KvindexState = Depends(state),
               scope: SessionScope = Scope) -> SessionInfo:
    return scope.shown(await guarded(st, st.sessions.fork(
        scope.key(session_id), scope.key(body.child), st.settings.idle_ttl_s)))


@router.post("/{session_id}/pin", response_model=SessionInfo, responses=error_responses(404),
             summary="Pin (retain) the session's chunks for ttl_s seconds: no other session's "
                     "evict takes them, at any priority, and the pods holding them keep "
                     "them out of their tiers' own eviction, until the pin lapses or is "
                     "released.")
async def pin(session_id: str, body: PinRequest,
              st: KvindexState = Depends(state),
              scope: SessionScope = Scope) -> SessionInfo:
    key = scope.key(session_id)
    info = await guarded(st, st.sessions.pin(key, body.ttl_s, st.settings.idle_ttl_s))
    await fan_out_pins(st, session_chunks(info), ttl_s=body.ttl_s,
                       also_pods=(*body.pods, *await _route_pods(st, key)))
    return scope.shown(info)


@router.post("/{session_id}/release", response_model=SessionInfo,
             responses=error_responses(404),
             summary="Drop the session's pin now (its references still protect at its "
                     "priority); the pods give back their pins on its chunks, except those "
                     "another pinned session references.")
async def release(session_id: str, st: KvindexState = Depends(state),
                  scope: SessionScope = Scope) -> SessionInfo:
    key = scope.key(session_id)
    info = await guarded(st, st.sessions.release(key, st.settings.idle_ttl_s))
    chunks = session_chunks(info)
    keep = pinned_by_others(await guarded(st, st.sessions.references(chunks)), asker=key)
    await fan_out_pins(st, [c for c in chunks if c not in keep], ttl_s=None,
                       also_pods=await _route_pods(st, key))
    return scope.shown(info)


def session_chunks(info: SessionInfo) -> list[str]:
    """Every chunk the session references, once, in first-seen order."""
    return list(dict.fromkeys(c for chunks in info.intents.values() for c in chunks))


async def _route_pods(st: KvindexState, key: str) -> tuple[str | None, ...]:
    """The pods the session's last turn ran on, from the proxy's routing record."""
    raw = await guarded(st, st.sessions.get_route(key))
    if raw is None:
        return ()
    route = SessionRoute.model_validate_json(raw)
    return route.last_pod, route.last_decode_pod


@router.put("/{session_id}/priority", response_model=SessionInfo,
            responses=error_responses(404),
            summary="Set the session's eviction priority: an evict at or below it keeps "
                    "the session's chunks, one above it may take them.")
async def set_priority(session_id: str, body: PriorityRequest,
                       st: KvindexState = Depends(state),
                       scope: SessionScope = Scope) -> SessionInfo:
    return scope.shown(await guarded(st, st.sessions.set_priority(
        scope.key(session_id), body.priority, st.settings.idle_ttl_s)))


@router.put("/{session_id}/route", response_model=SessionRoute,
            responses=error_responses(413),
            summary="Keep the proxy's routing record of a session (its last turn's chunks and "
                    "pods) for every proxy replica; apart from the session: it creates none "
                    "and protects no chunk. Lapses with --session-idle-ttl, goes with a close.")
async def put_route(session_id: str, body: SessionRoute, st: KvindexState = Depends(state),
                    scope: SessionScope = Scope) -> SessionRoute:
    check_chain_size(body.chunk_hashes, st.settings.max_batch_chunks)
    await guarded(st, st.sessions.put_route(scope.key(session_id), body.model_dump_json(),
                                            st.settings.idle_ttl_s))
    return body


@router.get("/{session_id}/route", response_model=SessionRoute, responses=error_responses(404),
            summary="The proxy's routing record of a session.")
async def get_route(session_id: str, st: KvindexState = Depends(state),
                    scope: SessionScope = Scope) -> SessionRoute:
    route = await guarded(st, st.sessions.get_route(scope.key(session_id)))
    if route is None:
        raise ApiError(404, f"no routing record for session '{session_id}'",
                       param="session_id", type="not_found_error")
    return SessionRoute.model_validate_json(route)
