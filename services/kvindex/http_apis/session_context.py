"""A session's context: the chunk chain of its latest turn, which the proxy writes after
every turn (``PUT /v1/sessions/{id}/context``).

It makes a session exist from its first turn, with or without intents, so pin, priority and
close act on any session the proxy served; it is kept as the intent ``~context``, so the
store's reference counts, forks (copy-on-write) and close treat it as any other intent. The
same call carries the proxy's routing record (one round trip per turn, not two) and, when
asked, the context-change eviction: the chunks the new chain left (``dropped_context``) are
evicted from every tier of the pods holding them unless another live session (or another
intent of this one) still references them.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from agentserving.core.schemas import CONTEXT_INTENT, ContextWritten, SessionContext
from agentserving.core.service import error_responses
from agentserving.kvindex.http_apis.control import fan_out_evict
from agentserving.kvindex.http_apis.deps import KvindexState, guarded, state
from agentserving.kvindex.http_apis.scope import SessionScope, session_scope
from agentserving.kvindex.http_apis.validation import check_chain_size
from agentserving.kvindex.index.base import UnknownSession, dropped_context, protected_chunks

router = APIRouter(prefix="/v1/sessions", tags=["sessions"],
                   responses=error_responses(503))


async def _context(st: KvindexState, key: str) -> list[str] | None:
    """The session's stored context; None: no live session, or none written yet."""
    try:
        return await st.sessions.get_intent(key, CONTEXT_INTENT)
    except UnknownSession:
        return None


@router.put("/{session_id}/context", response_model=ContextWritten,
            responses=error_responses(413),
            summary="Record a turn's chunk chain as the session's context (creating the "
                    "session), with the proxy's routing record; with evict_dropped, evict the "
                    "chunks only the context it replaced held.")
async def put_context(session_id: str, body: SessionContext,
                      st: KvindexState = Depends(state),
                      scope: SessionScope = Depends(session_scope)) -> ContextWritten:
    key, idle_ttl_s = scope.key(session_id), st.settings.idle_ttl_s
    if body.chunk_hashes is not None:
        check_chain_size(body.chunk_hashes, st.settings.max_batch_chunks)
    if body.route is not None:
        check_chain_size(body.route.chunk_hashes, st.settings.max_batch_chunks)
        await guarded(st, st.sessions.put_route(key, body.route.model_dump_json(), idle_ttl_s))
    previous = await guarded(st, _context(st, key)) \
        if body.evict_dropped or body.chunk_hashes is None else None
    chain = body.chunk_hashes if body.chunk_hashes is not None else previous or []
    info = await guarded(st, st.sessions.put_intent(key, CONTEXT_INTENT, chain, idle_ttl_s))
    written = ContextWritten(session=scope.shown(info))
    if not body.evict_dropped or body.chunk_hashes is None or not previous:
        return written
    written.dropped = dropped_context(previous, chain)
    if written.dropped:
        # written first, so the session's context no longer names them: what references a
        # dropped chunk now is another live session or another of this one's intents
        refs = await guarded(st, st.sessions.references(written.dropped))
        written.evict = await fan_out_evict(
            st, written.dropped, protected_chunks(refs, asker=None, priority=None),
            reclaimed="context_change")
    return written
