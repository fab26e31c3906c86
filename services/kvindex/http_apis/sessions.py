"""Sessions: an agent's intents mapped to the chunks they reuse; forks share copy-on-write."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

from agentserving.core.schemas import ForkRequest, IntentChunks, SessionInfo
from agentserving.core.service import ApiError, error_responses
from agentserving.kvindex.http_apis.deps import KvindexState, guarded, state
from agentserving.kvindex.http_apis.validation import check_chain_size

router = APIRouter(prefix="/v1/sessions", tags=["sessions"],
                   responses=error_responses(503))


@router.get("/{session_id}", response_model=SessionInfo, responses=error_responses(404),
            summary="A session and its intents.")
async def get_session(session_id: str, st: KvindexState = Depends(state)) -> SessionInfo:
    return await guarded(st, st.sessions.get_session(session_id))


@router.delete("/{session_id}", status_code=204, response_class=Response,
               responses=error_responses(404),
               summary="End a session: its chunk references are released.")
async def delete_session(session_id: str, st: KvindexState = Depends(state)) -> Response:
    if not await guarded(st, st.sessions.delete_session(session_id)):
        raise ApiError(404, f"unknown session '{session_id}'", param="session_id",
                       type="not_found_error")
    return Response(status_code=204)


@router.put("/{session_id}/intents/{intent}", response_model=SessionInfo,
            responses=error_responses(413),
            summary="Set the chunks an intent reuses (creates the session if new).")
async def put_intent(session_id: str, intent: str, body: IntentChunks,
                     st: KvindexState = Depends(state)) -> SessionInfo:
    check_chain_size(body.chunk_hashes, st.settings.max_batch_chunks)
    return await guarded(st, st.sessions.put_intent(session_id, intent, body.chunk_hashes))


@router.get("/{session_id}/intents/{intent}", response_model=IntentChunks,
            responses=error_responses(404),
            summary="The chunks an intent reuses.")
async def get_intent(session_id: str, intent: str,
                     st: KvindexState = Depends(state)) -> IntentChunks:
    chunks = await guarded(st, st.sessions.get_intent(session_id, intent))
    return IntentChunks(chunk_hashes=chunks)


@router.delete("/{session_id}/intents/{intent}", response_model=SessionInfo,
               responses=error_responses(404),
               summary="Forget an intent; its chunk references are released.")
async def delete_intent(session_id: str, intent: str,
                        st: KvindexState = Depends(state)) -> SessionInfo:
    return await guarded(st, st.sessions.delete_intent(session_id, intent))


@router.post("/{session_id}/fork", response_model=SessionInfo, status_code=201,
             responses=error_responses(404, 409, 413),
             summary="Start a child session sharing the parent's chunks copy-on-write.")
async def fork(session_id: str, body: ForkRequest,
               st: KvindexState = Depends(state)) -> SessionInfo:
    return await guarded(st, st.sessions.fork(session_id, body.child))
