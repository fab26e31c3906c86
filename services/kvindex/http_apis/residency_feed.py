"""Residency for followers: list it whole, then watch its changes (``index/changes.py``)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query

from agentserving.core.residency import TIER_BITS
from agentserving.core.schemas import (
    CURSOR_PATTERN,
    TIERS_FASTEST_FIRST,
    PodResidency,
    ResidencyChanges,
    ResidencyListing,
)
from agentserving.core.service import ApiError, error_responses
from agentserving.kvindex.http_apis.deps import KvindexState, guarded, state
from agentserving.kvindex.index.base import UnknownPod
from agentserving.kvindex.index.changes import CursorExpired

router = APIRouter(prefix="/v1/residency", tags=["residency feed"],
                   responses=error_responses(503))


@router.get("", response_model=ResidencyListing,
            summary="Every live pod with every chunk it holds, and the cursor to watch from.")
async def listing(st: KvindexState = Depends(state)) -> ResidencyListing:
    cursor = await guarded(st, st.feed.head())  # before the reads: replaying from it converges
    async def chunks_of(pod: str) -> dict[str, int] | None:
        try:
            return await st.index.pod_chunks(pod)
        except UnknownPod:  # its lease lapsed since the list: it is gone
            return None

    pods = []
    for info in await guarded(st, st.index.list_pods()):
        chunks = await guarded(st, chunks_of(info.pod))
        if chunks is None:
            continue
        by_tier = {t: [c for c, mask in chunks.items() if mask & TIER_BITS[t]]
                   for t in TIERS_FASTEST_FIRST}
        pods.append(PodResidency(info=info, chunks={t: c for t, c in by_tier.items() if c}))
    return ResidencyListing(cursor=cursor, pods=pods)


@router.get("/changes", response_model=ResidencyChanges, response_model_exclude_none=True,
            responses=error_responses(400, 410),
            summary="The residency changes after a cursor, waiting up to wait_s for one "
                    "(410: the cursor is too old or unknown; list again).")
async def changes(after: str = Query(pattern=CURSOR_PATTERN,
                                     description="A cursor from the listing or the last "
                                                 "answer."),
                  wait_s: float = Query(default=0.0, ge=0, le=30,
                                        description="Seconds to wait when nothing is new."),
                  limit: int = Query(default=1000, ge=1, le=10_000,
                                     description="Most changes to return."),
                  st: KvindexState = Depends(state)) -> ResidencyChanges:
    try:
        got, cursor = await guarded(st, st.feed.read(after, limit, wait_s))
    except CursorExpired as exc:
        raise ApiError(410, f"after: {exc}; list GET /v1/residency again", param="after",
                       type="gone_error", code="cursor_expired") from exc
    return ResidencyChanges(cursor=cursor, changes=got)
